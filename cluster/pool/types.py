"""What the worker pool publishes: its members and their states, under a version.

These cross process boundaries (pool actor → every router replica, pool → tests and tools),
so they are frozen dataclasses.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class MemberState(enum.Enum):
    """Where a worker is in its life in the pool."""

    STARTING = "starting"  # created; its `ready()` has not answered yet: no router routes to it
    SERVING = "serving"  # ready: every router routes to it
    LEAVING = "leaving"  # out of routing on every router; handing over its cache, draining


@dataclass(frozen=True)
class Member:
    """One worker of the pool: its name, handle, state, and its spec's fingerprint (empty
    until its `ready()` reported it)."""

    worker_id: str
    handle: Any
    state: MemberState
    fingerprint: str = ""


@dataclass(frozen=True)
class MembershipVersion:
    """`epoch` counts the pool's membership changes within one `incarnation` (one start of the
    pool actor); a router that holds another incarnation's version takes the whole list anew."""

    incarnation: str
    epoch: int


@dataclass(frozen=True)
class Membership:
    """The pool's members at one version, in the order they joined, and the revision of the
    app config the pool follows; `configured` False: the pool restarted and waits for a
    router to send the app config (`WorkerPoolActor.configure`)."""

    version: MembershipVersion
    members: tuple[Member, ...]
    config_revision: float = 0.0
    configured: bool = True

    def in_state(self, *states: MemberState) -> dict[str, Member]:
        return {m.worker_id: m for m in self.members if m.state in states}


@dataclass
class PoolCounters:
    """What the pool has done since it (last) started (a copy crosses to callers)."""

    workers_added: int = 0
    workers_removed: int = 0
    workers_replaced: int = 0  # removed because their spec was not the app's (reconcile)
    start_failures: int = 0  # created, but not ready within `startup_timeout_s`
    workers_lost: int = 0  # removed because their actor was gone for good (then replaced)
    handover_chains: int = 0
    handover_blocks: int = 0  # blocks peers took from leaving workers
    drain_finished: int = 0
    drain_handed_off: int = 0  # streams a drain ended for their routers to replay
    rounds_held: int = 0  # decision rounds skipped after a restart: a newer config is due


@dataclass(frozen=True)
class PoolStats:
    """The pool now (`WorkerPoolActor.stats`): membership, the size it aims at, what it did.

    Attributes:
        membership: the members and version.
        target: how many serving workers the planner aims at.
        fingerprint: the spec fingerprint new workers get (the app's).
        retired: workers removed for good, oldest first (a leak check's "gone" list).
        counters: what it has done.
        last_action: the last decision, in words (empty before the first).
        failed: why workers cannot start, when two starts in a row failed with the same
            constructor error (`StartFailures`): the pool then starts no more until a new
            worker spec is configured. Empty while starts succeed, or failed differently.
        frozen: `freeze` was called: the pool decides nothing more (the app is stopping).
    """

    membership: Membership
    target: int
    fingerprint: str
    retired: tuple[str, ...]
    counters: PoolCounters = field(default_factory=PoolCounters)
    last_action: str = ""
    failed: str = ""
    frozen: bool = False


class StartFailures:
    """Owns the causes of the pool's failed worker starts since the last one that succeeded.

    A worker whose constructor raises (a model it cannot load, a kernel that does not build)
    fails the same way on every retry: two such failed starts in a row with the same cause
    are taken as deterministic, and the pool stops starting workers instead of trying one
    after another for ever. Different causes are not; the pool records only constructor
    errors here (a start that timed out, or whose node was lost, may well pass next time).
    """

    def __init__(self) -> None:
        self._last: str | None = None

    def failed(self, cause: str) -> bool:
        """Record a failed start; True when it repeats the previous one's cause."""
        repeated = cause == self._last
        self._last = cause
        return repeated

    def succeeded(self) -> None:
        self._last = None
