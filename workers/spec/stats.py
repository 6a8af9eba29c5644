"""What speculative decoding did in one engine: counters while it runs, a frozen snapshot out."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class SpecStats:
    """Speculative decoding since the engine started (all zero when it is off).

    Attributes:
        num_verified: request-steps that verified drafts (one per request per step).
        num_draft_tokens: draft tokens proposed and verified.
        num_accepted_tokens: draft tokens the target accepted.
        num_emitted_tokens: tokens those steps produced (accepted drafts plus the target's own).
        draft_time_s: seconds spent proposing.
        verify_time_s: seconds spent in forwards that verified drafts.
        num_steps: engine steps that verified drafts.
    """

    num_verified: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    num_steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verified request-step, the target's own included (1 = no gain)."""
        return self.num_emitted_tokens / self.num_verified if self.num_verified else 0.0

    @property
    def draft_time_per_step_s(self) -> float:
        return self.draft_time_s / self.num_steps if self.num_steps else 0.0

    @property
    def verify_time_per_step_s(self) -> float:
        return self.verify_time_s / self.num_steps if self.num_steps else 0.0


@dataclass
class SpecCounters:
    """The engine's running counts; `snapshot` freezes them into `SpecStats`."""

    num_verified: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    num_steps: int = 0

    def on_verified(self, num_drafts: int, num_accepted: int, num_emitted: int) -> None:
        self.num_verified += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_emitted

    def snapshot(self) -> SpecStats:
        return SpecStats(**dataclasses.asdict(self))
