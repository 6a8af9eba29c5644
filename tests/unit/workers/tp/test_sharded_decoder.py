"""Slicing every rank's shard layer by layer while releasing the model gives the same slices as
slicing a whole model, shares no storage with it, and leaves none of its weights behind."""

import copy

import torch

from pagedserve.workers.tp.shard_bytes import model_shards
from pagedserve.workers.tp.sharded_decoder import ShardWeights, slice_shards, slice_weights


def tensors(weights: ShardWeights) -> list[torch.Tensor]:
    found = [weights.embed, weights.final_norm, weights.lm_head, *weights.rotary.buffers()]
    for layer in weights.layers:
        found += [layer.input_norm, layer.post_norm, *layer.qkv, *layer.o, *layer.gate_up]
        found += [*layer.down]
    return [t for t in found if t is not None]


def test_released_while_sliced_gives_the_same_own_slices(tiny_llama):
    loaded, _ = tiny_llama
    model = copy.deepcopy(loaded.model)
    originals = [*model.parameters(), *model.buffers()]  # held: no address is reused
    model_storages = {t.untyped_storage().data_ptr() for t in originals}
    shards = model_shards(loaded, 2)
    got = slice_shards(model, shards, loaded.head_dim, release=True)
    assert {p.device.type for p in [*model.parameters(), *model.buffers()]} == {"meta"}
    for shard, weights in zip(shards, got, strict=True):
        expected = slice_weights(loaded.model, shard, loaded.head_dim)
        for mine, theirs in zip(tensors(weights), tensors(expected), strict=True):
            assert torch.equal(mine, theirs)
            assert mine.untyped_storage().data_ptr() not in model_storages
