"""Linear layers on the CPU through oneDNN, their weights packed once at load.

`torch.nn.functional.linear` on the CPU hands every call a plain row-major weight; the GEMM
library re-blocks it on the fly, every layer, every step. A decode step is a batch of a few
dozen rows against every weight of the model, so that re-blocking is a large share of it. As
vLLM's CPU backend does (`create_onednn_mm`), each `nn.Linear` of the model is swapped at load
for a `PackedLinear` that holds its weight already in oneDNN's blocked layout and calls oneDNN's
linear on it (torch's own `mkldnn` ops, the ones inductor's freezing uses; no new dependency).

Measured on SmolLM2-135M (float32, 64 sequences decoding, 2 cores): decode steps 8-12% faster,
arms alternated (see bench/README.md). The arithmetic is the same float32 GEMM in another
summation order: greedy ids equal the torch path's on the compare prompts, not bit for bit
every logit.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pagedserve.kernels.backends import LINEAR_BACKENDS

# The row count oneDNN picks the packed layout for: a decode batch. Any other count works,
# with a layout tuned for this one.
BATCH_HINT = 64


class PackedLinear(nn.Module):
    """An `nn.Linear`'s computation over a oneDNN-packed copy of its weight."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.register_buffer(
            "packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        )
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def onednn_linear_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `PackedLinear` runs here: the CPU, a torch with oneDNN, a dtype it packs."""
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and dtype in (torch.float32, torch.bfloat16)
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def resolve_linear_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto` → `onednn` where supported, else `torch`; an explicit `onednn` that cannot run
    here is refused by name."""
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {name!r}")
    supported = onednn_linear_supported(device, dtype)
    if name == "auto":
        return "onednn" if supported else "torch"
    if name == "onednn" and not supported:
        raise ValueError(
            f"linear_backend 'onednn' needs the CPU, float32 or bfloat16 and a torch built with "
            f"oneDNN; here: device {device}, dtype {dtype}"
        )
    return name


def pack_linears(model: nn.Module) -> int:
    """Swap every `nn.Linear` of `model` for a `PackedLinear`, in place; returns how many.

    Idempotent (an already packed layer is left as it is), so engines that share one loaded
    model each call it safely. The model then runs only forward passes: keep a separate copy
    for anything that reads `.weight` of its linear layers.
    """
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
