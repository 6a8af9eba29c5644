"""Speculative decoding's one typed config (`EngineConfig.speculative`), off by default.

EngineConfig(speculative={"method": "ngram", "num_tokens": 3})
EngineConfig(speculative=SpeculativeConfig("draft", 3, draft_model="tiny-llama"))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SPEC_METHODS: tuple[str, ...] = ("ngram", "draft")
MAX_SPEC_TOKENS = 16  # a verify chunk longer than this costs more than its drafts can win


@dataclass(frozen=True)
class SpeculativeConfig:
    """How an engine proposes draft tokens and how many per step.

    Attributes:
        method: `ngram` (prompt lookup over the request's own tokens, no second model) or
            `draft` (a smaller model sharing the target's vocabulary).
        num_tokens: draft tokens proposed per running request per step (k).
        ngram_max: longest n-gram `ngram` matches against earlier tokens.
        ngram_min: shortest n-gram it accepts as a match.
        draft_model: `draft`: the draft model (a built-in name, checkpoint directory or GGUF).
        draft_seed: `draft`: weight seed of a random built-in draft (`tiny-llama`).
        draft_num_kv_blocks: `draft`: blocks of the draft's own KV pool (None: as many as
            the target's pool).
    """

    method: str = "ngram"
    num_tokens: int = 3
    ngram_max: int = 3
    ngram_min: int = 1
    draft_model: str | None = None
    draft_seed: int = 0
    draft_num_kv_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative.method must be one of {SPEC_METHODS}, got {self.method!r}"
            )
        if isinstance(self.num_tokens, bool) or not 1 <= self.num_tokens <= MAX_SPEC_TOKENS:
            raise ValueError(
                f"speculative.num_tokens must be in [1, {MAX_SPEC_TOKENS}], got {self.num_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                "speculative.ngram_min and ngram_max must satisfy 1 <= ngram_min <= ngram_max, "
                f"got {self.ngram_min} and {self.ngram_max}"
            )
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative.draft_model is required with method 'draft'")
        if self.method == "ngram" and self.draft_model is not None:
            raise ValueError("speculative.draft_model is only for method 'draft'")
        if self.draft_num_kv_blocks is not None and self.draft_num_kv_blocks < 1:
            raise ValueError(
                f"speculative.draft_num_kv_blocks must be >= 1, got {self.draft_num_kv_blocks}"
            )

    @classmethod
    def of(cls, value: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """The config from a dict (as `LLM(speculative={...})` and YAML give it), or as is.

        Raises:
            ValueError: a key that is no field, or a value out of range, named.
        """
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(
                f"speculative must be a mapping or SpeculativeConfig, got {type(value).__name__}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"speculative has unknown keys {unknown}; known: {sorted(names)}")
        return cls(**value)
