"""The app the gRPC soak drives: a fresh local Ray, Serve's gRPC proxy and the pagedserve app,
plus the handles the soak needs to strike and inspect it (router replicas, index, workers).

`serving_app` owns the whole lifetime: it starts a local Ray of its own (never another
session's), Serve on free ports and `build_app(config)`, and tears all of it down, named actors
included, whatever happens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve

from pagedserve.cluster.api.grpc.status import proxy_env_vars
from pagedserve.cluster.api.serve_options import grpc_options
from pagedserve.cluster.app import build_app
from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.pool.group import stop_worker_group
from pagedserve.cluster.ports import free_port
from pagedserve.cluster.serve.ray_startup import allow_slow_startup

SERVE_NAMESPACE = "serve"
# Serve names each replica actor "SERVE_REPLICA::<app>#<deployment>#<id>" (ReplicaID).
REPLICA_PREFIX = "SERVE_REPLICA::"
ROUTER_DEPLOYMENT = "Router"


@dataclass(frozen=True)
class SoakApp:
    """A running app: its config, where its gRPC proxy listens, and its Serve app name."""

    config: ClusterConfig
    grpc_port: int
    app_name: str

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def worker_handles(self) -> dict[str, Any]:
        """Worker id → handle, looked up by name (they outlive router replicas)."""
        config = self.config
        return {
            config.actors.worker_name(i): ray.get_actor(
                config.actors.worker_name(i), config.namespace
            )
            for i in range(config.scaling.num_workers)
        }

    def index_handle(self) -> Any:
        return ray.get_actor(self.config.actors.index_name, self.config.namespace)

    def router_replicas(self) -> list[str]:
        """The names of the Router replica actors alive now."""
        prefix = f"{REPLICA_PREFIX}{self.app_name}#{ROUTER_DEPLOYMENT}#"
        return sorted(
            actor["name"]
            for actor in ray.util.list_named_actors(all_namespaces=True)
            if actor["namespace"] == SERVE_NAMESPACE and actor["name"].startswith(prefix)
        )


@contextmanager
def serving_app(config: ClusterConfig, num_cpus: int = 4) -> Iterator[SoakApp]:
    """Start Ray, Serve (HTTP and gRPC proxies on free ports) and the app; tear all down.

    Args:
        config: the cluster config the app is built from.
        num_cpus: CPUs the local Ray advertises (workers take `worker_num_cpus` each).
    """
    if ray.is_initialized():
        ray.shutdown()
    allow_slow_startup()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    app = SoakApp(config, free_port(), config.name)
    try:
        env_vars = proxy_env_vars(
            "127.0.0.1", config.limits.max_request_bytes, config.limits.max_pending_grpc_calls
        )
        serve.start(
            http_options={"host": "127.0.0.1", "port": free_port()},
            grpc_options=grpc_options(app.grpc_port),
            controller_options={"runtime_env": {"env_vars": env_vars}},
        )
        serve.run(build_app(config.to_dict()), name=app.app_name, route_prefix="/")
        yield app
    finally:
        try:
            serve.shutdown()
            stop_worker_group(config)
        finally:
            ray.shutdown()
