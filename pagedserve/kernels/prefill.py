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

A tile's keys split in two: those at or before its first query position are visible to
every row and run without any mask; only the tiles from there to the tile's last query
position (the diagonal) pay the causal mask.

With `split_decodes`, sequences with exactly one new token are left to a second launch, the
split-KV decode kernel (VARLEN mode), so a long decode inside a mixed batch is spread over
many programs instead of one per KV head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels._attend import attend_tiles
from pagedserve.kernels._checks import check_prefill
from pagedserve.kernels._triton_utils import dot_precision, next_pow2, upcast_dot_operands
from pagedserve.kernels.decode import launch_decode
from pagedserve.kernels.kv_quant import as_bytes, format_code
from pagedserve.kernels.launch import (
    DEFAULT_DECODE,
    DEFAULT_PREFILL,
    DecodeLaunch,
    PrefillLaunch,
)

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
# The table stride and the decode-skipping flag vary per batch, so they stay unspecialised.
@triton.jit(do_not_specialize=["num_seqs", "stride_table", "skip_decodes"])
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
    skip_decodes,
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
    ROW: tl.constexpr,
    KV_FMT: tl.constexpr,
):
    """Program (tile, kv_head): causal attention of BLOCK_Q tokens x GROUP heads."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_in_seq = tile - (q_start // BLOCK_Q + seq)
    # Spare tile, or a decode that the split-KV decode launch handles.
    if (tile_in_seq * BLOCK_Q >= q_len) | ((skip_decodes != 0) & (q_len == 1)):
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
    # Whole tiles at or before the tile's first query position: visible to every row.
    full_end = (cached_len + tile_in_seq * BLOCK_Q + 1) // BLOCK_N * BLOCK_N
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table
    m_i, l_i, acc = attend_tiles(
        q, m_i, l_i, acc, key_cache_ptr, value_cache_ptr, table_row, kv_head, q_pos,
        0, full_end, scale_log2, offs_d, d_mask,
        NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N, False, True, DOT_PRECISION, UPCAST,
            ROW, KV_FMT,
    )  # fmt: skip
    m_i, l_i, acc = attend_tiles(
        q, m_i, l_i, acc, key_cache_ptr, value_cache_ptr, table_row, kv_head, q_pos,
        full_end, kv_end, scale_log2, offs_d, d_mask,
        NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N, True, True, DOT_PRECISION, UPCAST,
            ROW, KV_FMT,
    )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + (tokens[:, None] * NUM_HEADS + heads[:, None]) * HEAD_DIM + offs_d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def tile_sizes(
    group: int, head_dim: int, dtype: torch.dtype, launch: PrefillLaunch = DEFAULT_PREFILL
) -> tuple[int, int, int]:
    """(BLOCK_Q, BLOCK_M, BLOCK_N): `launch.block_m` query rows per tile, >= 16 (tl.dot)."""
    block_q = max(1, launch.block_m // group)
    block_m = max(16, next_pow2(block_q * group))
    return block_q, block_m, launch.tile_n(head_dim, dtype)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    launch: PrefillLaunch | None = None,
    split_decodes: bool = False,
    decode_launch: DecodeLaunch | None = None,
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
        launch: tile sizes, warps and stages; None for the defaults.
        split_decodes: send sequences with one new token through the split-KV decode
            kernel (a second launch) instead of one program per KV head here.
        decode_launch: the decode kernel's knobs when `split_decodes` is set.

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
    launch = launch or DEFAULT_PREFILL
    group = num_heads // num_kv_heads
    block_q, block_m, block_n = tile_sizes(group, head_dim, query.dtype, launch)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    prefill_kernel[grid](
        query, as_bytes(key_cache), as_bytes(value_cache), block_tables, query_start_loc,
        seq_lens, out, float(scale) * _LOG2E, num_seqs, int(split_decodes),
        query.stride(0), query.stride(1), block_tables.stride(0),
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
        ROW=key_cache.shape[3],
        KV_FMT=format_code(key_cache),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )  # fmt: skip
    if split_decodes:
        launch_decode(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, scale,
            num_splits=None, launch=decode_launch or DEFAULT_DECODE,
        )  # fmt: skip
    return out
