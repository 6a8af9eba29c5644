"""How many Ray clusters, Ray nodes and Serve instances a test run starts, and what they cost.

Starting Ray and Serve is most of what the integration tests spend (a head node alone takes
seconds of CPU on a 2-core machine): this count is how the suite keeps that number in view.
`StartupCount.install` wraps the calls that start something in this test process:

- `ray.init` with no address or `address="local"`: a local Ray started (one head node);
- `ray.cluster_utils.Cluster` and its `add_node`: a multi-node test cluster and its nodes;
- `serve.start` and `serve.run`: a Serve instance (controller and proxies) and an app deployed.

Each is counted with the wall-clock seconds the call took. Servers a test starts in a child
process (the CLI's `pagedserve serve`, a bench command's local cluster) start outside this
process and are not counted here. tests/conftest.py installs it for the session and prints
the totals (summed over pytest-xdist processes) at the end of the run.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve
from ray.cluster_utils import Cluster

KINDS = ("local Ray", "multi-node cluster", "Ray node", "Serve instance", "Serve app")


@dataclass
class StartupCount:
    """Owns the counts and seconds of every start-up of each kind in this process."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))

    def add(self, kind: str, seconds: float) -> None:
        self.counts[kind] += 1
        self.seconds[kind] += seconds

    def merge(self, other: dict[str, dict[str, float]]) -> None:
        """Add another process's `as_dict()`."""
        for kind in KINDS:
            self.counts[kind] += int(other["counts"].get(kind, 0))
            self.seconds[kind] += float(other["seconds"].get(kind, 0.0))

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {"counts": dict(self.counts), "seconds": dict(self.seconds)}

    def summary(self) -> str:
        parts = [
            f"{self.counts[kind]} {kind}{'s' if self.counts[kind] != 1 else ''} "
            f"({self.seconds[kind]:.0f} s)"
            for kind in KINDS
        ]
        return "start-ups in test processes: " + ", ".join(parts)

    def install(self, monkeypatch: Any) -> None:
        """Count every start-up of the kinds above from now on."""
        init = ray.init

        def counted_init(*args: Any, **kwargs: Any) -> Any:
            address = kwargs.get("address", args[0] if args else None)
            if address not in (None, "local"):  # a driver joining a running cluster
                return init(*args, **kwargs)
            return self._timed("local Ray", init, *args, **kwargs)

        cluster_init, add_node = Cluster.__init__, Cluster.add_node

        def counted_cluster(cluster: Cluster, *args: Any, **kwargs: Any) -> None:
            self._timed("multi-node cluster", cluster_init, cluster, *args, **kwargs)

        def counted_node(cluster: Cluster, *args: Any, **kwargs: Any) -> Any:
            return self._timed("Ray node", add_node, cluster, *args, **kwargs)

        monkeypatch.setattr(ray, "init", counted_init)
        monkeypatch.setattr(Cluster, "__init__", counted_cluster)
        monkeypatch.setattr(Cluster, "add_node", counted_node)
        monkeypatch.setattr(serve, "start", self._counting("Serve instance", serve.start))
        monkeypatch.setattr(serve, "run", self._counting("Serve app", serve.run))

    def _counting(self, kind: str, call: Callable[..., Any]) -> Callable[..., Any]:
        return functools.wraps(call)(functools.partial(self._timed, kind, call))

    def _timed(self, kind: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            return call(*args, **kwargs)
        finally:
            self.add(kind, time.monotonic() - started)


STARTUPS = StartupCount()
