"""The router's side of the channels, without Ray (`cluster/router/worker_channel.py`): a worker's
batches are demultiplexed into one bounded buffer per request (a message may come before its
submit returns); an unread request is paused on its worker and resumed at half; a lagging
reader gets a branch's deltas merged; a lost channel or a hung worker ends every stream on
it; a leg left early is aborted once admitted, a refused one never."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from pagedserve.cluster.router.worker_channel import WorkerChannels
from pagedserve.cluster.router.worker_state import WorkerState
from pagedserve.workers.protocol.errors import HandedOff, Overloaded, WorkerLost
from pagedserve.workers.protocol.requests import WorkerRequest
from pagedserve.workers.protocol.sampling import SamplingParams
from pagedserve.workers.protocol.stream import RequestFailed, StepBatch, StreamDelta


def _method(fn) -> Any:
    return type("Method", (), {"remote": staticmethod(fn)})()


class FakeWorker:
    """A worker handle: its channel sends what `send` is given (a batch, or an error to
    raise), its submit waits for `admit` (or raises `refuse`), and it records the pauses and
    aborts it is asked for."""

    def __init__(self) -> None:
        self.sent: asyncio.Queue = asyncio.Queue()
        self.admit = asyncio.Event()
        self.admit.set()
        self.refuse: Exception | None = None
        self.channels_opened = 0
        self.flow: list[tuple[str, bool, int]] = []
        self.aborted: list[str] = []
        self.channel = _method(self._channel)
        self.submit = _method(self._submit)
        self.set_paused = _method(
            lambda request_id, paused, seq: self.flow.append((request_id, paused, seq))
        )
        self.abort = _method(lambda request_id: _ready(self.aborted.append(request_id)))

    def send(self, *messages: StreamDelta | RequestFailed) -> None:
        self.sent.put_nowait(StepBatch("w0", tuple(messages)))

    async def _channel(self, owner_id: str, lane=None):  # connects no lane: all through here
        self.channels_opened += 1
        while True:
            item = await self.sent.get()
            if isinstance(item, Exception):
                raise item
            yield _ready(item)  # the router awaits each ref for its batch

    async def _submit(self, request: WorkerRequest) -> None:
        await self.admit.wait()
        if self.refuse is not None:
            raise self.refuse


async def _ready(value: Any) -> Any:
    return value


def delta(request_id: str, token: int, finish: str | None = None) -> StreamDelta:
    return StreamDelta(request_id, 0, [token], f"<{token}>", finish_reason=finish)


def leg(request_id: str) -> WorkerRequest:
    return WorkerRequest.fresh(request_id, [1, 2, 3], SamplingParams(max_tokens=8))


def setup(capacity: int = 64) -> tuple[WorkerChannels, WorkerState, FakeWorker]:
    handle = FakeWorker()
    return WorkerChannels("router", capacity), WorkerState("w0", handle, alive=True), handle


def test_a_batch_goes_to_each_request_s_stream_even_before_its_submit_returns():
    async def main():
        channels, worker, handle = setup()
        handle.admit.clear()  # the submits have not returned yet
        a, b = channels.open(worker, "a"), channels.open(worker, "b")
        a.submit(leg("a"))
        b.submit(leg("b"))
        handle.send(delta("a", 1), delta("b", 7), delta("gone", 9))  # "gone": ended already
        first = [await a.next(), await b.next()]
        handle.admit.set()
        handle.send(delta("a", 2, "length"), delta("b", 8, "stop"))
        last = [await a.next(), await b.next()]
        a.close(open_on_worker=False)
        b.close(open_on_worker=False)
        channels.close()
        return first, last, handle

    first, last, handle = asyncio.run(main())
    assert [(d.request_id, d.token_ids) for d in first] == [("a", [1]), ("b", [7])]
    assert [(d.token_ids, d.finish_reason) for d in last] == [([2], "length"), ([8], "stop")]
    assert handle.channels_opened == 1 and handle.aborted == []  # one channel for both


def test_an_unread_request_is_paused_on_its_worker_and_resumed_at_half():
    async def main():
        channels, worker, handle = setup(capacity=4)
        stream = channels.open(worker, "r")
        stream.submit(leg("r"))
        handle.send(*(delta("r", t) for t in range(6)))
        await _until(lambda: len(stream.buffer) == 6)
        paused = list(handle.flow)
        tokens = [(await stream.next()).token_ids for _ in range(4)]  # one at a time: cap 4
        resumed = list(handle.flow)
        stream.close(open_on_worker=True)
        await asyncio.sleep(0)
        channels.close()
        return paused, tokens, resumed, handle.aborted

    paused, tokens, resumed, aborted = asyncio.run(main())
    assert paused == [("r", True, 1)]  # once, when the 4th message came in unread
    assert tokens == [[0], [1], [2], [3]]
    assert resumed == [("r", True, 1), ("r", False, 2)]  # at 2 left unread: half of 4
    assert aborted == ["r"]  # left before its end: aborted on the worker


def test_a_lagging_reader_gets_a_branch_s_waiting_deltas_as_one_message():
    async def main():
        channels, worker, handle = setup(capacity=64)  # merges up to 64 // 8 = 8 deltas
        stream = channels.open(worker, "r")
        stream.submit(leg("r"))
        handle.send(*(delta("r", t) for t in range(9)), delta("r", 9, "length"))
        await _until(lambda: len(stream.buffer) == 10)
        messages = [await stream.next() for _ in range(2)]
        stream.close(open_on_worker=False)
        channels.close()
        return messages

    messages = asyncio.run(main())
    assert [m.token_ids for m in messages] == [list(range(8)), [8, 9]]  # at most 8 a message
    assert messages[0].text == "".join(f"<{t}>" for t in range(8))
    assert messages[-1].finish_reason == "length"


def test_a_lost_channel_ends_every_stream_on_it_and_the_next_leg_reopens_it():
    async def main():
        channels, worker, handle = setup()
        a, b = channels.open(worker, "a"), channels.open(worker, "b")
        a.submit(leg("a"))
        b.submit(leg("b"))
        handle.send(delta("a", 1))
        handle.sent.put_nowait(ActorDiedError())
        got = await a.next()
        for stream in (a, b):
            with pytest.raises(ActorDiedError):
                await stream.next()
            worker.alive = False  # its channel ended: nothing is aborted on a dead worker
            stream.close(open_on_worker=True)
        await asyncio.sleep(0)
        worker.alive = True  # restarted
        again = channels.open(worker, "c")
        await _until(lambda: handle.channels_opened == 2)
        again.close(open_on_worker=False)
        channels.close()
        return got, handle

    got, handle = asyncio.run(main())
    assert got.token_ids == [1] and handle.channels_opened == 2 and handle.aborted == []


def test_a_hung_worker_s_streams_end_as_lost():
    async def main():
        channels, worker, handle = setup()
        stream = channels.open(worker, "r")
        stream.submit(leg("r"))
        worker.stalled = True
        channels.worker_hung(worker)  # what the liveness poll calls
        with pytest.raises(WorkerLost, match="w0 stalled mid-stream"):
            await stream.next()
        stream.close(open_on_worker=True)
        await asyncio.sleep(0)
        channels.close()
        return handle.aborted

    assert asyncio.run(main()) == ["r"]  # alive: its blocks are freed by an abort


def test_a_request_failed_message_raises_its_error_in_the_reader():
    async def main():
        channels, worker, handle = setup()
        stream = channels.open(worker, "r")
        stream.submit(leg("r"))
        handle.send(delta("r", 1), RequestFailed("r", HandedOff("w0 drained")))
        first = await stream.next()
        with pytest.raises(HandedOff, match="w0 drained"):
            await stream.next()
        stream.close(open_on_worker=True)
        channels.close()
        return first

    assert asyncio.run(main()).token_ids == [1]


def test_a_leg_left_early_is_aborted_once_admitted_and_a_refused_one_never():
    async def main():
        channels, worker, handle = setup()
        handle.admit.clear()
        pending = channels.open(worker, "pending")
        pending.submit(leg("pending"))
        await asyncio.sleep(0)
        pending.close(open_on_worker=True)  # the client left while the submit was on its way
        await asyncio.sleep(0.01)
        before_admission = list(handle.aborted)
        handle.admit.set()
        await _until(lambda: handle.aborted)
        handle.refuse = Overloaded("full", 0.5)
        refused = channels.open(worker, "refused")
        refused.submit(leg("refused"))
        with pytest.raises(Overloaded, match="full"):
            await refused.next()
        refused.close(open_on_worker=True)
        await asyncio.sleep(0.01)
        channels.close()
        return before_admission, handle.aborted

    before_admission, aborted = asyncio.run(main())
    assert before_admission == [] and aborted == ["pending"]


async def _until(condition, deadline_s: float = 10.0) -> None:
    end = asyncio.get_running_loop().time() + deadline_s
    while not condition():
        assert asyncio.get_running_loop().time() < end, "timed out"
        await asyncio.sleep(0.001)


def test_a_leg_left_on_a_worker_dropped_from_routing_is_still_aborted():
    """The liveness poll may drop a worker that answers late (a loaded machine) while its
    channel still streams: the request runs on there, so leaving it must abort it."""

    async def main():
        channels, worker, handle = setup()
        stream = channels.open(worker, "r")
        stream.submit(leg("r"))
        handle.send(delta("r", 1))
        await stream.next()
        worker.alive = False  # dropped: not routable, but its channel reads on
        stream.close(open_on_worker=True)
        await _until(lambda: handle.aborted)
        channels.close()
        return handle.aborted

    assert asyncio.run(main()) == ["r"]


def test_numbered_batches_reach_their_streams_in_the_worker_s_order():
    """A lane's channel: a batch through Ray (one holding a `RequestMoved`) may come before the
    lane's batches sent ahead of it; each waits for those before it. Unnumbered: at once."""
    from pagedserve.cluster.router.worker_channel import _InOrder

    class Stream:
        def __init__(self) -> None:
            self.got: list[int] = []

        def put(self, message: StreamDelta) -> None:
            self.got.append(message.token_ids[0])

    stream = Stream()
    in_order = _InOrder({"r1": stream})

    def numbered(seq: int, token: int) -> StepBatch:
        return StepBatch("w0", (delta("r1", token),), seq=seq)

    in_order.put(numbered(3, 30))
    assert stream.got == []
    in_order.put(numbered(1, 10))
    assert stream.got == [10]
    in_order.put(StepBatch("w0", (delta("gone", 99),), seq=2))  # a leg that ended: skipped
    assert stream.got == [10, 30]
    in_order.put(StepBatch("w0", (delta("r1", 7),)))
    assert stream.got == [10, 30, 7]
