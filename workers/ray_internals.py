"""Every part of Ray's private API pagedserve touches, in one place, for one Ray version.

Ray and Serve offer no public way to do the things below, which pagedserve needs. Each is
reached only through a function here, and each has a test
(`tests/unit/workers/test_ray_internals.py`) that fails when an upgrade moves or reshapes
what it touches:

- `setup_hook_env_var`: `ray._private.ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR`, a
  setup hook for the processes Serve and the pool start (`api.grpc.backlog`, `drain_signal`);
- `serve_grpc_server_options`: `ray.serve._private.constants.DEFAULT_GRPC_SERVER_OPTIONS`,
  room for a gRPC burst (`api.grpc.backlog`);
- `wrap_grpc_handlers`: the `service_handler_factory` of Serve's gRPC proxy server, for cancels
  that reach the replica and statuses without internals (`api.grpc.streams`, `api.grpc.status`);
- `replica_wrapper_class`: `ActorReplicaWrapper.send_request_python`
  (`ray.serve._private.request_router.replica_wrapper`), backpressure from the proxy to the
  replica (`api.grpc.streams`);
- `wrap_get_node`: `ray._private.services.get_node`, a node start-up that waits longer than
  Ray's fixed 30 s (`ray_startup`);
- `route_sigterm_handlers`: `ray._private.utils.set_sigterm_handler`, a worker's drain on
  SIGTERM (`drain_signal`);
- `replica_serves_http_only`: `is_grpc_enabled` as `ray.serve._private.replica` reads it, so
  that a Router replica serving HTTP itself (`api.direct_ingress`) starts no gRPC server;
- `bound_http_responses` and `room_in_http_response`: `MessageQueue`
  (`ray.serve._private.http_util`), the replica's queue of a response's ASGI messages, which
  Serve fills without bound, for HTTP streams that pause when unread (`api.openai.api`);
- `detached_context` and `detached_task`: `ray._raylet.async_task_id`, the context variable by
  which Ray files each call an async actor makes under the request it serves, so that a call
  meant to outlive that request is not cancelled with it (`router`, `worker_channel`);
- `kv_put`, `kv_get` and `kv_del`: `ray.experimental.internal_kv`, the GCS's key-value store
  (where Serve keeps its own checkpoints), for what an actor must find again after Ray
  restarts it with its first arguments (`pool.pool`: the newest config revision followed).

Serve also reads settings from the environment that its docs do not list (set in
`serve_options`, `ray_startup` and `api.grpc.status`): `RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD`,
`RAY_SERVE_CONTROL_LOOP_INTERVAL_S`, `RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S`,
`RAY_SERVE_GRPC_MAX_MESSAGE_SIZE`, and direct ingress's (`api.direct_ingress`); the test checks
Serve still reads each one.

`pyproject.toml` pins Ray to `RAY_VERSION` exactly (and the lock holds that version). Moving
Ray is a change of its own: the pin, `RAY_VERSION`, then this module's tests and the whole
suite. `pagedserve serve` warns when the installed Ray is another version (`version_warning`).

It runs inside Serve's proxy too, so it imports nothing heavy.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Coroutine
from contextvars import ContextVar
from typing import Any

RAY_VERSION = "2.60.0"
SERVE_ENV_SETTINGS = (
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S",
    "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS",
    "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT",
    "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S",
    "RAY_SERVE_PORT_QUARANTINE_S",
)
HandlerFactory = Callable[..., Callable]
# The queue of the HTTP response this task writes (set as the replica creates it, and so seen by
# the task it then starts for the ASGI app).
_RESPONSE_QUEUE: ContextVar[Any] = ContextVar("pagedserve_response_queue", default=None)


def version_warning() -> str | None:
    """A warning when the installed Ray is not the version this module was written for."""
    import ray

    if ray.__version__ == RAY_VERSION:
        return None
    return (
        f"Ray {ray.__version__} is installed; pagedserve is built and tested against Ray "
        f"{RAY_VERSION} (it relies on Ray internals: pagedserve/workers/ray_internals.py)"
    )


def setup_hook_env_var() -> str:
    """The variable a Ray worker process reads its setup hook from (the public
    `runtime_env={"worker_process_setup_hook": ...}` is honoured only for a whole job)."""
    from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR

    return WORKER_PROCESS_SETUP_HOOK_ENV_VAR


def serve_grpc_server_options() -> list[tuple[str, Any]]:
    """The options Serve builds every gRPC server of this process with: the list itself, which
    Serve reads when it builds one, so that what is added to it applies."""
    from ray.serve._private import constants

    return constants.DEFAULT_GRPC_SERVER_OPTIONS


def wrap_grpc_handlers(
    server: Any, name: str, wrap: Callable[[HandlerFactory], HandlerFactory]
) -> bool:
    """Replace the handler factory of Serve's gRPC proxy server by `wrap(factory)`: every
    service registered afterwards gets its handlers from it. Idempotent per `name`; False for
    a server without Serve's factory (left alone)."""
    factory = getattr(server, "service_handler_factory", None)
    if factory is None:
        return False
    marker = f"_pagedserve_{name}"
    if getattr(factory, marker, False):
        return True
    wrapped = wrap(factory)
    setattr(wrapped, marker, True)
    for earlier in dir(factory):  # keep the markers of the wrappers already in place
        if earlier.startswith("_pagedserve_"):
            setattr(wrapped, earlier, True)
    server.service_handler_factory = wrapped
    return True


def replica_wrapper_class() -> type | None:
    """Serve's wrapper of a replica's actor handle, whose `send_request_python` makes the
    proxy's calls to the replica; None on a Serve without it."""
    try:
        from ray.serve._private.request_router.replica_wrapper import ActorReplicaWrapper
    except ImportError:
        return None
    return ActorReplicaWrapper


def wrap_get_node(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace `get_node`, which a starting node polls to see itself registered with the GCS,
    by `wrap(get_node)` in this process."""
    from ray._private import services

    services.get_node = wrap(services.get_node)


def current_get_node() -> Callable[..., Any]:
    from ray._private import services

    return services.get_node


def route_sigterm_handlers(keep: Callable[[Any], None]) -> None:
    """Make Ray's later setting of this process's SIGTERM handler (its main loop sets "exit
    now" just before it takes tasks) call `keep(ray_handler)` instead."""
    import ray._private.utils as ray_utils

    ray_utils.set_sigterm_handler = keep


def replica_serves_http_only() -> None:
    """Make the Serve replica in this process start no gRPC server of its own when it serves
    HTTP itself (direct ingress starts both for an ingress replica; gRPC stays on the proxy,
    `api.direct_ingress`). Call it in the replica's constructor: Serve starts the servers
    once the constructor returned. Idempotent."""
    from ray.serve._private import replica

    replica.is_grpc_enabled = _no_grpc


def _no_grpc(grpc_options: Any) -> bool:
    return False


def bound_http_responses() -> None:
    """Let an HTTP response's writer wait for the proxy in this (Router replica) process.

    Serve's replica puts each ASGI message of a response into a `MessageQueue` without bound
    (its `send` never waits) and yields what the queue holds to the proxy, that yield waiting
    while the proxy has `REPLICA_STREAM_BACKPRESSURE_OBJECTS` unread (`api.grpc.streams`). This
    makes every new queue known to the task that fills it and tells it when it was emptied,
    for `room_in_http_response`. Idempotent.
    """
    from ray.serve._private.http_util import MessageQueue

    if getattr(MessageQueue, "_pagedserve_bounded", False):
        return
    init, take = MessageQueue.__init__, MessageQueue.get_messages_nowait

    def __init__(self: Any) -> None:
        init(self)
        self._pagedserve_taken = asyncio.Event()
        _RESPONSE_QUEUE.set(self)

    def get_messages_nowait(self: Any) -> list:
        messages = take(self)
        self._pagedserve_taken.set()
        return messages

    MessageQueue.__init__ = __init__
    MessageQueue.get_messages_nowait = get_messages_nowait
    MessageQueue._pagedserve_bounded = True


async def room_in_http_response(max_queued: int) -> None:
    """Wait while the replica's queue of this task's HTTP response holds `max_queued` messages
    or more, not yet taken for the proxy; at once without `bound_http_responses` in place."""
    queue = _RESPONSE_QUEUE.get()
    taken = getattr(queue, "_pagedserve_taken", None)
    if taken is None:
        return
    while len(queue._message_queue) >= max_queued and not queue._closed:
        taken.clear()
        await taken.wait()


def detached_context() -> contextvars.Context:
    """A copy of the current context in which Ray files no call under the request being
    served.

    Ray cancels, with an async actor's call, every call submitted from its asyncio context
    (`ray.cancel(recursive=True)`, which Serve runs when a client cancels or disconnects). A
    long-lived call started there (a worker's channel, the prefix feed, the liveness polls)
    would die with the one request that happened to start it, and every other request on it
    with it; an abort sent while its request is being cancelled might not go out at all.
    """
    import ray

    context = contextvars.copy_context()
    task_id = getattr(ray._raylet, "async_task_id", None)
    if task_id is not None:
        context.run(task_id.set, None)
    return context


def detached_task(coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task:
    """`coroutine` in a task of the running loop, in a `detached_context`."""
    return asyncio.get_running_loop().create_task(coroutine, context=detached_context())


def kv_put(key: str, value: bytes, namespace: str) -> None:
    """Store `value` under `key` in the GCS's key-value store, replacing what was there: it
    outlives every actor of the app (and their restarts) until `kv_del`."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key, value, overwrite=True, namespace=namespace)


def kv_get(key: str, namespace: str) -> bytes | None:
    """What `kv_put` stored under `key`; None if nothing is."""
    from ray.experimental.internal_kv import _internal_kv_get

    return _internal_kv_get(key, namespace=namespace)


def kv_del(key: str, namespace: str) -> None:
    """Forget `key` (nothing happens if it holds nothing)."""
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(key, namespace=namespace)
