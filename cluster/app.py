"""The Serve application: a `Router` deployment in front of the worker actors.

`build_app` is the app builder Serve imports (`pagedserve.cluster.app:build_app`), so the same
config drives `pagedserve serve`, `serve run` and a KubeRay `serveConfigV2`. It wires the parts:
it validates the config once, creates (or finds) the prefix index and the worker pool actors
(`cluster/pool/group.py`: nothing waits on them), and binds the Router with their handles and
the sections it reads (`RouterConfig`, the control plane's `PlacementConfig`, the pool's
`PoolConfig` to hand on). A Router replica's constructor starts nothing remote: its first
health check (`RouterCore.start`) hands the pool its config and waits for the workers.

The one `Router` deployment is the ingress of both Serve proxies:

- gRPC (port 9000): Serve's proxy calls the method named after each RPC of
  `pagedserve.v1.Generation` (`Generate`, `GenerateStream`, ...) and of `grpc.health.v1.Health`
  (`Check`, `Watch`); `GrpcFrontend` serves them. The proxy learns the services from
  `serve_options.GRPC_SERVICER_FUNCTIONS`.
- HTTP (port 8000): a FastAPI app, `@serve.ingress`-bound to the same class, serves the
  OpenAI-compatible routes through `OpenAIFrontend`. The FastAPI ingress adds `__call__` for
  HTTP only; the gRPC methods dispatch by name exactly as without it.
- Python: `handle.options(stream=True).generate.remote(GenerateRequest)`, `abort`, `stats`.

No `from __future__ import annotations` here: Serve pickles `Router` by value, and FastAPI must
resolve the route annotations (`Request`) when the replica rebuilds the class.
"""

import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.cluster.api.auth import TokenAuth
from pagedserve.cluster.api.config import ApiConfig, split_app_args
from pagedserve.cluster.api.direct_ingress import REPLICA_ENV, install_http_guards
from pagedserve.cluster.api.errors import ApiError, as_api_error
from pagedserve.cluster.api.grpc.api import SERVING, GrpcFrontend
from pagedserve.cluster.api.openai.api import OpenAIFrontend, error_response
from pagedserve.cluster.api.openai.embeddings import Embedder, EmbeddingsFrontend
from pagedserve.cluster.api.openai.lora import LoraAdmin
from pagedserve.cluster.api.openai.responses_api import ResponsesFrontend
from pagedserve.cluster.api.openai.tokenization import TokenizeFrontend
from pagedserve.cluster.api.serve_options import ROUTER_ENV_VARS
from pagedserve.cluster.config import ClusterConfig, PlacementConfig, ScalingConfig
from pagedserve.cluster.pool.config import PoolConfig
from pagedserve.cluster.pool.group import create_pool
from pagedserve.cluster.router.config import RouterConfig
from pagedserve.cluster.router.metrics import CONTENT_TYPE
from pagedserve.cluster.router.router import RouterCore
from pagedserve.cluster.router.types import ClusterStats, RouterInflight
from pagedserve.workers.model.registry import DEFAULT_MODEL
from pagedserve.workers.process.cpu_placement import pin_process, set_niceness
from pagedserve.workers.protocol.requests import GenerateRequest
from pagedserve.workers.protocol.stream import StreamDelta
from pagedserve.workers.ray_internals import bound_http_responses
from pagedserve.workers.telemetry.telemetry import ROUTER_SERVICE, get_tracing

DEFAULT_INFLIGHT = 1024  # Serve's slots for a router without `max_inflight`
REFUSAL_HEADROOM = 1024
http_app = FastAPI(title="pagedserve", docs_url=None, redoc_url=None)


# Defined before `Router`: Serve pickles the class (by value) as soon as it is decorated.
def served_model_name(config: RouterConfig, api: ApiConfig) -> str:
    """The model id of the OpenAI API: the configured name, else the engine's model."""
    return api.served_model_name or config.engine.model or DEFAULT_MODEL


# The Router's code runs on Serve's own event loop (ROUTER_ENV_VARS): only there does a client
# that stops reading hold the Router's stream back, and so pause its request on the worker.


async def _answer(route: Awaitable[Response]) -> Response:
    """A route's response, or its failure as the API's error (`api.errors`)."""
    try:
        return await route
    except Exception as error:
        api_error = as_api_error(error)
        if api_error is None:
            raise
        return error_response(api_error)


@serve.deployment(
    name="Router",
    max_ongoing_requests=1024,
    ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": ROUTER_ENV_VARS}},
)
@serve.ingress(http_app)
class Router:
    """Ingress: takes requests, routes them to workers, streams deltas back.

    Args:
        config: the router's sections of the app config.
        placement: where the control plane runs (this replica pins itself there).
        index: the prefix index actor.
        pool: the worker pool actor.
        pool_config: the pool's sections, handed to the pool when the replica starts.
        api: the front ends' config (auth, served model name, telemetry).
        config_revision: when `build_app` bound this config (the worker pool follows the
            newest: a replica of an older deployment cannot roll the workers back).
    """

    def __init__(
        self,
        config: RouterConfig,
        placement: PlacementConfig,
        index: Any,
        pool: Any,
        pool_config: PoolConfig,
        api: ApiConfig | None = None,
        config_revision: float = 0.0,
    ) -> None:
        self.config = config
        if placement.control_cpus is not None:  # first: nothing heavy yet
            pin_process(placement.control_cpu_set, what="router")
        if placement.control_nice is not None:
            set_niceness(placement.control_nice, what="router")
        bound_http_responses()  # unread HTTP streams pause (cluster/api/sse_response.py)
        api_config = api or ApiConfig()
        if api_config.direct_ingress:  # HTTP served here, not by the proxy
            install_http_guards()
        telemetry = api_config.telemetry
        tracing = get_tracing(telemetry, ROUTER_SERVICE)
        # No workers yet: `start` (the first health check) asks the pool for them.
        self.core = RouterCore(
            config,
            index,
            {},
            tracing,
            telemetry.metrics,
            pool=pool,
            pool_config=pool_config,
            config_revision=config_revision,
        )
        auth = self.auth = TokenAuth.from_config(api_config.auth)
        model_name = served_model_name(self.config, api_config)
        embedder = Embedder(self.core, api_config.embedding_pooling)
        self.grpc = GrpcFrontend(self.core, auth, embedder)
        self.openai = OpenAIFrontend(self.core, auth, model_name)
        self.lora_admin = LoraAdmin(self.core, auth)
        self.tokenizing = TokenizeFrontend(self.core, auth, model_name)
        self.embedding = EmbeddingsFrontend(embedder, auth, model_name)
        self.responding = ResponsesFrontend(self.core, auth, model_name)

    # ---------------------------------------------------------------- Python
    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamDelta]:
        """Streaming: call through `handle.options(stream=True).generate.remote(request)`."""
        async with aclosing(self.core.generate(request)) as deltas:  # see RouterCore.generate
            async for delta in deltas:
                yield delta

    async def abort(self, request_id: str) -> bool:
        return await self.core.abort(request_id)

    async def stats(self) -> ClusterStats:
        return await self.core.cluster_stats()

    async def inflight(self) -> RouterInflight:
        """What this replica holds open now (leak checks: empty once every request ended)."""
        return self.core.inflight()

    async def check_health(self) -> None:
        await self.core.start()

    # -------------------------------------------- gRPC: pagedserve.v1.Generation
    async def Generate(self, request: Any, grpc_context: Any) -> Any:
        return await self.grpc.generate(request, grpc_context)

    async def GenerateStream(self, request: Any, grpc_context: Any) -> AsyncIterator[Any]:
        async with aclosing(self.grpc.generate_stream(request, grpc_context)) as responses:
            async for response in responses:
                yield response

    async def Abort(self, request: Any, grpc_context: Any) -> Any:
        return await self.grpc.abort(request, grpc_context)

    async def GetStats(self, request: Any, grpc_context: Any) -> Any:
        return await self.grpc.get_stats(request, grpc_context)

    async def ListWorkers(self, request: Any, grpc_context: Any) -> Any:
        return await self.grpc.list_workers(request, grpc_context)

    async def Embed(self, request: Any, grpc_context: Any) -> Any:
        return await self.grpc.embed(request, grpc_context)

    async def LoadLoraAdapter(self, request: Any, grpc_context: Any) -> Any:
        return await self.grpc.load_lora_adapter(request, grpc_context)

    async def UnloadLoraAdapter(self, request: Any, grpc_context: Any) -> Any:
        return await self.grpc.unload_lora_adapter(request, grpc_context)

    # ------------------------------------------------- gRPC: grpc.health.v1.Health
    async def Check(self, request: Any, grpc_context: Any) -> Any:
        return await self.grpc.check(request, grpc_context)

    async def Watch(self, request: Any, grpc_context: Any) -> AsyncIterator[Any]:
        async for response in self.grpc.watch(request, grpc_context):
            yield response

    # ------------------------------------------------------ HTTP: OpenAI API
    @http_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        return await self.openai.models(request)

    @http_app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        return await _answer(self.lora_admin.load(request))

    @http_app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        return await _answer(self.lora_admin.unload(request))

    @http_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self.openai.completions(request)

    @http_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self.openai.chat_completions(request)

    @http_app.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        return await self.responding.responses(request)

    @http_app.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        return await self.embedding.embeddings(request)

    @http_app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        return await self.tokenizing.tokenize(request)

    @http_app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return await self.tokenizing.detokenize(request)

    @http_app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        """Prometheus scrape endpoint (404 when `telemetry.metrics` is off); with auth on it
        needs a token like every other route but the health check."""
        try:
            self.auth.check(request.headers.get("authorization"))
        except ApiError as error:
            return error_response(error)
        if not self.core.metrics.enabled:
            return JSONResponse({"error": "metrics are off"}, status_code=404)
        await self.core.cluster_routers()  # every replica's counters, for this scrape
        return Response(self.core.metrics.render(), media_type=CONTENT_TYPE)

    @http_app.get("/health")
    async def health(self) -> Response:
        serving = await self.grpc.serving_status() == SERVING
        body = {"status": "ok" if serving else "unavailable"}
        return JSONResponse(body, status_code=200 if serving else 503)


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Validate the config, create (or find) the index and the worker pool, and bind the
    router with their handles and its sections of the config.

    Args:
        args: the config as the user wrote it (YAML, flags or serveConfigV2 `args`):
            `ClusterConfig` data plus the API's keys (`auth`, `served_model_name`,
            `telemetry`; see `api.config`).

    Raises:
        ValueError: a key or value is wrong (named), or the auth tokens file is unreadable.
    """
    cluster, api = split_app_args(args)
    config = ClusterConfig.from_dict(cluster)
    TokenAuth.from_config(api.auth)  # fail here, not in every replica, on a bad tokens file
    index, pool = create_pool(config, api.telemetry)
    return bind_router(config, api, index, pool)


def bind_router(config: ClusterConfig, api: ApiConfig, index: Any, pool: Any) -> serve.Application:
    """The Router deployment, sized by `config` and bound to the index and pool handles and
    its sections of the config."""
    ongoing = max_ongoing_requests(config.limits.max_inflight)
    env = {**ROUTER_ENV_VARS, **(REPLICA_ENV if api.direct_ingress else {})}
    router = Router.options(
        max_ongoing_requests=ongoing,
        max_queued_requests=ongoing,
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": env}},
        **router_scaling(config.scaling, config.limits.max_inflight),
    )
    # Frozen dataclasses and actor handles: Serve pickles them to each replica. The revision
    # is this bind's wall-clock time: each deploy (or redeploy) of the app binds a newer one.
    return router.bind(
        RouterConfig.of(config),
        config.placement,
        index,
        pool,
        PoolConfig.of(config),
        api,
        time.time(),
    )


def router_scaling(scaling: ScalingConfig, max_inflight: int | None) -> dict[str, Any]:
    """How many Router replicas Serve runs: a fixed `router_replicas`, or Serve's autoscaling
    between it and `router_max_replicas`, aiming at half of `max_inflight` streams per
    replica so that a replica gets company well before it refuses. A `serveConfigV2`'s own
    `deployments` entry overrides this, as Serve's config always does."""
    ceiling = scaling.router_max_replicas
    if ceiling is None or ceiling == scaling.router_replicas:
        return {"num_replicas": scaling.router_replicas}
    per_replica = max_inflight or DEFAULT_INFLIGHT
    return {
        "autoscaling_config": {
            "min_replicas": scaling.router_replicas,
            "max_replicas": ceiling,
            "target_ongoing_requests": max(1, per_replica // 2),
        }
    }


def max_ongoing_requests(max_inflight: int | None) -> int:
    """Calls Serve lets into one Router replica at once: the router's own stream limit plus
    room for the calls it refuses at once and for control calls. Serve must never be the
    one that queues a request the router would refuse: a refusal is due at once, not after
    the wait for a slot (past this, Serve refuses too: RESOURCE_EXHAUSTED, with a retry
    trailer from `api.grpc.status`)."""
    return (max_inflight or DEFAULT_INFLIGHT) + REFUSAL_HEADROOM
