"""Triton write_kv / copy_blocks / gather_blocks / scatter_blocks against the references."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import (
    copy_blocks,
    copy_blocks_ref,
    gather_blocks,
    gather_blocks_ref,
    scatter_blocks,
    scatter_blocks_ref,
    write_kv,
    write_kv_ref,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _pools(num_layers, shape, dtype, device, gen):
    keys = [torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(num_layers)]
    values = [torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(num_layers)]
    return keys, values


def _clone(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


def _assert_equal_lists(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("dtype", "block_size", "num_kv_heads", "head_dim", "slot_dtype"),
    [
        (torch.float32, 8, 2, 64, torch.int64),
        (torch.float16, 16, 1, 128, torch.int32),
        (torch.bfloat16, 32, 3, 80, torch.int64),
    ],
)
def test_write_kv_matches_reference(
    dtype, block_size, num_kv_heads, head_dim, slot_dtype, triton_device, gen
) -> None:
    shape = (7, block_size, num_kv_heads, head_dim)
    (key_cache,), (value_cache,) = _pools(1, shape, dtype, triton_device, gen)
    num_tokens = 2 * block_size + 3
    # Fused KV projection output: key and value are strided views.
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    kv = kv.to(triton_device)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    slots = torch.randperm(7 * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens are skipped
    slots = slots.to(slot_dtype).to(triton_device)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    write_kv_ref(key, value, expected_k, expected_v, slots)
    write_kv(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_write_kv_empty_is_a_no_op(triton_device: torch.device) -> None:
    cache = torch.zeros(2, 8, 1, 16, device=triton_device)
    empty = torch.empty(0, 1, 16, device=triton_device)
    write_kv(
        empty, empty, cache, cache.clone(), torch.empty(0, dtype=torch.int64, device=triton_device)
    )
    assert not cache.any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_matches_reference(dtype, triton_device, gen) -> None:
    keys, values = _pools(3, (9, 16, 2, 64), dtype, triton_device, gen)
    ref_keys, ref_values = _clone(keys), _clone(values)
    mapping = torch.tensor([[0, 5], [3, 8], [7, 1]], dtype=torch.int64)  # on CPU on purpose
    copy_blocks(keys, values, mapping)
    copy_blocks_ref(ref_keys, ref_values, mapping)
    _assert_equal_lists(keys + values, ref_keys + ref_values)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_scatter_match_reference(dtype, triton_device, gen) -> None:
    # A block of 32 x 4 x 64 = 8192 elements spans several program chunks.
    keys, values = _pools(2, (10, 32, 4, 64), dtype, triton_device, gen)
    ids = torch.tensor([9, 2, 4, 0], dtype=torch.int64, device=triton_device)
    packed = gather_blocks(keys, values, ids)
    assert packed.is_contiguous() and packed.device == keys[0].device
    assert torch.equal(packed, gather_blocks_ref(keys, values, ids))

    dst_keys, dst_values = _pools(2, (10, 32, 4, 64), dtype, triton_device, gen)
    ref_keys, ref_values = _clone(dst_keys), _clone(dst_values)
    dst_ids = torch.tensor([1, 3, 5, 7], dtype=torch.int64)
    scatter_blocks(packed, dst_keys, dst_values, dst_ids)
    scatter_blocks_ref(packed, ref_keys, ref_values, dst_ids)
    _assert_equal_lists(dst_keys + dst_values, ref_keys + ref_values)


def test_swap_round_trip_through_cpu(triton_device: torch.device, gen) -> None:
    """Swap out: gather, move to CPU; swap in: scatter the CPU tensor back into other blocks."""
    keys, values = _pools(2, (6, 8, 2, 32), torch.float16, triton_device, gen)
    ids = torch.tensor([4, 1])
    cpu_packed = gather_blocks(keys, values, ids).cpu()
    scatter_blocks(cpu_packed, keys, values, torch.tensor([0, 5]))
    for layer in range(2):
        assert torch.equal(keys[layer][[0, 5]], keys[layer][[4, 1]])
        assert torch.equal(values[layer][[0, 5]], values[layer][[4, 1]])


def test_empty_block_lists(triton_device: torch.device, gen) -> None:
    keys, values = _pools(2, (4, 8, 1, 16), torch.float32, triton_device, gen)
    before = _clone(keys + values)
    copy_blocks(keys, values, torch.empty(0, 2, dtype=torch.int64))
    packed = gather_blocks(keys, values, torch.empty(0, dtype=torch.int64))
    assert packed.shape == (2, 2, 0, 8, 1, 16)
    scatter_blocks(packed, keys, values, torch.empty(0, dtype=torch.int64))
    _assert_equal_lists(keys + values, before)
