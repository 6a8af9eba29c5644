"""The 8-bit KV cache (`kv_quant`): every backend's write, attention and block moves on fp8
and int8 pools against the torch reference, over dtype x head_dim x block_size with fixed
seeds."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_paged, reference
from pagedserve.kernels.kv_quant import (
    SCALE_BYTES,
    dequantise_rows,
    head_dim_of,
    quantise_rows,
    row_width,
)
from pagedserve.kernels.testing import edge_lens, make_paged_kv, naive_attention, quantise_pool

KV8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
# (KV format, query dtype, head_dim, block_size): each pair of values appears in some case.
CASES = [
    (torch.float8_e4m3fn, torch.float32, 64, 8),
    (torch.float8_e4m3fn, torch.bfloat16, 128, 16),
    (torch.float8_e4m3fn, torch.float16, 32, 32),
    (torch.float8_e5m2, torch.float32, 128, 32),
    (torch.float8_e5m2, torch.bfloat16, 32, 8),
    (torch.float8_e5m2, torch.float16, 64, 16),
    (torch.int8, torch.float32, 32, 16),
    (torch.int8, torch.bfloat16, 64, 32),
    (torch.int8, torch.float16, 128, 8),
]
IDS = [f"{str(f)[6:].removeprefix('float8_')}-{str(q)[6:]}-d{d}-b{b}" for f, q, d, b in CASES]
# The Triton cases (slow under the interpreter): one per format, every query dtype.
TRITON_CASES = [CASES[0], CASES[4], CASES[8]]
TRITON_IDS = [IDS[0], IDS[4], IDS[8]]
# The largest error of a value, as a share of its row's absmax: fp8's relative rounding of
# 3 / 2 mantissa bits (half a unit in the last place); int8's half step of a 127-step grid.
STEP = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3, torch.int8: 0.5 / 127}


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    # Both sides read the same codes: only the query dtype's arithmetic differs.
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def _pool(case, gen, lens):
    fmt, qdtype, head_dim, block = case
    kv = make_paged_kv(lens, 2, head_dim, block, torch.float32, generator=gen)
    query = torch.randn(len(lens), 4, head_dim, generator=gen).to(qdtype)
    return quantise_pool(kv, fmt), query


@pytest.mark.parametrize("fmt", KV8)
def test_rows_round_trip_within_the_format_step_with_a_scale_per_row(fmt, gen):
    rows = torch.randn(50, 3, 64, generator=gen) * torch.logspace(-3, 3, 50)[:, None, None]
    packed = quantise_rows(rows, fmt)
    assert packed.dtype == fmt and packed.shape == (50, 3, 64 + SCALE_BYTES)
    assert head_dim_of(packed) == 64 and row_width(64, fmt) == 68
    back = dequantise_rows(packed)
    # Each row's own scale: a row a million times smaller keeps its relative precision.
    amax = rows.abs().amax(-1, keepdim=True)
    assert bool(((back - rows).abs() <= STEP[fmt] * amax * (1 + 1e-6) + 1e-30).all())
    assert torch.equal(
        dequantise_rows(quantise_rows(torch.zeros(2, 1, 8), fmt)), torch.zeros(2, 1, 8)
    )


def test_an_8_bit_row_needs_head_dim_divisible_by_4():
    for fmt in KV8:
        with pytest.raises(ValueError, match="head_dim divisible by 4"):
            quantise_rows(torch.randn(2, 1, 6), fmt)


def test_int8_codes_are_symmetric_round_to_nearest_with_absmax_at_127(gen):
    rows = torch.randn(40, 2, 32, generator=gen) * 3
    packed = quantise_rows(rows, torch.int8)
    codes, scale = packed[..., :32], packed[..., 32:].contiguous().view(torch.float32)
    amax = rows.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(scale, amax / 127)
    assert int(codes.min()) >= -127 and int(codes.max()) <= 127
    # Each row's largest magnitude lands on ±127; every code is the nearest integer.
    assert torch.equal(codes.abs().amax(-1), torch.full((40, 2), 127, dtype=torch.int8))
    assert torch.equal(codes, (rows / scale).round().to(torch.int8))


def test_the_cpu_op_decodes_every_int8_byte_as_its_twos_complement_value():
    """The op's 256-entry int8 table against torch's conversion: the 256 bytes (-128 included,
    which quantisation never writes) as the values of one-token sequences, whose attention
    output is that one value row: each byte's int8 value times the row's scale."""
    if not cpu_paged.cpu_paged_available():
        pytest.skip("the C++ CPU kernel does not build here")
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8).view(64, 4)
    scale = torch.full((64, 1), 0.5).view(torch.int8)
    pool = torch.cat([codes, scale], dim=-1).view(64, 1, 1, 8)  # 64 blocks of one token
    tables = torch.arange(64, dtype=torch.int32).view(64, 1)
    seq_lens = torch.ones(64, dtype=torch.int32)
    query = torch.zeros(64, 1, 4)
    out = cpu_paged.paged_decode_attention_cpu(query, pool, pool, tables, seq_lens, 1.0)
    assert torch.equal(out.view(64, 4), codes.float() * 0.5)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_reference_on_8_bit_kv_attends_to_the_dequantised_kv(case, gen):
    lens = edge_lens(case[3])
    kv, query = _pool(case, gen, lens)
    out = reference.paged_decode_attention_ref(
        query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125
    )
    for seq in range(len(lens)):
        expected = naive_attention(
            query[seq : seq + 1].float(), kv.keys[seq], kv.values[seq], 0.125
        )
        torch.testing.assert_close(
            out[seq : seq + 1].float(), expected.float(), **_tolerance(case[1])
        )


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cpu_kernel_on_8_bit_kv_matches_the_reference(case, gen):
    if not cpu_paged.cpu_paged_available():
        pytest.skip("the C++ CPU kernel does not build here")
    lens = edge_lens(case[3])
    kv, query = _pool(case, gen, lens)
    args = (kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125)
    torch.testing.assert_close(
        cpu_paged.paged_decode_attention_cpu(query, *args),
        reference.paged_decode_attention_ref(query, *args),
        **_tolerance(case[1]),
    )
    # Prefill chunks of a few tokens (in place) and one long run (the reference's path).
    q_lens = [1, min(5, lens[1]), 9, 40]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    packed_q = torch.randn(int(starts[-1]), 4, case[2], generator=gen).to(case[1])
    pargs = (kv.key_cache, kv.value_cache, kv.block_tables, starts, kv.seq_lens, 0.125)
    torch.testing.assert_close(
        cpu_paged.paged_attention_cpu(packed_q, *pargs),
        reference.paged_prefill_attention_ref(packed_q, *pargs),
        **_tolerance(case[1]),
    )


@pytest.mark.parametrize("case", TRITON_CASES, ids=TRITON_IDS)
def test_triton_kernels_on_8_bit_kv_match_the_reference(case, gen, triton_device):
    from pagedserve.kernels import paged_decode_attention, paged_prefill_attention

    lens = [1, case[3], 2 * case[3] + 1, 70]
    kv, query = _pool(case, gen, lens)
    dev = triton_device
    tensors = [t.to(dev) for t in (kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)]
    query = query.to(dev)
    for splits in (None, 3):
        torch.testing.assert_close(
            paged_decode_attention(query, *tensors, 0.125, num_splits=splits),
            reference.paged_decode_attention_ref(query, *tensors, 0.125),
            **_tolerance(case[1]),
        )
    q_lens = [1, 3, 9, 20]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    packed_q = torch.randn(int(starts[-1]), 4, case[2], generator=gen).to(case[1]).to(dev)
    k, v, tables, seq_lens = tensors
    pargs = (k, v, tables, starts.to(dev), seq_lens, 0.125)
    torch.testing.assert_close(
        paged_prefill_attention(packed_q, *pargs),
        reference.paged_prefill_attention_ref(packed_q, *pargs),
        **_tolerance(case[1]),
    )


@pytest.mark.parametrize("fmt", KV8)
def test_triton_write_and_block_moves_on_8_bit_pools_match_the_reference(fmt, gen, triton_device):
    from pagedserve.kernels import copy_blocks, gather_blocks, scatter_blocks, write_kv

    dev = triton_device
    shape = (6, 4, 2, 32 + SCALE_BYTES)
    pools = [torch.zeros(shape, dtype=fmt, device=dev) for _ in range(4)]
    key = (torch.randn(10, 2, 32, generator=gen) * 5).to(dev)
    value = torch.randn(10, 2, 32, generator=gen).to(dev)
    slots = torch.tensor([0, 1, 2, 3, 4, 5, 9, 10, -1, 13], device=dev)
    write_kv(key, value, pools[0], pools[1], slots)
    reference.write_kv_ref(key, value, pools[2], pools[3], slots)
    assert torch.equal(pools[0].view(torch.uint8), pools[2].view(torch.uint8))
    assert torch.equal(pools[1].view(torch.uint8), pools[3].view(torch.uint8))
    mapping = torch.tensor([[0, 4], [2, 5]], device=dev)
    copy_blocks([pools[0]], [pools[1]], mapping)
    reference.copy_blocks_ref([pools[2]], [pools[3]], mapping)
    ids = torch.tensor([4, 1, 0], device=dev)
    packed = gather_blocks([pools[0]], [pools[1]], ids)
    assert packed.dtype == fmt
    assert torch.equal(
        packed.view(torch.uint8),
        reference.gather_blocks_ref([pools[2]], [pools[3]], ids).view(torch.uint8),
    )
    scatter_blocks(packed, [pools[0]], [pools[1]], torch.tensor([3, 5, 2], device=dev))
    reference.scatter_blocks_ref(
        packed, [pools[2]], [pools[3]], torch.tensor([3, 5, 2], device=dev)
    )
    for ours, theirs in zip(pools[:2], pools[2:], strict=True):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


@pytest.mark.parametrize("fmt", KV8)
def test_a_later_outlier_changes_no_earlier_row_and_keeps_its_own_precision(fmt, gen):
    """Scales are per row and fixed at the write: an outlier 1000x larger written later into
    the same block neither clips nor requantises what was there (a per-block or static scale
    would do one or the other)."""
    pool = [torch.zeros(2, 4, 1, 16 + SCALE_BYTES, dtype=fmt) for _ in range(2)]
    early = torch.randn(3, 1, 16, generator=gen)
    reference.write_kv_ref(early, early, *pool, torch.tensor([0, 1, 2]))
    before = pool[0].view(torch.uint8).clone()
    outlier = torch.randn(1, 1, 16, generator=gen) * 1000
    reference.write_kv_ref(outlier, outlier, *pool, torch.tensor([3]))
    assert torch.equal(pool[0].view(torch.uint8)[0, :3], before[0, :3])
    back = dequantise_rows(pool[0][0, 3])
    assert bool(((back - outlier[0]).abs() <= STEP[fmt] * outlier.abs().max()).all())
