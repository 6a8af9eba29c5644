"""Paged-KV kernels: Triton implementations, each beside a plain-torch reference.

Pool layout per layer: `key_cache`, `value_cache` of shape
`[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous. Pick a backend with
`get_kernel_ops(backend, device)`; the `_ref` functions are the torch references.
"""

from pagedserve.kernels.block_ops import copy_blocks, gather_blocks, scatter_blocks
from pagedserve.kernels.decode import paged_decode_attention
from pagedserve.kernels.dispatch import (
    BACKENDS,
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

__all__ = [
    "BACKENDS",
    "TORCH_OPS",
    "CopyLaunch",
    "DecodeLaunch",
    "KernelOps",
    "PrefillLaunch",
    "copy_blocks",
    "copy_blocks_ref",
    "gather_blocks",
    "gather_blocks_ref",
    "get_kernel_ops",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "scatter_blocks",
    "scatter_blocks_ref",
    "triton_interpreter_active",
    "write_kv",
    "write_kv_ref",
]
