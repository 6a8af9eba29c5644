"""One local multi-node Ray cluster per test process, reused by consecutive modules that need
one.

Starting a head and three worker nodes costs ~9 s of wall time and ~11 CPU-seconds on a quiet
2-core machine (twice that beside a busy test process), and sixteen integration modules used
to start their own. Now a test process starts one the first time a module asks and hands it to
the next module that asks, but only when it is clean: no named actor left in any namespace (the
workers, the prefix index and the pool of every cluster a test started are named and detached)
and every worker slot free. A module that left something behind costs the next one a fresh
cluster, never a shared mistake, so modules stay as isolated as when each had its own.

An idle cluster is not free (~0.1 core: raylets, agents, monitors), so it is stopped as soon
as a test that does not use it starts (tests/conftest.py, `pytest_runtest_setup`): it lives
across a run of cluster modules, which `--dist loadfile` hands out in name order
(`test_cluster*.py`, ...).

Each module connects as its own Ray job (a new driver): actors a module started without
`detached` die with its job when it disconnects.
"""

from __future__ import annotations

import time

import ray
from ray.cluster_utils import Cluster

from support.cluster import WORKER_RESOURCE

WORKER_NODES = 3
# How long a disconnected module's actors and slots get to go away before the cluster is
# judged dirty and replaced. Only decides reuse or a fresh start: no test result depends on it.
SETTLE_S = 10.0
_SLOTS = ("CPU", WORKER_RESOURCE)


class SharedCluster:
    """The test process's Ray cluster: `connect()` for a module, `disconnect()` after it,
    `stop()` when no test needs it."""

    def __init__(self) -> None:
        self._cluster: Cluster | None = None
        self._connected = False

    def connect(self) -> Cluster:
        """This process's driver connected to a clean cluster (the kept one when it is clean,
        else a fresh one)."""
        if ray.is_initialized():
            ray.shutdown()
        if self._cluster is not None:
            self._join()
            if _settled():
                return self._cluster
            self.stop()
        self._cluster = _start()
        self._join()
        return self._cluster

    def disconnect(self) -> None:
        """The module is done: its job ends (its non-detached actors with it)."""
        if self._connected and ray.is_initialized():
            ray.shutdown()
        self._connected = False

    def stop(self) -> None:
        """Stop the cluster, if one is up (a driver connected elsewhere is left alone)."""
        self.disconnect()
        if self._cluster is not None:
            self._cluster.shutdown()
            self._cluster = None

    def _join(self) -> None:
        assert self._cluster is not None
        ray.init(address=self._cluster.address, include_dashboard=False, log_to_driver=False)
        self._connected = True


SHARED = SharedCluster()


def _start() -> Cluster:
    head = {"num_cpus": 2, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(WORKER_NODES):
        cluster.add_node(num_cpus=1, resources={WORKER_RESOURCE: 1.0})
    cluster.wait_for_nodes()
    return cluster


def _settled() -> bool:
    """Whether nothing of an earlier module is left: no named actor, every slot free."""
    end = time.monotonic() + SETTLE_S
    while not _is_clean():
        if time.monotonic() >= end:
            return False
        time.sleep(0.1)
    return True


def _is_clean() -> bool:
    if ray.util.list_named_actors(all_namespaces=True):
        return False
    alive = sum(1 for node in ray.nodes() if node["Alive"])
    total, free = ray.cluster_resources(), ray.available_resources()
    return alive == WORKER_NODES + 1 and all(
        free.get(name, 0.0) == amount for name, amount in total.items() if name in _SLOTS
    )
