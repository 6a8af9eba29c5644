"""Triton kernels on a real GPU at serving sizes, against the torch references.

The CPU suite (tests/unit/kernels) runs the same kernels under the interpreter at toy sizes;
this one adds long contexts, big batches, cross-device block moves and CUDA-graph capture.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from pagedserve.kernels import (
    gather_blocks,
    get_kernel_ops,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    scatter_blocks,
)
from pagedserve.kernels.decode import choose_num_splits
from pagedserve.kernels.testing import make_paged_kv, tolerance

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")
# Llama-3-8B attention shape: 32 query heads over 8 KV heads of 128 channels.
HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(7)


def test_auto_backend_is_triton_on_cuda() -> None:
    assert get_kernel_ops("auto", CUDA).name == "triton"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens", [[32768], [1, 17, 4096, 9000], "random64"])
def test_decode_long_and_wide(dtype, lens, gen) -> None:
    if lens == "random64":
        lens = torch.randint(1, 3000, (64,), generator=gen).tolist()
    kv = make_paged_kv(lens, KV_HEADS, DIM, BLOCK, dtype, CUDA, generator=gen)
    query = torch.randn(len(lens), HEADS, DIM, generator=gen).to(dtype).to(CUDA)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, DIM**-0.5)
    expected = paged_decode_attention_ref(*args)
    for num_splits in (None, 1, 16):
        out = paged_decode_attention(*args, num_splits=num_splits)
        torch.testing.assert_close(out, expected, **tolerance(dtype))


def test_one_long_sequence_is_split_across_the_gpu() -> None:
    splits = choose_num_splits(1, KV_HEADS, 32768, DIM, CUDA)
    assert splits >= 8
    assert choose_num_splits(256, KV_HEADS, 32768, DIM, CUDA) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_mixed_batch_at_scale(dtype, gen) -> None:
    # plain 2k prompt, 4k cached prefix + 512 new, 3 decodes, a 1k chunk after 1000 cached
    ctx_lens = [2048, 4096 + 512, 700, 5000, 33, 1000 + 1024]
    q_lens = [2048, 512, 1, 1, 1, 1024]
    kv = make_paged_kv(ctx_lens, KV_HEADS, DIM, BLOCK, dtype, CUDA, generator=gen)
    starts = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=CUDA)
    query = torch.randn(int(starts[-1]), HEADS, DIM, generator=gen).to(dtype).to(CUDA)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, starts, kv.seq_lens, 0.088)
    torch.testing.assert_close(
        paged_prefill_attention(*args), paged_prefill_attention_ref(*args), **tolerance(dtype)
    )


def test_decode_replays_in_a_cuda_graph(gen) -> None:
    """No host sync in the wrapper: capture once, change lengths in place, replay."""
    lens = [100, 2000, 513, 7]
    kv = make_paged_kv(lens, KV_HEADS, DIM, BLOCK, torch.bfloat16, CUDA, generator=gen)
    query = torch.randn(4, HEADS, DIM, generator=gen).bfloat16().to(CUDA)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, DIM**-0.5)
    paged_decode_attention(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(*args)
    kv.seq_lens.copy_(torch.tensor([64, 1999, 1, 7], dtype=torch.int32))
    graph.replay()
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), **tolerance(torch.bfloat16))


def test_swap_out_to_cpu_and_back(gen) -> None:
    shape = (64, BLOCK, KV_HEADS, DIM)
    keys = [torch.randn(shape, generator=gen).half().to(CUDA) for _ in range(4)]
    values = [torch.randn(shape, generator=gen).half().to(CUDA) for _ in range(4)]
    ids = torch.tensor([5, 60, 2, 33])  # CPU ids for CUDA pools
    swapped = gather_blocks(keys, values, ids).to("cpu")
    originals = [t[ids.to(CUDA)].clone() for t in keys + values]
    for t in keys + values:
        t[ids.to(CUDA)] = 0
    scatter_blocks(swapped, keys, values, ids)  # CPU packed -> CUDA pools
    for t, original in zip(keys + values, originals, strict=True):
        assert torch.equal(t[ids.to(CUDA)], original)
