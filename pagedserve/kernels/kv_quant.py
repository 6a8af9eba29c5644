"""The 8-bit KV layout: 8-bit codes with a float32 scale per (token, KV head), in one row.

A quantised pool keeps the shape of a full-precision one but for its last dimension, which
holds each (token, KV head) row's `head_dim` 8-bit codes followed by the 4 bytes of its float32
scale (the row's absolute maximum over the format's largest code value: 448 for e4m3, 57,344
for e5m2, 127 for int8)::

    key_cache[num_blocks, block_size, num_kv_heads, head_dim + 4]
        dtype float8_e4m3fn / float8_e5m2 / int8
    row (block b, token j, head h):  codes[0 .. head_dim)  |  scale bytes [head_dim, head_dim + 4)
    value = float(code) * scale

fp8 codes are the values rounded to the format (relative steps: 3 or 2 mantissa bits); int8
codes are symmetric, `round(x / scale)` clamped to [-127, 127] (-128 is never written), a
uniform grid of 255 steps across the row's range.

Scales are computed when a token is written, from that token's own values, so a row never
changes after its write: no requantisation, no calibration, no scale that an outlier later in a
long context can spoil (a per-block or per-tensor scale either clips the new outlier or has to
requantise what was written before it). Because scales live inside the rows, every path that
moves whole blocks (copy-on-write, swap, tiers, export/import, pull/push/move, P/D hand-off)
moves codes and scales together with no change: an 8-bit block is just bytes to them.

Scale bytes are counted apart from the KV positions (as the seed counts block tables):
`SCALE_BYTES` per row, `4 / head_dim` of the codes (6.25% at head_dim 64).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4
# The pool dtype of each `kv_cache_dtype` name that quantises (`auto` keeps the model's dtype).
KV8_FORMATS: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Every 8-bit pool dtype: rows of codes and a scale.
KV8_DTYPES = (*FP8_DTYPES, torch.int8)
# Format codes the C++ and Triton kernels take: 0 full precision, 1 e4m3, 2 e5m2, 3 int8.
FORMAT_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2, torch.int8: 3}
INT8_MAX = 127  # symmetric: codes in [-127, 127]
# Scales never drop below this, so an all-zero row (never-written slots too) decodes to zeros.
_MIN_SCALE = 1e-12


def is_quantised(cache: torch.Tensor) -> bool:
    """Whether a pool (or packed blocks) holds 8-bit rows with their scales."""
    return cache.dtype in KV8_DTYPES


def format_code(cache: torch.Tensor) -> int:
    """0 for a full-precision pool, 1 for e4m3, 2 for e5m2, 3 for int8 (the kernels' constant)."""
    return FORMAT_CODES.get(cache.dtype, 0)


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements per (token, KV head) row of a pool of `dtype`: codes and scale, or head_dim."""
    return head_dim + SCALE_BYTES if dtype in KV8_DTYPES else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """The head dimension a pool stores (its last dimension less the scale bytes if 8-bit)."""
    return int(cache.shape[-1]) - (SCALE_BYTES if is_quantised(cache) else 0)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """An 8-bit tensor viewed as uint8 (torch's CPU copy ops lack fp8; the C++ op and the
    Triton kernels take every 8-bit pool as bytes); others unchanged."""
    return tensor.view(torch.uint8) if tensor.dtype in KV8_DTYPES else tensor


def quantise_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[..., head_dim]` float rows as `[..., head_dim + 4]` rows of `dtype` (codes + scale).

    head_dim must be a multiple of 4, so every scale sits 4-byte aligned in the pool.
    """
    head_dim = rows.shape[-1]
    if head_dim % SCALE_BYTES:
        raise ValueError(f"an 8-bit KV cache needs head_dim divisible by 4, got {head_dim}")
    values = rows.float()
    amax = values.abs().amax(dim=-1, keepdim=True)
    scale = (amax / _max_code(dtype)).clamp_min(_MIN_SCALE)
    codes = _codes(values / scale, dtype)
    scale_bytes = scale.contiguous().view(torch.uint8).view(dtype)
    return torch.cat([codes, scale_bytes], dim=-1)


def dequantise_rows(rows: torch.Tensor) -> torch.Tensor:
    """`[..., head_dim + 4]` 8-bit rows (codes + scale) as `[..., head_dim]` float32."""
    head_dim = head_dim_of(rows)
    codes = rows[..., :head_dim].float()
    scale = rows[..., head_dim:].contiguous().view(torch.uint8).view(torch.float32)
    return codes * scale


def _max_code(dtype: torch.dtype) -> float:
    """The largest code value of a format: a row's absmax maps onto it."""
    return float(INT8_MAX) if dtype == torch.int8 else torch.finfo(dtype).max


def _codes(scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values already divided by their row's scale as codes of `dtype`: fp8 rounds to the
    format (torch's cast), int8 rounds to the nearest integer (half to even) within ±127."""
    if dtype == torch.int8:
        return scaled.round().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return scaled.to(dtype)
