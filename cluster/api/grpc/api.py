"""The gRPC front end: `pagedserve.v1.Generation` and `grpc.health.v1.Health` on the router.

Serve's gRPC proxy calls the ingress method named after each RPC with the request message and
a `grpc_context`; the `Router` deployment hands both to `GrpcFrontend`, which owns the mapping
from requests to router calls and from failures to status codes.

How a status reaches the client: unary RPCs set the code on `grpc_context` and return an empty
message (the proxy copies the code over); a stream raises after setting it (a stream has no
message to carry the context). A client that cancels, or whose deadline passes, raises
`asyncio.CancelledError` at the await the handler is parked on; the router's stream then
aborts the request on its worker, which frees its blocks within one engine step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from pagedserve.cluster.api.auth import Caller, TokenAuth
from pagedserve.cluster.api.common import collect, new_request_id
from pagedserve.cluster.api.errors import ApiError, engine_failure, to_api_error
from pagedserve.cluster.api.grpc.convert import (
    delta_to_proto,
    request_from_proto,
    response_to_proto,
    stats_to_proto,
    workers_to_proto,
)
from pagedserve.cluster.api.grpc.status import RETRY_AFTER_KEY, with_retry_hint
from pagedserve.cluster.api.grpc.wire import SERVICE, MalformedRequest, StreamFailed
from pagedserve.cluster.api.openai.embeddings import Embedder, check_inputs, input_error
from pagedserve.cluster.router.requests import scoped_request_id
from pagedserve.cluster.router.router import RouterCore
from pagedserve.cluster.router.tracing import tag_ingress
from pagedserve.cluster.router.worker_liveness import WORKER_LOST_ERRORS
from pagedserve.proto.pagedserve.v1 import serving_pb2 as pb
from pagedserve.workers.deadline import within
from pagedserve.workers.protocol.errors import NoWorkerAvailable
from pagedserve.workers.protocol.requests import GenerateRequest
from pagedserve.workers.protocol.sampling import Pooling

logger = logging.getLogger(__name__)

HEALTH_SERVICES = ("", SERVICE.full_name)
HEALTH_WAIT_S = 1.0  # a health check answers NOT_SERVING rather than wait for worker startup
WATCH_INTERVAL_S = 1.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class GrpcFrontend:
    """Serves the `Generation` and `Health` RPCs from a `RouterCore`.

    Args:
        core: the router.
        auth: the token check (a no-op when auth is off).
    """

    def __init__(self, core: RouterCore, auth: TokenAuth, embedder: Embedder | None = None) -> None:
        self.core = core
        self.auth = auth
        self.embedder = embedder or Embedder(core, Pooling.LAST)

    # ----------------------------------------------------------- Generation
    async def generate(self, request: Any, context: Any) -> pb.GenerateResponse:
        try:
            caller = self._admit(request, context)
            collector = await collect(self.core, _traced(request, context, caller, self.core))
            _raise_on_engine_error(collector.completions)
            return response_to_proto(collector)
        except Exception as error:
            return self._fail(context, error, pb.GenerateResponse())

    async def generate_stream(
        self, request: Any, context: Any
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        try:
            caller = self._admit(request, context)
            deltas = self.core.generate(_traced(request, context, caller, self.core))
            async with aclosing(deltas):  # closed with this stream: aborted on its worker
                async for delta in deltas:
                    yield delta_to_proto(delta)
                    if delta.error:
                        raise engine_failure(delta.error)
        except Exception as error:
            self._fail(context, error, None)
            raise StreamFailed(context.details()) from error

    async def abort(self, request: Any, context: Any) -> pb.AbortResponse:
        try:
            tenant = self._admit(request, context).tenant
            if not request.request_id:
                raise ApiError.invalid("request_id is empty")
            return pb.AbortResponse(aborted=await self._abort(request.request_id, tenant))
        except Exception as error:
            return self._fail(context, error, pb.AbortResponse())

    async def get_stats(self, request: Any, context: Any) -> pb.GetStatsResponse:
        try:
            self._admit(request, context)
            return stats_to_proto(await self.core.cluster_stats())
        except Exception as error:
            return self._fail(context, error, pb.GetStatsResponse())

    async def list_workers(self, request: Any, context: Any) -> pb.ListWorkersResponse:
        try:
            self._admit(request, context)
            await self.core.start()
            return workers_to_proto(list(self.core.workers.values()))
        except Exception as error:
            return self._fail(context, error, pb.ListWorkersResponse())

    async def embed(self, request: Any, context: Any) -> pb.EmbedResponse:
        try:
            caller = self._admit(request, context)
            inputs, field = embed_inputs(request)
            base_id = request.request_id or new_request_id("embd-")
            template = GenerateRequest(
                params=self.embedder.params,
                priority=request.priority,
                cache_salt=request.cache_salt or None,
                tenant=caller.tenant,
                cache_scope=caller.cache_scope,
            )
            (template,) = tag_ingress([template], context.invocation_metadata(), "grpc")
            try:
                vectors, prompt_tokens = await self.embedder.embed(inputs, base_id, template)
            except Exception as error:
                raise input_error(to_api_error(error), field) from error
            return pb.EmbedResponse(
                request_id=base_id,
                embeddings=[pb.Embedding(index=i, values=v) for i, v in enumerate(vectors)],
                usage=pb.Usage(prompt_tokens=prompt_tokens),
            )
        except Exception as error:
            return self._fail(context, error, pb.EmbedResponse())

    async def load_lora_adapter(self, request: Any, context: Any) -> pb.LoadLoraAdapterResponse:
        try:
            self._admit(request, context)
            if not request.lora_name or not request.lora_path:
                raise ApiError.invalid("lora_name and lora_path are required", "lora_name")
            key = await self.core.load_lora(request.lora_name, request.lora_path)
            return pb.LoadLoraAdapterResponse(lora_name=request.lora_name, key=key)
        except Exception as error:
            return self._fail(context, error, pb.LoadLoraAdapterResponse())

    async def unload_lora_adapter(self, request: Any, context: Any) -> pb.UnloadLoraAdapterResponse:
        try:
            self._admit(request, context)
            await self.core.unload_lora(request.lora_name)
            return pb.UnloadLoraAdapterResponse()
        except Exception as error:
            return self._fail(context, error, pb.UnloadLoraAdapterResponse())

    async def _abort(self, request_id: str, tenant: str) -> bool:
        """Abort through this replica's router; else ask every worker (another router replica
        may hold the stream, and each worker knows its own requests by their tenant-scoped id,
        so a tenant reaches only its own)."""
        if await self.core.abort(request_id, tenant):
            return True
        request_id = scoped_request_id(tenant, request_id)
        alive = [w for w in self.core.workers.values() if w.alive]
        results = await asyncio.gather(
            *(
                within(w.handle.abort.remote(request_id), self.core.config.failure.rpc_timeout_s)
                for w in alive
            ),
            return_exceptions=True,
        )
        return any(result is True for result in results)

    # --------------------------------------------------------------- Health
    async def check(self, request: health_pb2.HealthCheckRequest, context: Any) -> Any:
        if request.service not in HEALTH_SERVICES:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details(f"service: unknown service {request.service!r}")
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=await self.serving_status())

    async def watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> AsyncIterator:
        """The status now, then each change (checked every second) until the client leaves."""
        if request.service not in HEALTH_SERVICES:
            yield health_pb2.HealthCheckResponse(
                status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            )
            return
        last = None
        while True:
            status = await self.serving_status()
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def serving_status(self) -> int:
        """SERVING once the workers are up and at least one is alive."""
        try:
            await within(self.core.start(), HEALTH_WAIT_S)
        except (TimeoutError, NoWorkerAvailable, *WORKER_LOST_ERRORS):
            return NOT_SERVING
        return SERVING if any(w.alive for w in self.core.workers.values()) else NOT_SERVING

    # --------------------------------------------------------------- errors
    def _admit(self, request: Any, context: Any) -> Caller:
        """Auth first (so a stranger learns nothing about the request), then well-formedness.
        Returns the caller."""
        caller = self.auth.check_metadata(context.invocation_metadata())
        if isinstance(request, MalformedRequest):
            raise ApiError.invalid(request.message, request.param)
        return caller

    def _fail(self, context: Any, error: Exception, empty: Any) -> Any:
        """Set the status for `error` on the context and return `empty`.

        A bug becomes INTERNAL with an incident id (the log has its traceback). A refusal's
        retry hint goes into the trailer here (unary: Serve copies it along with the empty
        response) and into the details, from which `api.grpc.status` makes the trailer of a
        stream, whose context Serve never copies on failure.
        """
        api_error = to_api_error(error)
        details = api_error.message
        if retry_after := api_error.retry_after_header():
            # A list: Serve's context concatenates it to its own list of request-id metadata.
            context.set_trailing_metadata([(RETRY_AFTER_KEY, retry_after)])
            details = with_retry_hint(details, retry_after)
        context.set_code(getattr(grpc.StatusCode, api_error.code.value))
        context.set_details(details)
        return empty


def embed_inputs(request: Any) -> tuple[list[str | list[int]], str]:
    """An `EmbedRequest`'s inputs and the field they came in; INVALID_ARGUMENT naming it."""
    if request.texts and request.token_ids:
        raise ApiError.invalid("give texts or token_ids, not both", "texts")
    if request.token_ids:
        return check_inputs([list(t.ids) for t in request.token_ids], "token_ids"), "token_ids"
    return check_inputs(list(request.texts), "texts"), "texts"


def _raise_on_engine_error(completions: list) -> None:
    for completion in completions:
        if completion.error:
            raise engine_failure(completion.error)


def _traced(message: Any, context: Any, caller: Caller, core: Any = None) -> GenerateRequest:
    """The router request of a gRPC message, continuing the trace its metadata names (a chat
    rendered by the router's tokenizer)."""
    request = request_from_proto(message, caller, getattr(core, "tokenizer", None))
    if request.lora is not None and request.lora == getattr(core, "model_name", None):
        request = dataclasses.replace(request, lora=None)  # the served model by name: the base
    (request,) = tag_ingress([request], context.invocation_metadata(), "grpc")
    return request
