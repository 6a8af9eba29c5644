"""The pending-call room of Serve's gRPC proxy: why a burst lost calls as bare CANCELLEDs, and
the setup hook that gives the proxy's server room for them."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
from ray.serve._private import constants
from support.api_app import wait_until

from pagedserve.cluster.api.grpc.backlog import (
    _MAX_WAIT as MAX_WAIT_OPTION,
)
from pagedserve.cluster.api.grpc.backlog import (
    MAX_PENDING_SECONDS,
    PENDING_CALLS_ENV,
    SETUP_HOOK,
    backlog_env_vars,
    pending_backlog_options,
    raise_pending_limit,
)
from pagedserve.cluster.api.grpc.status import proxy_env_vars
from pagedserve.cluster.api.serve_options import ROUTER_ENV_VARS
from pagedserve.workers.ray_internals import setup_hook_env_var

METHOD = "/test.Echo/Echo"
Echo = grpc.UnaryUnaryMultiCallable


class BlockableServer:
    """A grpc.aio server on a loop of its own, whose loop a test can hold: while it is held,
    grpc.aio takes up no call, and gRPC core keeps the calls that arrive pending."""

    def __init__(self, options: list[tuple[str, int]]) -> None:
        self.loop = asyncio.new_event_loop()
        self.release = threading.Event()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.port = self._run(self._start(options))

    async def _start(self, options: list[tuple[str, int]]) -> int:
        async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return request

        handler = grpc.unary_unary_rpc_method_handler(echo)
        self.server = grpc.aio.server(options=options)
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("test.Echo", {"Echo": handler}),)
        )
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    def hold(self) -> None:
        """Block the server's loop until `release` is set."""
        self.loop.call_soon_threadsafe(self.release.wait)

    def close(self) -> None:
        self.release.set()
        self._run(self.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)


@contextmanager
def held_server(options: list[tuple[str, int]]) -> Iterator[tuple[BlockableServer, Echo]]:
    server = BlockableServer(options)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        echo = channel.unary_unary(METHOD)
        assert echo(b"warm", timeout=30) == b"warm"  # grpc.aio now waits for the next call
        server.hold()
        yield server, echo
    finally:
        channel.close()
        server.close()


def send(echo: Echo, num_calls: int) -> list[grpc.Future]:
    return [echo.future(b"x%d" % i, timeout=60) for i in range(num_calls)]


def finish(calls: list[grpc.Future]) -> None:
    for call in calls:
        call.exception(timeout=60)  # waits for the call's end, however it ends


def codes(calls: list[grpc.Future]) -> list[grpc.StatusCode]:
    return [call.code() for call in calls]


def dropped(calls: list[grpc.Future]) -> list[grpc.Future]:
    return [c for c in calls if c.done() and c.code() is grpc.StatusCode.CANCELLED]


@pytest.mark.parametrize("limit", [4, 30])
def test_a_held_server_serves_the_calls_within_the_limit_and_drops_the_rest(limit):
    # One call is taken at once (grpc.aio asked for it before its loop was held); `limit` + 1
    # wait (gRPC core drops a call when `limit` or more already wait); the rest are dropped
    # while the loop is still held, so no Python code on the server ever sees them, and the
    # client gets CANCELLED with no details (grpc fills in the code's name).
    extra = 5
    with held_server(pending_backlog_options(limit)) as (server, echo):
        calls = send(echo, limit + 2 + extra)
        wait_until(lambda: len(dropped(calls)) == extra, 30, f"{extra} dropped calls")
        server.release.set()
        finish(calls)
    assert codes(calls).count(grpc.StatusCode.OK) == limit + 2
    assert codes(calls).count(grpc.StatusCode.CANCELLED) == extra
    assert {call.details() for call in dropped(calls)} <= {"", "CANCELLED"}


def test_a_held_call_waits_as_long_as_the_options_say_and_no_longer():
    # gRPC's own bound is 30 s, past which a call nobody took up ends as a bare CANCELLED (a
    # slow proxy under load lost the tail of a burst this way); ours is MAX_PENDING_SECONDS.
    assert dict(pending_backlog_options(10))[MAX_WAIT_OPTION] == MAX_PENDING_SECONDS >= 600
    with held_server(pending_backlog_options(10, max_pending_s=1)) as (server, echo):
        calls = send(echo, 3)
        # gRPC core checks a call's age when the server takes it up, so the calls must have
        # waited past the bound before the loop turns again: this sleep is the time under
        # test (a lower bound on the wait, whatever the machine's speed), not a guess at how
        # long something takes.
        time.sleep(3)
        server.release.set()
        finish(calls)
    # One was taken before the loop was held; the two that waited past 1 s are cancelled.
    assert sorted(code.name for code in codes(calls)) == ["CANCELLED", "CANCELLED", "OK"]


# ---------------------------------------------------------------- the setup hook
@pytest.fixture
def serve_options():
    saved = list(constants.DEFAULT_GRPC_SERVER_OPTIONS)
    yield constants.DEFAULT_GRPC_SERVER_OPTIONS
    constants.DEFAULT_GRPC_SERVER_OPTIONS[:] = saved


def test_the_hook_adds_the_limit_to_serve_s_server_options_once(serve_options, monkeypatch):
    before = list(serve_options)
    monkeypatch.setenv(PENDING_CALLS_ENV, "123")
    raise_pending_limit()
    raise_pending_limit()
    assert serve_options == before + pending_backlog_options(123)
    monkeypatch.setenv(PENDING_CALLS_ENV, "77")
    raise_pending_limit()
    assert serve_options == before + pending_backlog_options(77)


def test_the_hook_does_nothing_without_a_limit(serve_options, monkeypatch):
    before = list(serve_options)
    monkeypatch.delenv(PENDING_CALLS_ENV, raising=False)
    raise_pending_limit()
    assert serve_options == before


def test_proxies_run_the_hook_and_the_router_passes_it_on_to_no_one():
    env = proxy_env_vars("127.0.0.1", 1024, 5000)
    assert env[setup_hook_env_var()] == SETUP_HOOK and env[PENDING_CALLS_ENV] == "5000"
    assert backlog_env_vars(5000).items() <= env.items()
    # Ray runs no setup hook for an empty value; the replica's env_vars override the
    # controller's, and the workers it starts inherit the replica's.
    assert ROUTER_ENV_VARS[setup_hook_env_var()] == ""
    module, _, function = SETUP_HOOK.rpartition(".")
    assert (module, function) == (raise_pending_limit.__module__, raise_pending_limit.__name__)
