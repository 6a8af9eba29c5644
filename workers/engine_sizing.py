"""How many KV blocks an engine's pool holds, and what a block written to disk must match to
be loaded into it."""

from __future__ import annotations

import torch

from pagedserve.workers.engine_config import (
    CUDA_KV_MEMORY_FRACTION,
    DEFAULT_CPU_KV_CACHE_BYTES,
    EngineConfig,
)
from pagedserve.workers.kv_cache import KVCache
from pagedserve.workers.kv_tier_file import KVLayout
from pagedserve.workers.model_loader import LoadedModel
from pagedserve.workers.model_registry import TINY_LLAMA_NAME


def num_kv_blocks(config: EngineConfig, loaded: LoadedModel) -> int:
    """`num_kv_blocks` when set; else as many blocks as the byte budget holds: `kv_cache_bytes`,
    or a share of the free GPU memory, or the CPU default."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    budget = config.kv_cache_bytes
    if budget is None:
        if loaded.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(loaded.device)
            budget = int(free * CUDA_KV_MEMORY_FRACTION)
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
    return KVCache.num_blocks_for_budget(
        budget,
        block_size=config.block_size,
        num_layers=loaded.num_layers,
        num_kv_heads=loaded.num_kv_heads,
        head_dim=loaded.head_dim,
        dtype=loaded.dtype,
    )


def kv_layout(config: EngineConfig, loaded: LoadedModel) -> KVLayout:
    """What a disk-tier block must match to be loaded here (a random model's weights depend on
    the seed, so its seed is part of the name)."""
    model = loaded.name
    if model == TINY_LLAMA_NAME:
        model = f"{model}#seed={config.seed}"
    return KVLayout(
        model=model,
        num_layers=loaded.num_layers,
        block_size=config.block_size,
        num_kv_heads=loaded.num_kv_heads,
        head_dim=loaded.head_dim,
        dtype=str(loaded.dtype).removeprefix("torch."),
    )
