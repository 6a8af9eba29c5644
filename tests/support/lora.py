"""LoRA adapters made by `peft` in the test itself (no hub), and HF + PEFT's merged model as
the greedy reference for each."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from pagedserve.workers.model.tiny_llama import build_tiny_llama
from support.engine import ReferenceModel


@dataclass
class MadeAdapter:
    """An adapter directory and HF + PEFT's merged model of it (the reference)."""

    name: str
    path: str
    rank: int
    reference: ReferenceModel


class _Merged(ReferenceModel):
    def __init__(self, model) -> None:  # no copy: the merged model is this reference's own
        self.model = model
        self._memo = {}


def make_adapter(
    directory: Path,
    name: str,
    rank: int,
    targets: tuple[str, ...],
    seed: int,
    alpha: float | None = None,
    b_std: float = 0.2,
) -> MadeAdapter:
    """A PEFT LoRA over tiny-llama (seed 0, the weights `load("tiny-llama")` serves) with
    random A and B (B is zero in a fresh adapter: it would change nothing), saved to
    ``directory/name``; its reference is PEFT's `merge_and_unload` of it."""
    model = build_tiny_llama(seed=0)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=list(targets),
        lora_dropout=0.0,
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in peft_model.named_parameters():
            if "lora_A" in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
            elif "lora_B" in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) * b_std)
    path = directory / name
    peft_model.save_pretrained(str(path))
    merged = peft_model.merge_and_unload().eval()
    return MadeAdapter(name, str(path), rank, _Merged(merged))


# Different ranks and targets, to be served in one batch: a slot's rows must use its own
# adapter's A and B (a peer once shipped mixed ranks applying the wrong adapter's weights).
TEST_ADAPTERS = {
    "attn4": (4, ("q_proj", "k_proj", "v_proj", "o_proj")),
    "mlp8": (8, ("gate_proj", "up_proj", "down_proj")),
    "all2": (2, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
}


def make_test_adapters(directory: Path) -> dict[str, MadeAdapter]:
    """`TEST_ADAPTERS`, each with its own random weights."""
    return {
        name: make_adapter(directory, name, rank, targets, seed=i + 1)
        for i, (name, (rank, targets)) in enumerate(TEST_ADAPTERS.items())
    }
