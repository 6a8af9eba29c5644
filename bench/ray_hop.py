"""What one message from one actor to another costs in CPU, by transport.

    pagedserve bench ray-hop --messages 300 --period-ms 34.5 --repeats 3

A worker streams each engine step's messages to its router as one `StepBatch`: at a low load,
one message per token. This sends the same message (a `StepBatch` holding a one-token
`StreamDelta`) from a producer actor to a consumer actor, one every `--period-ms`, three ways:

- `ray-stream`: a streaming generator call, as `Worker.channel` is (the producer yields);
- `ray-call`: one actor call per message (the consumer asks, the producer answers);
- `socket`: length-prefixed pickles over one TCP connection between the two actors.

Each process's CPU (`time.process_time` inside it: every thread of it) is read before and
after each run and, over `--idle-s` before the runs, with nothing sent: the figures are CPU-ms
per message above that idle floor. Transports alternate within each repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import statistics
import struct
import time
from dataclasses import asdict, dataclass

from pagedserve.workers.protocol.stream import StepBatch, StreamDelta

TRANSPORTS = ("ray-stream", "ray-call", "socket")
_FRAME = struct.Struct("!I")


def step_batch(index: int) -> StepBatch:
    """One engine step's message of one request: a token and its text."""
    delta = StreamDelta(request_id="bench-0", index=0, token_ids=[index % 1000], text=" tok")
    return StepBatch(worker_id="worker-0", messages=(delta,))


@dataclass(frozen=True)
class HopRun:
    """One run of one transport: CPU-ms per message above the idle floor, both ends."""

    transport: str
    messages: int
    wall_s: float
    consumer_ms: float
    producer_ms: float


def per_message_ms(cpu_s: float, floor_per_s: float, wall_s: float, messages: int) -> float:
    """A process's CPU over a run, less its idle floor over the run's length, per message."""
    return (cpu_s - floor_per_s * wall_s) * 1e3 / messages


class Producer:
    def cpu_s(self) -> float:
        return time.process_time()

    async def stream(self, messages: int, period_s: float):
        for i in range(messages):
            await asyncio.sleep(period_s)
            yield step_batch(i)

    async def next_message(self, index: int, period_s: float) -> StepBatch:
        await asyncio.sleep(period_s)
        return step_batch(index)

    async def send(self, port: int, messages: int, period_s: float) -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        for i in range(messages):
            await asyncio.sleep(period_s)
            body = pickle.dumps(step_batch(i))
            writer.write(_FRAME.pack(len(body)) + body)
            await writer.drain()
        writer.close()
        await writer.wait_closed()


class Consumer:
    def cpu_s(self) -> float:
        return time.process_time()

    async def read_stream(self, producer, messages: int, period_s: float) -> int:
        got = 0
        async for ref in producer.stream.options(num_returns="streaming").remote(
            messages, period_s
        ):
            got += len((await ref).messages)
        return got

    async def read_calls(self, producer, messages: int, period_s: float) -> int:
        got = 0
        for i in range(messages):
            got += len((await producer.next_message.remote(i, period_s)).messages)
        return got

    async def read_socket(self, producer, messages: int, period_s: float) -> int:
        received: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            got = 0
            while True:
                try:
                    (size,) = _FRAME.unpack(await reader.readexactly(_FRAME.size))
                except asyncio.IncompleteReadError:
                    break
                got += len(pickle.loads(await reader.readexactly(size)).messages)
            writer.close()
            received.set_result(got)

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            await producer.send.remote(port, messages, period_s)
            return await received


_READERS = {"ray-stream": "read_stream", "ray-call": "read_calls", "socket": "read_socket"}


def run_hops(messages: int, period_s: float, repeats: int, idle_s: float) -> list[HopRun]:
    """Every transport `repeats` times, alternated, on one producer and one consumer actor
    (a local Ray started here if this process has none)."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False)
    producer = ray.remote(num_cpus=0)(Producer).remote()
    consumer = ray.remote(num_cpus=0)(Consumer).remote()
    ends = (consumer, producer)
    ray.get(consumer.read_stream.remote(producer, 3, 0.0))  # both started, paths warm
    before = ray.get([end.cpu_s.remote() for end in ends])
    time.sleep(idle_s)
    after = ray.get([end.cpu_s.remote() for end in ends])
    floors = [(a - b) / idle_s for a, b in zip(after, before, strict=True)]
    runs = []
    for _ in range(repeats):
        for transport in TRANSPORTS:
            before = ray.get([end.cpu_s.remote() for end in ends])
            start = time.monotonic()
            reader = getattr(consumer, _READERS[transport])
            got = ray.get(reader.remote(producer, messages, period_s))
            wall_s = time.monotonic() - start
            after = ray.get([end.cpu_s.remote() for end in ends])
            if got != messages:
                raise RuntimeError(f"{transport}: {got} of {messages} messages arrived")
            used = [a - b for a, b in zip(after, before, strict=True)]
            costs = [
                per_message_ms(cpu, floor, wall_s, messages)
                for cpu, floor in zip(used, floors, strict=True)
            ]
            runs.append(HopRun(transport, messages, wall_s, *costs))
    for end in ends:
        ray.kill(end)
    return runs


def summary_lines(runs: list[HopRun]) -> list[str]:
    """Per transport: CPU-ms per message at each end, median (min-max) over its runs."""

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

    lines = [f"{'transport':<12} {'consumer CPU-ms/msg':<24} producer CPU-ms/msg"]
    for transport in TRANSPORTS:
        mine = [r for r in runs if r.transport == transport]
        if mine:
            consumer = spread([r.consumer_ms for r in mine])
            lines.append(f"{transport:<12} {consumer:<24} {spread([r.producer_ms for r in mine])}")
    return lines


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "ray-hop",
        help="CPU per message from one actor to another: Ray stream, Ray call, socket",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--messages", type=int, default=300, help="messages per run")
    parser.add_argument(
        "--period-ms", type=float, default=34.5, help="between messages (34.5: ~29 a second)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per transport")
    parser.add_argument("--idle-s", type=float, default=10.0, help="the idle floor's window")
    parser.add_argument("--json", metavar="FILE", help="every run, as JSON")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.messages < 1 or args.repeats < 1 or args.period_ms < 0 or args.idle_s <= 0:
        raise SystemExit("--messages and --repeats must be >= 1, --period-ms >= 0, --idle-s > 0")
    runs = run_hops(args.messages, args.period_ms / 1e3, args.repeats, args.idle_s)
    print("\n".join(summary_lines(runs)))
    if args.json:
        with open(args.json, "w") as out:
            json.dump([asdict(r) for r in runs], out, indent=1)
    return 0
