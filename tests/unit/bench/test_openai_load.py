"""`bench/openai_load.py`: its metrics, its SSE parser, and the client against a fake server."""

import asyncio
import json
import math

import pytest
from aiohttp import web

from pagedserve.bench import openai_load
from pagedserve.bench.openai_load import (
    RequestRecord,
    Slo,
    SseDecoder,
    StreamEvent,
    completion_body,
    parse_event,
    run_closed_loop,
    run_load,
    summarize,
)
from pagedserve.bench.serve_workload import PlannedRequest
from pagedserve.cluster.ports import free_port


def record(index, send, chunks, end, tokens=4, error=None):
    return RequestRecord(
        index=index,
        arrival_s=send,
        prompt_tokens=3,
        max_tokens=4,
        send_s=send,
        end_s=end,
        chunk_times_s=tuple(chunks),
        output_tokens=tokens if error is None else None,
        finish_reason="length" if error is None else None,
        http_status=200 if error is None else 400,
        error=error,
    )


# ------------------------------------------------------------------- metrics
def test_ttft_tpot_and_e2e_of_one_record():
    r = record(0, send=1.0, chunks=[1.5, 1.6, 1.8], end=1.9)  # 4 tokens in 3 chunks
    assert r.ttft_s == pytest.approx(0.5)
    assert r.tpot_s == pytest.approx(0.3 / 3)  # (last - first) / (tokens - 1)
    assert r.e2e_s == pytest.approx(0.9)


def test_a_record_without_text_or_count_has_no_ttft_or_tpot():
    assert record(0, 0.0, [], 1.0, error="HTTP 400: bad").ttft_s is None
    assert record(0, 0.0, [0.5], 1.0, tokens=None).tpot_s is None  # finished other than length
    assert record(0, 0.0, [0.5], 1.0, tokens=1).tpot_s is None  # one token: no gap to time


def test_summary_percentiles_throughput_and_failures():
    records = [
        record(0, send=0.0, chunks=[0.1, 0.4], end=0.5),  # ttft 0.1, tpot 0.1
        record(1, send=1.0, chunks=[1.3, 1.9], end=2.0),  # ttft 0.3, tpot 0.2
        record(2, send=1.5, chunks=[], end=1.6, error="HTTP 400: bad"),
    ]
    s = summarize(records)
    assert (s.num_requests, s.failures, s.uncounted) == (3, 1, 0)
    assert s.ttft_p50_ms == pytest.approx(200.0)  # numpy's linear percentile of 100 and 300
    assert s.ttft_p99_ms == pytest.approx(298.0)
    assert s.tpot_p50_ms == pytest.approx(150.0)
    assert s.e2e_p50_ms == pytest.approx(750.0)
    assert s.output_tokens == 8  # the failure's tokens are not counted
    assert s.duration_s == pytest.approx(2.0)  # last end - first send
    assert s.output_tokens_per_s == pytest.approx(4.0)


def test_summary_of_only_failures_has_no_latencies():
    s = summarize([record(0, 0.0, [], 1.0, error="HTTP 500: boom")])
    assert s.failures == 1 and math.isnan(s.ttft_p50_ms) and s.output_tokens == 0


def test_a_request_meets_the_slo_only_with_both_latencies_within_it():
    slo = Slo(ttft_ms=200.0, tpot_ms=100.0)
    assert slo.met_by(record(0, 0.0, [0.2, 0.5], 0.5, tokens=4))  # ttft 200, tpot 100: met
    assert not slo.met_by(record(0, 0.0, [0.25, 0.5], 0.5))  # ttft 250
    assert not slo.met_by(record(0, 0.0, [0.1, 0.5], 0.5))  # tpot 133
    assert slo.met_by(record(0, 0.0, [0.1], 0.1, tokens=1))  # one token: no TPOT to miss
    assert not slo.met_by(record(0, 0.0, [0.1, 0.2], 0.2, tokens=None))  # count unknown
    assert not slo.met_by(record(0, 0.0, [], 0.1, error="HTTP 500: boom"))
    with pytest.raises(ValueError, match="> 0"):
        Slo(0.0, 100.0)


def test_goodput_is_requests_that_met_the_slo_per_second_of_the_run():
    records = [
        record(0, send=0.0, chunks=[0.1, 0.4], end=0.5),  # met
        record(1, send=1.0, chunks=[1.5, 1.9], end=2.0),  # ttft 500: missed
        record(2, send=1.5, chunks=[], end=1.6, error="HTTP 400: bad"),
    ]
    assert Slo(200.0, 150.0).goodput_per_s(records) == pytest.approx(1 / 2.0)
    assert Slo(200.0, 150.0).goodput_per_s([]) == 0.0


# ------------------------------------------------------------------- the SSE parser
def chunk(text, finish=None, index=0):
    body = {"object": "text_completion", "choices": [
        {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
    ]}  # fmt: skip
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()  # raw UTF-8, as ours


def test_decoder_joins_lines_split_across_reads():
    stream = chunk("Hé") + b": keep-alive\n\n" + chunk("llo", "length") + b"data: [DONE]\n\n"
    decoder = SseDecoder()
    payloads = []
    for i in range(len(stream)):  # one byte a read: lines and the UTF-8 'é' are cut
        payloads += decoder.feed(stream[i : i + 1])
    payloads += decoder.close()
    events = [parse_event(p) for p in payloads]
    assert [e.text for e in events] == ["Hé", "llo", ""]
    assert events[1].finish_reason == "length" and events[2].done


def test_decoder_keeps_a_last_line_without_newline_and_crlf_lines():
    decoder = SseDecoder()
    assert decoder.feed(b"data: [DONE]\r") == []
    assert decoder.close() == ["[DONE]"]
    assert SseDecoder().feed(b"data: [DONE]\r\n\r\n") == ["[DONE]"]


def test_a_chunk_with_several_tokens_is_one_event_with_all_its_text():
    # A server holds back tokens whose text is an incomplete UTF-8 character, then sends them
    # together: one chunk, several tokens, its text whole.
    (payload,) = SseDecoder().feed(chunk("é and more"))
    assert parse_event(payload) == StreamEvent(text="é and more")


def test_error_body_usage_chunk_and_junk():
    error = parse_event('{"error": {"message": "overloaded", "type": "server_error"}}')
    assert error.error is not None and "overloaded" in error.error
    usage = parse_event('{"choices": [], "usage": {"completion_tokens": 4}}')
    assert usage == StreamEvent()
    assert parse_event("not json").error.startswith("unreadable event")


# ------------------------------------------------------------------- the client
# Nothing below is timed against the clock: the fake server holds its streams on events the
# client's own steps set, so each bound holds on a machine of any speed or load.
TOKENS = 4
TOKEN_DELAY_S = 0.05
FAILSAFE_S = 120.0  # a request's deadline: only a hang reaches it


class FakeServer:
    """Streams `max_tokens` one-token chunks, each TOKEN_DELAY_S after the client has decoded
    the one before (`GatedDecoder`); refuses model 'nope'. The first `hold` requests wait
    for each other before their first chunk: the client must have sent them all at once.
    Requests are told apart by their prompt's last token."""

    def __init__(self, hold: int = 0) -> None:
        self.hold = hold
        self.received: list[int] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.decoded: dict[tuple[int, int], asyncio.Event] = {}
        self.all_held_arrived = asyncio.Event()

    def decoded_event(self, key: int, token: int) -> asyncio.Event:
        return self.decoded.setdefault((key, token), asyncio.Event())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["model"] == "nope":
            return web.json_response({"error": {"message": "no such model"}}, status=404)
        assert body == completion_body("m", PlannedRequest(0, 0.0, tuple(body["prompt"]), TOKENS))
        key = body["prompt"][-1]
        self.received.append(key)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if len(self.received) <= self.hold:
                if len(self.received) == self.hold:
                    self.all_held_arrived.set()
                await self.all_held_arrived.wait()
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            for i in range(body["max_tokens"]):
                if i > 0:
                    await self.decoded_event(key, i - 1).wait()
                await asyncio.sleep(TOKEN_DELAY_S)
                finish = "length" if i == body["max_tokens"] - 1 else None
                await response.write(chunk(f"{key}:{i}", finish))
            await response.write(b"data: [DONE]\n\n")
            return response
        finally:
            self.in_flight -= 1


def gated_decoder(server: FakeServer) -> type[SseDecoder]:
    """The client's SSE decoder, telling `server` each chunk it has decoded (the client takes
    a chunk's time before it decodes it)."""

    class GatedDecoder(SseDecoder):
        def feed(self, data: bytes) -> list[str]:
            payloads = super().feed(data)
            for payload in payloads:
                text = parse_event(payload).text
                if text:
                    key, token = text.split(":")
                    server.decoded_event(int(key), int(token)).set()
            return payloads

    return GatedDecoder


@pytest.fixture
def fake_server(monkeypatch):
    server = FakeServer()
    monkeypatch.setattr(openai_load, "SseDecoder", gated_decoder(server))
    return server


async def with_fake_server(server, model, workload, concurrency=None):
    app = web.Application()
    app.router.add_post("/v1/completions", server.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    try:
        if concurrency is not None:
            return await run_closed_loop(url, model, workload, concurrency, timeout_s=FAILSAFE_S)
        return await run_load(url, model, workload, timeout_s=FAILSAFE_S)
    finally:
        await runner.cleanup()


def planned(index: int, arrival_s: float) -> PlannedRequest:
    return PlannedRequest(index, arrival_s, (5, 6, 100 + index), TOKENS)


def test_the_client_times_streams_at_their_arrivals(fake_server):
    """Each request is sent at (never before) its arrival offset, all three at once (the
    server holds them until all have come), and each chunk is timed as it arrives: chunk k+1
    is written only TOKEN_DELAY_S after the client decoded chunk k, so its time is later by
    at least that, whatever the machine's load."""
    fake_server.hold = 3
    workload = [planned(i, 0.1 * i) for i in range(3)]
    records = asyncio.run(with_fake_server(fake_server, "m", workload))
    assert [r.index for r in records] == [0, 1, 2]
    assert [r.send_s for r in records] == sorted(r.send_s for r in records)
    for r in records:
        assert r.ok and r.http_status == 200 and r.finish_reason == "length"
        assert r.output_tokens == TOKENS and len(r.chunk_times_s) == TOKENS
        assert r.send_s >= r.arrival_s - 0.005  # sent at its arrival offset, not before
        assert r.ttft_s >= TOKEN_DELAY_S
        gaps = [b - a for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:], strict=False)]
        assert min(gaps) >= TOKEN_DELAY_S, gaps  # each chunk timed on its own arrival
        assert r.tpot_s >= TOKEN_DELAY_S and r.e2e_s >= r.ttft_s
    summary = summarize(records)
    assert summary.failures == 0 and summary.output_tokens == 3 * TOKENS


def test_a_closed_loop_keeps_that_many_requests_in_flight_in_workload_order(fake_server):
    fake_server.hold = 2  # the two clients' first requests: in flight together
    workload = [planned(i, 9.0) for i in range(5)]  # arrivals unused
    records = asyncio.run(with_fake_server(fake_server, "m", workload, concurrency=2))
    assert fake_server.most_in_flight == 2
    assert [r.index for r in records] == [0, 1, 2, 3, 4]
    assert all(r.ok and r.arrival_s == r.send_s for r in records)
    ends = sorted(r.end_s for r in records[:2])
    assert records[2].send_s >= ends[0]  # the third waited for a client to be free
    with pytest.raises(ValueError, match=">= 1"):
        asyncio.run(run_closed_loop("http://127.0.0.1:1", "m", workload, 0))


def test_a_4xx_is_a_failure_with_its_body(fake_server):
    (r,) = asyncio.run(with_fake_server(fake_server, "nope", [planned(0, 0.0)]))
    assert not r.ok and r.http_status == 404
    assert r.error.startswith("HTTP 404: ") and "no such model" in r.error
    assert r.output_tokens is None and r.ttft_s is None
    assert summarize([r]).failures == 1


def test_a_refused_connection_is_a_failure_not_an_exception():
    workload = [PlannedRequest(0, 0.0, (5,), TOKENS)]
    (r,) = asyncio.run(run_load(f"http://127.0.0.1:{free_port()}", "m", workload, FAILSAFE_S))
    assert not r.ok and r.http_status is None and "Connect" in r.error
