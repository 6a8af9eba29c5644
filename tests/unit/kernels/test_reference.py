"""The torch references against naive attention on contiguous tensors, and the KV movers
against explicit per-block loops. Torch only: no Triton needed."""

from __future__ import annotations

import itertools

import pytest
import torch

from pagedserve.kernels import (
    copy_blocks_ref,
    gather_blocks_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    scatter_blocks_ref,
    write_kv_ref,
)
from pagedserve.kernels.testing import (
    AttnCase,
    edge_lens,
    make_paged_kv,
    naive_attention,
    tolerance,
)

# References are cheap, so they get the full product of the factors.
ALL_CASES = [
    AttnCase(dtype, head_dim, block_size, group, 1 if group == 4 else 2)
    for dtype, head_dim, block_size, group in itertools.product(
        (torch.float32, torch.float16, torch.bfloat16), (64, 128), (8, 16, 32), (1, 4)
    )
]


def _packed_queries(q_lens: list[int], num_heads: int, head_dim: int, dtype, gen):
    starts = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), num_heads, head_dim, generator=gen).to(dtype)
    return query, starts


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.id() for c in ALL_CASES])
def test_decode_ref_matches_naive(case: AttnCase, gen: torch.Generator) -> None:
    lens = edge_lens(case.block_size)
    kv = make_paged_kv(
        lens, case.num_kv_heads, case.head_dim, case.block_size, case.dtype, generator=gen
    )
    query = torch.randn(len(lens), case.num_heads, case.head_dim, generator=gen).to(case.dtype)
    scale = case.head_dim**-0.5
    out = paged_decode_attention_ref(
        query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, scale
    )
    assert out.dtype == case.dtype and out.shape == query.shape
    for seq in range(len(lens)):
        expected = naive_attention(query[seq : seq + 1], kv.keys[seq], kv.values[seq], scale)
        torch.testing.assert_close(out[seq : seq + 1].double(), expected, **tolerance(case.dtype))


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.id() for c in ALL_CASES])
def test_prefill_ref_matches_naive(case: AttnCase, gen: torch.Generator) -> None:
    block = case.block_size
    # plain prefill, decode, prefix hit on whole blocks, unaligned chunk, no new tokens, 1 token
    ctx_lens = [2 * block + 1, 300, 4 * block + 5, block + 7, block, 1]
    q_lens = [2 * block + 1, 1, 2 * block + 5, 10, 0, 1]
    kv = make_paged_kv(ctx_lens, case.num_kv_heads, case.head_dim, block, case.dtype, generator=gen)
    query, starts = _packed_queries(q_lens, case.num_heads, case.head_dim, case.dtype, gen)
    scale = case.head_dim**-0.5
    out = paged_prefill_attention_ref(
        query, kv.key_cache, kv.value_cache, kv.block_tables, starts, kv.seq_lens, scale
    )
    for seq, (lo, hi) in enumerate(itertools.pairwise(starts.tolist())):
        expected = naive_attention(query[lo:hi], kv.keys[seq], kv.values[seq], scale)
        torch.testing.assert_close(out[lo:hi].double(), expected, **tolerance(case.dtype))


def test_decode_ref_zero_length_gives_zeros(gen: torch.Generator) -> None:
    kv = make_paged_kv([5, 0], 2, 64, 8, generator=gen)
    query = torch.randn(2, 2, 64, generator=gen)
    out = paged_decode_attention_ref(
        query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125
    )
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(out).all()


def test_decode_ref_groups_big_batches(gen: torch.Generator, monkeypatch) -> None:
    """Sequences are gathered in bounded groups; grouping must not change the result."""
    import pagedserve.kernels.reference as reference

    lens = [40, 3, 17, 64, 1, 33]
    kv = make_paged_kv(lens, 1, 64, 16, generator=gen)
    query = torch.randn(len(lens), 4, 64, generator=gen)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125)
    whole = paged_decode_attention_ref(*args)
    monkeypatch.setattr(reference, "_DECODE_GATHER_TOKENS", 64)
    torch.testing.assert_close(paged_decode_attention_ref(*args), whole)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_ref_scatters_and_skips(slot_dtype: torch.dtype, gen: torch.Generator) -> None:
    key_cache = torch.zeros(4, 8, 2, 16)
    value_cache = torch.zeros(4, 8, 2, 16)
    key = torch.randn(4, 2, 16, generator=gen)
    value = torch.randn(4, 2, 16, generator=gen)
    slots = torch.tensor([3 * 8 + 5, -1, 0, 8 + 7], dtype=slot_dtype)
    write_kv_ref(key, value, key_cache, value_cache, slots)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(key_cache[slot // 8, slot % 8], key[row])
            assert torch.equal(value_cache[slot // 8, slot % 8], value[row])
    assert int((key_cache != 0).any(-1).any(-1).sum()) == 3  # the -1 row wrote nothing


def _layers(num_layers: int, gen: torch.Generator, shape=(6, 4, 2, 8)):
    keys = [torch.randn(shape, generator=gen) for _ in range(num_layers)]
    values = [torch.randn(shape, generator=gen) for _ in range(num_layers)]
    return keys, values


def test_copy_blocks_ref_copies_every_layer(gen: torch.Generator) -> None:
    keys, values = _layers(3, gen)
    before = [t.clone() for t in keys + values]
    mapping = torch.tensor([[0, 4], [2, 5]], dtype=torch.int64)
    copy_blocks_ref(keys, values, mapping)
    for old, new in zip(before, keys + values, strict=True):
        expected = old.clone()
        expected[4], expected[5] = old[0], old[2]
        assert torch.equal(new, expected)


def test_gather_then_scatter_ref_round_trip(gen: torch.Generator) -> None:
    keys, values = _layers(2, gen)
    ids = torch.tensor([5, 0, 3])
    packed = gather_blocks_ref(keys, values, ids)
    assert packed.shape == (2, 2, 3, 4, 2, 8)
    for layer in range(2):
        for m, block in enumerate(ids.tolist()):
            assert torch.equal(packed[layer, 0, m], keys[layer][block])
            assert torch.equal(packed[layer, 1, m], values[layer][block])
    new_keys, new_values = _layers(2, gen)
    dst = torch.tensor([1, 2, 4])
    scatter_blocks_ref(packed, new_keys, new_values, dst)
    for layer in range(2):
        assert torch.equal(new_keys[layer][dst], keys[layer][ids])
        assert torch.equal(new_values[layer][dst], values[layer][ids])
