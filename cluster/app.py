"""The Serve application: a `Router` deployment in front of the worker actors.

`build_app` is the app builder Serve imports (`pagedserve.cluster.app:build_app`), so the same
config drives `pagedserve serve`, `serve run` and a KubeRay `serveConfigV2`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.router import GenerateRequest, RouterCore
from pagedserve.cluster.worker_group import start_worker_group
from pagedserve.workers.stream import StreamDelta


@serve.deployment(name="Router", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
class Router:
    """Ingress: takes requests, routes them to workers, streams deltas back."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = ClusterConfig.from_dict(config)
        index, workers = start_worker_group(self.config)
        self.core = RouterCore(self.config, index, workers)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamDelta]:
        """Streaming: call through `handle.options(stream=True).generate.remote(request)`."""
        async for delta in self.core.generate(request):
            yield delta

    async def abort(self, request_id: str) -> bool:
        return await self.core.abort(request_id)

    async def stats(self) -> dict[str, Any]:
        return await self.core.cluster_stats()

    async def check_health(self) -> None:
        await self.core.start()


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Bind the router with its config (plain data: from YAML, flags or serveConfigV2)."""
    config = ClusterConfig.from_dict(args or {})
    return Router.bind(config.to_dict())
