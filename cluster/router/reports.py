"""Cluster-wide router counters: every router replica reports its own, any replica sums them.

Each replica counts what it routed, migrated, replayed and refused (`RouterCounters`) and how
many requests it has open on each worker. With several replicas, GetStats (and the router
series of `/metrics`) answered by one replica must show them all, so each replica sends its
`RouterReport` every stats interval to something every replica already shares, the prefix
index actor, which keeps them in `RouterReports`; a replica answering GetStats sends its own
first, then reads the sum (`ClusterRouters`).

    replica A ─report every stats_interval_s─┐
    replica B ─report every stats_interval_s─┼─► index actor: RouterReports ─► ClusterRouters
                                             └── (the one answering GetStats reports first)

A replica that has not reported for its report's `expires_after_s` (its lease timeout: by then
every worker has aborted its requests too) is gone: its last counters are kept as retired, so
cluster totals never go back when a replica dies or scales in (and one that reports again
after all, a replica stalled that long, replaces its retired counters: its reports are
cumulative, so it is never counted twice). What is lost: a
dead replica's counts after its last report (one stats interval at most), and every count when
the index actor itself restarts (a counter reset, as a restarted process's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.cluster.router.types import RouterCounters


@dataclass(frozen=True)
class RouterReport:
    """One replica's counters and in-flight requests, as it sends them.

    Attributes:
        router_id: the replica (`RouterCore.router_id`).
        counters: a copy of its counters since it started.
        inflight: worker id → requests it has open there (workers with none left out).
        expires_after_s: how long without a newer report before it counts as gone.
    """

    router_id: str
    counters: RouterCounters
    inflight: dict[str, int] = field(default_factory=dict)
    expires_after_s: float = 10.0


@dataclass(frozen=True)
class ClusterRouters:
    """Every replica's counters summed (the gone ones' included), the live replicas, and the
    requests they have open on each worker."""

    counters: RouterCounters
    replicas: tuple[str, ...]
    inflight: dict[str, int]


class RouterReports:
    """Owns the latest report of each live replica and the last counters of each gone one.

    Args:
        clock: monotonic seconds (tests inject one).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._latest: dict[str, tuple[float, RouterReport]] = {}  # router → (when, report)
        self.retired: dict[str, RouterCounters] = {}  # router → its last counters

    def put(self, report: RouterReport) -> None:
        self.retired.pop(report.router_id, None)  # back after all: this report has it all
        self._latest[report.router_id] = (self.clock(), report)

    def _retire_expired(self) -> None:
        now = self.clock()
        for router_id, (at, report) in list(self._latest.items()):
            if now - at > report.expires_after_s:
                self.retired[router_id] = report.counters
                del self._latest[router_id]

    def cluster(self) -> ClusterRouters:
        """The sum over every replica, after retiring those gone silent."""
        self._retire_expired()
        counters = RouterCounters()
        for gone in self.retired.values():
            counters.add(gone)
        inflight: dict[str, int] = {}
        for _, report in self._latest.values():
            counters.add(report.counters)
            for worker_id, n in report.inflight.items():
                inflight[worker_id] = inflight.get(worker_id, 0) + n
        return ClusterRouters(counters, tuple(sorted(self._latest)), inflight)
