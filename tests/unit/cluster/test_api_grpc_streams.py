"""`cancel_streams_in_flight`: a stream that ends early cancels Serve's handler while it awaits,
and the gRPC handler returns only after Serve's handler has finished."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pagedserve.cluster.grpc_streams import cancel_streams_in_flight

UNARY_STREAM = SimpleNamespace(name="UNARY_STREAM")
UNARY_UNARY = SimpleNamespace(name="UNARY_UNARY")


class FakeServeHandler:
    """Stands in for the handler Serve's proxy makes: yields messages as the 'replica' sends
    them and records how it ended (Serve cancels the replica only on CancelledError)."""

    def __init__(self, messages: int, then_wait: bool = True) -> None:
        self.messages = messages
        self.then_wait = then_wait
        self.ended_by: str | None = None
        self.finished = False

    async def __call__(self, request, context):
        try:
            for i in range(self.messages):
                await asyncio.sleep(0)  # awaiting the replica
                yield f"m{i}".encode()
            if self.then_wait:
                await asyncio.Event().wait()
            self.ended_by = "completed"
        except asyncio.CancelledError:
            self.ended_by = "cancelled while awaiting"  # Serve cancels the replica here
            raise
        except GeneratorExit:
            self.ended_by = "closed at a yield"  # Serve would leak the replica call
            raise
        finally:
            self.finished = True


class FakeContext:
    def __init__(self, block_on_write: int | None = None) -> None:
        self.written: list[bytes] = []
        self.block_on_write = block_on_write
        self.writing = asyncio.Event()

    async def write(self, message: bytes) -> None:
        self.written.append(message)
        if len(self.written) == self.block_on_write:
            self.writing.set()
            await asyncio.Event().wait()  # a slow client: cancelled while writing


def wrap(handler) -> object:
    server = SimpleNamespace(service_handler_factory=lambda service_method, streaming_type: handler)
    cancel_streams_in_flight(server)
    cancel_streams_in_flight(server)  # idempotent
    return server.service_handler_factory(service_method="/x/y", streaming_type=UNARY_STREAM)


def test_a_complete_stream_writes_every_message():
    serve_handler = FakeServeHandler(3, then_wait=False)
    context = FakeContext()
    asyncio.run(wrap(serve_handler)(b"req", context))
    assert context.written == [b"m0", b"m1", b"m2"]
    assert serve_handler.ended_by == "completed"


@pytest.mark.parametrize("cancel_while", ["writing", "waiting"])
def test_a_cancelled_stream_cancels_serve_while_it_awaits(cancel_while):
    serve_handler = FakeServeHandler(2)
    context = FakeContext(block_on_write=2 if cancel_while == "writing" else None)

    async def main():
        task = asyncio.create_task(wrap(serve_handler)(b"req", context))
        if cancel_while == "writing":
            await context.writing.wait()
        else:
            while len(context.written) < 2:
                await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The gRPC handler returned: Serve's handler must be done by then.
        assert serve_handler.finished

    asyncio.run(main())
    assert serve_handler.ended_by == "cancelled while awaiting"


def test_other_streaming_types_are_left_alone():
    handler = object()
    server = SimpleNamespace(service_handler_factory=lambda service_method, streaming_type: handler)
    cancel_streams_in_flight(server)
    assert server.service_handler_factory(service_method="/x/y", streaming_type=UNARY_UNARY) is (
        handler
    )
    plain = SimpleNamespace()
    cancel_streams_in_flight(plain)  # not Serve's server: nothing to wrap
    assert not hasattr(plain, "service_handler_factory")
