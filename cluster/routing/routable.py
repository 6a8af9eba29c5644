"""Which workers a router may route to, ranked by its policy, kept current per change.

`RoutableWorkers` owns the router's `LoadRanking` (`cluster/routing/load_ranking.py`) over its
`workers` dict: an entry per routable worker (alive, not draining, not stalled). Each
`WorkerState` it tracks tells it when it changed (`on_change`); `current()` re-reads only
those before a decision. A worker added to or removed from the dict (or replaced by another
state object under its id) is noticed by comparing the dict with what it tracks, and answered
by re-reading every worker: membership changes are rare, decisions are not.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

from pagedserve.cluster.router.worker_state import WorkerState
from pagedserve.cluster.routing.load_ranking import LoadRanking


class RoutableWorkers:
    """Owns the ranking of `workers`' routable members and what changed since it was read.

    Args:
        workers: worker id → state; the router's own dict, read, never changed here.
        ranking: an empty ranking in the policy's order (`RoutingPolicy.new_ranking`).
    """

    def __init__(self, workers: Mapping[str, WorkerState], ranking: LoadRanking) -> None:
        self.workers = workers
        self.ranking = ranking
        self._tracked: dict[str, WorkerState] = {}
        self._changed: set[str] = set()

    def current(self) -> LoadRanking:
        """The ranking of the routable workers as they are now."""
        if not self._same_members():
            self._reread_all()
        elif self._changed:
            changed, self._changed = self._changed, set()
            for worker_id in changed:
                self._reread(self.workers[worker_id])
        return self.ranking

    def _same_members(self) -> bool:
        workers, tracked = self.workers, self._tracked
        return workers.keys() == tracked.keys() and all(
            map(operator.is_, workers.values(), tracked.values())
        )

    def _reread_all(self) -> None:
        for state in self._tracked.values():
            if state.on_change == self._on_change:
                state.on_change = None
        self._tracked = dict(self.workers)
        self._changed.clear()
        self.ranking.clear()
        for state in self._tracked.values():
            state.on_change = self._on_change
            self._reread(state)

    def _reread(self, state: WorkerState) -> None:
        if state.routable:
            self.ranking.put(state.load())
        else:
            self.ranking.remove(state.worker_id)

    def _on_change(self, state: WorkerState) -> None:
        self._changed.add(state.worker_id)
