"""A burst of concurrent unary `Generate` calls against a running server: the count of every
final status (code, details, `retry-after` trailer) and how long a refusal took.

    pagedserve bench grpc-burst --address 127.0.0.1:9000 --calls 1500 --bursts 3

The README ("What a client can count on") promises each call ends OK, RESOURCE_EXHAUSTED with a
`retry-after` trailer, or an error that names its problem; this counts the calls that do not
(`unexpected`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import grpc

from pagedserve.cluster.api.grpc.status import RETRY_AFTER_KEY
from pagedserve.proto.pagedserve.v1 import serving_pb2 as pb
from pagedserve.proto.pagedserve.v1 import serving_pb2_grpc

Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class CallOutcome:
    """How one call ended, as its client saw it."""

    code: str
    details: str
    retry_after: str | None
    latency_s: float

    @property
    def expected(self) -> bool:
        if self.code == "OK":
            return True
        if self.code == "RESOURCE_EXHAUSTED":
            return self.retry_after is not None
        return self.code not in ("CANCELLED", "UNKNOWN") and bool(self.details)


def burst_request(i: int, max_tokens: int) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompt = [(7 * i + j) % 250 + 1 for j in range(8)]
    return pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)


async def _call(
    stub: serving_pb2_grpc.GenerationStub, i: int, max_tokens: int, metadata: Metadata
) -> CallOutcome:
    call = stub.Generate(burst_request(i, max_tokens), metadata=metadata)
    start = time.perf_counter()
    with contextlib.suppress(grpc.aio.AioRpcError):
        await call
    latency = time.perf_counter() - start
    code = await call.code()
    trailers = dict(await call.trailing_metadata() or ())
    details = await call.details() or ""
    return CallOutcome(code.name, details, trailers.get(RETRY_AFTER_KEY), latency)


async def run_burst(
    address: str, calls: int, max_tokens: int = 8, channels: int = 1, metadata: Metadata = ()
) -> list[CallOutcome]:
    """Send `calls` unary `Generate` calls at once (over `channels` channels), wait for all.

    Args:
        metadata: sent with every call (an `authorization` entry, when auth is on).
    """
    opened = [grpc.aio.insecure_channel(address) for _ in range(channels)]
    try:
        stubs = [serving_pb2_grpc.GenerationStub(c) for c in opened]
        return await asyncio.gather(
            *(_call(stubs[i % channels], i, max_tokens, metadata) for i in range(calls))
        )
    finally:
        for channel in opened:
            await channel.close()


def summarize(outcomes: list[CallOutcome]) -> dict:
    """Counts per final status, the unexpected ones with their details, refusal latency."""
    codes = Counter(o.code for o in outcomes)
    unexpected = Counter(f"{o.code}: {o.details!r}" for o in outcomes if not o.expected)
    refusals = sorted(o.latency_s for o in outcomes if o.code == "RESOURCE_EXHAUSTED")
    summary: dict = {"codes": dict(codes), "unexpected": dict(unexpected)}
    summary["latency_s"] = {  # min, median, max
        code: _spread([o.latency_s for o in outcomes if o.code == code]) for code in codes
    }
    if refusals:
        summary["refusal_ms"] = {
            "median": round(statistics.median(refusals) * 1e3, 1),
            "p99": round(refusals[min(len(refusals) - 1, int(0.99 * len(refusals)))] * 1e3, 1),
        }
    return summary


def _spread(values: list[float]) -> list[float]:
    values = sorted(values)
    return [round(values[0], 2), round(statistics.median(values), 2), round(values[-1], 2)]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "grpc-burst",
        help="many unary Generate calls at once: every final status, time to a refusal",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--address", default="127.0.0.1:9000", help="a running `pagedserve serve` (gRPC)")
    add("--calls", type=int, default=1500, help="calls per burst, all sent at once")
    add("--bursts", type=int, default=3)
    add("--max-tokens", type=int, default=8, help="per call")
    add("--channels", type=int, default=1, help="calls spread over this many channels")
    add("--pause-s", type=float, default=5.0, help="between bursts")
    add("--token", default=None, help="bearer token, when the server has auth on")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """One JSON line per burst; exit status 1 when any call ended unexpectedly."""
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else ()
    unexpected = 0
    for burst in range(args.bursts):
        if burst:
            time.sleep(args.pause_s)
        outcomes = asyncio.run(
            run_burst(args.address, args.calls, args.max_tokens, args.channels, metadata)
        )
        summary = summarize(outcomes)
        unexpected += sum(summary["unexpected"].values())
        print(json.dumps({"burst": burst, **summary}), flush=True)
    return 1 if unexpected else 0
