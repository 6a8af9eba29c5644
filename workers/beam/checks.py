"""What a beam-search request may ask for (`SamplingParams.use_beam_search`), checked once.

Beam search here is HF's deterministic `generate(num_beams=n, do_sample=False)`: it ranks
continuations by the log-softmax of the raw logits. A field that would change those logits or
sample from them (vLLM's old `use_beam_search` refused them the same way) is an error naming
the field, never silently ignored. `length_penalty` and `early_stopping` mean nothing without
beam search and are refused there too. Every message starts with the field's name, so the
front ends answer 400 / INVALID_ARGUMENT naming it.
"""

from __future__ import annotations

import math
from typing import Any, Literal

EarlyStopping = bool | Literal["never"]
EARLY_STOPPING_VALUES: tuple[EarlyStopping, ...] = (True, False, "never")

# Field → (its value when off, what to say): each must be off under beam search.
_OFF_UNDER_BEAM_SEARCH: dict[str, tuple[Any, str]] = {
    "temperature": (0.0, "must be 0 with use_beam_search (beam search is deterministic)"),
    "top_p": (1.0, "must be 1 with use_beam_search"),
    "seed": (None, "has no effect with use_beam_search (it samples nothing); leave it out"),
    "min_tokens": (0, "is not supported with use_beam_search"),
    "presence_penalty": (0.0, "is not supported with use_beam_search"),
    "frequency_penalty": (0.0, "is not supported with use_beam_search"),
    "repetition_penalty": (1.0, "is not supported with use_beam_search"),
    "logprobs": (None, "is not supported with use_beam_search"),
    "prompt_logprobs": (None, "is not supported with use_beam_search"),
    "pooling": (None, "is not supported with use_beam_search"),
    "guided": (None, "is not supported with use_beam_search"),
    "allowed_token_ids": (None, "is not supported with use_beam_search"),
}
_EMPTY_UNDER_BEAM_SEARCH = ("stop", "logit_bias", "bad_words")


def check_beam_search(params: Any) -> None:
    """Raise `ValueError` (the field's name first) for beam-search fields that make no sense.

    Args:
        params: a `SamplingParams` being built.
    """
    if not isinstance(params.use_beam_search, bool):
        raise ValueError(f"use_beam_search must be a bool, got {params.use_beam_search!r}")
    lp = params.length_penalty
    if isinstance(lp, bool) or not isinstance(lp, int | float) or not math.isfinite(lp):
        raise ValueError(f"length_penalty must be a finite number, got {lp!r}")
    stopping = params.early_stopping
    if not isinstance(stopping, bool) and stopping not in EARLY_STOPPING_VALUES:
        raise ValueError(f"early_stopping must be true, false or 'never', got {stopping!r}")
    if not params.use_beam_search:
        if lp != 1.0:
            raise ValueError("length_penalty is only used with use_beam_search")
        if params.early_stopping is not False:
            raise ValueError("early_stopping is only used with use_beam_search")
        return
    if params.n < 2:
        raise ValueError(f"n must be >= 2 with use_beam_search (the beam width), got {params.n}")
    for name, (off, message) in _OFF_UNDER_BEAM_SEARCH.items():
        if getattr(params, name) != off:
            raise ValueError(f"{name} {message}, got {getattr(params, name)!r}")
    if params.top_k not in (0, -1):
        raise ValueError(f"top_k must be 0 or -1 with use_beam_search, got {params.top_k}")
    for name in _EMPTY_UNDER_BEAM_SEARCH:
        if getattr(params, name):
            raise ValueError(f"{name} is not supported with use_beam_search")
