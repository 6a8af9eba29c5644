"""The router's view of one worker: handle, liveness, last report and its own in-flight count.

Every assignment to a `WorkerState` attribute drops its cached `WorkerLoad` and calls its
`on_change` (the router's `RoutableWorkers` listens): routing re-reads a worker only after
something of it changed, whoever changed it (a poll, a request begun or ended, liveness).

Load without double counting: the worker's report (`WorkerStats`: running and waiting) covers
every router replica's requests there, this one's included; so what this router adds on top is
only what it sent that the report does not show yet. The report names the polling router's
requests it holds (`owned_requests`), and `unreported` is the rest of this router's open
requests there (sent after the report was taken, or not yet admitted when it was).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.cluster.routing.policy import WorkerLoad
from pagedserve.workers.protocol.stats import WorkerInfo, WorkerStats


@dataclass
class WorkerState:
    """Owns what one router knows of one worker: its handle, its `WorkerInfo` once it was
    ready, its last `WorkerStats`, and the requests this router has in flight on it."""

    worker_id: str
    handle: Any
    alive: bool = False
    info: WorkerInfo | None = None  # from `Worker.ready()`
    stats: WorkerStats | None = None  # last `Worker.stats()`
    inflight: int = 0
    inflight_tokens: int = 0
    # Request id → legs of it this router has open here (one, but for a retried leg). A leg
    # begun without an id (a test's pin) is never in a report: it always counts as unreported.
    open_legs: dict[str, int] = field(default_factory=dict)
    draining: bool = False  # alive, but taking nothing new: routing skips it
    stalled: bool = False  # alive, with work, but no engine step for `stall_timeout_s`
    leaving: bool = False  # the worker pool is taking it out: routing skips it, streams run on
    lost_at: float | None = None  # monotonic time it was dropped as unanswering (alive False)
    on_change: Callable[[WorkerState], None] | None = field(default=None, repr=False, compare=False)
    _load: WorkerLoad | None = field(default=None, init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _NOT_STATE:
            return
        object.__setattr__(self, "_load", None)
        listener = self.__dict__.get("on_change")  # absent while __init__ sets the fields
        if listener is not None:
            listener(self)

    @property
    def routable(self) -> bool:
        return self.alive and not self.draining and not self.stalled and not self.leaving

    def hung(self, now: float, stall_timeout_s: float) -> bool:
        """Its streams cannot progress: stalled, or unanswering for `stall_timeout_s` (a
        dead actor ends its streams by itself; one whose loop is stuck never would)."""
        unanswering = not self.alive and self.lost_at is not None
        return self.stalled or (unanswering and now - self.lost_at > stall_timeout_s)

    def mark_alive(self, info: WorkerInfo) -> None:
        self.info = info
        self.alive = True
        self.lost_at = None
        self.draining = False  # a (re)started worker admits again

    def begin(self, tokens: int, request_id: str | None = None) -> None:
        # `open_legs` changes in place, which drops no cached load: the assignments after it do.
        if request_id is not None:
            self.open_legs[request_id] = self.open_legs.get(request_id, 0) + 1
        self.inflight += 1
        self.inflight_tokens += tokens

    def end(self, tokens: int, request_id: str | None = None) -> None:
        if request_id is not None:  # in place first, as in `begin`
            legs = self.open_legs.pop(request_id) - 1
            if legs:
                self.open_legs[request_id] = legs
        self.inflight -= 1
        self.inflight_tokens -= tokens

    @property
    def unreported(self) -> int:
        """This router's requests here that the last report does not count yet."""
        reported = set(self.stats.owned_requests) if self.stats is not None else set()
        named = sum(n for rid, n in self.open_legs.items() if rid not in reported)
        anonymous = self.inflight - sum(self.open_legs.values())
        return named + anonymous

    def capacity_tokens(self) -> int:
        """Tokens one request can hold here: the context, and the pool less its reserve."""
        if self.info is None:
            return 0
        reserve = self.stats.kv.reserve_blocks if self.stats is not None else 0
        pool_tokens = (self.info.num_blocks - reserve) * self.info.block_size
        return min(self.info.max_model_len, pool_tokens)

    def load(self) -> WorkerLoad:
        """Its load now; built once and kept until an attribute changes (so it must depend
        on this state's attributes alone: nothing read from a clock or another object)."""
        if self._load is None:
            object.__setattr__(self, "_load", self._current_load())
        return self._load

    def _current_load(self) -> WorkerLoad:
        stats = self.stats
        total = stats.kv.total_blocks if stats else (self.info.num_blocks if self.info else 0)
        used = stats.kv.used_blocks if stats else 0
        return WorkerLoad(
            worker_id=self.worker_id,
            num_running=stats.num_running if stats else 0,
            num_waiting=stats.num_waiting if stats else 0,
            used_blocks=used,
            total_blocks=total,
            free_blocks=total - used,
            inflight=self.inflight,
            inflight_tokens=self.inflight_tokens,
            unreported=self.unreported,
        )


_NOT_STATE = frozenset({"_load", "on_change"})  # assignments that change nothing routing reads
