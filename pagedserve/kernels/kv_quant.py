"""The 8-bit KV layout: fp8 codes with a float32 scale per (token, KV head), in one row.

A quantised pool keeps the shape of a full-precision one but for its last dimension, which
holds each (token, KV head) row's `head_dim` fp8 codes followed by the 4 bytes of its float32
scale (the row's absolute maximum over the format's largest finite value)::

    key_cache[num_blocks, block_size, num_kv_heads, head_dim + 4]   dtype float8_e4m3fn / e5m2
    row (block b, token j, head h):  codes[0 .. head_dim)  |  scale bytes [head_dim, head_dim + 4)
    value = float(code) * scale

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
FP8_FORMATS: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Format codes the C++ and Triton kernels take: 0 full precision, 1 e4m3, 2 e5m2.
FORMAT_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
# Scales never drop below this, so an all-zero row (never-written slots too) decodes to zeros.
_MIN_SCALE = 1e-12


def is_quantised(cache: torch.Tensor) -> bool:
    """Whether a pool (or packed blocks) holds fp8 rows with their scales."""
    return cache.dtype in FP8_DTYPES


def format_code(cache: torch.Tensor) -> int:
    """0 for a full-precision pool, 1 for e4m3, 2 for e5m2 (the kernels' constant)."""
    return FORMAT_CODES.get(cache.dtype, 0)


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements per (token, KV head) row of a pool of `dtype`: codes and scale, or head_dim."""
    return head_dim + SCALE_BYTES if dtype in FP8_DTYPES else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """The head dimension a pool stores (its last dimension less the scale bytes if fp8)."""
    return int(cache.shape[-1]) - (SCALE_BYTES if is_quantised(cache) else 0)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor viewed as uint8 (torch's CPU copy ops lack fp8); others unchanged."""
    return tensor.view(torch.uint8) if tensor.dtype in FP8_DTYPES else tensor


def quantise_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[..., head_dim]` float rows as `[..., head_dim + 4]` rows of `dtype` (codes + scale).

    head_dim must be a multiple of 4, so every scale sits 4-byte aligned in the pool.
    """
    head_dim = rows.shape[-1]
    if head_dim % SCALE_BYTES:
        raise ValueError(f"an fp8 KV cache needs head_dim divisible by 4, got {head_dim}")
    values = rows.float()
    amax = values.abs().amax(dim=-1, keepdim=True)
    scale = (amax / torch.finfo(dtype).max).clamp_min(_MIN_SCALE)
    codes = (values / scale).to(dtype)
    scale_bytes = scale.contiguous().view(torch.uint8).view(dtype)
    return torch.cat([codes, scale_bytes], dim=-1)


def dequantise_rows(rows: torch.Tensor) -> torch.Tensor:
    """`[..., head_dim + 4]` fp8 rows (codes + scale) as `[..., head_dim]` float32."""
    head_dim = head_dim_of(rows)
    codes = rows[..., :head_dim].float()
    scale = rows[..., head_dim:].contiguous().view(torch.uint8).view(torch.float32)
    return codes * scale
