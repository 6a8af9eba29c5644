"""Triton paged decode attention: one query token per sequence, split-KV (flash-decoding).

Stage 1 runs one program per (sequence, KV head, split). The program loads the query heads
that share the KV head (GQA: `group = num_heads // num_kv_heads` rows, padded to a tile) so
each K/V tile is read once for the whole group, walks its share of the context through the
block table, and keeps an online softmax. Each sequence's context is cut into `num_splits`
equal ranges of its own length, so one long sequence still spreads over many SMs:

    seq_len = 1000, num_splits = 4, BLOCK_N = 64
    split 0: [0, 256)  split 1: [256, 512)  split 2: [512, 768)  split 3: [768, 1000)

Stage 2 (one program per (sequence, head)) merges the splits' partial outputs by their
log-sum-exp. With a single split, stage 1 writes the final output and stage 2 is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels._checks import check_decode
from pagedserve.kernels._triton_utils import (
    dot_precision,
    next_pow2,
    parallel_units,
    upcast_dot_operands,
)

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64


@triton.jit
def decode_split_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    stride_q_seq,
    stride_q_head,
    stride_table,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program (seq, kv_head, split): partial attention of a head group over one range."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Ranges are whole BLOCK_N tiles so that only the sequence's last tile is ragged.
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        query_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(start, end, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        # Per-token block lookup: tiles need not align with pages of any size.
        blocks = tl.load(
            block_tables_ptr + seq * stride_table + offs_n // PAGE, mask=n_mask, other=0
        ).to(tl.int64)
        rows = (blocks * PAGE + offs_n % PAGE) * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(key_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        # Every tile in [start, end) holds a valid key, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(value_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty range (short sequence, or seq_len 0) leaves l_i = 0: emit zeros, lse = -inf.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        dst = out_ptr + (seq * NUM_HEADS + heads[:, None]) * HEAD_DIM + offs_d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        row = (seq * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (seq, head): merge the splits' partial outputs weighted by exp2(lse)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    row = (seq * NUM_HEADS + head) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    # All splits empty (seq_len 0): every weight is 0 and the output is 0, not NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    parts = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(weights, 0)
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    dst = out_ptr + (seq * NUM_HEADS + head) * HEAD_DIM + offs_d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _block_n(head_dim: int) -> int:
    # 64 tokens x 128 dims x 2 bytes = 16 KiB per K tile: enough bytes in flight per program.
    return 64 if head_dim <= 128 else 32


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, head_dim: int, device: torch.device
) -> int:
    """Splits per sequence so that stage 1 launches about two waves of programs.

    Decided from shapes only (the block table's width bounds the context), never from
    `seq_lens` values, so no device sync is needed.
    """
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = triton.cdiv(2 * parallel_units(device), programs)
    tiles = triton.cdiv(max(max_context, 1), _block_n(head_dim))
    return max(1, min(wanted, tiles, _MAX_SPLITS))


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged context (Triton).

    Args:
        query: `[S, num_heads, head_dim]`, one token per sequence.
        key_cache: `[num_blocks, block_size, num_kv_heads, head_dim]` contiguous pool.
        value_cache: same shape as `key_cache`.
        block_tables: `[S, max_blocks]` int32 block ids of each sequence.
        seq_lens: `[S]` int32 context lengths including the query token (whose K/V is
            already in the pool); 0 yields a zero row.
        scale: softmax scale.
        num_splits: KV splits per sequence; None picks from the shapes and the SM count.

    Returns:
        `[S, num_heads, head_dim]` in the query's dtype.
    """
    check_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)
    num_seqs, num_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = key_cache.shape
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    if num_splits is None:
        max_context = block_tables.shape[1] * page
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context, head_dim, query.device)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    group = num_heads // num_kv_heads
    block_d = max(16, next_pow2(head_dim))  # tl.dot needs K >= 16
    if num_splits > 1:
        part_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
    else:  # stage 1 writes `out` directly; the partial buffers are never touched
        part_out = part_lse = out
    decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        float(scale) * _LOG2E,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE=page,
        NUM_SPLITS=num_splits,
        BLOCK_G=max(16, next_pow2(group)),  # tl.dot needs >= 16 rows
        BLOCK_D=block_d,
        BLOCK_N=_block_n(head_dim),
        DOT_PRECISION=dot_precision(query.dtype),
        UPCAST=upcast_dot_operands(query.dtype, query.device),
    )
    if num_splits > 1:
        decode_reduce_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            BLOCK_S=next_pow2(num_splits),
            BLOCK_D=block_d,
        )
    return out
