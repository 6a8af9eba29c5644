"""Triton paged prefill attention over packed variable-length queries, causal.

One kernel serves plain prefill, chunked prefill, prefix-cache hits and decodes mixed in one
batch: sequence i's `q_len_i` new tokens are its last positions, and each attends, causally,
to every earlier position in its paged context (cached blocks and new tokens alike, since
the caller wrote the new K/V first).

Grid: (query tile, KV head). A tile holds BLOCK_Q tokens of one sequence times the GROUP
query heads that share the KV head, flattened into BLOCK_M rows, so each K/V tile is loaded
once per group (GQA/MQA) and `tl.dot` has enough rows even at GROUP = 1:

    row r -> token tile_start + r // GROUP, query head kv_head * GROUP + r % GROUP

Tiles are numbered without a host sync: sequence i's tiles start at
`query_start_loc[i] // BLOCK_Q + i`, which leaves room for its ceil(q_len_i / BLOCK_Q)
tiles, so `T // BLOCK_Q + S` programs per head always suffice; spare ones exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels._checks import check_prefill
from pagedserve.kernels._triton_utils import dot_precision, next_pow2, upcast_dot_operands

_LOG2E = 1.4426950408889634


@triton.jit
def _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    # Binary search: the last sequence whose first tile index is <= tile.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# num_seqs stays a runtime int32: specialised to the constant 1 it could not seed the
# binary search's loop-carried `hi` (and every batch size would share one compile anyway).
@triton.jit(do_not_specialize=["num_seqs"])
def prefill_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_table,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program (tile, kv_head): causal attention of BLOCK_Q tokens x GROUP heads."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_in_seq = tile - (q_start // BLOCK_Q + seq)
    if tile_in_seq * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq)
    cached_len = ctx_len - q_len  # positions before the first new token

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = tile_in_seq * BLOCK_Q + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    row_mask = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    d_mask = offs_d < HEAD_DIM
    q_pos = cached_len + q_idx
    tokens = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        query_ptr
        + tokens[:, None] * stride_q_tok
        + heads[:, None] * stride_q_head
        + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys past the tile's last query position are masked for every row: stop there.
    kv_end = tl.minimum(ctx_len, cached_len + (tile_in_seq + 1) * BLOCK_Q)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table
    for kv_tile in range(0, kv_end, BLOCK_N):
        offs_n = kv_tile + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        blocks = tl.load(table_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        rows = (blocks * PAGE + offs_n % PAGE) * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(key_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        causal = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        qk = tl.where(causal, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # Padding rows see no key at all; subtract 0 instead of -inf to keep them NaN-free.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(value_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + (tokens[:, None] * NUM_HEADS + heads[:, None]) * HEAD_DIM + offs_d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def _tile_sizes(group: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_Q, BLOCK_M, BLOCK_N): ~64 query rows per tile, never fewer than 16 (tl.dot).

    Wide heads and float32 halve the KV tile, keeping the pipelined K/V buffers within the
    shared memory of GPUs smaller than an H100 (float32 at 64 x 128 needs ~113 KiB).
    """
    block_q = max(1, 64 // group)
    block_m = max(16, next_pow2(block_q * group))
    block_n = 64 if head_dim <= 128 and dtype != torch.float32 else 32
    return block_q, block_m, block_n


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed variable-length new tokens over cache plus themselves.

    Args:
        query: `[T, num_heads, head_dim]` packed new tokens (unit stride in the last dim).
        key_cache: `[num_blocks, block_size, num_kv_heads, head_dim]` contiguous pool that
            already holds the new tokens' K (the caller runs `write_kv` first).
        value_cache: same shape as `key_cache`.
        block_tables: `[S, max_blocks]` int32 block ids of each sequence.
        query_start_loc: `[S + 1]` int32 cumulative query offsets, starting at 0.
        seq_lens: `[S]` int32 full context lengths, new tokens included; the new tokens of
            sequence i are its last `query_start_loc[i+1] - query_start_loc[i]` positions.
        scale: softmax scale.

    Returns:
        `[T, num_heads, head_dim]` in the query's dtype; rows past `query_start_loc[-1]`
        (padding) are zero, as in the reference.
    """
    check_prefill(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale)
    num_tokens, num_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = key_cache.shape
    num_seqs = block_tables.shape[0]
    # Zeroed, not empty: padding rows past query_start_loc[-1] must not carry NaN garbage.
    out = torch.zeros((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_q, block_m, block_n = _tile_sizes(group, head_dim, query.dtype)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        float(scale) * _LOG2E,
        num_seqs,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE=page,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_D=max(16, next_pow2(head_dim)),  # tl.dot needs K >= 16
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(query.dtype),
        UPCAST=upcast_dot_operands(query.dtype, query.device),
    )
    return out
