"""Helpers for speculative decoding tests: a draft model that agrees with tiny-llama often but
not always, and prompts that prompt lookup can hit."""

from __future__ import annotations

import random

from pagedserve.workers.model.tiny_llama import save_truncated_tiny_llama

__all__ = ["repetitive_prompts", "save_truncated_tiny_llama"]


def repetitive_prompts(vocab: int, count: int, seed: int, prefix: int = 0) -> list[list[int]]:
    """Prompts that quote a random passage twice (prompt lookup hits the second copy), after
    an optional shared prefix of `prefix` tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(prefix)]
    prompts = []
    for _ in range(count):
        passage = [rng.randrange(vocab) for _ in range(rng.randrange(6, 20))]
        prompts.append(shared + passage + [rng.randrange(vocab)] + passage[: len(passage) // 2])
    return prompts
