"""Proposers: where a speculative step's draft tokens come from.

One small interface, chosen by `SpeculativeConfig.method` from a registry:

- `NgramProposer` (`ngram`, prompt lookup): match the last n tokens of a request against its
  own earlier prompt and output, and propose what followed the latest earlier occurrence;
- `DraftModelProposer` (`draft`, in `workers/spec/draft.py`): a smaller model sharing the
vocabulary,   on its own paged KV pool.

Every proposal is a single token per position (the proposer's argmax), so the verifier treats
the draft distribution `q` as one-hot; rejection sampling stays exact for any such `q`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, Protocol

import numpy as np

from pagedserve.workers.kv.manager import KVCacheManager
from pagedserve.workers.spec.config import SpeculativeConfig


class DraftRequest(Protocol):
    """What a proposer reads of a request."""

    request_id: str
    all_token_ids: Sequence[int]  # prompt + output so far
    cache_extra_keys: tuple[str, ...]


class Proposer(ABC):
    """Proposes up to `max_tokens[i]` draft tokens for each request of a step.

    Subclasses register under their method name. A proposer that holds per-request state
    (a KV pool) frees it in `release`; `kv` is that pool, for stats and leak checks.
    """

    registry: ClassVar[dict[str, type[Proposer]]] = {}
    method: ClassVar[str]
    kv: KVCacheManager | None = None

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if getattr(cls, "method", None):
            Proposer.registry[cls.method] = cls

    @classmethod
    @abstractmethod
    def from_config(cls, config: SpeculativeConfig, **resources) -> Proposer:
        """Build the proposer from its config and what it needs of the target."""

    @abstractmethod
    def propose(
        self, requests: Sequence[DraftRequest], max_tokens: Sequence[int]
    ) -> list[list[int]]:
        """One list of draft tokens per request (possibly empty: nothing to propose)."""

    def release(self, request_id: str) -> None:
        """The request left the engine (finished, aborted, moved): drop what is held for it.
        Stateless proposers hold nothing."""
        return None


class NgramProposer(Proposer):
    """Prompt lookup: no model, no state. For n from `ngram_max` down to `ngram_min`, find the
    latest earlier occurrence of the request's last n tokens and propose the tokens after it.

    Args:
        ngram_min: shortest suffix that counts as a match.
        ngram_max: longest suffix tried first.
    """

    method = "ngram"

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    @classmethod
    def from_config(cls, config: SpeculativeConfig, **resources) -> NgramProposer:
        return cls(config.ngram_min, config.ngram_max)  # needs none of the target's resources

    def propose(
        self, requests: Sequence[DraftRequest], max_tokens: Sequence[int]
    ) -> list[list[int]]:
        return [
            self.lookup(r.all_token_ids, k) if k > 0 else []
            for r, k in zip(requests, max_tokens, strict=True)
        ]

    def lookup(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens that followed the latest earlier match of the suffix."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            suffix = tokens[length - n :]
            # Windows that start before the suffix itself: starts 0 .. length - n - 1.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + num_tokens].tolist()
        return []


def make_proposer(config: SpeculativeConfig, **resources) -> Proposer:
    """The proposer `config.method` names, built from its config and what it needs of the
    target (`draft`: `target`, `device`, `ops`, `target_model`, `target_seed`, `block_size`,
    `num_blocks`, `max_model_len`)."""
    from pagedserve.workers.spec import draft as spec_draft  # noqa: F401  (registers `draft`)

    return Proposer.registry[config.method].from_config(config, **resources)
