"""Small helpers shared by the Triton wrappers (no kernels here)."""

from __future__ import annotations

import functools

import torch
import triton


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: exact for float32 (TF32 would lose ~3 digits), else native."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dot_operands(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `tl.dot` operands must be cast to float32 first.

    Only for bfloat16 under the interpreter (the one way Triton runs on a non-CUDA device):
    it stores bfloat16 as uint16 and its `tl.dot` multiplies the bit patterns
    (triton-lang/triton#11584; the docs say to cast bfloat16 to float32 there). On CUDA the
    native bfloat16 tensor-core path is kept.
    """
    return dtype == torch.bfloat16 and device.type != "cuda"


def next_pow2(value: int) -> int:
    """Smallest power of two >= value (and >= 1); Triton tile sizes must be powers of two."""
    return triton.next_power_of_2(max(int(value), 1))


@functools.lru_cache(maxsize=16)
def sm_count(device_index: int) -> int:
    """Number of streaming multiprocessors of a CUDA device (cached: the query is slow)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def parallel_units(device: torch.device) -> int:
    """How many programs the device runs at once, roughly: SMs on CUDA, 1 for the interpreter."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return sm_count(index)
    return 1
