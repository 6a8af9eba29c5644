"""One soak request through the real gRPC front end, and how it ended as the client saw it.

`call_stream` sends a `SoakRequest` as a `GenerateStream` RPC to Serve's gRPC proxy (raw bytes
for the malformed inputs a typed client cannot even build), reads its deltas, cancels it
where the request says so, and records the status code, details, trailing metadata and
latency in a `GrpcOutcome`. It never raises: a call that receives nothing (no message, no
status) for the hang timeout ends as `HUNG`, which the checks count as a failure. The bound is
on silence, not on the whole call, so a stream that keeps streaming on a slow machine is not
hung, however long it takes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from pagedserve.cluster.client import build_request
from pagedserve.proto.pagedserve.v1 import serving_pb2 as pb
from pagedserve.workers.deadline import within
from support.soak.driver import SoakRequest

HUNG = "HUNG"
STREAM_METHOD = "/pagedserve.v1.Generation/GenerateStream"

# Requests a typed client cannot build: the wire bytes of a GenerateRequest that does not parse
# (the proxy must answer INVALID_ARGUMENT naming the field, not a bare INTERNAL).
WIRE_BAD_INPUTS: dict[str, bytes] = {
    "bad_utf8_prompt": b"\x0a\x03ab\xff",
    "unknown_field": b"\x0a\x01a\x98\x06\x05",
}


@dataclass
class GrpcOutcome:
    """How one request ended, as the gRPC client saw it.

    Attributes:
        request: what was sent.
        code: the gRPC status code's name (`OK`, `RESOURCE_EXHAUSTED`, ...) or `HUNG`.
        tokens: token ids received, per branch.
        finish_reasons: the finish reason of each branch that finished.
        details: the status details (empty on OK).
        retry_after: the `retry-after` trailing-metadata entry, if any.
        client_cancelled: the client itself cancelled the call (a CANCELLED it expects).
        latency_s: from sending until the status arrived.
        num_deltas: stream messages received.
    """

    request: SoakRequest
    code: str = HUNG
    tokens: dict[int, list[int]] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    details: str = ""
    retry_after: str | None = None
    client_cancelled: bool = False
    latency_s: float = 0.0
    num_deltas: int = 0

    @property
    def finished(self) -> bool:
        """OK with every branch ended by its length (a greedy run to max_tokens)."""
        n = self.request.params.n
        return self.code == "OK" and self.finish_reasons == {j: "length" for j in range(n)}


def to_message(req: SoakRequest) -> pb.GenerateRequest | bytes:
    """The request as the client sends it: a message, or raw bytes for a wire-level bad input."""
    if req.bad_input in WIRE_BAD_INPUTS:
        return WIRE_BAD_INPUTS[req.bad_input]
    params = req.params
    return build_request(
        req.prompt,
        prompt_token_ids=req.token_ids,
        request_id=f"soak-{req.index}",
        timeout_s=req.timeout_s or 0.0,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        ignore_eos=params.ignore_eos,
        n=params.n,
    )


async def call_stream(
    channel: grpc.aio.Channel,
    req: SoakRequest,
    hang_timeout_s: float,
    *,
    request_id: str | None = None,
    deadline_s: float | None = None,
    outcome: GrpcOutcome | None = None,
    queued_timeout_s: float | None = None,
) -> GrpcOutcome:
    """Run `req` as a `GenerateStream` call; never raises.

    Args:
        channel: a channel to Serve's gRPC proxy.
        req: the request; `cancel_after` deltas are read before the client cancels.
        hang_timeout_s: a call that receives nothing for this long ends as `HUNG`.
        request_id: overrides the request's id (the duplicate-id pair shares one).
        deadline_s: a gRPC deadline for the call (None: none).
        outcome: the outcome to fill in as the call goes (the router-kill fault watches its
            victims' deltas arrive); a fresh one by default.
        queued_timeout_s: how long the call may wait for its first delta (a request queued
            behind long ones waits for admission, not hung); `hang_timeout_s` by default.
    """
    outcome = outcome if outcome is not None else GrpcOutcome(req)
    message = to_message(req)
    if request_id is not None and isinstance(message, pb.GenerateRequest):
        message.request_id = request_id
    serialize = None if isinstance(message, bytes) else pb.GenerateRequest.SerializeToString
    rpc = channel.unary_stream(
        STREAM_METHOD,
        request_serializer=serialize,
        response_deserializer=pb.GenerateStreamResponse.FromString,
    )
    start = time.monotonic()
    call = rpc(message, timeout=deadline_s)
    try:
        await _read(call, req, outcome, hang_timeout_s, queued_timeout_s or hang_timeout_s)
    except TimeoutError:
        outcome.code = HUNG
    finally:
        call.cancel()  # no-op once the call is done
        outcome.latency_s = time.monotonic() - start
    return outcome


async def _read(
    call: grpc.aio.UnaryStreamCall,
    req: SoakRequest,
    outcome: GrpcOutcome,
    silence_s: float,
    first_silence_s: float,
) -> None:
    """Read `call` to its status; TimeoutError once nothing arrived for `silence_s` (for
    `first_silence_s` before the first delta)."""

    def bound() -> float:
        return silence_s if outcome.num_deltas else first_silence_s

    try:
        while (delta := await within(call.read(), bound())) is not grpc.aio.EOF:
            outcome.num_deltas += 1
            outcome.tokens.setdefault(delta.index, []).extend(delta.token_ids)
            if delta.finish_reason:
                outcome.finish_reasons[delta.index] = delta.finish_reason
            if req.cancel_after is not None and outcome.num_deltas >= req.cancel_after:
                outcome.client_cancelled = True
                call.cancel()
                break
            if req.read_delay_s:
                await asyncio.sleep(req.read_delay_s)  # a slow client: its stream pauses
    except grpc.aio.AioRpcError:
        pass  # the status is read below, the same way for every ending
    outcome.code = (await within(call.code(), bound())).name
    outcome.details = await call.details() or ""
    trailing = await call.trailing_metadata()
    outcome.retry_after = _entry(trailing, "retry-after")


def _entry(metadata: grpc.aio.Metadata | None, key: str) -> str | None:
    if metadata is None:
        return None
    for name, value in metadata:
        if name == key:
            return value if isinstance(value, str) else value.decode()
    return None
