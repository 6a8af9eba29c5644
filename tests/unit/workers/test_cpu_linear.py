"""oneDNN-packed linear layers: the same function as `nn.Linear`, swapped in once, refused by
name where they cannot run."""

import pytest
import torch
from torch import nn

from pagedserve.workers.cpu_linear import (
    PackedLinear,
    onednn_linear_supported,
    pack_linears,
    resolve_linear_backend,
)

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not onednn_linear_supported(CPU, torch.float32), reason="this torch has no oneDNN linear"
)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_computes_what_linear_computes(bias, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 40, bias=bias)
    x = torch.randn(1, rows, 96)  # the packed batch's shape: [1, T, hidden]
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_pack_swaps_every_linear_once():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    x = torch.randn(3, 8)
    with torch.inference_mode():
        expected = model(x)
        assert pack_linears(model) == 2
        assert pack_linears(model) == 0  # already packed: engines sharing a model call it again
        assert not any(isinstance(m, nn.Linear) for m in model.modules())
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_backend_names_resolve_or_are_refused_by_name():
    assert resolve_linear_backend("torch", CPU, torch.float32) == "torch"
    assert resolve_linear_backend("auto", CPU, torch.float16) == "torch"  # not packed: fp16
    if onednn_linear_supported(CPU, torch.float32):
        assert resolve_linear_backend("auto", CPU, torch.float32) == "onednn"
    with pytest.raises(ValueError, match="linear_backend 'onednn' needs the CPU"):
        resolve_linear_backend("onednn", torch.device("meta"), torch.float32)
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        resolve_linear_backend("mkl", CPU, torch.float32)
