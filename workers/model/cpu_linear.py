"""The fused decoder's projections, optionally through oneDNN over weights packed once at load.

`torch.nn.functional.linear` on the CPU goes to the BLAS torch was built with (MKL here), which
takes a plain row-major weight every call. For the few rows of a serving decode step that path
is slow: on this project's 2-core AMD test machine, one thread, 4 rows, SmolLM2-135M's shapes,
its gate/up matmul took 1.12 ms and the 49,152-row LM head 37.9 ms, against 0.61 ms and
18.9 ms for oneDNN over the same weight packed once into its blocked layout (the path vLLM's
CPU backend takes, `create_onednn_mm`). At 64 rows oneDNN still led (gate/up 4.4 ms against
7.9 ms). `Projection` holds one weight either way and is called like `F.linear`.

The arithmetic is the same float32 GEMM in another summation order: logits equal the torch
path's to float rounding, not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedserve.kernels.backends import LINEAR_BACKENDS

# The row count oneDNN picks the packed layout for. Measured with 1-64 rows: the layout for 64
# is as fast as or faster than the one for the exact count from 4 rows up, and within ~20% at 1.
PACKING_ROWS_HINT = 64


@dataclass(frozen=True)
class Projection:
    """``x @ weight.T + bias`` over a plain weight (``F.linear``) or a oneDNN-packed one."""

    weight: Tensor
    bias: Tensor | None
    packed: bool

    @classmethod
    def of(cls, weight: Tensor, bias: Tensor | None, backend: str) -> Projection:
        """A projection over ``weight`` (``[out, in]``) for a resolved backend (`torch` or
        `onednn`); `onednn` packs a copy of the weight, the original is left as it is."""
        if backend == "torch":
            return cls(weight, bias, packed=False)
        if backend != "onednn":
            raise ValueError(f"resolve the linear backend first: got {backend!r}")
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_ROWS_HINT)
        return cls(packed, None if bias is None else bias.detach(), packed=True)

    def __call__(self, x: Tensor) -> Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def onednn_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a `Projection` can be packed here: the CPU, a torch with oneDNN, a dtype it
    packs."""
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and dtype in (torch.float32, torch.bfloat16)
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def resolve_linear_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto` is `onednn` for float32 on a CPU whose torch has oneDNN (bfloat16 was not
    measured), else `torch`; an explicit `onednn` that cannot run here is refused by name.

    Besides speed, oneDNN's packed GEMM gives each row the same bits whatever the row count
    (1 to 4,096 rows, 1 or 2 threads: `test_cpu_linear.py`), where torch's linear computes a
    one-row call differently from a many-row one; a sequence's logits then do not depend on how
    many others share its step.
    """
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {name!r}")
    if name == "auto":
        supported = onednn_supported(device, dtype)
        return "onednn" if supported and dtype == torch.float32 else "torch"
    if name == "onednn" and not onednn_supported(device, dtype):
        raise ValueError(
            "linear_backend 'onednn' needs the CPU, float32 or bfloat16 weights and a torch "
            f"built with oneDNN; here: device {device}, dtype {dtype}"
        )
    return name
