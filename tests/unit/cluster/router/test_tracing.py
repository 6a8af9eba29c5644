"""Telemetry without Ray: config, the no-op fallback, W3C propagation, worker spans from a real
engine, the trace file and its waterfall, and the Prometheus registry."""

from __future__ import annotations

import asyncio
import dataclasses
import re

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.engine import finish_clean, load

from pagedserve import LLM, SamplingParams
from pagedserve.cli import main as cli_main
from pagedserve.cluster.api.config import split_app_args
from pagedserve.cluster.router.metrics import RouterMetrics
from pagedserve.cluster.router.tracing import RouterTrace, carrier_from_headers
from pagedserve.cluster.router.types import MigrationKind
from pagedserve.cluster.trace_view import find_trace, render
from pagedserve.workers.protocol.requests import GenerateRequest
from pagedserve.workers.protocol.stats import KVUsage, WorkerStats
from pagedserve.workers.protocol.stream import FinishReason, RequestMetrics, StreamDelta, Usage
from pagedserve.workers.telemetry.telemetry import NOOP, TelemetryConfig, Tracing, get_tracing
from pagedserve.workers.telemetry.trace_file import read_spans
from pagedserve.workers.worker.core import WorkerCore

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture(scope="module")
def loaded():
    return load("tiny-llama")


@pytest.fixture()
def memory():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider.get_tracer("test"), provider), exporter


def run_request(loaded, tracing, request_id="r1", trace_context=None, **config):
    config = {"block_size": 8, "num_kv_blocks": 64, "attention_backend": "torch", **config}
    llm = LLM(loaded_model=loaded, **config)
    core = WorkerCore(llm.engine, "w0", tracing=tracing)

    async def main():
        deltas = [
            d
            async for d in core.generate(
                request_id, list(range(3, 23)), GREEDY, trace_context=trace_context
            )
        ]
        await core.close()
        return deltas

    deltas = asyncio.run(main())
    finish_clean(llm)
    return deltas


# ------------------------------------------------------------------ config
def test_config_defaults_off_and_names_bad_keys():
    assert TelemetryConfig().exporter == "none"
    assert TelemetryConfig.from_dict({"trace_file": "t.jsonl"}).exporter == "file"
    with pytest.raises(ValueError, match="unknown telemetry keys: colour"):
        TelemetryConfig.from_dict({"colour": 1})
    with pytest.raises(ValueError, match="exporter must be one of"):
        TelemetryConfig(exporter="jaeger")
    with pytest.raises(ValueError, match="needs telemetry.trace_file"):
        TelemetryConfig(exporter="file")


def test_exporter_from_the_standard_variable_unless_configured():
    env = {"OTEL_TRACES_EXPORTER": "console"}
    assert TelemetryConfig.from_dict({}, env).exporter == "console"
    assert TelemetryConfig.from_dict({"exporter": "none"}, env).exporter == "none"
    assert TelemetryConfig.from_dict({}, {}).exporter == "none"


def test_app_args_split_telemetry_from_the_cluster_config():
    cluster, api = split_app_args({"num_workers": 1, "telemetry": {"exporter": "console"}})
    assert cluster == {"num_workers": 1}
    assert api.telemetry.exporter == "console"


# ----------------------------------------------------------------- no-op
def test_off_is_the_noop_tracer_and_records_nothing():
    assert get_tracing(None, "x") is NOOP
    assert get_tracing(TelemetryConfig(), "x") is NOOP
    span = NOOP.start_span("s")
    assert not span.is_recording()
    assert NOOP.inject(span) is None and NOOP.extract(None) is None


def test_noop_worker_streams_as_before(loaded):
    deltas = run_request(loaded, NOOP, trace_context={"traceparent": TRACEPARENT})
    assert deltas[-1].finish_reason == "length"


# ----------------------------------------------------------- propagation
def test_inject_extract_round_trip(memory):
    tracing, exporter = memory
    parent = tracing.start_span("parent")
    carrier = tracing.inject(parent)
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-0[0-9a-f]", carrier["traceparent"])
    child = tracing.start_span("child", tracing.extract(carrier))
    child.end()
    parent.end()
    child_span, parent_span = exporter.get_finished_spans()
    assert child_span.context.trace_id == parent_span.context.trace_id
    assert child_span.parent.span_id == parent_span.context.span_id


def test_carrier_from_headers_and_metadata():
    pairs = [("Authorization", "x"), ("TraceParent", TRACEPARENT), ("tracestate", b"k=v")]
    assert carrier_from_headers(pairs) == {"traceparent": TRACEPARENT, "tracestate": "k=v"}
    assert carrier_from_headers([("authorization", "x")]) is None
    assert carrier_from_headers(None) is None


# ----------------------------------------------------------- worker spans
def test_worker_spans_continue_the_callers_trace(loaded, memory):
    tracing, exporter = memory
    run_request(loaded, tracing, trace_context={"traceparent": TRACEPARENT})
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"worker.request", "queue", "prefill", "prefill.chunk", "decode"}
    root = spans["worker.request"]
    assert f"{root.context.trace_id:032x}" == TRACE_ID
    assert f"{root.parent.span_id:016x}" == PARENT_ID
    for phase in ("queue", "prefill", "decode"):
        assert spans[phase].parent.span_id == root.context.span_id
    queue, prefill, decode = spans["queue"], spans["prefill"], spans["decode"]
    assert root.start_time <= queue.start_time <= queue.end_time <= prefill.start_time
    assert prefill.end_time <= decode.start_time <= decode.end_time <= root.end_time
    assert root.attributes["gen_ai.request.max_tokens"] == 5
    assert root.attributes["gen_ai.usage.input_tokens"] == 20
    assert prefill.attributes["gen_ai.usage.input_tokens"] == 20
    assert decode.attributes["gen_ai.usage.output_tokens"] == 5
    assert decode.attributes["pagedserve.preemptions"] == 0
    (finish,) = [e for e in root.events if e.name == "finish"]
    assert finish.attributes["gen_ai.response.finish_reasons"] == ("length",)


def test_prefill_chunks_are_spans_under_prefill(loaded, memory):
    tracing, exporter = memory
    run_request(loaded, tracing, max_num_batched_tokens=8)  # 20 prompt tokens: 8 + 8 + 4
    spans = exporter.get_finished_spans()
    (prefill,) = [s for s in spans if s.name == "prefill"]
    chunks = sorted((s for s in spans if s.name == "prefill.chunk"), key=lambda s: s.start_time)
    assert [c.attributes["pagedserve.tokens"] for c in chunks] == [8, 8, 4]
    assert all(c.parent.span_id == prefill.context.span_id for c in chunks)
    assert prefill.attributes["pagedserve.prefill_chunks"] == 3


def test_a_prefix_loaded_from_the_tiers_is_a_tier_load_span(loaded, memory, tmp_path):
    """A prefix evicted to the host and disk tiers and loaded back gets a `kv.tier_load` span
    under its request, with the blocks it loaded from each tier."""
    tracing, exporter = memory
    config = {"block_size": 8, "num_kv_blocks": 8, "attention_backend": "torch"}
    bytes_per_block = LLM(loaded_model=loaded, **config).engine.kv_cache.bytes_per_block
    tiers = {  # a host tier of two blocks: the rest of the prefix is demoted to disk
        "kv_host_tier_bytes": 2 * bytes_per_block,
        "kv_disk_tier_dir": str(tmp_path),
        "kv_disk_tier_bytes": 1 << 24,
    }
    llm = LLM(loaded_model=loaded, watermark=0.0, **config, **tiers)
    core = WorkerCore(llm.engine, "w0", tracing=tracing)
    prompt_a, prompt_b = list(range(3, 39)), list(range(100, 156))  # B evicts all of A

    async def main():
        for request_id, prompt in (("a", prompt_a), ("b", prompt_b), ("a-again", prompt_a)):
            _ = [d async for d in core.generate(request_id, prompt, GREEDY)]
        await core.close()

    asyncio.run(main())
    finish_clean(llm)
    spans = exporter.get_finished_spans()
    (load,) = [s for s in spans if s.name == "kv.tier_load"]
    (root,) = [
        s
        for s in spans
        if s.name == "worker.request" and s.attributes["pagedserve.request_id"] == "a-again"
    ]
    assert load.parent.span_id == root.context.span_id
    assert root.start_time <= load.start_time <= load.end_time <= root.end_time
    attributes = {k.removeprefix("pagedserve.tier_load."): v for k, v in load.attributes.items()}
    assert attributes == {"blocks": 4, "host_blocks": 2, "disk_blocks": 2}


def test_router_trace_records_usage_and_errors(memory):
    tracing, exporter = memory
    request = GenerateRequest(SamplingParams(max_tokens=4), prompt="hi", ingress="grpc")
    trace = RouterTrace(tracing, request, "q1", "tiny")
    trace.on_prompt(2)
    trace.child("route").end()
    delta = StreamDelta("q1", 0, [1], "", FinishReason.LENGTH, usage=Usage(2, 4, 0))
    trace.on_delta(delta)
    trace.end(RuntimeError("boom"))
    route, root = exporter.get_finished_spans()
    assert route.parent.span_id == root.context.span_id and root.parent is None
    assert root.attributes["gen_ai.usage.output_tokens"] == 4
    assert root.attributes["pagedserve.ingress"] == "grpc"
    assert root.status.description == "RuntimeError: boom"


# ------------------------------------------------------- trace file + view
def test_trace_file_and_waterfall(loaded, tmp_path, capsys):
    path = tmp_path / "spans.jsonl"
    config = TelemetryConfig(exporter="file", trace_file=str(path))
    tracing = get_tracing(config, "pagedserve-worker", worker_id="w0")
    router = get_tracing(config, "pagedserve-router")
    trace = RouterTrace(router, GenerateRequest(GREEDY, prompt="x"), "req-7", "tiny")
    call = trace.child("worker.call", **{"pagedserve.worker_id": "w0"})
    run_request(loaded, tracing, "req-7", router.inject(call))
    call.end()
    trace.end()
    tracing.flush()
    router.flush()
    spans = find_trace(read_spans(str(path)), "req-7")
    assert {s.name for s in spans} == {
        "pagedserve.request",
        "worker.call",
        "worker.request",
        "queue",
        "prefill",
        "prefill.chunk",
        "decode",
    }
    text = render(spans)
    lines = text.splitlines()
    assert "request req-7" in lines[0]
    assert lines[1].startswith("pagedserve.request")
    assert lines[3].startswith("    worker.request") and "w0" in lines[3]
    assert cli_main(["trace", "show", "req-7", "--trace-file", str(path)]) == 0
    assert "decode" in capsys.readouterr().out
    assert cli_main(["trace", "show", "nope", "--trace-file", str(path)]) == 1


# --------------------------------------------------------------- metrics
def test_metrics_registry_counts_and_reads_worker_stats():
    counts = {f.name: 0 for f in dataclasses.fields(KVUsage)}
    kv = KVUsage(
        **{
            **counts,
            "total_blocks": 10,
            "used_blocks": 4,
            "cached_free_blocks": 2,
            "free_blocks": 3,
            "reserve_blocks": 1,
            "useful_tokens": 30,
            "wasted_positions": 2,
            "prefix_queries_tokens": 100,
            "prefix_hits_tokens": 40,
        }
    )
    w0 = WorkerStats(worker_id="w0", epoch="e", kv=kv, num_running=2, num_waiting=1)
    stats = {"w0": (True, w0), "w1": (False, None)}
    metrics = RouterMetrics(True, lambda: stats)
    metrics.on_routed("kv_aware", "prefix_hit")
    metrics.on_migration(MigrationKind.PULL, 3)
    timings = RequestMetrics(queue_time=0.01, ttft=0.02, e2e=0.1, inter_token_latencies=(0.01,))
    delta = StreamDelta("r", 0, [], "", FinishReason.STOP, usage=Usage(5, 2, 0), worker_id="w0")
    metrics.on_finished(dataclasses.replace(delta, metrics=timings))
    text = metrics.render().decode()
    for line in (
        'pagedserve_routing_decisions_total{outcome="prefix_hit",policy="kv_aware"} 1.0',
        'pagedserve_migrations_total{kind="pull"} 1.0',
        'pagedserve_migrated_blocks_total{kind="pull"} 3.0',
        'pagedserve_ttft_seconds_count{worker="w0"} 1.0',
        'pagedserve_inter_token_latency_seconds_count{worker="w0"} 1.0',
        'pagedserve_requests_running{worker="w0"} 2.0',
        'pagedserve_kv_usage_fraction{worker="w0"} 0.4',
        'pagedserve_kv_blocks{state="cached",worker="w0"} 2.0',
        'pagedserve_kv_positions{kind="tail_waste",worker="w0"} 2.0',
        'pagedserve_prefix_cache_hits_tokens_total{worker="w0"} 40.0',
        'pagedserve_worker_up{worker="w1"} 0.0',
        'pagedserve_tokens_total{kind="prompt",worker="w0"} 5.0',
    ):
        assert line in text, line


def test_metrics_off_is_a_noop():
    metrics = RouterMetrics(False, dict)
    metrics.on_routed("kv_aware", "prefix_hit")
    metrics.on_finished(StreamDelta("r", 0, [], "", FinishReason.STOP))
    assert not metrics.enabled and metrics.render() == b""
