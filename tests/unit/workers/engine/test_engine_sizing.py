"""Where an engine loads and serves, and what a GPU pool's budget leaves for the weights:
under tensor parallelism rank 0 loads on the host, serves on cuda:0, and its pool's budget
subtracts one rank's shard, not the whole model. (No GPU is touched: free memory is faked.)"""

import dataclasses

import pytest
import torch

from pagedserve.workers.engine.config import CUDA_KV_MEMORY_FRACTION, EngineConfig
from pagedserve.workers.engine.sizing import (
    load_device,
    num_kv_blocks,
    serving_device,
    weights_to_come,
)
from pagedserve.workers.kv.cache import KVCache
from pagedserve.workers.tp.shard_bytes import model_shards, shard_weight_bytes

CUDA0 = torch.device("cuda", 0)


def test_tensor_parallel_loads_on_the_host_and_serves_on_rank_0s_device(tiny_llama):
    loaded, _ = tiny_llama  # on the CPU
    assert load_device(EngineConfig(device="cuda")) == torch.device("cuda")
    assert load_device(EngineConfig(device="cuda", tensor_parallel_size=2)).type == "cpu"
    assert serving_device(EngineConfig(), loaded) == loaded.device
    assert serving_device(EngineConfig(device="cuda", tensor_parallel_size=2), loaded) == CUDA0
    assert serving_device(EngineConfig(tensor_parallel_size=2), loaded).type == "cpu"


def test_weights_to_come_are_rank_0s_shard_only_when_the_model_is_elsewhere(tiny_llama):
    loaded, _ = tiny_llama
    split = EngineConfig(device="cuda", tensor_parallel_size=2)
    rank0 = model_shards(loaded, 2)[0]
    shard = shard_weight_bytes(loaded.model, rank0, loaded.head_dim)
    whole = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    assert weights_to_come(split, loaded, CUDA0) == shard < 0.6 * whole
    assert weights_to_come(split, loaded, torch.device("cpu")) == 0  # already counted
    assert weights_to_come(EngineConfig(device="cuda"), loaded, CUDA0) == 0


@pytest.mark.parametrize("size", [1, 2])
def test_gpu_budget_is_free_memory_less_the_weights_to_come(tiny_llama, monkeypatch, size):
    """k = 1: the model is on the GPU already (its free memory shows it); k = 2: rank 0's
    shard is still on the host, so it is subtracted before the pool takes its share."""
    loaded, _ = tiny_llama
    if size == 1:
        loaded = dataclasses.replace(loaded, device=CUDA0)  # as if loaded there
    free = 64 << 20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 80 << 30))
    config = EngineConfig(device="cuda", tensor_parallel_size=size)
    shard = shard_weight_bytes(loaded.model, model_shards(loaded, 2)[0], loaded.head_dim)
    left = free - shard if size == 2 else free
    assert num_kv_blocks(config, loaded) == KVCache.num_blocks_for_budget(
        int(left * CUDA_KV_MEMORY_FRACTION),
        block_size=config.block_size,
        num_layers=loaded.num_layers,
        num_kv_heads=loaded.num_kv_heads // size,
        head_dim=loaded.head_dim,
        dtype=loaded.dtype,
    )
