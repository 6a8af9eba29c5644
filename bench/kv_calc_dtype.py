"""`pagedserve kv-calc --kv-dtype`: what an 8-bit KV pool (`kv_cache_dtype`) stores per position.

An 8-bit pool (int8 or fp8) stores 1 byte per value (so M_KV = 2·L·h_kv·d_h·1) and a float32
scale per (token, KV head) row of K and of V (`pagedserve/kernels/kv_quant.py`): 2·L·h_kv·4
bytes per position, reported apart from M_KV as the seed reports block tables apart. Positions
per GiB are given both ways: by M_KV alone (how the engine sizes its pool from a byte budget)
and with the scales (what the pool really occupies).
"""

from __future__ import annotations

from typing import Any

KV_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
# The storage dtype of each 8-bit kv dtype (kv_memory's names).
CODE_DTYPES = {
    "int8": "int8",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
SCALE_BYTES = 4  # one float32 per row (kernels/kv_quant.SCALE_BYTES; torch-free here)
GIB = 1024**3


def code_dtype(dtype: str, kv_dtype: str) -> str:
    """The dtype of the stored KV values: the model's (`auto`) or the 8-bit format."""
    return CODE_DTYPES.get(kv_dtype, dtype)


def scale_bytes_per_token(num_layers: int, num_kv_heads: int, kv_dtype: str) -> int:
    """Bytes of scales per position: 2·L·h_kv·4 for an 8-bit pool, else 0."""
    return 2 * num_layers * num_kv_heads * SCALE_BYTES if kv_dtype in CODE_DTYPES else 0


def per_position(m_kv: int, scale_bytes: int) -> dict[str, Any]:
    """The JSON figures: bytes per position and positions per GiB, scales apart and with."""
    return {
        "kv_bytes_per_position": m_kv,
        "scale_bytes_per_position": scale_bytes,
        "positions_per_gib": GIB // m_kv,
        "positions_per_gib_with_scales": GIB // (m_kv + scale_bytes),
    }


def text_lines(kv_dtype: str, m_kv: int, scale_bytes: int) -> list[str]:
    """The report's lines on the KV dtype's scales and positions per GiB."""
    lines = []
    if scale_bytes:
        lines.append(
            f"KV dtype {kv_dtype}: 1 byte per value + scales 2*L*h_kv*4 = {scale_bytes} bytes "
            f"per position, counted apart ({100 * scale_bytes / m_kv:.2f}% of M_KV)"
        )
    figures = per_position(m_kv, scale_bytes)
    line = f"positions per GiB: {figures['positions_per_gib']}"
    if scale_bytes:
        line += f" ({figures['positions_per_gib_with_scales']} with the scales)"
    lines.append(line)
    return lines
