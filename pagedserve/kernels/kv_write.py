"""Triton kernel: scatter the K and V of new tokens into the paged pool by slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels._checks import check_write_kv
from pagedserve.kernels._triton_utils import next_pow2
from pagedserve.kernels.kv_quant import as_bytes, is_quantised, quantise_rows
from pagedserve.kernels.launch import DEFAULT_COPY, CopyLaunch


@triton.jit
def write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program copies BLOCK_H heads of one token's K and V into its slot."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # int64: slot * row size overflows int32 in pools above 2^31 elements.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)

    key = tl.load(
        key_ptr + token * stride_key_tok + heads[:, None] * stride_key_head + dims[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + token * stride_value_tok + heads[:, None] * stride_value_head + dims[None, :],
        mask=mask,
    )
    # The pool is contiguous, so a slot's row starts at slot * (heads * dim).
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(key_cache_ptr + dst, key, mask=mask)
    tl.store(value_cache_ptr + dst, value, mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    launch: CopyLaunch | None = None,
) -> None:
    """Scatter the K and V of N new tokens into the pool, in place (Triton).

    Args:
        key: `[N, num_kv_heads, head_dim]` new keys (unit stride in the last dimension).
        value: `[N, num_kv_heads, head_dim]` new values.
        key_cache: `[num_blocks, block_size, num_kv_heads, head_dim]` contiguous pool.
        value_cache: same shape as `key_cache`.
        slot_mapping: `[N]` int32/int64 slots `block_id * block_size + offset`; -1 skips.
        launch: elements per program (`chunk`: more heads go to a second grid axis) and
            warps; None for the defaults.

    An 8-bit pool (`kv_quant`: fp8 or int8): each (token, head) row is quantised with its own
    scale first (torch, on the device), then its codes and scale bytes are scattered as one row.
    """
    check_write_kv(key, value, key_cache, value_cache, slot_mapping)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    if is_quantised(key_cache):
        key = as_bytes(quantise_rows(key, key_cache.dtype))
        value = as_bytes(quantise_rows(value, key_cache.dtype))
        key_cache, value_cache = as_bytes(key_cache), as_bytes(value_cache)
    _, _, num_kv_heads, head_dim = key_cache.shape
    launch = launch or DEFAULT_COPY
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(num_kv_heads), max(1, launch.chunk // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    write_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=launch.num_warps,
    )
