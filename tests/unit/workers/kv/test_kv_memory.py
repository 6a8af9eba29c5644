"""Tests for the seed paper's KV memory equations (pagedserve.workers.kv.memory)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.workers.kv.memory import (
    BLOCK_TABLE_ENTRY_BYTES,
    allocated_positions,
    blocks_needed,
    check_lengths,
    dtype_bytes,
    kv_bytes_per_token,
    paged_usage,
    reserve_max_usage,
    tail_waste,
)

SEED_LENGTHS = (37, 91, 128, 201, 511)


def test_kv_bytes_per_token_llama_8b_shape() -> None:
    assert kv_bytes_per_token(32, 8, 128, "float16") == 131072
    assert kv_bytes_per_token(32, 8, 128, "torch.bfloat16") == 131072
    assert kv_bytes_per_token(32, 1, 128, "fp8") == 8192  # MQA, one byte


def test_dtype_bytes_unknown_names_dtype() -> None:
    assert dtype_bytes("float32") == 4
    with pytest.raises(ValueError, match="unknown dtype 'float13'"):
        dtype_bytes("float13")


@pytest.mark.parametrize(
    ("n", "block_size", "blocks", "allocated", "waste"),
    [(1, 16, 1, 16, 15), (16, 16, 1, 16, 0), (17, 16, 2, 32, 15), (511, 32, 16, 512, 1)],
)
def test_block_equations(n: int, block_size: int, blocks: int, allocated: int, waste: int) -> None:
    assert blocks_needed(n, block_size) == blocks
    assert allocated_positions(n, block_size) == allocated
    assert tail_waste(n, block_size) == waste


def test_seed_worked_example() -> None:
    reserve = reserve_max_usage(SEED_LENGTHS, 512)
    assert (reserve.useful, reserve.allocated, reserve.wasted) == (968, 2560, 1592)
    assert f"{100 * reserve.utilization:.2f}" == "37.81"
    assert reserve.block_table_entries == 0 and reserve.max_len == 512

    b16 = paged_usage(SEED_LENGTHS, 16)
    assert (b16.allocated, b16.wasted, b16.block_table_entries) == (992, 24, 62)
    assert f"{100 * b16.utilization:.2f}" == "97.58"
    assert b16.block_table_bytes == 62 * BLOCK_TABLE_ENTRY_BYTES

    b32 = paged_usage(SEED_LENGTHS, 32)
    assert (b32.allocated, b32.wasted, b32.block_table_entries) == (1024, 56, 32)
    assert f"{100 * b32.utilization:.2f}" == "94.53"


@pytest.mark.parametrize(
    ("lengths", "message"),
    [((), "must not be empty"), ((5, 0), "got 0 at position 1"), ((-1,), "got -1")],
)
def test_check_lengths_rejects(lengths: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_lengths(lengths)


def test_usage_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="length 600 exceeds max_len 512"):
        reserve_max_usage((5, 600), 512)
    with pytest.raises(ValueError, match="max_len must be >= 1"):
        reserve_max_usage((5,), 0)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        paged_usage((5,), 0)


@given(
    lengths=st.lists(st.integers(min_value=1, max_value=10_000), min_size=1, max_size=50),
    block_size=st.integers(min_value=1, max_value=1024),
)
def test_paged_usage_properties(lengths: list[int], block_size: int) -> None:
    usage = paged_usage(lengths, block_size)
    assert usage.useful == sum(lengths)
    assert usage.allocated >= usage.useful
    assert usage.allocated == sum(allocated_positions(n, block_size) for n in lengths)
    assert usage.block_table_entries == sum(blocks_needed(n, block_size) for n in lengths)
    assert all(0 <= tail_waste(n, block_size) < block_size for n in lengths)
    assert usage.wasted < block_size * len(lengths)
    assert 0 < usage.utilization <= 1


@given(
    lengths=st.lists(st.integers(min_value=1, max_value=4096), min_size=1, max_size=50),
    extra=st.integers(min_value=0, max_value=4096),
)
def test_reserve_max_never_beats_paged_at_max_len(lengths: list[int], extra: int) -> None:
    max_len = max(lengths) + extra
    reserve = reserve_max_usage(lengths, max_len)
    assert reserve.allocated == max_len * len(lengths) >= reserve.useful
    assert 0 < reserve.utilization <= 1
    # One block of max_len per sequence is exactly the reserve-max layout.
    assert paged_usage(lengths, max_len).allocated == reserve.allocated
