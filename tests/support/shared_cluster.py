"""One local multi-node Ray cluster per test process, for every integration module that does
not need a Ray of its own, and one Serve instance on it for the API modules in a row.

Starting a head and three worker nodes costs ~9 s of wall time and ~11 CPU-seconds on a quiet
2-core machine (twice that beside a busy test process); a local Ray ~8 s and a Serve instance
~4 s more. Modules used to start one of each for themselves (31 start-ups in a run). Now a test
process starts the cluster the first time a module asks and hands it to every later module
that asks, but only when it is clean: no named actor left in any namespace (the workers, the
prefix index and the pool of every cluster a test started are named and detached; so is every
Serve replica) but Serve's own controller and proxy, and every worker slot free. A module that
left something behind costs the next one a fresh cluster, never a shared mistake, so modules
stay as isolated as when each had its own.

Serve (its controller and one proxy, on the head node: the worker nodes share its address)
stays up from one API module to the next while the proxies' options are the same
(`serve(env_vars)`); each module deploys its own app and deletes it after its last test
(`support.api_app.running_app`). A module on the cluster without Serve shuts it down first
(`connect(serve=False)`), so it runs on what it always ran on.

The cluster lives until the test process leaves the integration tests (tests/conftest.py,
`pytest_runtest_setup`) or ends: idle it costs ~0.1 core (raylets, agents, monitors), less
than starting it again after a module that brings its own Ray (`bench serve`, the deploy test,
the `pagedserve serve` processes) would.

Each module connects as its own Ray job (a new driver): actors a module started without
`detached` die with its job when it disconnects.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray
from ray import serve
from ray.cluster_utils import Cluster

from pagedserve.cluster.api.serve_options import grpc_options
from pagedserve.cluster.ports import free_port
from support.cluster import WORKER_RESOURCE

WORKER_NODES = 3
# The head's CPUs: what an API app's two workers (1 CPU each) and the bench commands' workers
# take besides the control actors (0 CPUs); the worker nodes have one each.
HEAD_CPUS = 2
# How long a disconnected module's actors and slots get to go away before the cluster is
# judged dirty and replaced. Only decides reuse or a fresh start: no test result depends on it.
SETTLE_S = 10.0
_SLOTS = ("CPU", WORKER_RESOURCE)
SERVE_NAMESPACE = "serve"
# Serve's own named actors, kept with the instance between modules. Anything else of Serve's
# (a replica: "SERVE_REPLICA::<app>#...") is an app a module left behind.
_SERVE_OWN = ("SERVE_CONTROLLER_ACTOR", "SERVE_PROXY_ACTOR")


# Serve's proxy prefers the replicas on its own node, and our worker nodes share the head's
# address: with two Router replicas, one on the head and one elsewhere, every request went to
# the head's. On one node (where the API tests ran before) every replica is local; so here:
# no preference. The queue lengths the proxy places requests by (power of two choices) come
# from a probe with a 0.1 s deadline by default: on a loaded machine a replica answering late
# lost every choice; this deadline is a failsafe only.
SERVE_PROXY_ROUTING_ENV = {
    "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0",
    "RAY_SERVE_PROXY_PREFER_LOCAL_AZ_ROUTING": "0",
    "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "5",
    "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "30",
}


@dataclass(frozen=True)
class ServePorts:
    """Where the kept Serve instance's proxies listen."""

    http: int
    grpc: int


@dataclass(frozen=True)
class _Serve:
    env_vars: dict[str, str]
    ports: ServePorts


class SharedCluster:
    """The test process's Ray cluster and Serve instance: `connect()` for a module,
    `disconnect()` after it, `serve()` for an API module's app, `stop()` when no test needs
    them."""

    def __init__(self) -> None:
        self._cluster: Cluster | None = None
        self._connected = False
        self._serve: _Serve | None = None

    @property
    def address(self) -> str | None:
        return self._cluster.address if self._cluster is not None else None

    def connect(self, serve: bool = False) -> Cluster:
        """This process's driver connected to a clean cluster (the kept one when it is clean,
        else a fresh one). Without `serve`, a kept Serve instance is shut down first."""
        if ray.is_initialized():
            ray.shutdown()
        if self._cluster is not None:
            self._join()
            if _settled(serve_kept=self._serve is not None):
                if not serve:
                    self.stop_serve()
                return self._cluster
            self.stop()
        self._cluster = _start()
        self._join()
        return self._cluster

    def serve(self, env_vars: dict[str, str]) -> ServePorts:
        """Serve on the connected cluster with `env_vars` in its proxies' environment: the
        running instance when it was started with the same, else a fresh one on free ports."""
        assert self._connected, "connect() first (the `serve_cluster` fixture)"
        if self._serve is not None and self._serve.env_vars == env_vars:
            return self._serve.ports
        self.stop_serve()
        ports = ServePorts(free_port(), free_port())
        serve.start(
            proxy_location="HeadOnly",
            http_options={"host": "127.0.0.1", "port": ports.http},
            grpc_options=grpc_options(ports.grpc),
            # The proxies inherit the controller's environment.
            controller_options={"runtime_env": {"env_vars": env_vars | SERVE_PROXY_ROUTING_ENV}},
        )
        self._serve = _Serve(dict(env_vars), ports)
        return ports

    def stop_serve(self) -> None:
        """Shut the kept Serve instance down (the driver must be connected)."""
        if self._serve is not None:
            self._serve = None
            serve.shutdown()

    def disconnect(self) -> None:
        """The module is done: its job ends (its non-detached actors with it)."""
        if self._connected and ray.is_initialized():
            ray.shutdown()
        self._connected = False

    def stop(self) -> None:
        """Stop the cluster, Serve with it, if one is up (a driver connected elsewhere is left
        alone)."""
        self.disconnect()
        self._serve = None
        if self._cluster is not None:
            self._cluster.shutdown()
            self._cluster = None

    def _join(self) -> None:
        assert self._cluster is not None
        ray.init(address=self._cluster.address, include_dashboard=False, log_to_driver=False)
        self._connected = True


SHARED = SharedCluster()


def _start() -> Cluster:
    head = {"num_cpus": HEAD_CPUS, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(WORKER_NODES):
        cluster.add_node(num_cpus=1, resources={WORKER_RESOURCE: 1.0})
    cluster.wait_for_nodes()
    return cluster


def _settled(serve_kept: bool) -> bool:
    """Whether nothing of an earlier module is left: no named actor (but the kept Serve
    instance's own), every slot free."""
    end = time.monotonic() + SETTLE_S
    while not _is_clean(serve_kept):
        if time.monotonic() >= end:
            return False
        time.sleep(0.1)
    return True


def _is_clean(serve_kept: bool) -> bool:
    actors = ray.util.list_named_actors(all_namespaces=True)
    if any(not (serve_kept and _serve_own(actor)) for actor in actors):
        return False
    alive = sum(1 for node in ray.nodes() if node["Alive"])
    total, free = ray.cluster_resources(), ray.available_resources()
    return alive == WORKER_NODES + 1 and all(
        free.get(name, 0.0) == amount for name, amount in total.items() if name in _SLOTS
    )


def _serve_own(actor: dict[str, str]) -> bool:
    return actor["namespace"] == SERVE_NAMESPACE and actor["name"].startswith(_SERVE_OWN)
