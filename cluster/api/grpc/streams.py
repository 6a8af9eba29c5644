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

Backpressure, hop by hop, for a client that stops reading:
- gRPC → this wrapper: `context.write` waits once HTTP/2 flow control is exhausted;
- this wrapper → Serve's handler: at most `MAX_BUFFERED_MESSAGES` wait to be written; past it
  the pump stops pulling Serve's handler. A cancellation that finds the pump waiting for room
  (Serve's handler then sits at a `yield`, where a cancellation would leak the replica call)
  first lets Serve's handler step into its await of the replica, and cancels it there;
- proxy → replica: Serve calls the replica's streaming method without Ray's generator
  backpressure, so the replica would run ahead without bound. `bound_replica_streams` makes
  this process's calls carry `_generator_backpressure_num_objects`. (The replica must also run
  user code on its own loop, `RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0`, or Serve drives
  the user generator into an unbounded queue of its own.)

It runs inside the proxy actor, so it imports nothing heavy.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any

from pagedserve.workers.ray_internals import replica_wrapper_class, wrap_grpc_handlers

# Messages a stream buffers between Serve's handler and gRPC's writer (deltas are small).
MAX_BUFFERED_MESSAGES = 16
# Unconsumed objects a replica's streaming call may run ahead of this proxy.
REPLICA_STREAM_BACKPRESSURE_OBJECTS = 16
_REPLICA_STREAMING_METHODS = ("handle_request_streaming", "handle_request_with_rejection")


def cancel_streams_in_flight(server: Any, bound_replicas: bool = True) -> None:
    """Wrap the streaming handlers Serve's proxy makes (for every service registered after
    this) so that an early end of the stream cancels the call to the replica and an unread
    stream stops pulling; with `bound_replicas`, also `bound_replica_streams()` in this
    process. Idempotent; a server without Serve's handler factory is left alone."""
    if wrap_grpc_handlers(server, "streams", _streams_driven_in_tasks) and bound_replicas:
        bound_replica_streams()


def _streams_driven_in_tasks(factory: Callable) -> Callable:
    def wrapped_factory(service_method: str, streaming_type: Any) -> Callable:
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        if getattr(streaming_type, "name", "") != "UNARY_STREAM":
            return handler
        return _driven_in_a_task(handler)

    return wrapped_factory


_DONE = object()


def _driven_in_a_task(handler: Callable, max_buffered: int = MAX_BUFFERED_MESSAGES) -> Callable:
    """Serve's streaming handler run in a task of its own, its messages written by a coroutine
    handler (grpc.aio's reader/writer API), so the call outlives every step of Serve's handler.

    The pump pulls Serve's handler only while fewer than `max_buffered` messages wait to be
    written, so a client that stops reading stops the replica call (and, through it, the
    worker) instead of filling this proxy's memory.
    """

    async def unary_stream(request: Any, context: Any) -> None:
        queue: asyncio.Queue = asyncio.Queue()  # holds at most `max_buffered`: see `room`
        room = asyncio.Semaphore(max_buffered)
        messages = handler(request, context)

        async def pump() -> None:
            try:
                while True:
                    try:
                        await room.acquire()
                    except asyncio.CancelledError:
                        await _cancel_in_its_await(messages)
                        raise
                    try:
                        message = await anext(messages)  # a cancellation here reaches Serve
                    except StopAsyncIteration:
                        return
                    queue.put_nowait(message)
            finally:
                queue.put_nowait(_DONE)

        task = asyncio.get_running_loop().create_task(pump())
        try:
            while (message := await queue.get()) is not _DONE:
                room.release()
                await context.write(message)
            await task  # re-raise what the handler raised, if anything
        finally:
            if not task.done():
                task.cancel()  # lands in Serve's await of the replica: it cancels the call
                await asyncio.wait([task])  # Serve's bookkeeping, while the call still exists

    return unary_stream


async def _cancel_in_its_await(messages: Any) -> None:
    """Cancel Serve's handler where Serve handles it: in its await of the replica.

    It sits at a `yield`. Asking for the next message resumes it into that await (its first
    suspension: one loop turn), and the cancellation then lands there. Should a message have
    been ready at once, it is dropped (the client is gone) and the step repeats.
    """
    while True:
        step = asyncio.ensure_future(anext(messages))
        await asyncio.sleep(0)  # one turn: the step runs up to its first await
        if not step.done():
            step.cancel()
            await asyncio.wait([step])
            return
        if step.cancelled() or step.exception() is not None:  # ended (StopAsyncIteration)
            return


def bound_replica_streams(num_objects: int = REPLICA_STREAM_BACKPRESSURE_OBJECTS) -> None:
    """Make this process's streaming calls to Serve replicas carry Ray's generator
    backpressure, so a replica runs at most `num_objects` messages ahead of this proxy.

    Serve 2.60 sets no backpressure on them and offers no option for it, so this wraps
    `ActorReplicaWrapper.send_request_python`. Idempotent; a Serve without that class is left
    alone (then the hop stays unbounded, as before).
    """
    ActorReplicaWrapper = replica_wrapper_class()  # noqa: N806 (Serve's class)
    if ActorReplicaWrapper is None or getattr(ActorReplicaWrapper, "_pagedserve_bounded", False):
        return
    original = ActorReplicaWrapper.send_request_python

    def send_request_python(self: Any, pr: Any, *, with_rejection: bool) -> Any:
        shim = copy.copy(self)
        shim._actor_handle = _Backpressured(self._actor_handle, num_objects)
        return original(shim, pr, with_rejection=with_rejection)

    ActorReplicaWrapper.send_request_python = send_request_python
    ActorReplicaWrapper._pagedserve_bounded = True


class _Backpressured:
    """A replica's actor handle whose streaming methods default to generator backpressure."""

    def __init__(self, handle: Any, num_objects: int) -> None:
        self._handle = handle
        self._num_objects = num_objects

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._handle, name)
        if name not in _REPLICA_STREAMING_METHODS:
            return method
        return _BackpressuredMethod(method, self._num_objects)


class _BackpressuredMethod:
    def __init__(self, method: Any, num_objects: int) -> None:
        self._method = method
        self._num_objects = num_objects

    def options(self, **options: Any) -> Any:
        if options.get("num_returns") == "streaming":
            options.setdefault("_generator_backpressure_num_objects", self._num_objects)
        return self._method.options(**options)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._method.remote(*args, **kwargs)
