"""Batched LoRA for a mixed batch (S-LoRA / Punica): every token adds its own adapter's update.

One projection's output ``out [T, N]`` of inputs ``x [T, K]`` gets, per token ``t`` whose
adapter slot is ``s = slots[t] >= 0``,

    out[t] += scales[s] * (x[t] @ A[s].T) @ B[s].T        shrink: K -> R, expand: R -> N

from the resident adapters' stacked weights ``A [S, R, K]`` and ``B [S, N, R]`` (``R`` the
largest rank resident: a smaller rank is zero-padded, and zeros add nothing). A token of the
base model has slot ``-1`` and is left alone.

Three implementations, each in place on ``out`` and compared in `tests/unit/kernels`:

- `add_lora_ref`: one token at a time, the definition above (the reference);
- `add_lora_torch`: the CPU path, one shrink and one expand matmul per adapter present in the
  batch over its rows (gathered with ``index_select``, added back with ``index_add_``);
- `add_lora_triton` (`lora_triton.py`): the GPU path, one program per token tile gathering
  each token's own A and B rows.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_lora_args(
    out: Tensor, x: Tensor, a: Tensor, b: Tensor, scales: Tensor, slots: Tensor
) -> None:
    """Shapes, dtypes and devices of one batched-LoRA call (raises ValueError)."""
    if x.ndim != 2 or out.ndim != 2 or out.shape[0] != x.shape[0]:
        raise ValueError(
            f"x [T, K] and out [T, N] expected, got {tuple(x.shape)} {tuple(out.shape)}"
        )
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or a.shape[1] != b.shape[2]:
        raise ValueError(
            f"A [S, R, K] and B [S, N, R] expected, got {tuple(a.shape)} {tuple(b.shape)}"
        )
    if a.shape[2] != x.shape[1] or b.shape[1] != out.shape[1]:
        raise ValueError(
            f"A's K {a.shape[2]} / B's N {b.shape[1]} do not match x {tuple(x.shape)}, "
            f"out {tuple(out.shape)}"
        )
    if scales.shape != (a.shape[0],):
        raise ValueError(f"scales must be [S={a.shape[0]}], got {tuple(scales.shape)}")
    if slots.shape != (x.shape[0],) or slots.dtype != torch.int64:
        raise ValueError(f"slots must be [T={x.shape[0]}] int64, got {tuple(slots.shape)}")
    if len({t.device for t in (out, x, a, b, scales, slots)}) != 1:
        raise ValueError("every LoRA tensor must be on one device")


def add_lora_ref(
    out: Tensor, x: Tensor, a: Tensor, b: Tensor, scales: Tensor, slots: Tensor
) -> Tensor:
    """The reference: token by token, in float32. Returns ``out``."""
    check_lora_args(out, x, a, b, scales, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        shrunk = x[t].float() @ a[slot].float().T
        out[t] += (scales[slot].float() * (shrunk @ b[slot].float().T)).to(out.dtype)
    return out


def add_lora_torch(
    out: Tensor,
    x: Tensor,
    a: Tensor,
    b: Tensor,
    scales: Tensor,
    slots: Tensor,
    groups: list[tuple[int, Tensor]] | None = None,
) -> Tensor:
    """The CPU path: per adapter present, one shrink and one expand over its rows.

    Args:
        groups: ``(slot, rows)`` for each adapter present (rows: int64 token indices); derived
            from ``slots`` when None. The engine builds them once per step and reuses them
            for every layer and projection.

    Returns:
        ``out``, updated in place.
    """
    check_lora_args(out, x, a, b, scales, slots)
    if groups is None:
        groups = slot_groups(slots)
    for slot, rows in groups:
        shrunk = x.index_select(0, rows) @ a[slot].T
        update = (shrunk @ b[slot].T) * scales[slot]
        out.index_add_(0, rows, update.to(out.dtype))
    return out


def slot_groups(slots: Tensor) -> list[tuple[int, Tensor]]:
    """``(slot, rows)`` per adapter slot present in ``slots`` (``-1``, the base, left out)."""
    present = [int(s) for s in torch.unique(slots).tolist() if s >= 0]
    return [(s, torch.nonzero(slots == s).flatten()) for s in present]
