"""Bounds on the HTTP connections not serving a request, in the process whose uvicorn serves
HTTP: Serve's proxy, or the Router replica when it serves HTTP itself (`api.direct_ingress`).

uvicorn (Serve's HTTP server) gives a connection no deadline until its first response: one that
opens and sends nothing, or sends headers a byte at a time (slowloris), holds its socket and
buffers for as long as it likes, and its keep-alive timeout (Serve's is 90 s) starts only once a
response went out. `guard_connections` (run in that process, with
`sse_response.limit_send_buffers`) adds two bounds to every connection uvicorn accepts:

- **a header deadline**: a request's headers must be complete within `HEADER_TIMEOUT_ENV`
  seconds (default `HEADER_TIMEOUT_S`) of the connection opening, or of the first byte after
  the previous response; past it the connection is closed. An idle keep-alive connection that
  sends nothing is left to uvicorn's keep-alive timeout, so clients that reuse connections see
  no change;
- **a bound on connections not serving a request** (opening, reading headers, or idle between
  requests): past `MAX_IDLE_ENV` (default `MAX_IDLE_CONNECTIONS`) of them, the least recently
  active one (opened, or began its last request, longest ago) is closed as the next connection
  opens. A connection with a request in flight (a stream, however long) is never closed by
  either bound.

A deadline armed for a request whose headers then completed lapses unused; bytes of a later
request arm the next one, so a client that trickles headers is closed within at most twice the
deadline.

And one courtesy: **a lingering close**. A request refused before its body was read (413 for a
body past `max_request_bytes`, 401, ...) may be answered while the client still sends the
body; when uvicorn then closes (the client sent `Connection: close`, as urllib does), the
unread bytes make the kernel reset the connection, and a client that sends its whole body
before reading (urllib, blocking `requests`-style clients) gets `Connection reset by peer`
instead of its answer, and retries. Instead the connection is half-closed after the answer
and what the client still sends is read and dropped, up to `LINGER_MAX_BYTES` or
`LINGER_MAX_S`, whichever comes first, before the close (nginx's `lingering_close`).

0 turns a bound off. It runs inside Serve's proxy too, so it imports nothing heavy.
"""

from __future__ import annotations

import os
import time
from typing import Any

HEADER_TIMEOUT_S = 10.0
HEADER_TIMEOUT_ENV = "PAGEDSERVE_HTTP_HEADER_TIMEOUT_S"
MAX_IDLE_CONNECTIONS = 512
MAX_IDLE_ENV = "PAGEDSERVE_HTTP_MAX_IDLE_CONNECTIONS"
LINGER_MAX_BYTES = 64 << 20
LINGER_MAX_S = 30.0


def guard_connections() -> None:
    """Install both bounds on every HTTP connection uvicorn accepts in this process from now
    on, with the sizes the environment gives (see the module docstring). Idempotent."""
    from uvicorn.protocols.http import h11_impl, httptools_impl

    header_timeout_s = float(os.environ.get(HEADER_TIMEOUT_ENV, HEADER_TIMEOUT_S))
    max_idle = int(os.environ.get(MAX_IDLE_ENV, MAX_IDLE_CONNECTIONS))
    for protocol in (h11_impl.H11Protocol, httptools_impl.HttpToolsProtocol):
        if getattr(protocol, "_pagedserve_guarded", False):
            continue
        opened = protocol.connection_made
        protocol.connection_made = _guarded_open(opened, header_timeout_s, max_idle)
        protocol.data_received = _guarded_read(protocol.data_received, header_timeout_s)
        protocol._pagedserve_guarded = True


def serving(protocol: Any) -> bool:
    """Whether a connection has a request in flight (its headers read, its response not done)."""
    cycle = getattr(protocol, "cycle", None)
    return cycle is not None and not cycle.response_complete


def _guarded_open(connection_made: Any, header_timeout_s: float, max_idle: int) -> Any:
    def guarded_open(self: Any, transport: Any) -> None:
        connection_made(self, transport)
        if not isinstance(self.transport, LingeringTransport):  # once, however often guarded
            self.transport = LingeringTransport(self.transport, self)
        self._pagedserve_idle_since = time.monotonic()
        self._pagedserve_header_deadline = None
        if header_timeout_s > 0:
            _arm_header_deadline(self, header_timeout_s)
        if max_idle > 0:
            _close_the_longest_idle(self.connections, max_idle)

    return guarded_open


def _guarded_read(data_received: Any, header_timeout_s: float) -> Any:
    def guarded_read(self: Any, data: bytes) -> None:
        if isinstance(self.transport, LingeringTransport) and self.transport.lingering:
            self.transport.discard(data)  # the rest of a body already answered
            return
        if not serving(self):  # the first bytes of the next request
            self._pagedserve_idle_since = time.monotonic()
            if header_timeout_s > 0 and self._pagedserve_header_deadline is None:
                _arm_header_deadline(self, header_timeout_s)
        data_received(self, data)

    return guarded_read


def _arm_header_deadline(protocol: Any, timeout_s: float) -> None:
    protocol._pagedserve_header_deadline = protocol.loop.call_later(
        timeout_s, _header_deadline_passed, protocol, protocol.cycle
    )


def _header_deadline_passed(protocol: Any, cycle_when_armed: Any) -> None:
    """Close the connection unless a request's headers completed since the deadline was armed
    (a new cycle started)."""
    protocol._pagedserve_header_deadline = None
    if protocol.cycle is cycle_when_armed and not protocol.transport.is_closing():
        protocol.transport.close()


def _close_the_longest_idle(connections: set[Any], max_idle: int) -> None:
    idle = [c for c in connections if not serving(c) and not c.transport.is_closing()]
    if len(idle) > max_idle:
        oldest = min(idle, key=lambda c: getattr(c, "_pagedserve_idle_since", 0.0))
        oldest.transport.close()


class LingeringTransport:
    """A connection's transport whose `close`, while the client still sends the body of a
    request already answered, half-closes instead and reads the rest away (bounded): see the
    module docstring. Everything else is the transport's own."""

    def __init__(self, transport: Any, protocol: Any) -> None:
        self._transport = transport
        self._protocol = protocol
        self.lingering = False
        self._discarded = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        if self.lingering:
            return  # it ends at its own bounds, or when the client closes
        cycle = getattr(self._protocol, "cycle", None)
        body_unread = cycle is not None and cycle.response_complete and cycle.more_body
        if not body_unread or self._transport.is_closing() or not self.can_write_eof():
            self._transport.close()
            return
        self.lingering = True
        self._transport.write_eof()  # after the answer: the client sees it end
        self._transport.resume_reading()
        self._protocol.loop.call_later(LINGER_MAX_S, self._transport.close)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def discard(self, data: bytes) -> None:
        self._discarded += len(data)
        if self._discarded > LINGER_MAX_BYTES:
            self._transport.close()
