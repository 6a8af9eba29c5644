"""Per-sequence split counts, decodes of mixed batches through the split kernel, launch knobs.

Interpreter on CPU (or CUDA), tiny shapes, against the torch references.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from pagedserve.kernels import (
    DecodeLaunch,
    PrefillLaunch,
    get_kernel_ops,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from pagedserve.kernels.testing import make_paged_kv, naive_attention, tolerance


def _packed(q_lens, heads, dim, dtype, device, gen):
    starts = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), heads, dim, generator=gen).to(dtype)
    return query.to(device), starts.to(device)


@pytest.mark.parametrize(
    "launch",
    [
        DecodeLaunch(block_n=16, min_split_tokens=16),
        DecodeLaunch(block_n=32, min_split_tokens=100),
        DecodeLaunch(block_n=16, min_split_tokens=1),  # more splits than tiles: empty ones
    ],
    ids=["n16-min16", "n32-min100", "n16-min1"],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_uneven_lengths_take_their_own_split_counts(launch, dtype, triton_device, gen) -> None:
    """One long sequence among short ones: each uses only the splits its length needs."""
    lens = [0, 1, 15, 16, 17, 33, 290]
    kv = make_paged_kv(lens, 2, 64, 8, dtype, triton_device, generator=gen)
    query = torch.randn(len(lens), 8, 64, generator=gen).to(dtype).to(triton_device)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125)
    expected = paged_decode_attention_ref(*args)
    for num_splits in (1, 3, 8):
        out = paged_decode_attention(*args, num_splits=num_splits, launch=launch)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        torch.testing.assert_close(out, expected, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16])
def test_mixed_batch_decodes_through_the_split_kernel(dtype, block_size, triton_device, gen):
    """Prefill chunks, cached prefixes and decodes (one long) in one batch, both paths."""
    ctx_lens = [40, 300, 9, 2 * block_size + 3, 1, 130]
    q_lens = [40, 1, 1, block_size + 1, 1, 17]
    kv = make_paged_kv(ctx_lens, 2, 64, block_size, dtype, triton_device, generator=gen)
    query, starts = _packed(q_lens, 4, 64, dtype, triton_device, gen)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, starts, kv.seq_lens, 0.1)
    expected = paged_prefill_attention_ref(*args)
    small = DecodeLaunch(block_n=16, min_split_tokens=32)  # several splits for 300 tokens
    plain = paged_prefill_attention(*args)
    split = paged_prefill_attention(*args, split_decodes=True, decode_launch=small)
    torch.testing.assert_close(plain, expected, **tolerance(dtype))
    torch.testing.assert_close(split, expected, **tolerance(dtype))


def test_kernel_ops_flag_routes_mixed_decodes(triton_device, gen) -> None:
    ops = get_kernel_ops("triton", triton_device, split_decodes=True)
    kv = make_paged_kv([50, 200], 1, 32, 16, torch.float32, triton_device, generator=gen)
    query, starts = _packed([50, 1], 2, 32, torch.float32, triton_device, gen)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, starts, kv.seq_lens, 0.2)
    torch.testing.assert_close(
        ops.paged_prefill_attention(*args),
        paged_prefill_attention_ref(*args),
        **tolerance(torch.float32),
    )


@pytest.mark.parametrize(
    "launch",
    [PrefillLaunch(block_m=16, block_n=16), PrefillLaunch(block_m=32, block_n=64, num_warps=8)],
    ids=["m16-n16", "m32-n64"],
)
def test_prefill_tiles_unmasked_and_diagonal(launch, triton_device, gen) -> None:
    """Cached prefixes that end mid-tile and chunks that start mid-tile, at small tiles, so
    every boundary between unmasked and diagonal tiles is crossed; float64 reference."""
    ctx_lens, q_lens = [77, 64, 33, 100], [20, 64, 1, 37]
    kv = make_paged_kv(ctx_lens, 2, 32, 8, torch.float32, triton_device, generator=gen)
    query, starts = _packed(q_lens, 4, 32, torch.float32, triton_device, gen)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, starts, kv.seq_lens, 0.17)
    out = paged_prefill_attention(*args, launch=launch).double().cpu()
    for i, (lo, hi) in enumerate(itertools.pairwise(starts.tolist())):
        expected = naive_attention(query[lo:hi].cpu(), kv.keys[i].cpu(), kv.values[i].cpu(), 0.17)
        torch.testing.assert_close(out[lo:hi], expected, atol=1e-4, rtol=1e-4)


def test_launch_configs_reject_bad_knobs() -> None:
    with pytest.raises(ValueError, match="block_n"):
        DecodeLaunch(block_n=48)
    with pytest.raises(ValueError, match="block_m"):
        PrefillLaunch(block_m=8)
    with pytest.raises(ValueError, match="num_stages"):
        PrefillLaunch(num_stages=0)
