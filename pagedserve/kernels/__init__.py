"""Paged-KV kernels: Triton implementations, each beside a plain-torch reference.

Pool layout per layer: `key_cache`, `value_cache` of shape
`[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous. Pick a backend with
`get_kernel_ops(backend, device)`; the `_ref` functions are the torch references, the `_cpu`
ones the C++ CPU kernel (`cpu_paged`, built on first use).

Every name is imported on first use (PEP 562), never by importing this package: the Triton
kernels only when one is asked for (`pagedserve.kernels.write_kv`, `get_kernel_ops("triton")`),
so the torch backend runs without Triton (or with a broken one), and Triton decides compile vs
interpret (`TRITON_INTERPRET`) when a kernel module is first imported; `backends` without
torch, so configs can list the backend names cheaply.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.kernels.backends import BACKENDS
    from pagedserve.kernels.block_ops import copy_blocks, gather_blocks, scatter_blocks
    from pagedserve.kernels.cpu_paged import (
        cpu_paged_available,
        paged_attention_cpu,
        paged_decode_attention_cpu,
    )
    from pagedserve.kernels.decode import paged_decode_attention
    from pagedserve.kernels.dispatch import (
        CPU_OPS,
        TORCH_OPS,
        KernelOps,
        get_kernel_ops,
        triton_interpreter_active,
    )
    from pagedserve.kernels.kv_write import write_kv
    from pagedserve.kernels.launch import CopyLaunch, DecodeLaunch, PrefillLaunch
    from pagedserve.kernels.prefill import paged_prefill_attention
    from pagedserve.kernels.reference import (
        copy_blocks_ref,
        gather_blocks_ref,
        paged_decode_attention_ref,
        paged_prefill_attention_ref,
        scatter_blocks_ref,
        write_kv_ref,
    )

# Public name → the submodule defining it, imported by `__getattr__` on first access.
_HOMES = {
    "BACKENDS": "backends",
    "CPU_OPS": "dispatch",
    "TORCH_OPS": "dispatch",
    "KernelOps": "dispatch",
    "get_kernel_ops": "dispatch",
    "triton_interpreter_active": "dispatch",
    "CopyLaunch": "launch",
    "DecodeLaunch": "launch",
    "PrefillLaunch": "launch",
    "copy_blocks_ref": "reference",
    "gather_blocks_ref": "reference",
    "paged_decode_attention_ref": "reference",
    "paged_prefill_attention_ref": "reference",
    "scatter_blocks_ref": "reference",
    "write_kv_ref": "reference",
    "cpu_paged_available": "cpu_paged",
    "paged_attention_cpu": "cpu_paged",
    "paged_decode_attention_cpu": "cpu_paged",
    # Triton kernels:
    "copy_blocks": "block_ops",
    "gather_blocks": "block_ops",
    "scatter_blocks": "block_ops",
    "paged_decode_attention": "decode",
    "write_kv": "kv_write",
    "paged_prefill_attention": "prefill",
}


def __getattr__(name: str) -> Any:
    module = _HOMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))


__all__ = [
    "BACKENDS",
    "CPU_OPS",
    "TORCH_OPS",
    "CopyLaunch",
    "DecodeLaunch",
    "KernelOps",
    "PrefillLaunch",
    "copy_blocks",
    "copy_blocks_ref",
    "cpu_paged_available",
    "gather_blocks",
    "gather_blocks_ref",
    "get_kernel_ops",
    "paged_attention_cpu",
    "paged_decode_attention",
    "paged_decode_attention_cpu",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "scatter_blocks",
    "scatter_blocks_ref",
    "triton_interpreter_active",
    "write_kv",
    "write_kv_ref",
]
