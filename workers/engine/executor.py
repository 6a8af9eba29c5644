"""The engine's pool and forward: one process's (`KVCache`, `ModelRunner`) or a tensor-parallel
group's (`GroupKVCache`, `TPRunner`: `workers/tp/`), with the same calls."""

from __future__ import annotations

import torch

from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.engine.sizing import kv_pool_dtype
from pagedserve.workers.kv.cache import KVCache
from pagedserve.workers.model.loader import LoadedModel
from pagedserve.workers.model.runner import ModelRunner
from pagedserve.workers.tp.executor import GroupKVCache, TPRunner, build_tp_executor


def build_model_executor(
    config: EngineConfig,
    loaded: LoadedModel,
    device: torch.device,
    ops,
    num_blocks: int,
    num_swap: int,
    *,
    release_model: bool = False,
) -> tuple[KVCache | GroupKVCache, ModelRunner | TPRunner]:
    """The pool and the forward on ``device``: one process's, or a tensor-parallel group's
    (`workers/tp/`; ``release_model``: drop the model's weights as they are sliced)."""
    kv_dtype = kv_pool_dtype(config, loaded)
    if config.tensor_parallel_size > 1:
        return build_tp_executor(
            config,
            loaded,
            device,
            num_blocks=num_blocks,
            num_swap_blocks=num_swap,
            kv_dtype=kv_dtype,
            release_model=release_model,
        )
    kv_cache = KVCache(
        num_layers=loaded.num_layers,
        num_blocks=num_blocks,
        block_size=config.block_size,
        num_kv_heads=loaded.num_kv_heads,
        head_dim=loaded.head_dim,
        dtype=kv_dtype,
        device=device,  # loaded.device: one process serves where its model is
        num_swap_blocks=num_swap,
        ops=ops,
    )
    runner = ModelRunner(loaded, kv_cache, ops, linear_backend=config.linear_backend)
    return kv_cache, runner
