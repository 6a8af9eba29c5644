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
    """`auto` is `onednn` for float32 on a CPU whose torch has oneDNN, and for bfloat16 where
    the CPU also has native bfloat16 arithmetic (oneDNN's check: AVX512-BF16 or AMX; elsewhere
    oneDNN emulates it, unmeasured), else `torch`; an explicit `onednn` that cannot run here is
    refused by name.

    Bfloat16, SmolLM2-135M's projections (30 layers + LM head), one thread, best of 20 per
    shape, on the 2-core AMD EPYC (avx512_bf16) test machine: 1 row 5.0 ms against 9.9 ms for
    torch's bfloat16 linear, 8 rows 7.7 against 12.7 ms, a prefill of 800 rows (no LM head)
    325 against 340 ms.

    Besides speed, oneDNN's packed GEMM gives each row the same bits whatever the row count
    (1 to 4,096 rows, 1 or 2 threads: `test_cpu_linear.py`), where torch's linear computes a
    one-row call differently from a many-row one; a sequence's logits then do not depend on how
    many others share its step.
    """
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {name!r}")
    if name == "auto":
        return "onednn" if onednn_supported(device, dtype) and _native(dtype) else "torch"
    if name == "onednn" and not onednn_supported(device, dtype):
        raise ValueError(
            "linear_backend 'onednn' needs the CPU, float32 or bfloat16 weights and a torch "
            f"built with oneDNN; here: device {device}, dtype {dtype}"
        )
    return name


def _native(dtype: torch.dtype) -> bool:
    """Whether oneDNN computes ``dtype`` in hardware here (float32 always)."""
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
