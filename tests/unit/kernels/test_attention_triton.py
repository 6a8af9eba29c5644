"""Triton paged attention against the torch references (interpreter on CPU, or CUDA)."""

from __future__ import annotations

import itertools

import pytest
import torch

from pagedserve.kernels import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    write_kv,
)
from pagedserve.kernels.testing import (
    PAIRWISE_CASES,
    AttnCase,
    edge_lens,
    make_paged_kv,
    naive_attention,
    tolerance,
)

CASE_IDS = [case.id() for case in PAIRWISE_CASES]


def _to(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("num_splits", [None, 4])
@pytest.mark.parametrize("case", PAIRWISE_CASES, ids=CASE_IDS)
def test_decode_matches_reference(
    case: AttnCase, num_splits: int | None, triton_device: torch.device, gen: torch.Generator
) -> None:
    lens = edge_lens(case.block_size)
    kv = make_paged_kv(
        lens,
        case.num_kv_heads,
        case.head_dim,
        case.block_size,
        case.dtype,
        triton_device,
        generator=gen,
    )
    query = torch.randn(len(lens), case.num_heads, case.head_dim, generator=gen)
    query = query.to(case.dtype).to(triton_device)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.7 / 8)
    out = paged_decode_attention(*args, num_splits=num_splits)
    assert out.dtype == case.dtype and out.shape == query.shape
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), **tolerance(case.dtype))


def test_decode_more_splits_than_tiles_and_empty_sequence(
    triton_device: torch.device, gen: torch.Generator
) -> None:
    """Splits past a sequence's end are empty; a zero-length sequence yields zeros."""
    kv = make_paged_kv([0, 3, 70], 2, 64, 16, torch.float16, triton_device, generator=gen)
    query = torch.randn(3, 8, 64, generator=gen).half().to(triton_device)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125)
    expected = paged_decode_attention_ref(*args)
    for num_splits in (1, 7):
        out = paged_decode_attention(*args, num_splits=num_splits)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        torch.testing.assert_close(out, expected, **tolerance(torch.float16))


def test_decode_accepts_strided_query_and_table(
    triton_device: torch.device, gen: torch.Generator
) -> None:
    """A query sliced from a fused QKV output and a column slice of a wider block table."""
    kv = make_paged_kv(
        [33, 9], 2, 64, 8, torch.float32, triton_device, generator=gen, spare_columns=4
    )
    qkv = torch.randn(2, 8 + 2 * 2, 64, generator=gen).to(triton_device)
    query = qkv[:, :8]
    tables = kv.block_tables[:, :5]
    assert not query.is_contiguous() and not tables.is_contiguous()
    args = (query, kv.key_cache, kv.value_cache, tables, kv.seq_lens, 0.125)
    torch.testing.assert_close(
        paged_decode_attention(*args, num_splits=2),
        paged_decode_attention_ref(*args),
        **tolerance(torch.float32),
    )


def _mixed_batch(block: int) -> tuple[list[int], list[int]]:
    """(context lengths, new-token counts): plain prefill, decode, prefix hit on whole
    blocks, unaligned chunked prefill, a sequence without new tokens, a 1-token prompt."""
    ctx_lens = [2 * block + 1, 300, 4 * block + 5, block + 7, block, 1]
    q_lens = [2 * block + 1, 1, 2 * block + 5, 10, 0, 1]
    return ctx_lens, q_lens


def _packed_queries(q_lens, num_heads, head_dim, dtype, device, gen):
    starts = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), num_heads, head_dim, generator=gen).to(dtype)
    return query.to(device), starts.to(device)


@pytest.mark.parametrize("case", PAIRWISE_CASES, ids=CASE_IDS)
def test_prefill_matches_reference(
    case: AttnCase, triton_device: torch.device, gen: torch.Generator
) -> None:
    ctx_lens, q_lens = _mixed_batch(case.block_size)
    kv = make_paged_kv(
        ctx_lens,
        case.num_kv_heads,
        case.head_dim,
        case.block_size,
        case.dtype,
        triton_device,
        generator=gen,
    )
    query, starts = _packed_queries(
        q_lens, case.num_heads, case.head_dim, case.dtype, triton_device, gen
    )
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, starts, kv.seq_lens, 0.1)
    out = paged_prefill_attention(*args)
    assert out.dtype == case.dtype and out.shape == query.shape
    torch.testing.assert_close(out, paged_prefill_attention_ref(*args), **tolerance(case.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_long_prompt(dtype: torch.dtype, triton_device: torch.device, gen) -> None:
    """Several hundred new tokens in one sequence: many query tiles and KV tiles."""
    kv = make_paged_kv([333], 2, 64, 16, dtype, triton_device, generator=gen)
    query, starts = _packed_queries([333], 8, 64, dtype, triton_device, gen)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, starts, kv.seq_lens, 0.125)
    torch.testing.assert_close(
        paged_prefill_attention(*args), paged_prefill_attention_ref(*args), **tolerance(dtype)
    )


def test_chunked_prefill_then_decode_end_to_end(
    triton_device: torch.device, gen: torch.Generator
) -> None:
    """write_kv + prefill in two chunks, then decode: matches attention over the whole
    contiguous prompt, as an engine would run it."""
    heads, kv_heads, dim, block = 4, 2, 64, 8
    prompt = 29
    keys = torch.randn(prompt + 1, kv_heads, dim, generator=gen).to(triton_device)
    values = torch.randn(prompt + 1, kv_heads, dim, generator=gen).to(triton_device)
    queries = torch.randn(prompt + 1, heads, dim, generator=gen).to(triton_device)
    key_cache = torch.zeros(8, block, kv_heads, dim, device=triton_device)
    value_cache = torch.zeros_like(key_cache)
    table = torch.tensor([[6, 1, 4, 0, 7]], dtype=torch.int32, device=triton_device)
    positions = torch.arange(prompt + 1, device=triton_device)
    slots = table[0, positions // block].long() * block + positions % block
    outputs = []
    for lo, hi in ((0, 13), (13, prompt)):  # chunked prefill: 13 tokens, then 16
        write_kv(keys[lo:hi], values[lo:hi], key_cache, value_cache, slots[lo:hi].int())
        outputs.append(
            paged_prefill_attention(
                queries[lo:hi],
                key_cache,
                value_cache,
                table,
                torch.tensor([0, hi - lo], dtype=torch.int32, device=triton_device),
                torch.tensor([hi], dtype=torch.int32, device=triton_device),
                dim**-0.5,
            )
        )
    write_kv(keys[prompt:], values[prompt:], key_cache, value_cache, slots[prompt:])
    outputs.append(
        paged_decode_attention(
            queries[prompt:],
            key_cache,
            value_cache,
            table,
            torch.tensor([prompt + 1], dtype=torch.int32, device=triton_device),
            dim**-0.5,
            num_splits=2,
        )
    )
    expected = naive_attention(queries, keys, values, dim**-0.5)
    torch.testing.assert_close(torch.cat(outputs).double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("head_dim", "block_size", "group", "num_kv_heads"),
    [(80, 12, 3, 2), (96, 5, 8, 1), (32, 64, 2, 3)],
    ids=["d80-b12-g3", "d96-b5-g8", "d32-b64-g2"],
)
def test_odd_shapes(
    head_dim: int, block_size: int, group: int, num_kv_heads: int, triton_device, gen
) -> None:
    """Head dims and block sizes that are not powers of two, group sizes of 2, 3 and 8."""
    ctx_lens = [1, block_size, 3 * block_size + 1, 140]
    q_lens = [1, block_size, 2, 140]
    kv = make_paged_kv(
        ctx_lens,
        num_kv_heads,
        head_dim,
        block_size,
        torch.float16,
        triton_device,
        generator=gen,
    )
    heads = group * num_kv_heads
    query, starts = _packed_queries(q_lens, heads, head_dim, torch.float16, triton_device, gen)
    tol = tolerance(torch.float16)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, starts, kv.seq_lens, 0.1)
    torch.testing.assert_close(
        paged_prefill_attention(*args), paged_prefill_attention_ref(*args), **tol
    )
    decode_query = query[starts[1:].long() - 1]  # each sequence's last token
    args = (decode_query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.1)
    torch.testing.assert_close(
        paged_decode_attention(*args, num_splits=3), paged_decode_attention_ref(*args), **tol
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_batches(seed: int, triton_device: torch.device) -> None:
    """Many sequences of random lengths and random new-token counts in one batch."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = 12
    ctx_lens = torch.randint(1, 200, (num_seqs,), generator=gen).tolist()
    q_lens = [int(torch.randint(1, n + 1, (1,), generator=gen)) if n < 40 else 1 for n in ctx_lens]
    kv = make_paged_kv(ctx_lens, 2, 64, 16, torch.float32, triton_device, generator=gen)
    query, starts = _packed_queries(q_lens, 4, 64, torch.float32, triton_device, gen)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, starts, kv.seq_lens, 0.125)
    torch.testing.assert_close(
        paged_prefill_attention(*args), paged_prefill_attention_ref(*args), atol=1e-4, rtol=1e-4
    )


def test_prefill_padding_rows_are_zero(triton_device: torch.device, gen) -> None:
    """Tokens past query_start_loc[-1] (a padded batch) come back as zeros, as in the ref."""
    kv = make_paged_kv([20], 1, 64, 8, torch.float32, triton_device, generator=gen)
    query = torch.randn(24, 2, 64, generator=gen).to(triton_device)
    starts = torch.tensor([0, 20], dtype=torch.int32, device=triton_device)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, starts, kv.seq_lens, 0.125)
    out = paged_prefill_attention(*args)
    assert torch.equal(out[20:], torch.zeros_like(out[20:]))
    torch.testing.assert_close(out, paged_prefill_attention_ref(*args), atol=1e-4, rtol=1e-4)
