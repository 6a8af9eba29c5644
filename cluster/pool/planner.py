"""The worker pool's decisions, with no Ray in them: when to add a worker and which to retire.

`PoolPlanner.decide` looks at one round of observations (each member's state, spec
fingerprint and load) and returns at most one `PoolAction`. It keeps only the size it aims
at (`target`, within `min_workers..max_workers`) and how long each worker has been idle.
Rules, first match wins:

0. a serving worker whose actor is gone for good (dead and not restarting): remove it from
   the pool; `target` stays, so rule 3 adds its replacement on the next round;
1. a member is starting or leaving: nothing (one change at a time);
2. a serving worker's spec is not the app's (reconcile): with no surge yet, add one
   worker; once the surge serves, retire the oldest stale worker. Scaling waits until
   every worker is current, so a roll replaces workers one at a time, new before old;
3. fewer serving than `target`: add; more: retire one (idle first, then the newest);
4. the scale-up signal, the mean waiting queue per serving worker reaching
   `scale_up_waiting_per_worker` or the mean KV usage reaching `scale_up_kv_usage`:
   `target` + 1 (up to `max_workers`), add;
5. a worker idle (nothing running, waiting or streaming) for `scale_down_idle_s`:
   `target` - 1 (down to `min_workers`), retire the newest such worker.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.cluster.config import ScalingConfig
from pagedserve.cluster.pool.types import MemberState


class Reason(enum.Enum):
    """Why the pool adds or retires a worker."""

    TARGET = "target"  # below or above the size it aims at (bounds changed, a start failed)
    LOAD = "load"  # the scale-up signal
    IDLE = "idle"  # idle for scale_down_idle_s
    RECONCILE = "reconcile"  # a worker's spec is not the app's
    LOST = "lost"  # its actor is gone for good (killed with no restart, its node lost)


class ActionKind(enum.Enum):
    ADD = "add"
    RETIRE = "retire"  # out of routing, cache handed over, drained, then stopped
    REMOVE = "remove"  # a lost worker: dropped from the membership and the index at once


@dataclass(frozen=True)
class PoolAction:
    kind: ActionKind
    reason: Reason
    worker_id: str | None = None  # the worker to retire or remove (None for ADD)

    def describe(self) -> str:
        who = f" {self.worker_id}" if self.worker_id else ""
        return f"{self.kind.value}{who} ({self.reason.value})"


@dataclass(frozen=True)
class ScalingSettings:
    """The planner's part of `ScalingConfig` (see its docstring)."""

    min_workers: int
    max_workers: int
    up_waiting_per_worker: float
    up_kv_usage: float
    down_idle_s: float

    @classmethod
    def of(cls, config: ScalingConfig) -> ScalingSettings:
        low, high = config.worker_bounds
        return cls(
            low,
            high,
            config.scale_up_waiting_per_worker,
            config.scale_up_kv_usage,
            config.scale_down_idle_s,
        )


@dataclass(frozen=True)
class Observation:
    """One member as the pool saw it this round; load fields are None when its stats did not
    answer (such a worker is neither idle nor counted in the signal). `gone`: its stats call
    failed because the actor is dead and Ray will not restart it."""

    worker_id: str
    state: MemberState
    fingerprint: str
    slot: int  # its name's counter value: larger is newer
    num_waiting: int | None = None
    num_running: int | None = None
    num_streams: int | None = None
    kv_usage: float | None = None  # used / total blocks
    gone: bool = False

    @property
    def idle(self) -> bool:
        loads = (self.num_waiting, self.num_running, self.num_streams)
        return None not in loads and sum(loads) == 0


class PoolPlanner:
    """Owns the pool's target size and the idle clocks; decides one action per round.

    Args:
        settings: bounds and signal thresholds.
        target: the size to aim at first (`num_workers`).
        fingerprint: the app's worker spec fingerprint.
    """

    def __init__(self, settings: ScalingSettings, target: int, fingerprint: str) -> None:
        self.settings = settings
        self.fingerprint = fingerprint
        self.target = self._clamp(target)
        self._idle_since: dict[str, float] = {}

    def configure(self, settings: ScalingSettings, fingerprint: str, target: int) -> None:
        """A new app config: its bounds, its spec, and (its `num_workers`) a new target."""
        self.settings = settings
        self.fingerprint = fingerprint
        self.target = self._clamp(target)

    def start_failed(self, serving: int) -> None:
        """An added worker never became ready: aim at what serves (the next round may try
        again if the signal still holds)."""
        self.target = self._clamp(serving)

    def decide(self, now: float, observed: Sequence[Observation]) -> PoolAction | None:
        self._clock_idle(now, observed)
        lost = [o for o in observed if o.gone]
        if lost:
            oldest = min(lost, key=lambda o: o.slot)
            return PoolAction(ActionKind.REMOVE, Reason.LOST, oldest.worker_id)
        if any(o.state != MemberState.SERVING for o in observed):
            return None
        serving = list(observed)
        stale = [o for o in serving if o.fingerprint != self.fingerprint]
        if stale:
            if len(serving) <= self.target:
                return PoolAction(ActionKind.ADD, Reason.RECONCILE)
            oldest = min(stale, key=lambda o: o.slot)
            return PoolAction(ActionKind.RETIRE, Reason.RECONCILE, oldest.worker_id)
        if len(serving) < self.target:
            return PoolAction(ActionKind.ADD, Reason.TARGET)
        if len(serving) > self.target:
            victim = min(serving, key=lambda o: (not o.idle, -o.slot))
            return PoolAction(ActionKind.RETIRE, Reason.TARGET, victim.worker_id)
        if self._loaded(serving) and self.target < self.settings.max_workers:
            self.target += 1
            return PoolAction(ActionKind.ADD, Reason.LOAD)
        idle = [o for o in serving if self._idle_for(o.worker_id, now) >= self.settings.down_idle_s]
        if idle and self.target > self.settings.min_workers and not self._loaded(serving):
            self.target -= 1
            victim = max(idle, key=lambda o: o.slot)
            return PoolAction(ActionKind.RETIRE, Reason.IDLE, victim.worker_id)
        return None

    def _loaded(self, serving: Sequence[Observation]) -> bool:
        waiting = [o.num_waiting for o in serving if o.num_waiting is not None]
        usage = [o.kv_usage for o in serving if o.kv_usage is not None]
        if not waiting:
            return False
        mean_waiting = sum(waiting) / len(waiting)
        mean_usage = sum(usage) / len(usage) if usage else 0.0
        s = self.settings
        return mean_waiting >= s.up_waiting_per_worker or mean_usage >= s.up_kv_usage

    def _clock_idle(self, now: float, observed: Sequence[Observation]) -> None:
        """Start a worker's idle clock when it is first seen idle; stop it when it is not."""
        idle_now = {o.worker_id for o in observed if o.state == MemberState.SERVING and o.idle}
        self._idle_since = {w: t for w, t in self._idle_since.items() if w in idle_now}
        for worker_id in idle_now:
            self._idle_since.setdefault(worker_id, now)

    def _idle_for(self, worker_id: str, now: float) -> float:
        since = self._idle_since.get(worker_id)
        return 0.0 if since is None else now - since

    def _clamp(self, target: int) -> int:
        return max(self.settings.min_workers, min(self.settings.max_workers, target))
