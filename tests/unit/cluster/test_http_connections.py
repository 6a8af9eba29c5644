"""The bounds on HTTP connections not serving a request, on a real uvicorn (both of its HTTP
protocols): a header deadline that closes a half-sent request while a served one goes on, and a
bound on idle connections that closes the least recently active."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
import uvicorn
from uvicorn.protocols.http import h11_impl, httptools_impl

from pagedserve.cluster import http_connections
from pagedserve.cluster.ports import free_port

PROTOCOLS = {"h11": h11_impl.H11Protocol, "httptools": httptools_impl.HttpToolsProtocol}
WAIT_S = 60.0  # a failsafe: each wait ends on the server's close or answer


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def serve(monkeypatch) -> Iterator:
    """Start uvicorn with `http` after `guard_connections` under `env`; the patches go with
    the test."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(http: str, **env: str) -> int:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        protocol = PROTOCOLS[http]
        for attribute in ("connection_made", "data_received"):
            monkeypatch.setattr(protocol, attribute, getattr(protocol, attribute))
        monkeypatch.setattr(protocol, "_pagedserve_guarded", False, raising=False)
        http_connections.guard_connections()
        # Bound and listening before uvicorn starts: a connection made meanwhile waits in the
        # backlog until uvicorn serves it.
        listening = socket.create_server(("127.0.0.1", free_port()))
        config = uvicorn.Config(app, http=http, log_level="error")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
        thread.start()
        servers.append((server, thread))
        return listening.getsockname()[1]

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(WAIT_S)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes the connection (waits for it: recv returns b"")."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def get(sock: socket.socket) -> bytes:
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    return sock.recv(4096)


@pytest.mark.parametrize("http", PROTOCOLS)
def test_a_half_sent_request_is_closed_at_its_header_deadline(serve, http):
    # Short, yet ample for a client that sends its whole request at once to be served.
    port = serve(http, **{http_connections.HEADER_TIMEOUT_ENV: "3"})
    half = connect(port)
    half.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    served = connect(port)
    assert get(served).startswith(b"HTTP/1.1 200")
    assert closed_by_server(half)
    assert get(served).startswith(b"HTTP/1.1 200")  # a kept-alive connection goes on


@pytest.mark.parametrize("http", PROTOCOLS)
def test_past_the_idle_bound_the_least_recently_active_connection_is_closed(serve, http):
    port = serve(http, **{http_connections.MAX_IDLE_ENV: "2"})
    first = connect(port)
    assert get(first).startswith(b"HTTP/1.1 200")  # then idle, kept alive
    second, third = connect(port), connect(port)  # the third is one too many
    assert closed_by_server(first)
    assert get(second).startswith(b"HTTP/1.1 200")
    assert get(third).startswith(b"HTTP/1.1 200")


def test_zero_turns_the_bounds_off(serve):
    env = {http_connections.HEADER_TIMEOUT_ENV: "0", http_connections.MAX_IDLE_ENV: "0"}
    port = serve("h11", **env)
    sockets = [connect(port) for _ in range(3)]
    sockets[0].sendall(b"GET / HTTP/1.1\r\n")
    sockets[0].sendall(b"Host: x\r\n\r\n")
    assert all(get(s).startswith(b"HTTP/1.1 200") for s in sockets[1:])
    assert sockets[0].recv(4096).startswith(b"HTTP/1.1 200")
