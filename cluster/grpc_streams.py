"""Make a cancelled gRPC stream cancel its request on the replica, every time.

Serve's gRPC proxy cancels the replica call only when the cancellation lands while its stream
handler awaits the next result. When a client cancels (or its deadline passes) while gRPC is
writing a message, grpc.aio instead drops the handler's generator, which is closed later with a
`GeneratorExit`; Serve's handler swallows it and the replica generates on, holding its KV
blocks, until the request ends by itself (ray-project/ray#42665 set out to fix this and was
closed unmerged). Token streams write often, so this happens to a good share of cancels.

`cancel_streams_in_flight` wraps the handlers Serve's proxy makes for server-streaming RPCs: the
Serve handler runs in a task of its own and its messages are written by a coroutine handler
(grpc.aio's reader/writer API). When the stream ends early, the task is cancelled, which lands
in Serve's await of the replica, the path Serve handles; and the coroutine waits for that task,
so Serve's handler finishes (status, access log) before gRPC releases the call: touching a
released call's context crashes the proxy. Remove this module once Serve does it itself.

It runs inside the proxy actor, so it imports nothing heavy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


def cancel_streams_in_flight(server: Any) -> None:
    """Wrap the streaming handlers Serve's proxy makes (for every service registered after
    this) so that an early end of the stream cancels the call to the replica. Idempotent; a
    server without Serve's handler factory is left alone."""
    factory = getattr(server, "service_handler_factory", None)
    if factory is None or getattr(factory, "_pagedserve_wrapped", False):
        return

    def wrapped_factory(service_method: str, streaming_type: Any) -> Callable:
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        if getattr(streaming_type, "name", "") != "UNARY_STREAM":
            return handler
        return _driven_in_a_task(handler)

    wrapped_factory._pagedserve_wrapped = True  # type: ignore[attr-defined]
    server.service_handler_factory = wrapped_factory


_DONE = object()


def _driven_in_a_task(handler: Callable) -> Callable:
    """Serve's streaming handler run in a task of its own, its messages written by a coroutine
    handler (grpc.aio's reader/writer API), so the call outlives every step of Serve's handler.

    The queue is unbounded on purpose: the handler task must never wait on it, so that a
    cancellation always lands in Serve's await of the replica (deltas are small).
    """

    async def unary_stream(request: Any, context: Any) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            try:
                async for message in handler(request, context):
                    queue.put_nowait(message)
            finally:
                queue.put_nowait(_DONE)

        task = asyncio.get_running_loop().create_task(pump())
        try:
            while (message := await queue.get()) is not _DONE:
                await context.write(message)
            await task  # re-raise what the handler raised, if anything
        finally:
            if not task.done():
                task.cancel()  # lands in Serve's await of the replica: it cancels the call
                await asyncio.wait([task])  # Serve's bookkeeping, while the call still exists

    return unary_stream
