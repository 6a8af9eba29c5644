"""The engine's one typed config: model, KV pool, scheduling and kernels."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.workers.kv_cache_manager import ALLOCATION_MODES
from pagedserve.workers.model_registry import DEFAULT_MODEL

DEFAULT_CPU_KV_CACHE_BYTES = 256 * 1024 * 1024
CUDA_KV_MEMORY_FRACTION = 0.8


@dataclass(frozen=True)
class EngineConfig:
    """Everything one worker's engine is built from.

    `max_waiting` bounds the waiting queue: past it `add_request` raises `Overloaded` at once
    (None: unbounded, as offline use wants). `num_kv_blocks` wins over `kv_cache_bytes`; with
    neither, the pool takes 256 MiB on the CPU or 80% of free device memory on CUDA.
    `max_model_len` defaults to the model's context. `model` is a built-in name
    (`smollm2-135m`, the default, or `tiny-llama`), a checkpoint directory or a `.gguf` file
    (see `model_registry`); None means the default.
    """

    model: str | None = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    num_swap_blocks: int | None = None
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    kv_allocation: str = "paged"
    watermark: float = 0.01
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    max_waiting: int | None = None  # new requests queued at most (Overloaded past it)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if self.num_swap_blocks is not None and self.num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be >= 0, got {self.num_swap_blocks}")
        if self.kv_allocation not in ALLOCATION_MODES:
            raise ValueError(
                f"kv_allocation must be one of {ALLOCATION_MODES}, got {self.kv_allocation!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
