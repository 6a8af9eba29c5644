"""The one interface a grammar backend implements, so another (llguidance, outlines-core) could
sit beside xgrammar without the engine changing.

A backend is made for one tokenizer (its vocabulary decides which tokens a grammar allows):
`compile` turns a `GuidedSpec` into an opaque compiled grammar, `new_matcher` gives a sequence its
own `Matcher`, and the bitmask calls build one step's masks for a whole batch. `check_syntax`
needs no tokenizer: the router calls it to refuse a bad spec before any work is queued.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from torch import Tensor

from pagedserve.workers.protocol.guided import GuidedSpec


class Matcher(Protocol):
    """One sequence's place in its grammar."""

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` (1 bit per token)."""

    def accept_token(self, token_id: int) -> bool:
        """Advance past `token_id`; False (and no change) when the grammar forbids it."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative drafts)."""

    def is_terminated(self) -> bool:
        """Whether the grammar ended (its stop token was accepted)."""


class GrammarBackend(Protocol):
    """Compiles specs and makes matchers for one tokenizer."""

    name: str

    def compile(self, spec: GuidedSpec) -> Any:
        """The compiled grammar of `spec` (raises ValueError naming the field when it cannot)."""

    def new_matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the start of `compiled`."""

    def allocate_bitmask(self, num_rows: int) -> Tensor:
        """A CPU bitmask of `num_rows` rows, every token allowed."""

    def fill_bitmasks(self, matchers: Sequence[Matcher], bitmask: Tensor, rows: Sequence[int]):
        """Fill row `rows[i]` of `bitmask` from `matchers[i]`, for the whole batch at once."""

    def apply_bitmask(self, logits: Tensor, bitmask: Tensor, rows: Sequence[int]) -> None:
        """Set the logits of forbidden tokens to -inf, in place, in rows `rows` only."""
