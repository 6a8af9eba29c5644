"""Triton kernel: batched LoRA shrink + expand for a mixed batch (see `lora_ops.py`).

One program per (token, tile of N output columns) reads its token's adapter slot, gathers that
adapter's A rows (shrink, ``K -> R``, accumulated in float32 over tiles of K) and its B tile
(expand, ``R -> N``) and adds the scaled update into ``out`` in place. A base token (slot -1)
returns at once. Ranks are small (<= 64), so the shrink is recomputed per N tile rather than
staged through memory: one launch, no intermediate buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels._triton_utils import next_pow2
from pagedserve.kernels.lora_ops import check_lora_args


@triton.jit
def lora_shrink_expand_kernel(
    out_ptr,
    x_ptr,
    a_ptr,
    b_ptr,
    scales_ptr,
    slots_ptr,
    stride_out_t,
    stride_x_t,
    stride_b_s,
    stride_b_n,
    K,
    N,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:
        return
    ranks = tl.arange(0, BLOCK_R)
    rank_mask = ranks < R
    shrunk = tl.zeros([BLOCK_R], dtype=tl.float32)
    a_base = a_ptr + slot * R * K
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < K
        x = tl.load(x_ptr + token * stride_x_t + cols, mask=col_mask, other=0.0).to(tl.float32)
        a = tl.load(
            a_base + ranks[:, None] * K + cols[None, :],
            mask=rank_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        shrunk += tl.sum(a * x[None, :], axis=1)
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    out_mask = outs < N
    b = tl.load(
        b_ptr + slot * stride_b_s + outs[:, None] * stride_b_n + ranks[None, :],
        mask=out_mask[:, None] & rank_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    scale = tl.load(scales_ptr + slot).to(tl.float32)
    update = tl.sum(b * shrunk[None, :], axis=1) * scale
    out_row = out_ptr + token * stride_out_t + outs
    current = tl.load(out_row, mask=out_mask, other=0.0)
    tl.store(out_row, (current.to(tl.float32) + update).to(current.dtype), mask=out_mask)


def add_lora_triton(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
    *,
    block_k: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """``out[t] += scales[s] * (x[t] @ A[s].T) @ B[s].T`` for each token with slot ``s >= 0``.

    Args:
        out: ``[T, N]``, unit stride in the last dimension (a column slice of a wider output
            is fine: rows are addressed by its row stride).
        x: ``[T, K]``, unit stride in the last dimension.
        a: ``[S, R, K]`` contiguous stacked A of the resident adapters.
        b: ``[S, N, R]`` stacked B, unit stride in R (the engine's is a view of ``[N, S, R]``).
        scales: ``[S]`` each adapter's ``alpha / r``.
        slots: ``[T]`` int64 adapter slot per token, -1 for the base model.

    Returns:
        ``out``, updated in place.
    """
    check_lora_args(out, x, a, b, scales, slots)
    if out.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("out and x need unit stride in their last dimension")
    if not a.is_contiguous() or b.stride(2) != 1:
        raise ValueError("the stacked A must be contiguous and B have unit stride in R")
    num_tokens, n = out.shape
    if num_tokens == 0:
        return out
    k, rank = x.shape[1], a.shape[1]
    block_n = min(block_n, next_pow2(n))
    grid = (num_tokens, triton.cdiv(n, block_n))
    lora_shrink_expand_kernel[grid](
        out,
        x,
        a,
        b,
        scales,
        slots,
        out.stride(0),
        x.stride(0),
        b.stride(0),
        b.stride(1),
        k,
        n,
        R=rank,
        BLOCK_R=next_pow2(rank),
        BLOCK_K=min(block_k, next_pow2(k)),
        BLOCK_N=block_n,
    )
    return out
