"""Python clients of the gRPC API: `Client` (blocking) and `AsyncClient` (asyncio).

    from pagedserve.cluster.client import Client

    with Client("localhost:9000") as client:
        print(client.generate("Paged attention", max_tokens=16).completions[0].text)
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        print(client.generate(messages=chat, max_tokens=32).completions[0].text)
        for delta in client.generate_stream("Hello", max_tokens=32):
            print(delta.text, end="", flush=True)
        vector = client.embed(["Paged attention"]).embeddings[0].values

Results are the `pagedserve.v1` messages (see `serving.proto`); failures raise `grpc.RpcError`
with the server's status code and message. Leaving a stream early cancels the request on the
server, which frees its KV blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.proto.pagedserve.v1 import serving_pb2 as pb
from pagedserve.proto.pagedserve.v1 import serving_pb2_grpc

DEFAULT_ADDRESS = "localhost:9000"
SAMPLING_FIELDS = frozenset(f.name for f in pb.SamplingParams.DESCRIPTOR.fields)


def build_request(
    prompt: str | None = None,
    *,
    prompt_token_ids: Sequence[int] | None = None,
    messages: Sequence[Mapping[str, str]] | None = None,
    request_id: str = "",
    priority: int = 0,
    cache_salt: str = "",
    timeout_s: float = 0.0,
    **sampling: Any,
) -> pb.GenerateRequest:
    """A `GenerateRequest` from keyword arguments.

    Args:
        prompt: the prompt as text, or
        prompt_token_ids: the prompt as token ids, or
        messages: a chat (`{"role": ..., "content": ...}` turns), rendered by the server with
            the model's chat template.
        request_id: the id to abort it by (the server makes one when empty).
        priority: lower runs first.
        cache_salt: only requests with the same salt share cached prefix blocks.
        timeout_s: a worker-side deadline (0: none; gRPC deadlines apply regardless).
        **sampling: `SamplingParams` fields: max_tokens, temperature, top_p, top_k, seed,
            stop, n, ignore_eos, stop_token_ids, min_tokens, include_stop_str_in_output,
            use_beam_search, length_penalty, early_stopping (True, False or "never"), ...

    Raises:
        TypeError: an unknown keyword.
    """
    unknown = sorted(set(sampling) - SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling parameters: {', '.join(unknown)}")
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    if isinstance(sampling.get("early_stopping"), bool):  # the proto's string: "true", "false"
        sampling["early_stopping"] = str(sampling["early_stopping"]).lower()
    return pb.GenerateRequest(
        prompt=prompt or "",
        prompt_token_ids=list(prompt_token_ids or ()),
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ()],
        sampling=pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}),
        request_id=request_id,
        priority=priority,
        cache_salt=cache_salt,
        timeout_s=timeout_s,
    )


def build_embed_request(
    texts: Sequence[str] = (),
    *,
    token_ids: Sequence[Sequence[int]] = (),
    request_id: str = "",
    priority: int = 0,
    cache_salt: str = "",
) -> pb.EmbedRequest:
    """An `EmbedRequest`: texts, or token-id lists (one of the two)."""
    return pb.EmbedRequest(
        texts=list(texts),
        token_ids=[pb.TokenIds(ids=list(ids)) for ids in token_ids],
        request_id=request_id,
        priority=priority,
        cache_salt=cache_salt,
    )


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class Client:
    """A blocking client of one pagedserve cluster.

    Args:
        address: `host:port` of Serve's gRPC proxy.
        token: bearer token, when the cluster has auth on.
        timeout: default deadline in seconds of every call (None: no deadline).
        options: gRPC channel options, e.g. `("grpc.keepalive_time_ms", 30000)` or a small
            receive window (`("grpc.http2.lookahead_bytes", 1024)`, `("grpc.http2.bdp_probe",
            0)`) for a reader that should hold the server back when it stops reading.
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        token: str | None = None,
        timeout: float | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address, options=list(options))
        self.stub = serving_pb2_grpc.GenerationStub(self.channel)
        self.metadata = _metadata(token)
        self.timeout = timeout

    def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> pb.GenerateResponse:
        """Generate every completion; see `build_request` for the arguments."""
        return self.stub.Generate(
            build_request(prompt, **kwargs), timeout=self._timeout(timeout), metadata=self.metadata
        )

    def generate_stream(
        self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> Iterator[pb.GenerateStreamResponse]:
        """Token deltas as they are sampled; closing the iterator early cancels the request."""
        call = self.stub.GenerateStream(
            build_request(prompt, **kwargs), timeout=self._timeout(timeout), metadata=self.metadata
        )
        try:
            yield from call
        finally:
            call.cancel()  # no-op once the stream is done

    def embed(
        self, texts: Sequence[str] = (), *, timeout: float | None = None, **kwargs: Any
    ) -> pb.EmbedResponse:
        """The embeddings of `texts` (or `token_ids=[[...], ...]`); see `build_embed_request`."""
        return self.stub.Embed(
            build_embed_request(texts, **kwargs),
            timeout=self._timeout(timeout),
            metadata=self.metadata,
        )

    def abort(self, request_id: str) -> bool:
        return self.stub.Abort(
            pb.AbortRequest(request_id=request_id), timeout=self.timeout, metadata=self.metadata
        ).aborted

    def stats(self) -> pb.GetStatsResponse:
        return self.stub.GetStats(
            pb.GetStatsRequest(), timeout=self.timeout, metadata=self.metadata
        )

    def list_workers(self) -> list[pb.WorkerInfo]:
        response = self.stub.ListWorkers(
            pb.ListWorkersRequest(), timeout=self.timeout, metadata=self.metadata
        )
        return list(response.workers)

    def health(self, service: str = "") -> str:
        """`SERVING` or `NOT_SERVING`, from the standard health service."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout


class AsyncClient:
    """The asyncio twin of `Client`; use it inside a running event loop.

    Args:
        address: `host:port` of Serve's gRPC proxy.
        token: bearer token, when the cluster has auth on.
        timeout: default deadline in seconds of every call (None: no deadline).
        options: gRPC channel options, e.g. `("grpc.keepalive_time_ms", 30000)` or a small
            receive window (`("grpc.http2.lookahead_bytes", 1024)`, `("grpc.http2.bdp_probe",
            0)`) for a reader that should hold the server back when it stops reading.
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        token: str | None = None,
        timeout: float | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=list(options))
        self.stub = serving_pb2_grpc.GenerationStub(self.channel)
        self.metadata = _metadata(token)
        self.timeout = timeout

    async def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> pb.GenerateResponse:
        return await self.stub.Generate(
            build_request(prompt, **kwargs), timeout=self._timeout(timeout), metadata=self.metadata
        )

    async def generate_stream(
        self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        """Token deltas as they are sampled; closing the iterator early cancels the request."""
        call = self.stub.GenerateStream(
            build_request(prompt, **kwargs), timeout=self._timeout(timeout), metadata=self.metadata
        )
        try:
            async for delta in call:
                yield delta
        finally:
            call.cancel()

    async def embed(
        self, texts: Sequence[str] = (), *, timeout: float | None = None, **kwargs: Any
    ) -> pb.EmbedResponse:
        return await self.stub.Embed(
            build_embed_request(texts, **kwargs),
            timeout=self._timeout(timeout),
            metadata=self.metadata,
        )

    async def abort(self, request_id: str) -> bool:
        response = await self.stub.Abort(
            pb.AbortRequest(request_id=request_id), timeout=self.timeout, metadata=self.metadata
        )
        return response.aborted

    async def stats(self) -> pb.GetStatsResponse:
        return await self.stub.GetStats(
            pb.GetStatsRequest(), timeout=self.timeout, metadata=self.metadata
        )

    async def list_workers(self) -> list[pb.WorkerInfo]:
        response = await self.stub.ListWorkers(
            pb.ListWorkersRequest(), timeout=self.timeout, metadata=self.metadata
        )
        return list(response.workers)

    async def health(self, service: str = "") -> str:
        stub = health_pb2_grpc.HealthStub(self.channel)
        request = health_pb2.HealthCheckRequest(service=service)
        response = await stub.Check(request, timeout=self.timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout
