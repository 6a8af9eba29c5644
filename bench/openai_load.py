"""An OpenAI-HTTP load client: streamed `/v1/completions` at planned arrival times, and its metrics.

Server-agnostic on purpose (it speaks only the OpenAI wire format), so that `bench serve-compare`
drives our server and vLLM's through the very same code. Each request is sent at its arrival
offset as

    POST {base}/v1/completions  {"model", "prompt": [ids], "max_tokens", "temperature": 0,
                                 "ignore_eos": true, "stream": true}

and its server-sent events (``data: {...}`` lines, then ``data: [DONE]``) are timed as they
arrive. Times are the client's (`time.monotonic`), in seconds after the run's start:

    TTFT     sent → first chunk carrying text
    TPOT     (last chunk carrying text − first one) / (output tokens − 1)
    E2E      sent → end of the stream
    tok/s    all output tokens / (last end − first send)
    goodput  requests that met an `Slo` (TTFT and TPOT at most its bounds) / (last end − first send)

`run_load` sends at planned arrival times (open loop: the server's speed does not change when
requests come); `run_closed_loop` keeps a fixed number of clients busy instead, each sending
its next request when its last one ended (what saturates a server without a queue of arrivals
piling up in front of it).

A chunk may carry several tokens (a server holds back tokens whose text is an incomplete UTF-8
character), so the token count is not the number of chunks: with ``ignore_eos`` a request that
finishes with ``length`` produced exactly ``max_tokens``; any other finish leaves the count
unknown (None), reported and left out of TPOT and tok/s. A failed request (an HTTP status other
than 200 with its body, an error event in the stream, a stream cut before ``[DONE]``, a
connection error) is kept with its reason, never dropped; summaries count it and leave it out of
the latency statistics only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pagedserve.bench.serve_workload import PlannedRequest

if TYPE_CHECKING:  # imported where used: `pagedserve --help` stays fast
    import aiohttp

DONE = "[DONE]"
MAX_ERROR_BODY = 2_000  # characters of an error body kept in the record


# ------------------------------------------------------------------- the stream
@dataclass(frozen=True)
class StreamEvent:
    """One ``data:`` payload, read: the end marker, an error, or a chunk's text and finish."""

    done: bool = False
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


class SseDecoder:
    """Turns the body's bytes, split anywhere, into the payloads of its ``data:`` lines."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[str]:
        lines = (self._pending + data).split(b"\n")
        self._pending = lines.pop()  # the last piece has no newline yet
        return [p for p in map(_payload, lines) if p is not None]

    def close(self) -> list[str]:
        """Payloads of a last line the server did not end with a newline."""
        rest, self._pending = self._pending, b""
        payload = _payload(rest)
        return [payload] if payload is not None else []


def _payload(line: bytes) -> str | None:
    text = line.decode("utf-8").rstrip("\r")
    if not text.startswith("data:"):
        return None  # blank separators, comments (": ping"), `event:` and `id:` fields
    return text[len("data:") :].strip()


def parse_event(payload: str) -> StreamEvent:
    """One payload: ``[DONE]``, ``{"error": ...}`` or a completion chunk (its choices' text)."""
    if payload == DONE:
        return StreamEvent(done=True)
    try:
        body = json.loads(payload)
    except json.JSONDecodeError:
        return StreamEvent(error=f"unreadable event: {payload[:MAX_ERROR_BODY]}")
    if not isinstance(body, dict):
        return StreamEvent(error=f"unexpected event: {payload[:MAX_ERROR_BODY]}")
    if "error" in body:
        return StreamEvent(error=f"error event: {json.dumps(body['error'])[:MAX_ERROR_BODY]}")
    choices = body.get("choices") or []  # a usage-only chunk has none
    finish = next((c["finish_reason"] for c in choices if c.get("finish_reason")), None)
    return StreamEvent(text="".join(c.get("text") or "" for c in choices), finish_reason=finish)


# ------------------------------------------------------------------- records
@dataclass(frozen=True)
class RequestRecord:
    """One request as measured; `error` is set exactly when it failed. Times: s after start."""

    index: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    send_s: float
    end_s: float
    chunk_times_s: tuple[float, ...]  # every chunk carrying text, in order
    output_tokens: int | None  # None: finished other than `length`, count unknown
    finish_reason: str | None
    http_status: int | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.send_s if self.chunk_times_s else None

    @property
    def tpot_s(self) -> float | None:
        tokens = self.output_tokens
        if not self.chunk_times_s or tokens is None or tokens < 2:
            return None
        return (self.chunk_times_s[-1] - self.chunk_times_s[0]) / (tokens - 1)

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.send_s


@dataclass(frozen=True)
class LoadSummary:
    """A run's figures; latencies in milliseconds over the successful requests only."""

    num_requests: int
    failures: int
    uncounted: int  # successful, but finished other than `length`: tokens unknown
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    e2e_p50_ms: float
    output_tokens: int
    duration_s: float
    output_tokens_per_s: float


def summarize(records: Sequence[RequestRecord]) -> LoadSummary:
    """Percentiles (numpy's linear ones) and throughput of one run's records."""
    ok = [r for r in records if r.ok]
    ttft = [t for r in ok if (t := r.ttft_s) is not None]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    tokens = sum(r.output_tokens or 0 for r in ok)
    duration = run_duration_s(records)
    return LoadSummary(
        num_requests=len(records),
        failures=len(records) - len(ok),
        uncounted=sum(r.output_tokens is None for r in ok),
        ttft_p50_ms=_percentile_ms(ttft, 50),
        ttft_p99_ms=_percentile_ms(ttft, 99),
        tpot_p50_ms=_percentile_ms(tpot, 50),
        tpot_p99_ms=_percentile_ms(tpot, 99),
        e2e_p50_ms=_percentile_ms([r.e2e_s for r in ok], 50),
        output_tokens=tokens,
        duration_s=duration,
        output_tokens_per_s=tokens / duration if duration > 0 else 0.0,
    )


def run_duration_s(records: Sequence[RequestRecord]) -> float:
    """From the first send to the last end: what tok/s and goodput divide by."""
    if not records:
        return 0.0
    return max(r.end_s for r in records) - min(r.send_s for r in records)


@dataclass(frozen=True)
class Slo:
    """A latency target each request meets or misses: TTFT and TPOT at most these bounds."""

    ttft_ms: float
    tpot_ms: float

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.tpot_ms > 0):
            raise ValueError(f"SLO bounds must be > 0 ms, got {self.ttft_ms}, {self.tpot_ms}")

    def met_by(self, record: RequestRecord) -> bool:
        """A failed request, or one whose token count is unknown (so its TPOT is), misses; one
        of a single token has no TPOT to miss."""
        ttft, tpot = record.ttft_s, record.tpot_s
        if not record.ok or ttft is None or record.output_tokens is None:
            return False
        return ttft * 1e3 <= self.ttft_ms and (tpot is None or tpot * 1e3 <= self.tpot_ms)

    def goodput_per_s(self, records: Sequence[RequestRecord]) -> float:
        """Requests per second that met this SLO, over the run's duration."""
        duration = run_duration_s(records)
        return sum(map(self.met_by, records)) / duration if duration > 0 else 0.0


def _percentile_ms(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


# ------------------------------------------------------------------- the client
def completion_body(model: str, planned: PlannedRequest) -> dict:
    """The JSON both servers get: token ids, greedy, exactly `max_tokens` tokens, streamed."""
    return {
        "model": model,
        "prompt": list(planned.token_ids),
        "max_tokens": planned.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


async def run_load(
    base_url: str,
    model: str,
    workload: Sequence[PlannedRequest],
    timeout_s: float | None = None,
) -> list[RequestRecord]:
    """Send every request at its arrival offset and time its stream.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000`` (``/v1/completions`` is appended).
        model: the served model name the body names.
        workload: the requests, arrival offsets in seconds after the first.
        timeout_s: deadline of one request from its send (None: none).

    Returns:
        One record per request, failures included, in workload order.
    """
    url = base_url.rstrip("/") + "/v1/completions"
    async with client_session(timeout_s) as session:
        t0 = time.monotonic() + 0.05  # every task is scheduled before the first arrival

        async def one(planned: PlannedRequest) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + planned.arrival_s - time.monotonic()))
            return await send_request(session, url, model, planned, t0)

        return list(await asyncio.gather(*(one(p) for p in workload)))


async def run_closed_loop(
    base_url: str,
    model: str,
    workload: Sequence[PlannedRequest],
    concurrency: int,
    timeout_s: float | None = None,
) -> list[RequestRecord]:
    """`concurrency` clients take the requests in workload order, each sending its next one
    when its last one ended; arrival offsets are ignored.

    Returns:
        One record per request, in workload order; its `arrival_s` is when it was sent.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    url = base_url.rstrip("/") + "/v1/completions"
    queue = list(reversed(workload))  # popped from the end: workload order
    records: dict[int, RequestRecord] = {}
    async with client_session(timeout_s) as session:
        t0 = time.monotonic()

        async def client() -> None:
            while queue:
                record = await send_request(session, url, model, queue.pop(), t0)
                records[record.index] = dataclasses.replace(record, arrival_s=record.send_s)

        await asyncio.gather(*(client() for _ in range(min(concurrency, len(queue)))))
    return [records[p.index] for p in workload]


def client_session(
    timeout_s: float | None, headers: dict[str, str] | None = None
) -> aiohttp.ClientSession:
    """A session for `send_request`; `headers` go with every request (e.g. `authorization`)."""
    import aiohttp

    # limit=0: no cap on open connections, so a burst is never queued inside the client.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        headers=headers,
    )


async def send_request(
    session: aiohttp.ClientSession, url: str, model: str, planned: PlannedRequest, t0: float
) -> RequestRecord:
    """Send one request and time its stream (times in seconds after `t0`); never raises."""
    send_s = time.monotonic() - t0
    chunk_times: list[float] = []
    finish: str | None = None
    status: int | None = None
    error: str | None = None
    try:
        async with session.post(url, json=completion_body(model, planned)) as response:
            status = response.status
            if status != 200:
                body = await response.text(errors="replace")
                error = f"HTTP {status}: {body[:MAX_ERROR_BODY]}"
            else:
                finish, error = await _read_stream(response, chunk_times, t0)
    except Exception as failure:  # connection refused, reset, timeout: kept, never dropped
        error = f"{type(failure).__name__}: {failure}"
    tokens = planned.max_tokens if finish == "length" else None
    return RequestRecord(
        index=planned.index,
        arrival_s=planned.arrival_s,
        prompt_tokens=len(planned.token_ids),
        max_tokens=planned.max_tokens,
        send_s=send_s,
        end_s=time.monotonic() - t0,
        chunk_times_s=tuple(chunk_times),
        output_tokens=tokens if error is None else None,
        finish_reason=finish,
        http_status=status,
        error=error,
    )


async def _read_stream(
    response: aiohttp.ClientResponse, chunk_times: list[float], t0: float
) -> tuple[str | None, str | None]:
    """Reads events until ``[DONE]``, appending the time of each chunk carrying text.

    Returns:
        (finish reason, error or None).
    """
    finish = None
    async with contextlib.aclosing(_payloads(response, t0)) as payloads:
        async for now, payload in payloads:
            event = parse_event(payload)
            if event.error or event.done:
                return finish, event.error
            if event.text:
                chunk_times.append(now)
            finish = event.finish_reason or finish
    return finish, "the stream ended before [DONE]"


async def _payloads(
    response: aiohttp.ClientResponse, t0: float
) -> AsyncIterator[tuple[float, str]]:
    """(arrival time, payload) of each ``data:`` line; the events of one read share its time."""
    decoder = SseDecoder()
    async for data in response.content.iter_any():
        now = time.monotonic() - t0
        for payload in decoder.feed(data):
            yield now, payload
    now = time.monotonic() - t0
    for payload in decoder.close():
        yield now, payload
