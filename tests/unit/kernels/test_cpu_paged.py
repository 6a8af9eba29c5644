"""The C++ CPU kernel against naive attention and the torch reference: ragged contexts, GQA and
MQA, chunked prefill over a cached prefix, mixed decode + prefill batches, shared blocks and -1
table padding. Needs a C++ compiler (the op is built on first use)."""

from __future__ import annotations

import itertools
import shutil

import pytest
import torch

from pagedserve.kernels import (
    cpu_paged_available,
    paged_attention_cpu,
    paged_decode_attention_cpu,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
)
from pagedserve.kernels.testing import (
    AttnCase,
    edge_lens,
    make_paged_kv,
    naive_attention,
    tolerance,
)

if shutil.which("c++") is None:
    pytest.skip("the CPU kernel is built with a C++ compiler; none here", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert cpu_paged_available(), "the C++ op failed to build; see the warning logged"


# Cheap enough for the full product, as the reference tests.
ALL_CASES = [
    AttnCase(dtype, head_dim, block_size, group, 1 if group == 4 else 2)
    for dtype, head_dim, block_size, group in itertools.product(
        (torch.float32, torch.float16, torch.bfloat16), (64, 128), (8, 16, 32), (1, 4)
    )
]
# tiny-llama's head size (32: unrolled, two vectors per row on AVX512), one the kernel has no
# unrolled loop for (24: the generic loops) and the SmolLM2-135M grouping of 9 query heads
# over 3 KV heads. Float32 and bfloat16 decodes of 32, 64 and 128 take the two-pass decode
# path (bfloat16 widened to float in registers).
ODD_CASES = [
    AttnCase(dtype, head_dim, block_size, group, num_kv_heads)
    for dtype in (torch.float32, torch.bfloat16)
    for head_dim, block_size, group, num_kv_heads in ((32, 8, 4, 2), (24, 16, 3, 3), (64, 16, 3, 3))
]


def _packed_queries(q_lens: list[int], num_heads: int, head_dim: int, dtype, gen):
    starts = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), num_heads, head_dim, generator=gen).to(dtype)
    return query, starts


@pytest.mark.parametrize("case", ALL_CASES + ODD_CASES, ids=[c.id() for c in ALL_CASES + ODD_CASES])
def test_decode_matches_naive_and_reference(case: AttnCase, gen: torch.Generator) -> None:
    lens = [*edge_lens(case.block_size), 5]
    kv = make_paged_kv(
        lens, case.num_kv_heads, case.head_dim, case.block_size, case.dtype, generator=gen
    )
    query = torch.randn(len(lens), case.num_heads, case.head_dim, generator=gen).to(case.dtype)
    scale = case.head_dim**-0.5
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, scale)
    out = paged_decode_attention_cpu(*args)
    assert out.dtype == case.dtype and out.shape == query.shape
    for seq in range(len(lens)):
        expected = naive_attention(query[seq : seq + 1], kv.keys[seq], kv.values[seq], scale)
        torch.testing.assert_close(out[seq : seq + 1].double(), expected, **tolerance(case.dtype))
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), **tolerance(case.dtype))


@pytest.mark.parametrize("case", ALL_CASES + ODD_CASES, ids=[c.id() for c in ALL_CASES + ODD_CASES])
def test_prefill_matches_naive_and_reference(case: AttnCase, gen: torch.Generator) -> None:
    block = case.block_size
    # plain prefill, decode, prefix hit on whole blocks, unaligned chunk over a cached prefix,
    # no new tokens, 1 token, a prefill longer than several query tiles
    ctx_lens = [2 * block + 1, 300, 4 * block + 5, block + 7, block, 1, 70]
    q_lens = [2 * block + 1, 1, 2 * block + 5, 10, 0, 1, 70]
    kv = make_paged_kv(ctx_lens, case.num_kv_heads, case.head_dim, block, case.dtype, generator=gen)
    query, starts = _packed_queries(q_lens, case.num_heads, case.head_dim, case.dtype, gen)
    scale = case.head_dim**-0.5
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, starts, kv.seq_lens, scale)
    out = paged_attention_cpu(*args)
    for seq, (lo, hi) in enumerate(itertools.pairwise(starts.tolist())):
        expected = naive_attention(query[lo:hi], kv.keys[seq], kv.values[seq], scale)
        torch.testing.assert_close(out[lo:hi].double(), expected, **tolerance(case.dtype))
    torch.testing.assert_close(out, paged_prefill_attention_ref(*args), **tolerance(case.dtype))


def test_shared_blocks_and_padding_are_read_through_the_table(gen: torch.Generator) -> None:
    """Two sequences share their first blocks (a prefix-cache hit, copy-on-write not yet
    done); table padding is -1 and a spare -1 column follows every row."""
    kv = make_paged_kv([40, 23], 3, 64, 16, generator=gen, spare_columns=2)
    tables = kv.block_tables.clone()
    tables[1, :1] = tables[0, :1]  # sequence 1 reads sequence 0's first block
    tables[0, 3:] = -1
    query = torch.randn(2, 9, 64, generator=gen)
    args = (query, kv.key_cache, kv.value_cache, tables, kv.seq_lens, 0.125)
    torch.testing.assert_close(
        paged_decode_attention_cpu(*args), paged_decode_attention_ref(*args), atol=1e-5, rtol=1e-5
    )
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    prefill_args = (query, kv.key_cache, kv.value_cache, tables, starts, kv.seq_lens, 0.125)
    torch.testing.assert_close(
        paged_attention_cpu(*prefill_args), paged_prefill_attention_ref(*prefill_args)
    )


def test_zero_length_decode_and_rows_past_the_last_sequence_are_zero(gen) -> None:
    kv = make_paged_kv([5, 0], 2, 64, 8, generator=gen)
    query = torch.randn(2, 2, 64, generator=gen)
    out = paged_decode_attention_cpu(
        query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125
    )
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(out).all()
    packed = torch.randn(4, 2, 64, generator=gen)
    starts = torch.tensor([0, 2, 2], dtype=torch.int32)
    lens = torch.tensor([5, 0], dtype=torch.int32)
    out = paged_attention_cpu(
        packed, kv.key_cache, kv.value_cache, kv.block_tables, starts, lens, 1.0
    )
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))


def test_threads_and_work_split_do_not_change_the_result(gen: torch.Generator) -> None:
    """Items are dealt to one bin per thread; the result must not depend on the dealing."""
    lens = [700, 3, 17, 64, 1, 33, 250]
    q_lens = [40, 1, 1, 64, 1, 1, 1]
    kv = make_paged_kv(lens, 3, 64, 16, generator=gen)
    query, starts = _packed_queries(q_lens, 9, 64, torch.float32, gen)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, starts, kv.seq_lens, 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = paged_attention_cpu(*args)
        torch.set_num_threads(2)
        spread = paged_attention_cpu(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, spread)  # each row is computed by one item, in the same order
    torch.testing.assert_close(alone, paged_prefill_attention_ref(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_decode_row_is_the_same_bits_whatever_its_batch(
    dtype: torch.dtype, gen: torch.Generator
) -> None:
    """A decode row's attention depends on its own sequence only: alone, beside longer
    contexts, or in a mixed step beside a short chunk (in the op) and a long one (gather +
    SDPA), its output is bit for bit the same. So a request's tokens do not depend on what the
    worker batched it with (with row-invariant projections: `workers/model/cpu_linear.py`). The
    torch reference lacks this: it pads each decode group to its longest context, and a decode row
    beside a longer one comes out a rounding apart."""
    lens = [300, 900, 40, 20]
    kv = make_paged_kv(lens, 3, 64, 16, dtype, generator=gen)
    query = torch.randn(4, 9, 64, generator=gen).to(dtype)
    caches = (kv.key_cache, kv.value_cache)
    tables, seq_lens = kv.block_tables, kv.seq_lens
    alone = paged_decode_attention_cpu(query[:1], *caches, tables[:1], seq_lens[:1], 0.125)
    beside = paged_decode_attention_cpu(query[:3], *caches, tables[:3], seq_lens[:3], 0.125)
    chunks, starts = _packed_queries([1, 1, 40, 20], 9, 64, dtype, gen)
    chunks[:1] = query[:1]
    mixed = paged_attention_cpu(chunks, *caches, tables, starts, seq_lens, 0.125)
    assert torch.equal(beside[:1], alone)
    assert torch.equal(mixed[:1], alone)


@pytest.mark.parametrize("max_in_place", [0, 1 << 30], ids=["all-reference", "all-in-place"])
def test_routing_by_query_length_does_not_change_the_result(
    max_in_place: int, gen: torch.Generator, monkeypatch
) -> None:
    """Long query runs leave the op for gather + SDPA; either way gives the same rows. With
    every run in place, the op's multi-tile prefill (here up to 130 tokens) is covered too."""
    import pagedserve.kernels.cpu_paged as cpu_paged

    lens = [300, 3, 140, 64, 1, 33]
    q_lens = [130, 1, 40, 64, 1, 17]
    kv = make_paged_kv(lens, 3, 64, 16, generator=gen)
    query, starts = _packed_queries(q_lens, 9, 64, torch.float32, gen)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, starts, kv.seq_lens, 0.125)
    monkeypatch.setattr(cpu_paged, "MAX_IN_PLACE_QUERY", max_in_place)
    out = paged_attention_cpu(*args)
    torch.testing.assert_close(out, paged_prefill_attention_ref(*args))
    for seq, (lo, hi) in enumerate(itertools.pairwise(starts.tolist())):
        expected = naive_attention(query[lo:hi], kv.keys[seq], kv.values[seq], 0.125)
        torch.testing.assert_close(out[lo:hi].double(), expected, **tolerance(torch.float32))


def _prefill_args(**overrides):
    args = {
        "query": torch.randn(3, 4, 16),
        "key_cache": torch.randn(3, 8, 2, 16),
        "value_cache": torch.randn(3, 8, 2, 16),
        "block_tables": torch.tensor([[0, 1], [2, -1]], dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 2, 3], dtype=torch.int32),
        "seq_lens": torch.tensor([9, 4], dtype=torch.int32),
        "scale": 0.25,
    }
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"block_tables": torch.tensor([[0, 5], [2, -1]], dtype=torch.int32)}, "outside the pool"),
        ({"block_tables": torch.tensor([[0, -1], [2, -1]], dtype=torch.int32)}, "outside the pool"),
        ({"seq_lens": torch.tensor([17, 4], dtype=torch.int32)}, "needs 3 blocks"),
        ({"seq_lens": torch.tensor([1, 4], dtype=torch.int32)}, "new tokens exceed"),
        ({"query_start_loc": torch.tensor([0, 2, 4], dtype=torch.int32)}, "query_start_loc"),
        ({"query_start_loc": torch.tensor([0, 2, 1], dtype=torch.int32)}, "query_start_loc"),
    ],
)
def test_rejects_what_would_read_out_of_bounds(bad: dict, match: str) -> None:
    """The op reads raw pointers: every table entry and query row it would read is checked."""
    with pytest.raises(ValueError, match=match):
        paged_attention_cpu(**_prefill_args(**bad))


@pytest.mark.parametrize("q_lens", [[1] * 7, [1, 7, 16, 17, 30, 1, 1]], ids=["decode", "mixed"])
def test_a_bfloat16_pool_is_attended_to_within_one_bfloat16_step(q_lens, gen) -> None:
    """Bfloat16 keys and values are widened to float in registers and every sum is float: each
    output is the exact attention of its bfloat16 inputs, rounded once to bfloat16 (one unit of
    its last place at most, far inside the shared 2e-2 bfloat16 tolerance)."""
    lens = [1, 7, 16, 17, 100, 200, 333]
    kv = make_paged_kv(lens, 3, 64, 16, torch.bfloat16, generator=gen)
    query, starts = _packed_queries(q_lens, 9, 64, torch.bfloat16, gen)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, starts, kv.seq_lens, 0.125)
    out = paged_attention_cpu(*args)
    for seq, (lo, hi) in enumerate(itertools.pairwise(starts.tolist())):
        exact = naive_attention(query[lo:hi], kv.keys[seq], kv.values[seq], 0.125)
        torch.testing.assert_close(out[lo:hi].double(), exact, atol=1e-6, rtol=2**-7)
