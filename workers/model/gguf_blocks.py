"""Float32 weights that are exactly GGUF block codes, found and kept as those codes.

A GGUF checkpoint dequantised to float32 (`gguf_cache.py` converts one; the built-in SmolLM2
is Q4_1, with a Q8_0 embedding) holds, in every run of 32 input values of one output row, one
of the values GGUF's own dequantisation gives:

    Q4_1:  w = float(d) * q + float(m)    q in 0..15,      d, m float16
    Q8_0:  w = q * float(d)               q in -128..127,  d float16

(each a float32 multiply, then for Q4_1 a float32 add, rounded in turn). `find_block_codes`
recovers ``d``, ``m`` and ``q`` for every block of a weight and keeps the weight's codes only
when all of them decode back to the same float32 bits, checked twice: in torch while
recovering, then through the op's own decoder. So nothing is approximated: the projection
computes with the very weights it was given, from 0.625 (Q4_1) or 1.0625 (Q8_0) bytes a weight
instead of 4 (`pagedserve/kernels/cpu_blocks.py`). A weight that is not such a code (a float
checkpoint, bfloat16, a LoRA merge) is left to oneDNN.

How ``d`` is recovered: a block's smallest value has code 0 (Q4_1: it is ``m``) and its
largest code 15 (Q4_1) or ±127 (Q8_0), as GGUF's quantiser assigns them, so ``d`` is the
float16 nearest the span over 15 (or the largest magnitude over 127); the float16 values two
steps either side are tried for blocks where the nearest does not reproduce every value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pagedserve.kernels.cpu_blocks import (
    BLOCK_VALUES,
    FORMAT_Q4_1,
    FORMAT_Q8_0,
    TILE_COLUMNS,
    block_dequantize,
    block_linear,
)

FORMAT_NAMES = {FORMAT_Q4_1: "Q4_1", FORMAT_Q8_0: "Q8_0"}
# Rows recovered at a time: bounds the temporaries (a few copies of 2,048 x K floats).
_ROWS_PER_CHUNK = 2048
# Float16 steps around the nearest scale tried where the nearest does not reproduce a block.
_SCALE_STEPS = (-1, 1, -2, 2)


@dataclass(frozen=True)
class BlockCodes:
    """An ``n x k`` float32 weight held as GGUF block codes, packed for the op."""

    codes: Tensor
    n: int
    k: int
    fmt: int

    @property
    def format_name(self) -> str:
        return FORMAT_NAMES[self.fmt]

    @property
    def nbytes(self) -> int:
        return self.codes.numel()

    def __call__(self, x: Tensor) -> Tensor:
        """``x @ W.T``, float32."""
        return block_linear(x, self.codes, self.n, self.k, self.fmt)


def find_block_codes(weight: Tensor) -> BlockCodes | None:
    """``weight``'s Q4_1 or Q8_0 codes when every one of its values is exactly one, else None.

    The weight must be a float32 ``[n, k]`` CPU tensor with ``n`` a multiple of 16 and ``k`` of
    32 (the op's tiles and GGUF's blocks); anything else is None.
    """
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        return None
    n, k = weight.shape
    if n == 0 or n % TILE_COLUMNS or k == 0 or k % BLOCK_VALUES:
        return None
    weight = weight.detach()
    for fmt, recover in ((FORMAT_Q4_1, _recover_q4_1), (FORMAT_Q8_0, _recover_q8_0)):
        packed = _pack_all(weight, fmt, recover)
        if packed is not None and torch.equal(block_dequantize(packed, n, k, fmt), weight):
            return BlockCodes(packed, n, k, fmt)
    return None


def _pack_all(weight: Tensor, fmt: int, recover) -> Tensor | None:
    chunks = []
    for start in range(0, weight.shape[0], _ROWS_PER_CHUNK):
        rows = weight[start : start + _ROWS_PER_CHUNK]
        found = recover(rows.reshape(rows.shape[0], -1, BLOCK_VALUES))
        if found is None:
            return None
        chunks.append(_pack(fmt, *found))
    return torch.cat(chunks)


def _recover_q4_1(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """(codes uint8 [R, KB, 32], d float16 [R, KB], m float16 [R, KB]) or None."""
    values = blocks.reshape(-1, BLOCK_VALUES)
    low = values.amin(-1)
    m = low.to(torch.float16)
    if not torch.equal(m.float(), low):
        return None
    offsets = low.unsqueeze(-1)

    def codes_for(d: Tensor, which: Tensor | slice) -> tuple[Tensor, Tensor]:
        scale, offset, exact_values = d.float().unsqueeze(-1), offsets[which], values[which]
        q = torch.where(scale > 0, (exact_values - offset) / scale, 0.0).round().clamp(0, 15)
        return q, (scale * q + offset == exact_values).all(-1)

    nearest = ((values.amax(-1) - low) / 15).to(torch.float16)
    found = _recover(nearest, codes_for)
    if found is None:
        return None
    q, d = found
    return q.to(torch.uint8).view(blocks.shape), d.view(blocks.shape[:-1]), m.view(d.shape)


def _recover_q8_0(blocks: Tensor) -> tuple[Tensor, Tensor] | None:
    """(codes int8 [R, KB, 32], d float16 [R, KB]) or None."""
    values = blocks.reshape(-1, BLOCK_VALUES)

    def codes_for(d: Tensor, which: Tensor | slice) -> tuple[Tensor, Tensor]:
        scale, exact_values = d.float().unsqueeze(-1), values[which]
        q = torch.where(scale > 0, exact_values / scale, 0.0).round().clamp(-128, 127)
        return q, (q * scale == exact_values).all(-1)

    found = _recover((values.abs().amax(-1) / 127).to(torch.float16), codes_for)
    if found is None:
        return None
    q, d = found
    return q.to(torch.int8).view(blocks.shape), d.view(blocks.shape[:-1])


def _recover(nearest: Tensor, codes_for) -> tuple[Tensor, Tensor] | None:
    """Codes [B, 32] and float16 scales [B] of B blocks: the nearest scale first, then its
    float16 neighbours for the blocks it leaves inexact; None when a block has no exact scale
    among them. ``codes_for(d, which)`` gives the codes of blocks ``which`` under scales ``d``
    and whether they reproduce every value."""
    q, exact = codes_for(nearest, slice(None))
    d = nearest.clone()
    for step in _SCALE_STEPS:
        missing = (~exact).nonzero().squeeze(1)
        if missing.numel() == 0:
            break
        tried = _float16_step(nearest[missing], step)
        q_tried, exact_tried = codes_for(tried, missing)
        hit = missing[exact_tried]
        q[hit] = q_tried[exact_tried]
        d[hit] = tried[exact_tried]
        exact[hit] = True
    return (q, d) if bool(exact.all()) else None


def _float16_step(d: Tensor, step: int) -> Tensor:
    """The float16 ``step`` representable values above (below, negative) each of ``d`` >= 0;
    never below zero."""
    moved = (d.view(torch.int16).to(torch.int32) + step).clamp(0, 0x7BFF).to(torch.int16)
    return moved.view(torch.float16)


def _pack(fmt: int, q: Tensor, d: Tensor, m: Tensor | None = None) -> Tensor:
    """The op's layout of rows ``[R, KB, 32]``: tile-major, each tile's blocks in K order."""
    rows, k_blocks, _ = q.shape
    tiles = rows // TILE_COLUMNS
    # [R, KB, 32] -> [tiles, KB, 32 (k), 16 (columns)]
    by_k = q.view(tiles, TILE_COLUMNS, k_blocks, BLOCK_VALUES).permute(0, 2, 3, 1)
    if fmt == FORMAT_Q4_1:
        code_bytes = (by_k[:, :, 0::2] | (by_k[:, :, 1::2] << 4)).reshape(tiles, k_blocks, -1)
    else:
        code_bytes = by_k.contiguous().view(torch.uint8).reshape(tiles, k_blocks, -1)
    scales = [_tile_halves(d, tiles, k_blocks)]
    if m is not None:
        scales.append(_tile_halves(m, tiles, k_blocks))
    return torch.cat([*scales, code_bytes], dim=-1).reshape(-1)


def _tile_halves(values: Tensor, tiles: int, k_blocks: int) -> Tensor:
    """float16 ``[R, KB]`` -> bytes ``[tiles, KB, 32]``: each block's 16 columns' values."""
    by_tile = values.view(tiles, TILE_COLUMNS, k_blocks).permute(0, 2, 1).contiguous()
    return by_tile.view(torch.uint8).reshape(tiles, k_blocks, 2 * TILE_COLUMNS)
