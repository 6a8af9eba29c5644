"""Triton paged decode attention: one query token per sequence, split-KV (flash-decoding).

Stage 1 runs one program per (sequence, KV head, split). The program loads the query heads
that share the KV head (GQA: `group = num_heads // num_kv_heads` rows, padded to a tile) so
each K/V tile is read once for the whole group, walks its share of the context through the
block table, and keeps an online softmax.

Split counts are per sequence and decided on the device from `seq_lens`: the host picks only
the grid's split axis, `num_splits` (from the batch shape and the SM count), and passes it as
a runtime argument, so no batch shape ever compiles a new kernel. Sequence i uses
`n_i = clamp(ceil(seq_len_i / min_split_tokens), 1, num_splits)` equal ranges of whole tiles;
programs past `n_i` exit at once:

    num_splits = 4, min_split_tokens = 64, BLOCK_N = 64
    seq_len 1000: n = 4  [0, 256) [256, 512) [512, 768) [768, 1000)
    seq_len   70: n = 2  [0, 64) [64, 70)                 splits 2, 3 exit
    seq_len   30: n = 1  [0, 30) written straight to the output; stage 2 skips it

Stage 2 (one program per (sequence, head)) merges the partial outputs of sequences with
n_i > 1 by their log-sum-exp; it is not launched at all when num_splits is 1.

With VARLEN the query rows come from a packed mixed batch (`query_start_loc`): only
sequences with exactly one new token are handled, each at its own row, so the decodes of a
prefill+decode batch get split-KV too (`paged_prefill_attention(..., split_decodes=True)`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels._attend import attend_tiles
from pagedserve.kernels._checks import check_decode
from pagedserve.kernels._triton_utils import (
    dot_precision,
    next_pow2,
    parallel_units,
    upcast_dot_operands,
)
from pagedserve.kernels.kv_quant import as_bytes, format_code
from pagedserve.kernels.launch import DEFAULT_DECODE, DecodeLaunch

_LOG2E = 1.4426950408889634
# Runtime ints that vary with the batch: kept out of Triton's specialisation (== 1 and
# divisible-by-16 variants), so that they never pick a new compiled kernel.
_RUNTIME_INTS = ["num_splits", "min_split_tokens", "stride_table"]
_UNUSED_PARTIALS: dict[torch.device, torch.Tensor] = {}


def _unused_partials(device: torch.device) -> torch.Tensor:
    """A float32 stand-in for the partial buffers when nothing is split.

    Passing `out` instead would hand the kernel a pointer of another dtype, which Triton
    compiles as a separate variant; one cached tensor per device keeps a single variant
    (and stays valid across CUDA-graph replays).
    """
    if device not in _UNUSED_PARTIALS:
        _UNUSED_PARTIALS[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return _UNUSED_PARTIALS[device]


@triton.jit
def _splits_of(seq_len, num_splits, min_split_tokens):
    # Both stages derive a sequence's split count the same way, from its length alone.
    wanted = tl.cdiv(seq_len, min_split_tokens)
    return tl.maximum(tl.minimum(wanted, num_splits), 1)


@triton.jit
def _decode_row(query_start_loc_ptr, seq, VARLEN: tl.constexpr):
    # The packed row of this sequence's query token, and whether it is a decode at all.
    if VARLEN:
        row = tl.load(query_start_loc_ptr + seq)
        is_decode = tl.load(query_start_loc_ptr + seq + 1) - row == 1
        return row.to(tl.int64), is_decode
    return seq, seq >= 0


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def decode_split_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    num_splits,
    min_split_tokens,
    stride_q_seq,
    stride_q_head,
    stride_table,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    VARLEN: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ROW: tl.constexpr,
    KV_FMT: tl.constexpr,
):
    """Program (seq, kv_head, split): partial attention of a head group over one range."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row, is_decode = _decode_row(query_start_loc_ptr, seq, VARLEN)
    seq_len = tl.load(seq_lens_ptr + seq)
    n_splits = _splits_of(seq_len, num_splits, min_split_tokens)
    if is_decode & (split < n_splits):
        # Ranges are whole BLOCK_N tiles so that only the sequence's last tile is ragged.
        per_split = tl.cdiv(tl.cdiv(seq_len, n_splits), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, seq_len)
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + offs_g
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        q = tl.load(
            query_ptr + row * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        table_row = block_tables_ptr + seq * stride_table
        m_i, l_i, acc = attend_tiles(
            q, m_i, l_i, acc, key_cache_ptr, value_cache_ptr, table_row, kv_head, offs_g,
            start, full_end, scale_log2, offs_d, d_mask,
            NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N, False, False, DOT_PRECISION, UPCAST,
            ROW, KV_FMT,
        )  # fmt: skip
        m_i, l_i, acc = attend_tiles(
            q, m_i, l_i, acc, key_cache_ptr, value_cache_ptr, table_row, kv_head, offs_g,
            full_end, end, scale_log2, offs_d, d_mask,
            NUM_KV_HEADS, HEAD_DIM, PAGE, BLOCK_N, True, False, DOT_PRECISION, UPCAST,
            ROW, KV_FMT,
        )  # fmt: skip

        # An empty range (seq_len 0) leaves l_i = 0: emit zeros, lse = -inf.
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None]
        out_mask = g_mask[:, None] & d_mask[None, :]
        if n_splits == 1:
            out_dst = out_ptr + (row * NUM_HEADS + heads[:, None]) * HEAD_DIM + offs_d[None, :]
            tl.store(out_dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            part = (seq * NUM_HEADS + heads) * num_splits + split
            part_dst = part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :]
            tl.store(part_dst, out, mask=out_mask)
            lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(part_lse_ptr + part, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits", "min_split_tokens"])
def decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    num_splits,
    min_split_tokens,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    VARLEN: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (seq, head): merge the splits' partial outputs weighted by exp2(lse)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row, is_decode = _decode_row(query_start_loc_ptr, seq, VARLEN)
    n_splits = _splits_of(tl.load(seq_lens_ptr + seq), num_splits, min_split_tokens)
    # A single split wrote the output itself in stage 1.
    if is_decode & (n_splits > 1):
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_mask = offs_s < n_splits
        d_mask = offs_d < HEAD_DIM
        part = (seq * NUM_HEADS + head) * num_splits + offs_s
        lse = tl.load(part_lse_ptr + part, mask=s_mask, other=float("-inf"))
        lse_max = tl.max(lse, 0)
        # Split 0 is never empty when n_splits > 1 (later ones may be), so lse_max is finite.
        weights = tl.exp2(lse - lse_max)
        parts = tl.load(
            part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
        dst = out_ptr + (row * NUM_HEADS + head) * HEAD_DIM + offs_d
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_context: int,
    head_dim: int,
    device: torch.device,
    launch: DecodeLaunch = DEFAULT_DECODE,
    dtype: torch.dtype = torch.bfloat16,
) -> int:
    """The grid's split axis: about two waves of stage-1 programs, from shapes only.

    The block table's width bounds the context, so no device sync is needed; each sequence
    then uses as many of these splits as its own length warrants (decided on the device).
    The value is a runtime kernel argument: any value reuses the same compiled kernel.
    """
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = triton.cdiv(2 * parallel_units(device), programs)
    ranges = triton.cdiv(max(max_context, 1), launch.split_tokens(head_dim, dtype))
    return max(1, min(wanted, ranges, launch.max_splits))


def reduce_block_s(launch: DecodeLaunch) -> int:
    """Stage 2's split tile: the cap, whatever this batch's split count.

    Fixed per launch config, so stage 2 compiles once: a warm-up at one batch size cannot
    leave a compile for another batch size to pay mid-serving. Masked lanes cost no memory
    traffic, and stage 2 is a small fraction of a split decode.
    """
    return max(16, next_pow2(launch.max_splits))


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    launch: DecodeLaunch | None = None,
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
        num_splits: most KV splits per sequence; None picks from the shapes and SM count
            (at most `launch.max_splits`).
        launch: tile sizes, warps, stages and split policy; None for the defaults.

    Returns:
        `[S, num_heads, head_dim]` in the query's dtype.
    """
    check_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] == 0:
        return out
    launch_decode(
        query, key_cache, value_cache, block_tables, seq_lens, None, out, scale,
        num_splits=num_splits, launch=launch or DEFAULT_DECODE,
    )  # fmt: skip
    return out


def launch_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    out: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None,
    launch: DecodeLaunch,
) -> None:
    """Run both stages into `out` (arguments already checked).

    With `query_start_loc` (VARLEN), `query`/`out` are a packed mixed batch and only the
    rows of sequences with exactly one new token are written.
    """
    num_seqs = block_tables.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[2]
    _, page, num_kv_heads, _ = key_cache.shape
    block_n = launch.tile_n(head_dim, query.dtype)
    if num_splits is None:
        max_context = block_tables.shape[1] * page
        num_splits = choose_num_splits(
            num_seqs, num_kv_heads, max_context, head_dim, query.device, launch, query.dtype
        )
    if not isinstance(num_splits, int) or not 1 <= num_splits <= launch.max_splits:
        raise ValueError(
            f"num_splits must be an int in [1, {launch.max_splits}] or None, got {num_splits!r}"
        )
    # One split per sequence: the partial buffers are never touched.
    part_out = part_lse = _unused_partials(query.device)
    if num_splits > 1:
        part_shape = (num_seqs, num_heads, num_splits)
        part_out = query.new_empty((*part_shape, head_dim), dtype=torch.float32)
        part_lse = query.new_empty(part_shape, dtype=torch.float32)
    varlen = query_start_loc is not None
    qsl = query_start_loc if varlen else seq_lens  # any int tensor; unread unless VARLEN
    min_tokens = launch.split_tokens(head_dim, query.dtype)
    group = num_heads // num_kv_heads
    block_d = max(16, next_pow2(head_dim))  # tl.dot needs K >= 16
    decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, as_bytes(key_cache), as_bytes(value_cache), block_tables, seq_lens, qsl, out,
        part_out, part_lse,
        float(scale) * _LOG2E, num_splits, min_tokens,
        query.stride(0), query.stride(1), block_tables.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE=page,
        VARLEN=varlen,
        BLOCK_G=max(16, next_pow2(group)),  # tl.dot needs >= 16 rows
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(query.dtype),
        UPCAST=upcast_dot_operands(query.dtype, query.device),
        ROW=key_cache.shape[3],
        KV_FMT=format_code(key_cache),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_lse, seq_lens, qsl, out, num_splits, min_tokens,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            VARLEN=varlen,
            BLOCK_S=reduce_block_s(launch),
            BLOCK_D=block_d,
            num_warps=4,
        )  # fmt: skip
