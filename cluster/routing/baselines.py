"""The prefix-blind routing policies `kv_aware` is measured against: `least_loaded` (fewest
requests) and `round_robin` (each worker in turn). Neither looks at what a worker caches; both
still report each worker's match, so a decision's candidates show the hits they passed over.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

from pagedserve.cluster.routing.policy import (
    Candidate,
    RoutingDecision,
    RoutingPolicy,
    WorkerLoad,
    make_decision,
    prefix_split,
    sorted_loads,
)


class LeastLoadedPolicy(RoutingPolicy):
    """Fewest requests: reported running + waiting, plus this router's not yet reported; then
    id."""

    name = "least_loaded"

    def choose(
        self,
        num_prompt_blocks: int,
        matches: Mapping[str, int],
        loads: Sequence[WorkerLoad],
        tier_load_blocks: Mapping[str, float] | None = None,
    ) -> RoutingDecision:
        candidates = []
        for worker in sorted_loads(loads):
            matched, prefill = prefix_split(worker.worker_id, num_prompt_blocks, matches)
            count = float(worker.num_requests)
            candidates.append(Candidate(worker.worker_id, matched, prefill, count, count))
        best = min(candidates, key=lambda c: (c.cost, c.worker_id))
        return make_decision(best, self.name, candidates)


class RoundRobinPolicy(RoutingPolicy):
    """Cycles over the alive workers in id order.

    It remembers the last worker id it chose, not a position, so a worker joining or leaving
    neither skips nor repeats anyone. `cost` is each worker's distance from the chosen one in
    the rotation.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(
        self,
        num_prompt_blocks: int,
        matches: Mapping[str, int],
        loads: Sequence[WorkerLoad],
        tier_load_blocks: Mapping[str, float] | None = None,
    ) -> RoutingDecision:
        ordered = sorted_loads(loads)
        ids = [w.worker_id for w in ordered]
        # The first id after the last one chosen, wrapping to the start.
        start = 0 if self._last is None else bisect.bisect_right(ids, self._last) % len(ids)
        candidates = []
        for i, worker in enumerate(ordered):
            matched, prefill = prefix_split(worker.worker_id, num_prompt_blocks, matches)
            turn = float((i - start) % len(ids))
            candidates.append(
                Candidate(worker.worker_id, matched, prefill, float(worker.num_requests), turn)
            )
        best = candidates[start]
        self._last = best.worker_id
        return make_decision(best, self.name, candidates)
