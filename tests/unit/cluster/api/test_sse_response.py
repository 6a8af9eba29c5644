"""The proxy's HTTP connections keep small send buffers, so an unread stream backs up to the
router instead of into the kernel (cluster/api/sse_response.py)."""

import asyncio
import socket

import pytest
from uvicorn.protocols.http import h11_impl, httptools_impl

from pagedserve.cluster.api.sse_response import (
    SEND_BUFFER_ENV,
    _with_send_buffer,
    limit_send_buffers,
)


@pytest.mark.parametrize("protocol", [h11_impl.H11Protocol, httptools_impl.HttpToolsProtocol])
def test_both_of_uvicorn_s_http_protocols_are_wrapped_once(protocol, monkeypatch):
    original = protocol.connection_made
    monkeypatch.setattr(protocol, "connection_made", original)
    monkeypatch.setattr(protocol, "_pagedserve_send_buffer", False, raising=False)
    limit_send_buffers()
    wrapped = protocol.connection_made
    limit_send_buffers()
    assert wrapped is not original and protocol.connection_made is wrapped


def test_a_connection_keeps_the_configured_buffers(monkeypatch):
    monkeypatch.setenv(SEND_BUFFER_ENV, "8192")
    seen: dict = {}
    made = asyncio.Event()

    class Recorder(asyncio.Protocol):
        def connection_made(self, transport):
            sock = transport.get_extra_info("socket")
            seen["sndbuf"] = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            seen["high_water"] = transport.get_write_buffer_limits()[1]
            made.set()

    Recorder.connection_made = _with_send_buffer(Recorder.connection_made, 8192)

    async def accept_one():
        server = await asyncio.get_running_loop().create_server(Recorder, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        await made.wait()
        writer.close()
        server.close()

    asyncio.run(accept_one())
    assert seen == {"sndbuf": 2 * 8192, "high_water": 8192}  # the kernel doubles what is set
