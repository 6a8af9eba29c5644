"""Launch knobs of the Triton kernels: tile sizes, warps per program, pipelining depth.

Each attention kernel takes an optional config object; `None` means the defaults below. The
knobs that are Triton `constexpr`s (tile sizes) or launch options (`num_warps`, `num_stages`)
each compile a kernel variant of their own, so they are bucketed to a few powers of two and
fixed per model shape: nothing here depends on the batch, so a serving run compiles each
kernel once per (model, dtype), never mid-serving.

Where the defaults come from: no GPU has run this project yet, so they are the anchors'
starting points, not measurements. SGLang's grouped decode kernel and vLLM's copy of it use
4 warps and 2 stages; the Triton fused-attention tutorial tunes 64-128 query rows and 32-128
key columns with 4-8 warps and 2-4 stages. `pagedserve.bench.kernels --sweep` times these
candidates on a GPU; set the defaults from its winners once a lent GPU has run it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Triton compiles tiles of power-of-two sizes; tl.dot needs at least 16 rows and columns.
_MIN_DOT = 16


def _check_pow2(name: str, value: int, low: int, high: int) -> None:
    if not (isinstance(value, int) and low <= value <= high and value & (value - 1) == 0):
        raise ValueError(f"{name} must be a power of two in [{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class DecodeLaunch:
    """Knobs of `paged_decode_attention`.

    Attributes:
        block_n: KV tokens per tile; None picks 64 (32 for head_dim > 128 or float32).
        num_warps: warps per stage-1 program.
        num_stages: software-pipelining depth of stage 1's KV loop.
        min_split_tokens: a sequence gets at most ceil(seq_len / this) splits, so short
            sequences of a batch are not cut into slivers; None means one tile (block_n).
            A runtime argument: changing it never recompiles.
        max_splits: cap on splits per sequence (sizes the partial buffers).
    """

    block_n: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    min_split_tokens: int | None = None
    max_splits: int = 64

    def __post_init__(self) -> None:
        if self.block_n is not None:
            _check_pow2("block_n", self.block_n, _MIN_DOT, 256)
        _check_pow2("num_warps", self.num_warps, 1, 16)
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be in [1, 8], got {self.num_stages!r}")
        if self.min_split_tokens is not None and self.min_split_tokens < 1:
            raise ValueError(f"min_split_tokens must be >= 1, got {self.min_split_tokens!r}")
        _check_pow2("max_splits", self.max_splits, 1, 256)

    def tile_n(self, head_dim: int, dtype: torch.dtype) -> int:
        """KV tokens per tile for this head dim and dtype."""
        if self.block_n is not None:
            return self.block_n
        # 64 tokens x 128 dims x 2 bytes = 16 KiB per K tile: enough bytes in flight per
        # program; wider heads and float32 halve it to keep the pipelined buffers small.
        return 64 if head_dim <= 128 and dtype != torch.float32 else 32

    def split_tokens(self, head_dim: int, dtype: torch.dtype) -> int:
        """The fewest KV tokens one split of a sequence handles."""
        if self.min_split_tokens is not None:
            return self.min_split_tokens
        return self.tile_n(head_dim, dtype)


@dataclass(frozen=True)
class PrefillLaunch:
    """Knobs of `paged_prefill_attention`.

    Attributes:
        block_m: query rows per program (tokens x the query heads sharing a KV head).
        block_n: KV tokens per tile; None picks 64 (32 for head_dim > 128 or float32,
            which keeps the pipelined K/V buffers within a smaller GPU's shared memory).
        num_warps: warps per program.
        num_stages: software-pipelining depth of the KV loop.
    """

    block_m: int = 64
    block_n: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        _check_pow2("block_m", self.block_m, _MIN_DOT, 256)
        if self.block_n is not None:
            _check_pow2("block_n", self.block_n, _MIN_DOT, 256)
        _check_pow2("num_warps", self.num_warps, 1, 16)
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be in [1, 8], got {self.num_stages!r}")

    def tile_n(self, head_dim: int, dtype: torch.dtype) -> int:
        """KV tokens per tile for this head dim and dtype."""
        if self.block_n is not None:
            return self.block_n
        return 64 if head_dim <= 128 and dtype != torch.float32 else 32


@dataclass(frozen=True)
class CopyLaunch:
    """Knobs of the memory-bound movers (`write_kv`, block copy/gather/scatter).

    Attributes:
        chunk: elements one program moves per tensor.
        num_warps: warps per program.
    """

    chunk: int = 4096
    num_warps: int = 4

    def __post_init__(self) -> None:
        _check_pow2("chunk", self.chunk, 128, 1 << 16)
        _check_pow2("num_warps", self.num_warps, 1, 16)


DEFAULT_DECODE = DecodeLaunch()
DEFAULT_PREFILL = PrefillLaunch()
DEFAULT_COPY = CopyLaunch()

# What `pagedserve.bench.kernels --sweep` times (and `compile_sm90.py` builds for sm_90 in CI,
# so that no candidate can fail a GPU run on shared memory). First of each: the default.
DECODE_CANDIDATES: tuple[DecodeLaunch, ...] = (
    DEFAULT_DECODE,
    DecodeLaunch(block_n=32, num_warps=4, num_stages=2),  # SGLang's grouped decode
    DecodeLaunch(block_n=64, num_warps=4, num_stages=3),
    DecodeLaunch(block_n=64, num_warps=8, num_stages=3),
    DecodeLaunch(block_n=128, num_warps=4, num_stages=2),
    DecodeLaunch(block_n=128, num_warps=8, num_stages=3),
    DecodeLaunch(block_n=32, num_warps=2, num_stages=3),
    # Same compiled kernel as the default; only the per-sequence split policy differs.
    DecodeLaunch(min_split_tokens=256),
    DecodeLaunch(min_split_tokens=1024),
)
PREFILL_CANDIDATES: tuple[PrefillLaunch, ...] = (
    DEFAULT_PREFILL,
    PrefillLaunch(block_m=64, block_n=32, num_warps=4, num_stages=3),
    PrefillLaunch(block_m=64, block_n=128, num_warps=4, num_stages=2),
    PrefillLaunch(block_m=128, block_n=32, num_warps=4, num_stages=3),
    PrefillLaunch(block_m=128, block_n=64, num_warps=4, num_stages=3),
    PrefillLaunch(block_m=128, block_n=64, num_warps=8, num_stages=2),
    PrefillLaunch(block_m=128, block_n=64, num_warps=8, num_stages=3),  # tutorial-like
    PrefillLaunch(block_m=128, block_n=128, num_warps=8, num_stages=2),
)
