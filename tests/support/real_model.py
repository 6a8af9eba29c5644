"""The real model in tests: SmolLM2-135M-Instruct, loaded once per session, with HF's reference.

The first test of a machine pays the GGUF conversion (about 30 s; cached in $PAGEDSERVE_CACHE
afterwards); every later load reads the safetensors checkpoint in about a second. The HF
reference is a deep copy taken before any engine switches the model to paged attention, with
HF's own attention and cache (`support.engine.ReferenceModel`), memoized per prompt.
"""

from __future__ import annotations

import torch

from pagedserve.workers.model.loader import LoadedModel
from pagedserve.workers.model.tokenizer import render_chat
from support.engine import ReferenceModel
from support.real_text import CHATS, PROMPTS

SMOLLM2 = "smollm2-135m"


def prompt_ids(loaded: LoadedModel) -> list[list[int]]:
    """Token ids of every real-text prompt, then of every chat through the chat template."""
    tokenizer = loaded.tokenizer
    texts = PROMPTS + [render_chat(tokenizer, chat) for chat in CHATS]
    return [tokenizer.encode(text) for text in texts]


def hf_logprobs(reference: ReferenceModel, token_ids: list[int]) -> torch.Tensor:
    """``[T, V]`` float64 log_softmax of HF's forward over the sequence (row p scores p + 1)."""
    with torch.inference_mode():
        logits = reference.model(torch.tensor([token_ids])).logits[0]
    return logits.double().log_softmax(dim=-1)
