"""Where an engine loads its model and serves, how many KV blocks its pool holds, and what a
block written to disk must match to be loaded into it.

Under tensor parallelism the two devices differ: rank 0 loads the whole model on the host
(`load_device`), slices every rank's shard there and serves on its own device (`serving_device`,
``cuda:0`` or the CPU), where only its shard and its slice of the pool live."""

from __future__ import annotations

import torch

from pagedserve.kernels.kv_quant import FP8_DTYPES, KV8_FORMATS, row_width
from pagedserve.workers.engine.checks import EngineConfigError
from pagedserve.workers.engine.config import (
    AUTO_DTYPE,
    CUDA_KV_MEMORY_FRACTION,
    DEFAULT_CPU_KV_CACHE_BYTES,
    EngineConfig,
)
from pagedserve.workers.kv.cache import KVCache
from pagedserve.workers.kv.tier_file import KVLayout
from pagedserve.workers.model.loader import LoadedModel
from pagedserve.workers.model.registry import TINY_LLAMA_NAME
from pagedserve.workers.tp.shard_bytes import model_shards, shard_weight_bytes
from pagedserve.workers.tp.shards import check_tp_size

# Triton converts fp8 in hardware from Ada / Hopper (sm_89) on.
FP8_MIN_CAPABILITY = (8, 9)


def load_device(config: EngineConfig) -> torch.device:
    """Where the engine loads its model: ``config.device``, or the host under tensor
    parallelism (each rank's shard is sliced there, then moved to its device)."""
    return torch.device("cpu" if config.tensor_parallel_size > 1 else config.device)


def serving_device(config: EngineConfig, loaded: LoadedModel) -> torch.device:
    """Where the engine's forward runs and its inputs, pool and sampling live: the model's own
    device for one process; rank 0's device (``cuda:0``, or the CPU) under tensor
    parallelism, whatever device the whole model was loaded on."""
    if config.tensor_parallel_size == 1:
        return loaded.device
    on_gpu = "cuda" in (torch.device(config.device).type, loaded.device.type)
    return torch.device("cuda", 0) if on_gpu else torch.device("cpu")


def kv_pool_dtype(config: EngineConfig, loaded: LoadedModel) -> torch.dtype:
    """The pool's dtype: the model's for `kv_cache_dtype` `auto`, else the 8-bit format.

    Raises:
        EngineConfigError: (field `kv_cache_dtype`) the model's head_dim is not a multiple
            of 4, which 8-bit rows need (their scales sit 4-byte aligned beside the codes), or
            fp8 with the Triton kernels on a GPU older than compute capability 8.9 (int8 codes
            convert on any GPU).
    """
    if config.kv_cache_dtype == AUTO_DTYPE:
        return loaded.dtype
    if loaded.head_dim % 4:
        raise EngineConfigError(
            "kv_cache_dtype",
            f"kv_cache_dtype {config.kv_cache_dtype!r} needs a head_dim divisible by 4; "
            f"{loaded.name} has {loaded.head_dim}",
        )
    pool_dtype = KV8_FORMATS[config.kv_cache_dtype]
    device = serving_device(config, loaded)
    triton = device.type == "cuda" and config.attention_backend in ("auto", "triton")
    if triton and pool_dtype in FP8_DTYPES:
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            raise EngineConfigError(
                "kv_cache_dtype",
                f"kv_cache_dtype {config.kv_cache_dtype!r} with the triton attention backend "
                f"needs a GPU of compute capability 8.9 or newer (fp8 conversions); this one "
                f"is {capability[0]}.{capability[1]}: use kv_cache_dtype 'int8' or 'auto'",
            )
    return pool_dtype


def num_kv_blocks(config: EngineConfig, loaded: LoadedModel) -> int:
    """`num_kv_blocks` when set; else as many blocks as the byte budget holds: `kv_cache_bytes`,
    or a share of the free GPU memory (less the weights still to come there), or the CPU
    default."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    budget = config.kv_cache_bytes
    if budget is None:
        device = serving_device(config, loaded)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            free -= weights_to_come(config, loaded, device)
            budget = int(max(free, 0) * CUDA_KV_MEMORY_FRACTION)
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
    return KVCache.num_blocks_for_budget(
        budget,
        block_size=config.block_size,
        num_layers=loaded.num_layers,
        # Per rank under tensor parallelism: the budget is each device's, and the first
        # ranks hold the most KV heads (`workers/tp/shards.py`).
        num_kv_heads=-(-loaded.num_kv_heads // config.tensor_parallel_size),
        head_dim=loaded.head_dim,
        dtype=kv_pool_dtype(config, loaded),
    )


def weights_to_come(config: EngineConfig, loaded: LoadedModel, device: torch.device) -> int:
    """Bytes of weights the serving device will hold that its free memory does not show yet:
    under tensor parallelism with the model on the host, rank 0's shard (the fullest rank: the
    first ranks take the remainders, and rank 0 the row-parallel biases); else none (the
    model's weights are already there). The devices of a group are taken to be alike."""
    size = config.tensor_parallel_size
    if size == 1 or loaded.device.type == device.type:
        return 0
    check_tp_size(size, loaded.num_heads, loaded.num_kv_heads, loaded.name)
    rank0 = model_shards(loaded, size)[0]
    return shard_weight_bytes(loaded.model, rank0, loaded.head_dim)


def kv_layout(config: EngineConfig, loaded: LoadedModel) -> KVLayout:
    """What a disk-tier block must match to be loaded here (a random model's weights depend on
    the seed, so its seed is part of the name). `head_dim` is the stored row: an 8-bit pool's
    rows carry their scale (`kv_quant`), and its dtype is the 8-bit format, so blocks of another
    KV dtype never load."""
    model = loaded.name
    if model == TINY_LLAMA_NAME:
        model = f"{model}#seed={config.seed}"
    return KVLayout(
        model=model,
        num_layers=loaded.num_layers,
        block_size=config.block_size,
        num_kv_heads=loaded.num_kv_heads,
        head_dim=row_width(loaded.head_dim, kv_pool_dtype(config, loaded)),
        dtype=str(kv_pool_dtype(config, loaded)).removeprefix("torch."),
    )
