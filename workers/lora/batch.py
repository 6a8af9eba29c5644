"""One step's LoRA: which adapter slot each packed token uses, applied after each projection.

The fused decoder runs q/k/v as one matmul and gate/up as one; each target's update goes into
its own columns of the fused output:

    qkv     [ q_proj | k_proj | v_proj ]        gate_up [ gate_proj | up_proj ]
    o       [ o_proj ]                          down    [ down_proj ]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from pagedserve.kernels.lora_ops import add_lora_torch, lora_mask
from pagedserve.workers.lora.adapter import ModuleShape
from pagedserve.workers.lora.registry import LoraRegistry, LoraSlots

# Fused projection -> its targets, in column order.
FUSED_TARGETS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass
class LoraBatch:
    """Per-token adapter slots of one packed batch (-1: the base model) and the stacks.

    Attributes:
        num_slots: slots below this are used by the step (the highest one present + 1).
        mask: ``[T, num_slots · R]`` for the CPU path (`lora_ops.lora_mask`); None on a GPU.
        present: the slots the step uses.
    """

    slots: LoraSlots
    token_slots: Tensor
    num_slots: int
    mask: Tensor | None
    present: frozenset[int]
    columns: dict[str, tuple[int, int]]  # target -> its column range in the fused output

    def add(self, layer: int, fused: str, x: Tensor, out: Tensor) -> None:
        """Add every token's adapter update of projection ``fused`` of ``layer`` to ``out``."""
        for target in FUSED_TARGETS[fused]:
            if not any(target in self.slots.targets[slot] for slot in self.present):
                continue
            a, b = self.slots.stacks[(layer, target)]
            start, end = self.columns[target]
            columns = out[:, start:end]
            scales, slots = self.slots.scales, self.token_slots
            if self.mask is None:
                from pagedserve.kernels.lora_triton import add_lora_triton

                add_lora_triton(columns, x, a, b, scales, slots)
            else:
                add_lora_torch(columns, x, a, b, scales, slots, self.num_slots, self.mask)


def fused_columns(shapes: dict[str, ModuleShape]) -> dict[str, tuple[int, int]]:
    """Each target's column range inside its fused projection's output."""
    columns: dict[str, tuple[int, int]] = {}
    for targets in FUSED_TARGETS.values():
        start = 0
        for target in targets:
            end = start + shapes[target].out_features
            columns[target] = (start, end)
            start = end
    return columns


def build_lora_batch(
    registry: LoraRegistry,
    keys: Sequence[str | None],
    num_tokens: Sequence[int],
    device: torch.device,
    dtype: torch.dtype,
) -> LoraBatch | None:
    """The step's `LoraBatch`: request ``i`` (adapter ``keys[i]``, None for the base) has
    ``num_tokens[i]`` consecutive packed rows. None when no request uses an adapter, so the
    base model's step costs nothing more."""
    present = {key for key in keys if key is not None}
    if not present:
        return None
    slot_of = registry.assign(present)
    per_request = [-1 if key is None else slot_of[key] for key in keys]
    token_slots = torch.repeat_interleave(
        torch.tensor(per_request, dtype=torch.int64), torch.tensor(list(num_tokens))
    ).to(device)
    num_slots = max(slot_of.values()) + 1
    mask = None
    if device.type != "cuda":
        scales = registry.slots.scales[:num_slots]
        mask = lora_mask(token_slots, scales, registry.config.max_lora_rank, dtype)
    return LoraBatch(
        slots=registry.slots,
        token_slots=token_slots,
        num_slots=num_slots,
        mask=mask,
        present=frozenset(slot_of.values()),
        columns=fused_columns(registry.shapes),
    )
