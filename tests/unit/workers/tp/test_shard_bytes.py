"""A rank's weight bytes counted from the model's shapes (what pool sizing subtracts before the
shard exists) equal the bytes `slice_weights` gives it, biases included, and can be counted
on a released (meta) model."""

import copy

import pytest
import torch

from pagedserve.workers.model.loader import load_model
from pagedserve.workers.tp.shard_bytes import model_shards, shard_weight_bytes
from pagedserve.workers.tp.sharded_decoder import ShardWeights, slice_weights


def sliced_bytes(weights: ShardWeights) -> int:
    """Bytes of every weight tensor of a shard (the rotary table aside)."""
    tensors = [weights.embed, weights.final_norm, weights.lm_head]
    for layer in weights.layers:
        tensors += [layer.input_norm, layer.post_norm, *layer.qkv, *layer.o, *layer.gate_up]
        tensors += [*layer.down]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def full_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("size", [1, 2])
def test_counted_bytes_equal_the_sliced_shards(tiny_llama, size):
    loaded, _ = tiny_llama
    meta = copy.deepcopy(loaded.model).to(torch.device("meta"))
    for shard in model_shards(loaded, size):
        counted = shard_weight_bytes(loaded.model, shard, loaded.head_dim)
        assert counted == sliced_bytes(slice_weights(loaded.model, shard, loaded.head_dim))
        assert shard_weight_bytes(meta, shard, loaded.head_dim) == counted
    if size == 1:
        assert counted == full_bytes(loaded.model)
    else:  # the layers and the LM head are split, the embedding replicated
        assert counted < 0.6 * full_bytes(loaded.model)


def test_qwen2_qkv_biases_are_counted(qwen2_dir):
    loaded = load_model(qwen2_dir)
    assert loaded.model.model.layers[0].self_attn.q_proj.bias is not None
    for shard in model_shards(loaded, 2):
        weights = slice_weights(loaded.model, shard, loaded.head_dim)
        assert shard_weight_bytes(loaded.model, shard, loaded.head_dim) == sliced_bytes(weights)
