"""Room in Serve's gRPC proxy for calls its event loop has not taken up yet.

grpc.aio takes calls off gRPC core one at a time, on the proxy's event loop, which also runs
Serve's handler of every call already taken. A burst arrives faster than that, and gRPC core
holds the calls not yet taken in a pending queue. Past `grpc.server.max_pending_requests`
(1,000) it drops new calls at random, and every one past the hard limit (3,000)
(`RandomEarlyDetection` in gRPC's src/core/server/server.cc). A dropped call ends CANCELLED
with no details before any Python code sees it: no retry hint can be added, and Serve writes no
access log line. 1,500 unary calls sent at once lost 44-60 calls this way, each 0.04-0.4 s
after it was sent (2 CPUs); with a limit of 100 the same burst lost ~1,370.

Serve builds its gRPC server (channel args fixed at construction) before it imports our
servicer functions, so `api.grpc.wire` comes too late. `raise_pending_limit` runs earlier: it is a
Ray worker-process setup hook (`backlog_env_vars`), run when the proxy's process starts, and it
adds our limit to the options Serve builds every gRPC server with. The hook is inherited by the
processes the controller starts (proxies, Router replicas); `ROUTER_ENV_VARS` turns it off for
the Router replica and everything it starts, which build no gRPC server.

A burst past `max_pending_grpc_calls` still loses calls this way: gRPC core drops them before
they reach anything we can change.

gRPC core also bounds how long a call may wait in that queue
(`grpc.server_max_unrequested_time_in_server`, 30 s by default) and cancels it, again as a bare
CANCELLED, past that. On a loaded machine a proxy took longer than 30 s to take up a burst of
1,200 calls, and the last 135 ended this way (the gRPC API test under a busy loop). The wait is
raised to `MAX_PENDING_SECONDS`: a call held is taken up however slowly the proxy's loop turns,
and then served or refused with a retry hint by the router; the client's own deadline still
ends it sooner if it has one.
"""

from __future__ import annotations

import os

from pagedserve.workers.ray_internals import serve_grpc_server_options, setup_hook_env_var

PENDING_CALLS_ENV = "PAGEDSERVE_GRPC_MAX_PENDING_CALLS"
SETUP_HOOK = "pagedserve.cluster.api.grpc.backlog.raise_pending_limit"
_SOFT_LIMIT = "grpc.server.max_pending_requests"
_HARD_LIMIT = "grpc.server.max_pending_requests_hard_limit"
_MAX_WAIT = "grpc.server_max_unrequested_time_in_server"
_OPTION_NAMES = (_SOFT_LIMIT, _HARD_LIMIT, _MAX_WAIT)
# How long gRPC core holds a call our proxy has not taken up yet, in seconds (gRPC's own: 30).
MAX_PENDING_SECONDS = 600


def backlog_env_vars(max_pending_calls: int) -> dict[str, str]:
    """Environment of Serve's proxies that runs `raise_pending_limit` as they start."""
    return {setup_hook_env_var(): SETUP_HOOK, PENDING_CALLS_ENV: str(max_pending_calls)}


def pending_backlog_options(
    max_pending_calls: int, max_pending_s: int = MAX_PENDING_SECONDS
) -> list[tuple[str, int]]:
    """gRPC server options: hold up to `max_pending_calls` calls not yet taken up, dropping
    none below it (soft limit = hard limit: no random drops before the limit), each for up to
    `max_pending_s` seconds."""
    return [
        (_SOFT_LIMIT, max_pending_calls),
        (_HARD_LIMIT, max_pending_calls),
        (_MAX_WAIT, max_pending_s),
    ]


def raise_pending_limit() -> None:
    """Ray worker-process setup hook: add the pending-call limit from `PENDING_CALLS_ENV` to
    the options of every gRPC server Serve builds in this process. Idempotent."""
    limit = os.environ.get(PENDING_CALLS_ENV)
    if not limit:
        return
    options = serve_grpc_server_options()
    options[:] = [o for o in options if o[0] not in _OPTION_NAMES]
    options.extend(pending_backlog_options(int(limit)))
