"""`cancel_streams_in_flight`: a stream that ends early cancels Serve's handler while it awaits,
the gRPC handler returns only after Serve's handler has finished, and a client that stops
reading stops the pulling at a bounded buffer (and can still cancel). `bound_replica_streams`:
Serve's streaming calls to replicas carry Ray's generator backpressure."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import pytest

from pagedserve.cluster.api.grpc import streams as grpc_streams
from pagedserve.cluster.api.grpc.streams import cancel_streams_in_flight

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
        self.yielded = 0

    async def __call__(self, request, context):
        try:
            for i in range(self.messages):
                await asyncio.sleep(0)  # awaiting the replica
                self.yielded += 1
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
    cancel_streams_in_flight(server, bound_replicas=False)
    cancel_streams_in_flight(server, bound_replicas=False)  # idempotent
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
    cancel_streams_in_flight(server, bound_replicas=False)
    assert server.service_handler_factory(service_method="/x/y", streaming_type=UNARY_UNARY) is (
        handler
    )
    plain = SimpleNamespace()
    cancel_streams_in_flight(plain, bound_replicas=False)  # not Serve's server: nothing to wrap
    assert not hasattr(plain, "service_handler_factory")


async def turns(n: int = 200) -> None:
    """Let every task run `n` more loop turns (no wall-clock time involved)."""
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.mark.parametrize("cancel", [False, True])
def test_an_unread_stream_stops_pulling_at_its_bound_and_can_still_cancel(cancel):
    serve_handler = FakeServeHandler(1000)
    context = FakeContext(block_on_write=1)  # the client reads nothing: the first write blocks
    bounded = grpc_streams._driven_in_a_task(serve_handler, max_buffered=4)

    async def main():
        task = asyncio.create_task(bounded(b"req", context))
        await context.writing.wait()
        await turns()
        # One message in the blocked write, four waiting: Serve's handler is not pulled on.
        assert serve_handler.yielded == 5 and not serve_handler.finished
        if cancel:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert serve_handler.finished
        else:
            task.cancel()  # tidy up below
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    # Cancelled while the pump waited for room, Serve's handler still ends in its await.
    assert serve_handler.ended_by == "cancelled while awaiting"


def test_a_slow_reader_gets_every_message_in_order():
    serve_handler = FakeServeHandler(50, then_wait=False)
    context = FakeContext()
    asyncio.run(grpc_streams._driven_in_a_task(serve_handler, max_buffered=3)(b"req", context))
    assert context.written == [f"m{i}".encode() for i in range(50)]
    assert serve_handler.ended_by == "completed"


class FakeMethod:
    def __init__(self) -> None:
        self.options_seen: list[dict] = []

    def options(self, **options):
        self.options_seen.append(options)
        return self

    def remote(self, *args, **kwargs):
        return ("called", args)


def test_replica_streaming_calls_carry_generator_backpressure():
    from ray.serve._private.request_router.replica_wrapper import ActorReplicaWrapper

    streaming, rejection, unary = FakeMethod(), FakeMethod(), FakeMethod()
    handle = SimpleNamespace(
        handle_request_streaming=streaming,
        handle_request_with_rejection=rejection,
        handle_request=unary,
    )
    grpc_streams.bound_replica_streams(7)
    grpc_streams.bound_replica_streams(7)  # idempotent
    wrapper = ActorReplicaWrapper(handle)
    request = SimpleNamespace(metadata=SimpleNamespace(is_streaming=True), args=(), kwargs={})
    for with_rejection in (False, True):
        # Serve wraps our fake result and may choke on it; only the options matter here.
        with contextlib.suppress(Exception):
            wrapper.send_request_python(request, with_rejection=with_rejection)
    expected = {"num_returns": "streaming", "_generator_backpressure_num_objects": 7}
    assert streaming.options_seen == [expected] and rejection.options_seen == [expected]
    assert wrapper._actor_handle is handle  # the wrapper itself is left as it was
