"""Backend selection and the argument checks shared by every implementation."""

from __future__ import annotations

import pytest
import torch

import pagedserve.kernels as kernels
from pagedserve.kernels import CPU_OPS, TORCH_OPS, get_kernel_ops

TRITON_FUNCS = {
    "write_kv": kernels.write_kv,
    "paged_decode_attention": kernels.paged_decode_attention,
    "paged_prefill_attention": kernels.paged_prefill_attention,
    "copy_blocks": kernels.copy_blocks,
    "gather_blocks": kernels.gather_blocks,
    "scatter_blocks": kernels.scatter_blocks,
}


def test_auto_picks_the_cpu_kernel_on_cpu_and_triton_on_cuda() -> None:
    expected = CPU_OPS if kernels.cpu_paged_available() else TORCH_OPS
    assert get_kernel_ops("auto", "cpu") is expected
    assert get_kernel_ops() is expected
    assert get_kernel_ops("auto", "meta") is TORCH_OPS
    ops = get_kernel_ops("auto", torch.device("cuda", 0))  # choosing needs no GPU
    assert ops.name == "triton"
    for name, func in TRITON_FUNCS.items():
        assert getattr(ops, name) is func


def test_torch_is_always_available() -> None:
    assert get_kernel_ops("torch", "cuda") is TORCH_OPS
    assert TORCH_OPS.paged_decode_attention is kernels.paged_decode_attention_ref
    assert TORCH_OPS.write_kv is kernels.write_kv_ref


def test_auto_falls_back_to_torch_where_the_cpu_kernel_cannot_build(monkeypatch) -> None:
    from pagedserve.kernels import dispatch

    monkeypatch.setattr(dispatch.cpu_paged, "cpu_paged_available", lambda: False)
    assert get_kernel_ops("auto", "cpu") is TORCH_OPS
    with pytest.raises(ValueError, match="did not build"):
        get_kernel_ops("cpu", "cpu")


def test_cpu_backend_shares_the_reference_movers_and_needs_a_cpu_pool() -> None:
    assert CPU_OPS.write_kv is kernels.write_kv_ref
    assert CPU_OPS.copy_blocks is kernels.copy_blocks_ref
    assert CPU_OPS.paged_decode_attention is kernels.paged_decode_attention_cpu
    assert CPU_OPS.paged_prefill_attention is kernels.paged_attention_cpu
    with pytest.raises(ValueError, match="CPU pools only"):
        get_kernel_ops("cpu", "cuda")


def test_unknown_backend_lists_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'flash'.*auto.*triton.*cpu.*torch"):
        get_kernel_ops("flash")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_kernel_ops("triton", "cpu")


def test_triton_on_cpu_under_the_interpreter() -> None:
    if not kernels.triton_interpreter_active():
        pytest.skip("needs TRITON_INTERPRET=1 set before triton is imported")
    assert get_kernel_ops("triton", "cpu").name == "triton"


IMPLS = [
    pytest.param(kernels.paged_decode_attention_ref, id="ref"),
    pytest.param(kernels.paged_decode_attention, id="triton"),
    pytest.param(kernels.paged_decode_attention_cpu, id="cpu"),
]


def _decode_args(**overrides):
    args = {
        "query": torch.randn(2, 4, 16),
        "key_cache": torch.randn(3, 8, 2, 16),
        "value_cache": torch.randn(3, 8, 2, 16),
        "block_tables": torch.zeros(2, 2, dtype=torch.int32),
        "seq_lens": torch.ones(2, dtype=torch.int32),
        "scale": 0.25,
    }
    args.update(overrides)
    return args


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("bad", "name"),
    [
        ({"query": torch.randn(2, 3, 16)}, "query"),  # 3 heads, 2 KV heads
        ({"query": torch.randn(2, 4, 16).half()}, "query"),  # dtype differs from the pool
        ({"key_cache": torch.randn(3, 8, 16, 2).transpose(2, 3)}, "key_cache"),
        ({"value_cache": torch.randn(3, 8, 2, 8)}, "value_cache"),
        ({"block_tables": torch.zeros(2, 2)}, "block_tables"),
        ({"block_tables": torch.zeros(3, 2, dtype=torch.int32)}, "block_tables"),
        ({"seq_lens": torch.ones(2, 1, dtype=torch.int32)}, "seq_lens"),
        ({"scale": -1.0}, "scale"),
    ],
)
def test_decode_rejects_bad_arguments(impl, bad: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        impl(**_decode_args(**bad))


@pytest.mark.parametrize(
    "impl",
    [
        kernels.paged_prefill_attention_ref,
        kernels.paged_prefill_attention,
        kernels.paged_attention_cpu,
    ],
)
def test_prefill_rejects_short_query_start_loc(impl) -> None:
    args = _decode_args()
    with pytest.raises(ValueError, match="query_start_loc"):
        impl(
            args["query"],
            args["key_cache"],
            args["value_cache"],
            args["block_tables"],
            torch.tensor([0, 1], dtype=torch.int32),
            args["seq_lens"],
            0.25,
        )


@pytest.mark.parametrize("impl", [kernels.write_kv_ref, kernels.write_kv])
def test_write_kv_rejects_bad_slot_mapping(impl) -> None:
    cache = torch.zeros(2, 4, 1, 8)
    rows = torch.zeros(3, 1, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        impl(rows, rows, cache, cache.clone(), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="slot_mapping"):
        impl(rows, rows, cache, cache.clone(), torch.zeros(3))
    with pytest.raises(ValueError, match="key"):
        impl(torch.zeros(3, 2, 8), rows, cache, cache.clone(), torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("impl", [kernels.scatter_blocks_ref, kernels.scatter_blocks])
def test_scatter_rejects_misshaped_packed(impl) -> None:
    caches = [torch.zeros(4, 8, 1, 16) for _ in range(2)]
    with pytest.raises(ValueError, match="packed"):
        impl(torch.zeros(2, 2, 3, 8, 1, 16), caches[:1], caches[1:], torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("impl", [kernels.copy_blocks_ref, kernels.copy_blocks])
def test_copy_rejects_bad_mapping_and_mismatched_layers(impl) -> None:
    caches = [torch.zeros(4, 8, 1, 16) for _ in range(2)]
    with pytest.raises(ValueError, match="block_mapping"):
        impl(caches[:1], caches[1:], torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="layer 1"):
        impl([caches[0], torch.zeros(5, 8, 1, 16)], caches, torch.tensor([[0, 1]]))
