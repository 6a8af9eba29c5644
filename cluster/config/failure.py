"""What the app does when a part is slow, stalls or dies: the control calls' deadlines, the
liveness watch's intervals and leases, drains, and what a lost worker's requests become.
Read by the router's liveness watch and request path, the worker pool and each worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from pagedserve.cluster.config.checks import positive_finite


class FailureMode(StrEnum):
    """What a router does with the requests of a worker that died: `REPLAY` them on a peer
    from their tokens, or `FAIL` them (UNAVAILABLE / 503)."""

    REPLAY = "replay"
    FAIL = "fail"


FAILURE_MODES = tuple(mode.value for mode in FailureMode)


@dataclass(frozen=True)
class FailureConfig:
    """Deadlines, liveness and drains.

    Attributes:
        on_worker_failure: `replay` a dead worker's requests on a peer from their tokens, or
            `fail` them with UNAVAILABLE.
        stats_interval_s: how often the router refreshes each worker's load (and renews its
            lease there, asks the pool for its members and reports its counters). Every poll
            is a Ray call on the router, the worker, the pool or the index: every 0.25 s they
            cost an idle local cluster 32 CPU-ms a second more than every 1 s (bench/README.md,
            "Serving defaults"), ~1.2 ms per streamed token at 1 request/s. The router counts
            its own requests on each worker at once, so a poll only adds the other replicas'.
        rpc_timeout_s: deadline of every control call (stats, index, abort).
        startup_timeout_s: how long the router waits for workers to load their model.
        lease_timeout_s: a worker aborts the requests of a router replica that has not renewed
            its lease (every stats poll renews it) within this long, so a dead router leaves
            no orphans decoding. At least 4 × `stats_interval_s`, so that a few late polls
            cannot end live requests.
        stall_timeout_s: a worker that has runnable requests but takes no engine step for
            this long is stalled: out of routing, and the router's streams on it end as if it
            were lost (replayed on a peer, or UNAVAILABLE), so no stream waits on it forever.
            It rejoins routing once it steps again. Longer than any one step may take.
        drain_grace_s: how long a draining worker's open streams get to finish before the
            rest are handed back to the router (which replays them on a peer): on SIGTERM to
            the worker's process (`pagedserve drain-node`, a pod's removal), when
            `stop_worker_group` stops the app, and when `pagedserve serve` stops on SIGINT or
            SIGTERM (unless `--shutdown-grace-s` says otherwise).
        fault_injection: workers accept fault calls (stall, refuse, lose a KV fetch or an
            event batch: `workers/worker/fault_injection.py`), for soaks and failure tests. Off in
            production: a production worker has no such methods.
    """

    on_worker_failure: FailureMode = field(
        default=FailureMode.REPLAY, metadata={"choices": FAILURE_MODES}
    )
    stats_interval_s: float = 1.0
    rpc_timeout_s: float = 10.0
    startup_timeout_s: float = 300.0
    lease_timeout_s: float = 10.0
    stall_timeout_s: float = 60.0
    drain_grace_s: float = 30.0
    fault_injection: bool = False

    def __post_init__(self) -> None:
        if self.on_worker_failure not in FAILURE_MODES:
            raise ValueError(
                f"on_worker_failure must be one of {FAILURE_MODES}, got {self.on_worker_failure!r}"
            )
        object.__setattr__(self, "on_worker_failure", FailureMode(self.on_worker_failure))
        positive_finite(
            self,
            "stats_interval_s",
            "rpc_timeout_s",
            "startup_timeout_s",
            "lease_timeout_s",
            "stall_timeout_s",
            "drain_grace_s",
        )
        if self.lease_timeout_s < 4 * self.stats_interval_s:
            raise ValueError(
                f"lease_timeout_s ({self.lease_timeout_s}) must be >= 4 x stats_interval_s "
                f"({self.stats_interval_s}): the router renews leases every stats interval"
            )
