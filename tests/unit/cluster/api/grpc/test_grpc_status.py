"""The proxy-side status finisher: retry trailers, no internals, loopback-only serving."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagedserve.cluster.api.grpc.status import (
    REPLICA_LOST_DETAILS,
    _finishing,
    finish_status,
    is_loopback,
    peer_is_loopback,
    with_retry_hint,
)


class FakeContext:
    """The part of a grpc.aio servicer context the finisher uses."""

    def __init__(self, code=None, details="", peer="ipv4:127.0.0.1:5000"):
        self._code, self._details, self._peer = code, details, peer
        self._trailers: tuple = (("request_id", "r1"),)

    def code(self):
        return self._code

    def details(self):
        return self._details

    def set_code(self, code):
        self._code = code

    def set_details(self, details):
        self._details = details

    def trailing_metadata(self):
        return self._trailers

    def set_trailing_metadata(self, trailers):
        self._trailers = tuple(trailers)

    def peer(self):
        return self._peer


def test_a_refusal_gets_its_retry_trailer_and_keeps_the_others():
    context = FakeContext(
        grpc.StatusCode.RESOURCE_EXHAUSTED, with_retry_hint("the router streams its limit", "3")
    )
    finish_status(context)
    assert dict(context.trailing_metadata()) == {"request_id": "r1", "retry-after": "3"}
    assert context.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_serve_s_own_refusal_gets_a_default_retry_trailer():
    context = FakeContext(grpc.StatusCode.RESOURCE_EXHAUSTED, "Request dropped due to backpressure")
    finish_status(context)
    assert dict(context.trailing_metadata())["retry-after"] == "1"


def test_a_lost_replica_becomes_unavailable_without_internals():
    details = (
        "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task."
        " (pid=1234, ip=10.0.0.5, actor_id=c45125cc) Traceback (most recent call last): ..."
    )
    context = FakeContext(grpc.StatusCode.INTERNAL, details)
    finish_status(context)
    assert context.code() is grpc.StatusCode.UNAVAILABLE
    assert context.details().startswith(REPLICA_LOST_DETAILS)
    assert "pid" not in context.details() and "10.0.0.5" not in context.details()


def test_an_unforeseen_internal_error_keeps_only_an_incident_id():
    context = FakeContext(grpc.StatusCode.UNKNOWN, 'Traceback ... File "/x/y.py", line 3')
    finish_status(context)
    assert context.code() is grpc.StatusCode.INTERNAL
    assert context.details().startswith("internal error (incident ")
    assert ".py" not in context.details()


def test_statuses_the_replica_set_itself_pass_unchanged():
    for code, details in [
        (grpc.StatusCode.INTERNAL, "internal error (incident abc123)"),
        (grpc.StatusCode.INVALID_ARGUMENT, "temperature must be >= 0, got -1"),
        (grpc.StatusCode.OK, ""),
        (None, ""),
    ]:
        context = FakeContext(code, details)
        finish_status(context)
        assert (context.code(), context.details()) == (code, details)
        assert dict(context.trailing_metadata()) == {"request_id": "r1"}


@pytest.mark.parametrize(
    ("peer", "loopback"),
    [
        ("ipv4:127.0.0.1:5000", True),
        ("ipv4:127.0.3.4:1", True),
        ("ipv6:[::1]:5000", True),
        ("ipv6:%5B::1%5D:5000", True),
        ("ipv6:%5B::1%5D:44608", True),  # what grpc really reports for `localhost` -> ::1
        ("ipv6:%5B::ffff:127.0.0.1%5D:40000", True),
        ("ipv6:%5B::ffff:192.0.2.7%5D:40000", False),
        ("ipv6:%5B2001:db8::1%5D:443", False),
        ("unix:/tmp/s", True),
        ("ipv4:192.0.2.7:5000", False),
        ("ipv6:[2001:db8::1]:443", False),
        ("", False),
    ],
)
def test_peer_is_loopback(peer, loopback):
    assert peer_is_loopback(peer) is loopback


def test_loopback_hosts():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("my-host")


def test_on_a_loopback_host_a_call_from_elsewhere_is_refused(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_GRPC_HOST", "127.0.0.1")
    calls = []

    async def handler(request, context):
        calls.append(request)
        return b"ok"

    wrapped = _finishing(handler)
    remote = FakeContext(peer="ipv4:192.0.2.7:5000")
    assert asyncio.run(wrapped("r", remote)) == b""
    assert remote.code() is grpc.StatusCode.PERMISSION_DENIED and calls == []
    assert asyncio.run(wrapped("r", FakeContext())) == b"ok" and calls == ["r"]


def test_a_streaming_handler_stays_a_streaming_handler_and_is_finished():
    async def handler(request, context):
        yield b"a"
        context.set_code(grpc.StatusCode.INTERNAL)
        context.set_details("boom at /srv/app.py line 3")

    wrapped = _finishing(handler)
    context = FakeContext()

    async def drain():
        return [m async for m in wrapped("r", context)]

    assert asyncio.run(drain()) == [b"a"]
    assert context.details().startswith("internal error (incident ")
