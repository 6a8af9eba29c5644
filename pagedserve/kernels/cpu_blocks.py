"""The CPU op that multiplies by weights kept as GGUF block codes (`csrc/cpu_block_linear.cpp`).

A weight whose float32 values are exactly GGUF Q4_1 or Q8_0 block codes (a dequantised GGUF
checkpoint, such as the built-in SmolLM2) can be kept as those codes: 0.625 or 1.0625 bytes a
weight instead of 4, rebuilt to the same float32 bits inside the op. A decode step reads every
weight, so it reads 5-6x fewer bytes. The arithmetic is float32, with one summation order for
every row whatever the batch (see the source's header). `workers/model/gguf_blocks.py` finds
the codes and packs them.

The op is built for AVX-512 only (its loops are written with AVX-512 intrinsics); elsewhere
`blocks_available()` is False and projections stay on oneDNN.
"""

from __future__ import annotations

import functools
import logging

import torch

from pagedserve.kernels.cpu_build import CSRC, build_and_load, loads

logger = logging.getLogger(__name__)

FORMAT_Q4_1 = 1
FORMAT_Q8_0 = 2
TILE_COLUMNS = 16
BLOCK_VALUES = 32


@functools.cache
def _load() -> None:
    """Build (first time on a machine) and load `torch.ops.pagedserve_blocks`.

    Raises:
        RuntimeError, OSError, ImportError: when the build or the load fails.
    """
    # No contraction: each weight is rebuilt as GGUF's dequantisation computes it, a rounded
    # multiply then a rounded add, never one fused multiply-add.
    build_and_load(
        "pagedserve_cpu_blocks", CSRC / "cpu_block_linear.cpp", extra_cflags=("-ffp-contract=off",)
    )


@functools.cache
def blocks_available() -> bool:
    """Whether the op can run here: an AVX-512 CPU, and the op builds and loads."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        logger.info("GGUF block-code projections need AVX-512; this CPU: %s", capability)
        return False
    return loads(_load, "GGUF block-code kernel unavailable, projections stay on oneDNN")


def block_linear(x: torch.Tensor, codes: torch.Tensor, n: int, k: int, fmt: int) -> torch.Tensor:
    """``x @ W.T`` (``[..., n]``, float32) for the ``n x k`` weight ``W`` that ``codes`` hold.

    On a decode step's path: the op is loaded already (codes come from `block_dequantize`)."""
    rows = x.reshape(-1, k).contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    if rows.shape[0]:
        torch.ops.pagedserve_blocks.block_linear(out, rows, codes, n, k, fmt)
    return out.view(*x.shape[:-1], n)


def block_dequantize(codes: torch.Tensor, n: int, k: int, fmt: int) -> torch.Tensor:
    """The ``n x k`` float32 weight that ``codes`` hold, decoded as `block_linear` decodes it."""
    _load()
    out = torch.empty(n, k, dtype=torch.float32)
    torch.ops.pagedserve_blocks.block_dequantize(out, codes, n, k, fmt)
    return out
