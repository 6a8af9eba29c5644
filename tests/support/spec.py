"""Helpers for speculative decoding tests: a draft model that agrees with tiny-llama often but
not always, and prompts that prompt lookup can hit."""

from __future__ import annotations

import json
import os
import random

import torch

from pagedserve.workers.tiny_llama import build_tiny_llama, tiny_llama_config
from pagedserve.workers.tokenizer import BYTE_TOKENIZER_MARKER, ByteTokenizer


def save_truncated_tiny_llama(path: str | os.PathLike[str], num_layers: int = 2) -> str:
    """tiny-llama (seed 0) cut to its first `num_layers` layers, as a checkpoint directory: a
    draft with the same vocabulary whose guesses are right only part of the time."""
    full = build_tiny_llama(0)
    config = tiny_llama_config()
    config.num_hidden_layers = num_layers
    with torch.random.fork_rng(devices=[]):
        draft = type(full)(config)
    state = {
        name: value
        for name, value in full.state_dict().items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    draft.load_state_dict(state)
    path = os.fspath(path)
    draft.eval().save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, BYTE_TOKENIZER_MARKER), "w", encoding="utf-8") as f:
        json.dump({"type": "byte", "vocab_size": ByteTokenizer.vocab_size}, f)
    return path


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
