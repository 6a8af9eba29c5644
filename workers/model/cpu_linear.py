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

With the `gguf` backend (the `auto` choice for float32 on an AVX-512 CPU), a weight whose values
are exactly GGUF Q4_1 or Q8_0 block codes (a dequantised GGUF checkpoint, such as the built-in
SmolLM2) is kept as those codes instead (`gguf_blocks.py`): the same float32 weights, read from
5-6x fewer bytes. Other weights of the model go to oneDNN.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedserve.kernels.backends import LINEAR_BACKENDS
from pagedserve.kernels.cpu_blocks import blocks_available
from pagedserve.workers.model.gguf_blocks import BlockCodes, find_block_codes

# The row count oneDNN picks the packed layout for. Measured with 1-64 rows: the layout for 64
# is as fast as or faster than the one for the exact count from 4 rows up, and within ~20% at 1.
PACKING_ROWS_HINT = 64


@dataclass(frozen=True)
class Projection:
    """``x @ weight.T + bias`` over a plain weight (``F.linear``), a oneDNN-packed one, or GGUF
    block codes (``blocks``; ``weight`` is then the float32 weight they hold, unused here)."""

    weight: Tensor
    bias: Tensor | None
    packed: bool
    blocks: BlockCodes | None = None

    @classmethod
    def of(cls, weight: Tensor, bias: Tensor | None, backend: str) -> Projection:
        """A projection over ``weight`` (``[out, in]``) for a resolved backend (`torch`,
        `onednn` or `gguf`). `onednn` packs a copy of the weight; `gguf` keeps its block codes
        when it has them, else packs it as `onednn` does. The original is left as it is."""
        if backend == "gguf":
            blocks = find_block_codes(weight)
            if blocks is not None:
                return cls(weight, None if bias is None else bias.detach(), False, blocks)
            backend = "onednn"
        if backend == "torch":
            return cls(weight, bias, packed=False)
        if backend != "onednn":
            raise ValueError(f"resolve the linear backend first: got {backend!r}")
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_ROWS_HINT)
        return cls(packed, None if bias is None else bias.detach(), packed=True)

    def __call__(self, x: Tensor) -> Tensor:
        if self.blocks is not None:
            out = self.blocks(x)
            return out if self.bias is None else out.add_(self.bias)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def describe_block_codes(projections: list[Projection]) -> str:
    """How many of ``projections`` hold GGUF block codes, in which formats, and the bytes of
    weights a step reads through them against float32."""
    blocks = [p.blocks for p in projections if p.blocks is not None]
    formats = Counter(b.format_name for b in blocks)
    others = sum(p.weight.numel() * p.weight.element_size() for p in projections if not p.blocks)
    read = sum(b.nbytes for b in blocks) + others
    float32 = sum(b.n * b.k * 4 for b in blocks) + others
    kinds = ", ".join(f"{name} {count}" for name, count in sorted(formats.items())) or "none"
    return (
        f"{len(blocks)} of {len(projections)} projections kept as GGUF block codes ({kinds}): "
        f"{read / 1e6:.1f} MB of weights read per step instead of {float32 / 1e6:.1f} MB"
    )


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
    """`auto` is `gguf` for float32 on an AVX-512 CPU whose torch has oneDNN (block codes where
    a weight has them, oneDNN for the rest), `onednn` for other float32 CPUs and for bfloat16
    where the CPU also has native bfloat16 arithmetic (oneDNN's check: AVX512-BF16 or AMX;
    elsewhere oneDNN emulates it, unmeasured), else `torch`; an explicit `onednn` or `gguf` that
    cannot run here is refused by name.

    Bfloat16, SmolLM2-135M's projections (30 layers + LM head), one thread, best of 20 per
    shape, on the 2-core AMD EPYC (avx512_bf16) test machine: 1 row 5.0 ms against 9.9 ms for
    torch's bfloat16 linear, 8 rows 7.7 against 12.7 ms, a prefill of 800 rows (no LM head)
    325 against 340 ms. Float32 from GGUF block codes: see `bench/README.md`.

    Besides speed, oneDNN's packed GEMM and the block-code op each give a row the same bits
    whatever the row count (`test_cpu_linear.py`, `test_gguf_blocks.py`), where torch's linear
    computes a one-row call differently from a many-row one; a sequence's logits then do not
    depend on how many others share its step.
    """
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {name!r}")
    if name == "auto":
        if _gguf_runs(device, dtype):
            return "gguf"
        return "onednn" if onednn_supported(device, dtype) and _native(dtype) else "torch"
    if name == "onednn" and not onednn_supported(device, dtype):
        raise ValueError(
            "linear_backend 'onednn' needs the CPU, float32 or bfloat16 weights and a torch "
            f"built with oneDNN; here: device {device}, dtype {dtype}"
        )
    if name == "gguf" and not _gguf_runs(device, dtype):
        raise ValueError(
            "linear_backend 'gguf' needs the CPU with AVX-512, float32 weights and a torch "
            f"built with oneDNN; here: device {device}, dtype {dtype}, CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}"
        )
    return name


def _gguf_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether block codes can run here; only asked when `auto` or `gguf` is named, since the
    first answer on a machine builds the op."""
    return onednn_supported(device, dtype) and dtype == torch.float32 and blocks_available()


def _native(dtype: torch.dtype) -> bool:
    """Whether oneDNN computes ``dtype`` in hardware here (float32 always)."""
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
