"""The bounds on HTTP connections not serving a request, on a real uvicorn (both of its HTTP
protocols): a header deadline that closes a half-sent request while a served one goes on, and a
bound on idle connections that closes the least recently active."""

from __future__ import annotations

import socket
import threading
import urllib.request
from collections.abc import Iterator

import pytest
import uvicorn
from uvicorn.protocols.http import h11_impl, httptools_impl

from pagedserve.cluster.api import http_connections
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
        for protocol in PROTOCOLS.values():  # the guard patches both
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
    """One whole response to a GET: the app's answer is chunked (it sets no length), so it
    ends with the last chunk; one `recv` may hold only its start."""
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    response = b""
    while not response.endswith(b"0\r\n\r\n"):
        data = sock.recv(4096)
        if not data:
            break  # closed: what came is the answer
        response += data
    return response


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


def urllib_post(port: int, size: int) -> tuple[int, bytes]:
    """POST `size` bytes as urllib does: `Connection: close`, the whole body sent before the
    answer is read."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/", data=b"x" * size)
    with urllib.request.urlopen(request, timeout=WAIT_S) as response:
        return response.status, response.read()


@pytest.mark.parametrize("http", PROTOCOLS)
def test_a_client_that_sends_its_whole_body_first_reads_an_early_answer(serve, http):
    """The app answers without reading the body; the 10 MB still being sent are read away."""
    port = serve(http)
    assert urllib_post(port, 10 << 20) == (200, b"ok")
    assert urllib_post(port, 10 << 20) == (200, b"ok")


@pytest.mark.parametrize("http", PROTOCOLS)
def test_the_rest_of_an_answered_body_is_read_only_up_to_a_bound(serve, http, monkeypatch):
    monkeypatch.setattr(http_connections, "LINGER_MAX_BYTES", 1 << 20)
    port = serve(http)
    sock = connect(port)
    sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n")
    sock.sendall(b"Content-Length: 1000000000\r\n\r\n")
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        for _ in range(1000):  # 1 GB, the body it declared: the server stops reading first
            sock.sendall(b"x" * (1 << 20))


@pytest.mark.parametrize("http", PROTOCOLS)
def test_a_client_that_stops_sending_is_closed_at_the_linger_bound(serve, http, monkeypatch):
    monkeypatch.setattr(http_connections, "LINGER_MAX_S", 2.0)
    lost = threading.Event()  # the server's side of the connection ended
    connection_lost = PROTOCOLS[http].connection_lost

    def record_loss(protocol, error) -> None:
        lost.set()
        connection_lost(protocol, error)

    monkeypatch.setattr(PROTOCOLS[http], "connection_lost", record_loss)
    port = serve(http)
    sock = connect(port)
    sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n")
    sock.sendall(b"Content-Length: 1000\r\n\r\nxx")  # and never the rest
    answer = b""
    while chunk := sock.recv(4096):  # the answer, then the server's half-close
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"\r\nok\r\n0\r\n\r\n")
    assert not lost.is_set()  # still reading what the client may send
    assert lost.wait(WAIT_S)  # until the bound; the client never closed its side
