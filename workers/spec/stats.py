"""What speculative decoding did in one engine: counters while it runs, a frozen snapshot out."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedserve.workers.protocol.stats import SpecStats


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
