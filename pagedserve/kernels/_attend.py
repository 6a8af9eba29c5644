"""The inner loop shared by the decode and prefill kernels: online softmax over KV tiles.

Both kernels cut a program's KV range into full tiles that need no mask and a short tail
(the ragged last tile, or prefill's diagonal tiles) that does:

    keys      0 ............................ full_end ....... hi
              | unmasked tiles (MASKED=False) | masked tiles    |

so the common case pays neither the bounds test nor the causal `where` on every tile.

An 8-bit pool (KV_FMT 1: fp8 e4m3, 2: fp8 e5m2, 3: int8; `kv_quant`) arrives as bytes with
rows of ROW = HEAD_DIM + 4: each tile's codes are bit-cast to their format, converted and
multiplied by their row's float32 scale in registers, so nothing outside the kernel ever holds
a dequantised copy.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dequantise_tile(codes, cache_ptr, rows, HEAD_DIM: tl.constexpr, KV_FMT: tl.constexpr):
    """8-bit codes `[BLOCK_N, BLOCK_D]` (bytes) of pool rows `rows` times each row's scale,
    the float32 stored right after its HEAD_DIM codes; float32 out."""
    if KV_FMT == 1:
        values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif KV_FMT == 3:
        values = codes.to(tl.int8, bitcast=True).to(tl.float32)
    else:
        values = codes.to(tl.float8e5, bitcast=True).to(tl.float32)
    scale_ptr = (cache_ptr + rows + HEAD_DIM).to(tl.pointer_type(tl.float32), bitcast=True)
    return values * tl.load(scale_ptr)[:, None]


@triton.jit
def attend_tiles(
    q,
    m_i,
    l_i,
    acc,
    key_cache_ptr,
    value_cache_ptr,
    table_row,
    kv_head,
    q_pos,
    lo,
    hi,
    scale_log2,
    offs_d,
    d_mask,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ROW: tl.constexpr,
    KV_FMT: tl.constexpr,
):
    """Fold keys [lo, hi) of one sequence and KV head into (m_i, l_i, acc), base-2 softmax.

    Unmasked calls need `hi - lo` to be a whole number of tiles, every key visible to every
    row. Masked calls drop keys >= hi and, when CAUSAL, keys past each row's `q_pos`.
    """
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        # Per-token block lookup: tiles need not align with pages of any size.
        if MASKED:
            n_mask = offs_n < hi
            blocks = tl.load(table_row + offs_n // PAGE, mask=n_mask, other=0)
            kv_mask = n_mask[:, None] & d_mask[None, :]
        else:
            blocks = tl.load(table_row + offs_n // PAGE)
            kv_mask = d_mask[None, :]
        # int64: block * row size overflows int32 in pools above 2^31 elements.
        rows = (blocks.to(tl.int64) * PAGE + offs_n % PAGE) * (NUM_KV_HEADS * ROW)
        rows += kv_head * ROW
        k = tl.load(key_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FMT != 0:
            k = dequantise_tile(k, key_cache_ptr, rows, HEAD_DIM, KV_FMT).to(q.dtype)
        elif UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if MASKED:
            visible = n_mask[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= q_pos[:, None])
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row that has seen no key yet (prefill padding) subtracts 0, not -inf: no NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(value_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FMT != 0:
            v = dequantise_tile(v, value_cache_ptr, rows, HEAD_DIM, KV_FMT).to(q.dtype)
        elif UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc
