"""A running pagedserve app for API tests: Serve's HTTP and gRPC proxies, two workers, on the
test process's shared cluster (support/shared_cluster.py: the module uses the `serve_cluster`
fixture).

The app is watched by the session's leak check (support/leaks.py) while it runs: after each
test, and when it stops (`serve.delete`, then its worker group), its Router, pools and index
must be clean. The Serve instance stays up for the next API module; the app does not.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import ray
import requests
from ray import serve

from pagedserve.cluster.api.config import split_app_args
from pagedserve.cluster.api.grpc.status import proxy_env_vars
from pagedserve.cluster.app import build_app
from pagedserve.cluster.client import Client
from pagedserve.cluster.config import SECTIONS, ClusterConfig, nest
from pagedserve.cluster.pool.group import stop_worker_group
from support.leaks import DEADLINE_S, WATCH, assert_cluster_clean, serve_router
from support.shared_cluster import SHARED

# 127 usable blocks of 8 tokens (one kept in reserve): prompt + max_tokens > 1016 never fits,
# while tiny-llama's context is 2048, so the two refusals can be told apart.
ENGINE = {"num_kv_blocks": 128, "block_size": 8, "attention_backend": "torch"}
POOL_TOKENS = 127 * 8
CONTEXT = 2048
VOCAB = 259


class LocalPorts:
    """The addresses of a server on this machine, from its `http_port` and `grpc_port`."""

    http_port: int
    grpc_port: int

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@dataclass(frozen=True)
class RunningApp(LocalPorts):
    name: str
    http_port: int
    grpc_port: int
    config: ClusterConfig


@contextmanager
def running_app(name: str, **args: Any) -> Iterator[RunningApp]:
    """Deploy the app on the shared cluster's Serve (started, or kept from the module before
    when its proxies' options are the same); delete it and stop its workers after.

    `args` are `build_app` arguments over the defaults (API keys and cluster config keys).
    """
    defaults = {
        "engine": ENGINE,
        "name": name,
        "scaling": {"num_workers": 2},
        # `stall_workers` calls the workers' `chaos_stall`
        "failure": {"stats_interval_s": 0.1, "fault_injection": True},
    }
    app_args = _over(defaults, nest(args))
    # The default model is the real (slower) SmolLM2: tests name tiny-llama unless they say.
    app_args["engine"] = {"model": "tiny-llama", **app_args["engine"]}
    config = ClusterConfig.from_dict(split_app_args(app_args)[0])
    env_vars = proxy_env_vars(
        "127.0.0.1", config.limits.max_request_bytes, config.limits.max_pending_grpc_calls
    )
    ports = SHARED.serve(env_vars)
    app = RunningApp(name, ports.http, ports.grpc, config)
    try:
        serve.run(build_app(app_args), name=name, route_prefix="/")
        WATCH.watch_serve_app(config, name)
        _wait_routed(app)
        yield app
    finally:
        serve.delete(name)
        stop_worker_group(config)


def _over(defaults: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """`args` over `defaults`, section by section (a config section given in `args` replaces
    only the keys it names)."""
    merged = dict(defaults)
    for key, value in args.items():
        held = merged.get(key)
        both_sections = key in SECTIONS and isinstance(held, dict) and isinstance(value, dict)
        merged[key] = {**held, **value} if both_sections else value
    return merged


def _wait_routed(app: RunningApp) -> None:
    """Until both proxies route to the app (a kept proxy learns a new app's route a moment
    after `serve.run` returns)."""

    def routed() -> bool:
        with contextlib.suppress(requests.RequestException, grpc.RpcError):
            if requests.get(f"{app.http_url}/health", timeout=10).status_code != 200:
                return False
            with Client(app.grpc_address, timeout=10) as client:
                return client.health() == "SERVING"
        return False

    wait_until(routed, DEADLINE_S, f"the proxies to route to {app.name!r}")


def stall_workers(app: RunningApp, stalled: bool, after_steps: int = 0) -> None:
    """Hold every worker's engine still after `after_steps` more steps (True), or release it
    (`FaultInjectingWorker.chaos_stall`): a stream open by construction, not by outrunning it."""
    config = app.config
    handles = [
        ray.get_actor(config.actors.worker_name(i), namespace=config.namespace)
        for i in range(config.scaling.num_workers)
    ]
    ray.get([h.chaos_stall.remote(stalled, after_steps) for h in handles], timeout=60)


@contextmanager
def held_workers(app: RunningApp, after_steps: int) -> Iterator[None]:
    """Every worker's engine holds still after `after_steps` more steps until the block ends:
    a request sent meanwhile cannot finish, however fast the machine (`stall_workers`)."""
    stall_workers(app, True, after_steps=after_steps)
    try:
        yield
    finally:
        stall_workers(app, False)


def wait_router_let_go(app: RunningApp) -> None:
    """Until the app's Router holds no request: a client's cancel or deadline reached it (and
    it sent the abort on to the worker), before a held worker is released."""
    router = serve_router(app.name)
    wait_until(lambda: router.read().idle, DEADLINE_S, "the Router to let the request go")


def assert_app_clean(app: RunningApp, deadline_s: float = DEADLINE_S) -> None:
    """The leak check, now (see `support.leaks`): the Router holds nothing open, every worker's
    pool is idle and clean, the index equals the pools. Waits up to `deadline_s` (a failsafe)
    for requests that are still being aborted."""
    assert_cluster_clean(app.config, [serve_router(app.name)], deadline_s)


def view_entries(app: RunningApp) -> int:
    """Block hashes in the prefix view of the app's Router (what it routes on; one replica)."""
    stats = serve.get_app_handle(app.name).stats.remote().result(timeout_s=60)
    return stats.view.entries


def wait_viewed(app: RunningApp, entries_before: int, blocks: int) -> int:
    """Until the Router's prefix view holds `blocks` more entries than `entries_before` (the
    last request's KV events reached it), so the next request is routed by them. Returns the
    new count."""

    def viewed() -> int | None:
        entries = view_entries(app)
        return entries if entries >= entries_before + blocks else None

    return wait_until(viewed, 120, f"{blocks} new entries in the router's prefix view")


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll `condition` until it returns something truthy; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)
