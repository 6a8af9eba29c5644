"""The HF baseline of `pagedserve bench offline`: static batches through ``generate``.

A static batch runs until its longest member is done: every row of the batch generates
``max(max_tokens_i in batch)`` tokens, and only the first ``max_tokens_i`` of row i are useful.

    batch  [p0 p1 p2 p3]  targets 8, 120, 30, 64   -> generate 120 tokens for all four rows
    useful 8 + 120 + 30 + 64 = 222 of 4 * 120 = 480 generated (the rest is waste)

Batches are taken in prompt order, or, with ``sort_by_length``, after sorting the prompts by
length (a stronger baseline: less left padding). Output targets cannot be sorted on: a real
server does not know them in advance.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.workers.model.loader import LoadedModel


@dataclass(frozen=True)
class HFRun:
    """What the HF side produced: useful outputs in prompt order, and what it cost."""

    outputs: list[list[int]]  # row i trimmed to its target max_tokens_i
    generated_tokens: int  # everything generate produced, waste included
    elapsed_s: float


def pad_token_id(loaded: LoadedModel) -> int:
    for source in (loaded.model.generation_config, loaded.model.config, loaded.tokenizer):
        value = getattr(source, "pad_token_id", None)
        if isinstance(value, int):
            return value
    return min(loaded.eos_token_ids, default=0)


def batch_order(prompts: Sequence[list[int]], sort_by_length: bool) -> list[int]:
    """Prompt indices in the order they are batched: as given, or shortest prompt first."""
    order = list(range(len(prompts)))
    if sort_by_length:
        order.sort(key=lambda i: len(prompts[i]))  # stable: equal lengths keep prompt order
    return order


def trim_to_lengths(outputs: Sequence[list[int]], output_lens: Sequence[int]) -> list[list[int]]:
    """The useful part of each output: its first ``output_lens[i]`` tokens.

    Raises:
        RuntimeError: an output is shorter than its target (generate stopped early).
    """
    trimmed = []
    for index, (tokens, target) in enumerate(zip(outputs, output_lens, strict=True)):
        if len(tokens) < target:
            raise RuntimeError(f"output {index} has {len(tokens)} tokens, below its {target}")
        trimmed.append(list(tokens[:target]))
    return trimmed


def run_hf(
    hf_model: Any,
    prompts: Sequence[list[int]],
    output_lens: Sequence[int],
    batch_size: int,
    pad_id: int,
    *,
    sort_by_length: bool = False,
) -> HFRun:
    """HF ``generate`` over static, left-padded batches of ``batch_size`` prompts.

    ``eos_token_id=None`` turns EOS off (no stop, no masking), the HF side of ``ignore_eos``.

    Returns:
        Each prompt's first ``output_lens[i]`` tokens in prompt order, all tokens generated, and
        the total wall time of the ``generate`` calls.
    """
    assert len(prompts) == len(output_lens), (len(prompts), len(output_lens))
    order = batch_order(prompts, sort_by_length)
    raw: list[list[int]] = [[] for _ in prompts]
    generated = 0
    elapsed = 0.0
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        num_new = max(output_lens[i] for i in batch)
        new_tokens, seconds = _generate_batch(
            hf_model, [prompts[i] for i in batch], num_new, pad_id
        )
        elapsed += seconds
        generated += len(batch) * num_new
        for index, tokens in zip(batch, new_tokens, strict=True):
            raw[index] = tokens
    return HFRun(trim_to_lengths(raw, output_lens), generated, elapsed)


def _generate_batch(
    hf_model: Any, batch: Sequence[list[int]], num_new: int, pad_id: int
) -> tuple[list[list[int]], float]:
    """Exactly ``num_new`` greedy tokens for every prompt of one left-padded batch, timed."""
    import torch

    device = hf_model.device
    width = max(len(p) for p in batch)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
    _sync(device)
    started = time.perf_counter()
    generated = hf_model.generate(
        input_ids,
        attention_mask=mask,
        max_new_tokens=num_new,
        min_new_tokens=num_new,
        do_sample=False,
        pad_token_id=pad_id,
        eos_token_id=None,
    )
    new_tokens = generated[:, width:].tolist()  # .tolist() waits for the device
    elapsed = time.perf_counter() - started
    if any(len(tokens) != num_new for tokens in new_tokens):
        raise RuntimeError(f"HF generate stopped before {num_new} tokens")
    return new_tokens, elapsed


def _sync(device: Any) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
