"""No JIT churn: a sweep of batch sizes and contexts launches a fixed few kernel variants.

What is counted: distinct specialisation keys (`kernels.testing.specialisation_key`) of the
launches the wrappers make, i.e. the constexpr values, launch options, argument dtypes and
Triton's int/pointer specialisations (== 1, % 16) of every argument not in the kernel's
`do_not_specialize`. Equal keys share one compiled binary, so on a GPU the number of keys
is the number of compiles. The kernels themselves are replaced by recorders (nothing runs),
and the SM count is that of an H200 (132), so the host-side split choice sweeps its real
range (1..64) while no GPU is needed. `tests/gpu/test_serving_sizes.py` counts the real
Triton cache entries on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import decode, paged_decode_attention, paged_prefill_attention, prefill
from pagedserve.kernels.testing import KernelRecorder

BATCHES = [*range(1, 17), 24, 31, 32, 33, 48, 64, 100, 128, 200, 255, 256]
CONTEXTS = [1, 15, 16, 17, 100, 511, 512, 1000, 2048, 4097, 8192, 16384, 32768]
HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16
H200_SMS = 132


@pytest.fixture
def recorders(monkeypatch: pytest.MonkeyPatch) -> dict[str, KernelRecorder]:
    monkeypatch.setattr(decode, "parallel_units", lambda device: H200_SMS)
    recs = {}
    for module, name in (
        (decode, "decode_split_kernel"),
        (decode, "decode_reduce_kernel"),
        (prefill, "prefill_kernel"),
    ):
        recs[name] = KernelRecorder(getattr(module, name))
        monkeypatch.setattr(module, name, recs[name])
    return recs


def _pool(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # Nothing is launched, so one block is enough: only shapes, dtypes and strides count.
    shape = (1, BLOCK, KV_HEADS, DIM)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def _tables(batch: int, context: int, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = -(-context // BLOCK) + extra
    tables = torch.zeros((batch, width), dtype=torch.int32)
    return tables, torch.full((batch,), context, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_sweep_compiles_one_variant_per_stage(recorders, dtype) -> None:
    key_cache, value_cache = _pool(dtype)
    splits_seen = set()
    for batch in BATCHES:
        for context in CONTEXTS:
            tables, seq_lens = _tables(batch, context, extra=batch % 3)
            query = torch.zeros((batch, HEADS, DIM), dtype=dtype)
            paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, 0.088)
            splits_seen.add(
                decode.choose_num_splits(batch, KV_HEADS, tables.shape[1] * BLOCK, DIM, "cuda")
            )
    # The sweep spans many split counts: each was a compile when NUM_SPLITS was a constexpr.
    assert len(splits_seen) >= 10 and min(splits_seen) == 1 and max(splits_seen) >= 32
    assert recorders["decode_split_kernel"].launches == len(BATCHES) * len(CONTEXTS)
    assert len(recorders["decode_split_kernel"].keys) == 1
    assert len(recorders["decode_reduce_kernel"].keys) == 1


@pytest.mark.parametrize("split_decodes", [False, True])
def test_mixed_batch_sweep_compiles_a_fixed_few_variants(recorders, split_decodes) -> None:
    key_cache, value_cache = _pool(torch.bfloat16)
    for batch in [1, 2, 5, 16, 33, 64]:
        for context in [17, 512, 4097, 32768]:
            tables, seq_lens = _tables(batch, context, extra=batch % 2)
            # A mix of one-token decodes and chunks of varying length.
            q_lens = [1 if i % 2 else min(context, 7 + 13 * i) for i in range(batch)]
            starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
            query = torch.zeros((int(starts[-1]), HEADS, DIM), dtype=torch.bfloat16)
            paged_prefill_attention(
                query, key_cache, value_cache, tables, starts, seq_lens, 0.088,
                split_decodes=split_decodes,
            )  # fmt: skip
    assert len(recorders["prefill_kernel"].keys) == 1
    assert len(recorders["decode_split_kernel"].keys) == (1 if split_decodes else 0)
    assert len(recorders["decode_reduce_kernel"].keys) == (1 if split_decodes else 0)
