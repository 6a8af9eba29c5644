"""The last word on every `pagedserve.v1.Generation` status, inside Serve's gRPC proxy.

Two things can only be done here, after Serve's handler has set the call's final status:

- **A retry hint on every refusal.** A replica sets trailing metadata on its own copy of the
  gRPC context, which Serve copies to the call only together with a response message; a stream
  refused before its first message (and Serve's own `BackPressureError`) would reach the client
  without `retry-after`. So a refusal's details end with `(retry after N s)` (see
  `with_retry_hint`), and this module turns that into the `retry-after` trailer.
- **No internals in a status.** When the Router replica dies mid-call, or Serve fails in a way
  nobody foresaw, Serve puts `str(exception)` in the details: a traceback, file paths, the
  node's IP, pids and actor ids. Such a status is logged here with an incident id and replaced:
  a lost replica by UNAVAILABLE (the client may retry), anything else by INTERNAL with the id.
  Statuses the replica set itself (our `ApiError`s) pass unchanged.

- **Only the interface `--host` names.** Serve's proxy binds `[::]` whatever the HTTP host is.
  When pagedserve serves on a loopback host, a call from any other address is refused with
  PERMISSION_DENIED before it reaches a replica (the proxy learns the host from
  `GRPC_HOST_ENV`, see `proxy_env_vars`). A non-loopback host cannot be told apart from the
  call alone, so there every address is served: firewall the port.

`finish_statuses` wraps the handler factory of Serve's proxy the way `api.grpc.streams` does; it
runs inside the proxy actor, so it imports only grpc.
"""

from __future__ import annotations

import inspect
import ipaddress
import logging
import os
import re
import urllib.parse
import uuid
from collections.abc import Callable
from typing import Any

import grpc

from pagedserve.cluster.api.grpc.backlog import backlog_env_vars
from pagedserve.workers.ray_internals import wrap_grpc_handlers

logger = logging.getLogger(__name__)

RETRY_AFTER_KEY = "retry-after"
GRPC_HOST_ENV = "PAGEDSERVE_GRPC_HOST"
SERVE_MAX_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"
_RETRY_HINT = re.compile(r" \(retry after (\d+) s\)$")
# How Ray words a lost actor (ActorDiedError, ActorUnavailableError, RayActorError).
_REPLICA_LOST = re.compile(
    r"ActorDiedError|ActorUnavailableError|RayActorError|actor died|actor is unavailable"
    r"|actor is dead",
    re.IGNORECASE,
)
# Details our replica writes itself for INTERNAL (see `api.errors.internal_error`).
_OWN_INTERNAL = ("internal error (incident ", "the engine step serving this request failed")
REPLICA_LOST_DETAILS = "the router replica serving this request was lost; retry the request"


def with_retry_hint(message: str, retry_after: str) -> str:
    """`message` with the retry hint this module turns into the `retry-after` trailer."""
    return f"{message} (retry after {retry_after} s)"


def proxy_env_vars(host: str, max_request_bytes: int, max_pending_calls: int) -> dict[str, str]:
    """Environment of Serve's proxies (`serve.start(controller_options=...)`: proxies inherit
    the controller's): the gRPC message limit, enforced by gRPC before any parsing, the host
    this module restricts calls to, and the room for calls not yet taken up (`api.grpc.backlog`)."""
    return {
        SERVE_MAX_MESSAGE_ENV: str(max_request_bytes),
        GRPC_HOST_ENV: host,
        **backlog_env_vars(max_pending_calls),
    }


def is_loopback(host: str) -> bool:
    """`localhost`, 127.0.0.0/8, ::1, and IPv4 loopback mapped into IPv6 (`::ffff:127.0.0.1`,
    how a socket bound to `[::]` sees an IPv4 client)."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def peer_is_loopback(peer: str) -> bool:
    """For a grpc peer string: `ipv4:127.0.0.1:5000`, `ipv6:[::1]:5000` (gRPC percent-encodes
    the brackets: `ipv6:%5B::1%5D:5000`), `unix:...`."""
    kind, _, address = urllib.parse.unquote(peer).partition(":")
    if kind == "unix":
        return True
    host = address.rsplit(":", 1)[0]
    return is_loopback(host)


def finish_statuses(server: Any) -> None:
    """Wrap the handlers Serve's proxy makes (for every service registered after this) so
    that each call's final status gets its retry trailer and loses any internals. Idempotent;
    a server without Serve's handler factory is left alone."""
    wrap_grpc_handlers(server, "statuses", _finishing_statuses)


def _finishing_statuses(factory: Callable) -> Callable:
    def wrapped_factory(service_method: str, streaming_type: Any) -> Callable:
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        return _finishing(handler)

    return wrapped_factory


def _finishing(handler: Callable) -> Callable:
    """`handler` of the same kind (grpc.aio tells kinds apart by the function's type), with
    `finish_status` run on its context once it ends, however it ends."""
    loopback_only = is_loopback(os.environ.get(GRPC_HOST_ENV, ""))
    if inspect.isasyncgenfunction(handler):

        async def stream(request: Any, context: Any) -> Any:
            if loopback_only and _refuse_remote(context):
                return
            try:
                async for message in handler(request, context):
                    yield message
            finally:
                finish_status(context)

        return stream

    async def call(request: Any, context: Any) -> Any:
        if loopback_only and _refuse_remote(context):
            return b""
        try:
            return await handler(request, context)
        finally:
            finish_status(context)

    return call


def _refuse_remote(context: Any) -> bool:
    """PERMISSION_DENIED for a call from outside this machine, when serving on loopback."""
    if peer_is_loopback(context.peer() or ""):
        return False
    context.set_code(grpc.StatusCode.PERMISSION_DENIED)
    context.set_details("this server takes calls from its own machine only (--host)")
    return True


def finish_status(context: Any) -> None:
    """Add the retry trailer a refusal asks for; replace a status that leaks internals."""
    code = _status_code(context)
    details = context.details() or ""
    if isinstance(details, bytes):
        details = details.decode("utf-8", "replace")
    if code is None or code is grpc.StatusCode.OK:
        return
    if hint := _RETRY_HINT.search(details):
        _add_trailer(context, RETRY_AFTER_KEY, hint.group(1))
    elif code is grpc.StatusCode.RESOURCE_EXHAUSTED:  # Serve's own queue refused the call
        _add_trailer(context, RETRY_AFTER_KEY, "1")
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) and not details.startswith(
        _OWN_INTERNAL
    ):
        incident = uuid.uuid4().hex[:12]
        logger.error("gRPC call failed, incident %s: %s %s", incident, code, details)
        if _REPLICA_LOST.search(details):
            context.set_code(grpc.StatusCode.UNAVAILABLE)
            context.set_details(f"{REPLICA_LOST_DETAILS} (incident {incident})")
        else:
            context.set_code(grpc.StatusCode.INTERNAL)
            context.set_details(f"internal error (incident {incident})")


def _status_code(context: Any) -> grpc.StatusCode | None:
    """The code set on a grpc.aio context (it may hold the enum or its integer)."""
    code = context.code()
    if code is None or isinstance(code, grpc.StatusCode):
        return code
    return next((c for c in grpc.StatusCode if c.value[0] == code), None)


def _add_trailer(context: Any, key: str, value: str) -> None:
    getter = getattr(context, "trailing_metadata", None)
    existing = [(k, v) for k, v in (getter() if getter else None) or () if k != key]
    context.set_trailing_metadata(tuple(existing) + ((key, value),))
