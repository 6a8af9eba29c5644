"""cpu_linear: a packed projection computes F.linear's result; the backend names resolve as
documented and an impossible choice is refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_blocks import blocks_available
from pagedserve.workers.model.cpu_linear import Projection, onednn_supported, resolve_linear_backend

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not onednn_supported(CPU, torch.float32), reason="this torch has no oneDNN linear"
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 4, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_a_packed_projection_equals_f_linear(rows: int, with_bias: bool):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 48, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    x = torch.randn(rows, 48, generator=generator)
    original = weight.clone()
    packed = Projection.of(weight, bias, "onednn")
    assert packed.packed and packed.weight is not weight
    torch.testing.assert_close(packed(x), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    assert torch.equal(weight, original)  # packing reads a copy


@needs_onednn
@pytest.mark.parametrize("rows", [1, 8, 300])
def test_a_packed_bfloat16_projection_equals_f_linear_to_bfloat16_rounding(rows: int):
    if not onednn_supported(CPU, torch.bfloat16):
        pytest.skip("this torch's oneDNN does not pack bfloat16")
    generator = torch.Generator().manual_seed(rows)
    weight = (torch.randn(96, 48, generator=generator) / 8).to(torch.bfloat16)
    x = torch.randn(rows, 48, generator=generator).to(torch.bfloat16)
    out = Projection.of(weight, None, "onednn")(x)
    assert out.dtype == torch.bfloat16
    expected = F.linear(x.float(), weight.float())
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=1e-2)


@needs_onednn
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_packed_projection_gives_each_row_the_same_bits_whatever_the_row_count(
    threads: int, dtype: torch.dtype
):
    """What makes a sequence's logits independent of how many others share its step: every
    row computed in a batch equals the same row computed alone, bit for bit."""
    if not onednn_supported(CPU, dtype):
        pytest.skip(f"this torch's oneDNN does not pack {dtype}")
    generator = torch.Generator().manual_seed(7)
    weight = (torch.randn(384, 256, generator=generator) / 16).to(dtype)  # tiny-llama's q/k/v
    x = torch.randn(2048, 256, generator=generator).to(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        packed = Projection.of(weight, None, "onednn")
        alone = torch.cat([packed(x[i : i + 1]) for i in range(len(x))])
        for rows in (2, 3, 7, 16, 64, 255, 300, 512, 1375, 2048):
            assert torch.equal(packed(x[:rows]), alone[:rows]), f"{rows} rows"
    finally:
        torch.set_num_threads(previous)


def test_the_torch_backend_calls_f_linear_on_the_weight_itself():
    weight, x = torch.randn(8, 4), torch.randn(3, 4)
    projection = Projection.of(weight, None, "torch")
    assert not projection.packed and projection.weight is weight
    assert torch.equal(projection(x), F.linear(x, weight))


def test_an_unresolved_backend_is_refused():
    with pytest.raises(ValueError, match="resolve the linear backend first: got 'auto'"):
        Projection.of(torch.randn(2, 2), None, "auto")


@needs_onednn
def test_auto_takes_block_codes_or_onednn_for_float32_and_bfloat16_on_the_cpu_only():
    float32 = resolve_linear_backend("auto", CPU, torch.float32)
    assert float32 == ("gguf" if blocks_available() else "onednn")
    native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    bf16 = resolve_linear_backend("auto", CPU, torch.bfloat16)
    assert bf16 == ("onednn" if native_bf16 else "torch")
    assert resolve_linear_backend("auto", CPU, torch.float16) == "torch"
    assert resolve_linear_backend("auto", torch.device("cuda"), torch.bfloat16) == "torch"
    assert resolve_linear_backend("auto", torch.device("cuda"), torch.float32) == "torch"
    assert resolve_linear_backend("torch", CPU, torch.float32) == "torch"


def test_an_impossible_or_unknown_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="linear_backend 'onednn' needs the CPU"):
        resolve_linear_backend("onednn", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        resolve_linear_backend("mkl", CPU, torch.float32)
    with pytest.raises(ValueError, match="linear_backend 'gguf' needs the CPU with AVX-512"):
        resolve_linear_backend("gguf", CPU, torch.bfloat16)


def test_engine_config_refuses_an_unknown_linear_backend():
    from pagedserve.workers.engine.config import EngineConfig

    with pytest.raises(ValueError, match="linear_backend must be one of .* got 'fast'"):
        EngineConfig(linear_backend="fast")
