"""The router's view of one worker: handle, liveness, last report and its own in-flight count."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.cluster.routing import WorkerLoad


@dataclass
class WorkerState:
    worker_id: str
    handle: Any
    alive: bool = False
    info: dict[str, Any] = field(default_factory=dict)  # from `Worker.ready()`
    stats: dict[str, Any] = field(default_factory=dict)  # last `Worker.stats()`
    inflight: int = 0
    inflight_tokens: int = 0
    draining: bool = False  # alive, but taking nothing new: routing skips it

    @property
    def routable(self) -> bool:
        return self.alive and not self.draining

    def mark_alive(self, info: dict[str, Any]) -> None:
        self.info = info
        self.alive = True
        self.draining = False  # a (re)started worker admits again

    def begin(self, tokens: int) -> None:
        self.inflight += 1
        self.inflight_tokens += tokens

    def end(self, tokens: int) -> None:
        self.inflight -= 1
        self.inflight_tokens -= tokens

    def load(self) -> WorkerLoad:
        kv = self.stats.get("kv", {})
        total = kv.get("total_blocks", self.info.get("num_blocks", 0))
        used = kv.get("used_blocks", 0)
        return WorkerLoad(
            worker_id=self.worker_id,
            num_running=self.stats.get("num_running", 0),
            num_waiting=self.stats.get("num_waiting", 0),
            used_blocks=used,
            total_blocks=total,
            free_blocks=total - used,
            inflight=self.inflight,
            inflight_tokens=self.inflight_tokens,
        )
