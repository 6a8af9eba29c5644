"""The seed paper's KV memory equations, exact and in integers.

    (1) M_KV   = 2 · L · h_kv · d_h · b        bytes of K and V per token (all layers)
    (2) A_B(n) = B · ceil(n / B)               positions allocated to a sequence of n tokens
        W_B(n) = A_B(n) − n                    tail waste of its last block
    (3) U      = Σ n_i / Σ A_B(n_i)            position utilization

Block tables, workspaces, padding and reserve pools are excluded from (1)–(3) and reported
separately by whoever owns them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class AllocationMode(StrEnum):
    """How a request's block table grows: `PAGED` as its tokens arrive, `RESERVE_MAX` a whole
    context (`max_model_len`) at admission, as a contiguous server would."""

    PAGED = "paged"
    RESERVE_MAX = "reserve-max"


ALLOCATION_MODES: tuple[str, ...] = tuple(mode.value for mode in AllocationMode)


DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8": 1,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}

BLOCK_TABLE_ENTRY_BYTES = 4  # int32 physical block id per logical block


def dtype_bytes(dtype: str) -> int:
    """Bytes per scalar for a dtype name such as ``float16`` or ``torch.bfloat16``."""
    name = str(dtype).removeprefix("torch.").lower()
    if name not in DTYPE_BYTES:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise ValueError(f"unknown dtype {dtype!r}; expected one of: {known}")
    return DTYPE_BYTES[name]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """Equation (1): bytes of K and V one token occupies across all layers."""
    for name, value in (("layers", num_layers), ("kv-heads", num_kv_heads), ("head-dim", head_dim)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes(dtype)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """ceil(n / B): blocks a sequence of ``num_tokens`` occupies."""
    return -(-num_tokens // block_size)


def allocated_positions(num_tokens: int, block_size: int) -> int:
    """Equation (2): A_B(n) = B · ceil(n / B)."""
    return block_size * blocks_needed(num_tokens, block_size)


def tail_waste(num_tokens: int, block_size: int) -> int:
    """Equation (2): W_B(n) = A_B(n) − n, at most B − 1."""
    return allocated_positions(num_tokens, block_size) - num_tokens


@dataclass(frozen=True)
class LayoutUsage:
    """Positions one KV layout allocates for a batch of sequences, per equations (2) and (3).

    Two layouts are modelled: ``reserve-max`` reserves ``max_len`` positions for every sequence
    up front; ``paged`` allocates whole blocks of ``block_size`` positions on demand. Block-table
    entries (one int32 per logical block) are counted here but never folded into utilization.

    Attributes:
        name: ``"reserve-max"`` or ``"paged"``.
        useful: Σ n, the positions that hold real tokens.
        allocated: Σ A(n), the positions the layout reserves.
        block_table_entries: Σ ceil(n / B) for ``paged``; 0 for ``reserve-max`` (no table).
        block_size: B for ``paged``, else None.
        max_len: the per-sequence reservation for ``reserve-max``, else None.
    """

    name: str
    useful: int
    allocated: int
    block_table_entries: int = 0
    block_size: int | None = None
    max_len: int | None = None

    @property
    def wasted(self) -> int:
        """Positions allocated but holding no token: Σ A(n) − Σ n."""
        return self.allocated - self.useful

    @property
    def utilization(self) -> float:
        """Equation (3): U = Σ n / Σ A(n), in (0, 1]."""
        return self.useful / self.allocated

    @property
    def block_table_bytes(self) -> int:
        """Bytes of the block tables, reported beside (not inside) the KV positions."""
        return BLOCK_TABLE_ENTRY_BYTES * self.block_table_entries


def check_lengths(lengths: Sequence[int]) -> None:
    """Raise ValueError unless ``lengths`` is a non-empty sequence of integers >= 1."""
    if len(lengths) == 0:
        raise ValueError("lengths must not be empty")
    for index, length in enumerate(lengths):
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"lengths must be integers >= 1, got {length!r} at position {index}")


def reserve_max_usage(lengths: Sequence[int], max_len: int) -> LayoutUsage:
    """Usage when every sequence reserves ``max_len`` positions up front.

    Args:
        lengths: Tokens per sequence, each in [1, max_len].
        max_len: Positions reserved per sequence.

    Returns:
        The ``reserve-max`` layout: allocated = max_len · len(lengths).

    Raises:
        ValueError: If lengths are empty or non-positive, max_len < 1, or a length exceeds it.
    """
    check_lengths(lengths)
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    longest = max(lengths)
    if longest > max_len:
        raise ValueError(f"length {longest} exceeds max_len {max_len}")
    return LayoutUsage(
        name="reserve-max", useful=sum(lengths), allocated=max_len * len(lengths), max_len=max_len
    )


def paged_usage(lengths: Sequence[int], block_size: int) -> LayoutUsage:
    """Usage when each sequence holds ceil(n / B) blocks of ``block_size`` positions.

    Args:
        lengths: Tokens per sequence, each >= 1.
        block_size: B, positions per block.

    Returns:
        The ``paged`` layout: allocated = Σ A_B(n), one block-table entry per block.

    Raises:
        ValueError: If lengths are empty or non-positive, or block_size < 1.
    """
    check_lengths(lengths)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_blocks = sum(blocks_needed(length, block_size) for length in lengths)
    return LayoutUsage(
        name="paged",
        useful=sum(lengths),
        allocated=block_size * num_blocks,
        block_table_entries=num_blocks,
        block_size=block_size,
    )
