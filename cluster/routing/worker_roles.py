"""Where each phase of a request may run under prefill/decode disaggregation (P/D).

A worker's role (`workers/protocol/role.py`: `prefill`, `decode`, `mixed`) comes with its
`WorkerInfo`. Each phase has a `RoleFilter`: the router routes a fresh request (and a replay)
with `PREFILL_PHASE` among the workers that prefill, and continues a handed-off or moved
request with `DECODE_PHASE` among those that decode (`Migrations.move_target`). With no
routable worker of a fitting role the filter falls back to every routable worker (counted as
`pd.fallbacks`), so a cluster that lost all its prefill (or decode) workers still serves. In a
cluster of `mixed` workers (no P/D) both filters pass every worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pagedserve.cluster.router.worker_state import WorkerState
from pagedserve.workers.protocol.role import WorkerRole


def role_of(worker: WorkerState) -> WorkerRole:
    """A worker's role; `mixed` until its `ready()` told (it is not routable before)."""
    return WorkerRole.MIXED if worker.info is None else worker.info.role


@dataclass(frozen=True)
class RoleFilter:
    """The roles that may take one phase of a request.

    Attributes:
        phase: its name (for logs and spans).
        admits: whether a worker of a role may take the phase.
    """

    phase: str
    admits: Callable[[WorkerRole], bool]

    def split(self, workers: Iterable[WorkerState]) -> tuple[list[WorkerState], bool]:
        """(the routable `workers` of a fitting role, False), or (every routable one, True)
        when none fits: the fallback."""
        routable = [w for w in workers if w.routable]
        fitting = [w for w in routable if self.admits(role_of(w))]
        if fitting or not routable:
            return fitting, False
        return routable, True

    def unfit(self, workers: Iterable[WorkerState]) -> tuple[frozenset[str], bool]:
        """(ids of the routable `workers` this phase should not go to, whether it fell back):
        empty when every routable one fits, or none does."""
        routable = [w for w in workers if w.routable]
        chosen, fell_back = self.split(routable)
        if fell_back:
            return frozenset(), True
        kept = {w.worker_id for w in chosen}
        return frozenset(w.worker_id for w in routable if w.worker_id not in kept), False


PREFILL_PHASE = RoleFilter("prefill", lambda role: role.prefills)
DECODE_PHASE = RoleFilter("decode", lambda role: role.decodes)
