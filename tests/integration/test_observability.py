"""Tracing and metrics end to end: a running app exports spans by OTLP/gRPC to a receiver in
this process, and serves Prometheus metrics at `/metrics`.

One app serves the module (two tiny-llama workers, tracing to the receiver, metrics on); the
last test adds two more workers and a router in this process, to trace a move.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from support.api_app import running_app, wait_until
from support.cluster import greedy, run_request

from pagedserve.cluster.client import Client, build_request
from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.pool.group import start_worker_group, stop_worker_group
from pagedserve.cluster.router.config import RouterConfig
from pagedserve.cluster.router.router import RouterCore
from pagedserve.workers.telemetry.telemetry import ROUTER_SERVICE, TelemetryConfig, get_tracing

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
PHASES = {"queue", "prefill", "decode"}


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps every span it is sent, as plain dicts."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 (the RPC's name)
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    record = {
                        "name": span.name,
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_id": span.parent_span_id.hex() or None,
                        "attributes": {a.key: _value(a.value) for a in span.attributes},
                        "events": [e.name for e in span.events],
                        "resource": resource,
                    }
                    with self.lock:
                        self.spans.append(record)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace_of(self, request_id: str) -> list[dict]:
        """Every span of the trace whose root carries `request_id`."""
        with self.lock:
            spans = list(self.spans)
        roots = [
            s
            for s in spans
            if s["name"] == "pagedserve.request"
            and s["attributes"].get("pagedserve.request_id") == request_id
        ]
        if not roots:
            return []
        return [s for s in spans if s["trace_id"] == roots[0]["trace_id"]]


@pytest.fixture(scope="module")
def receiver():
    servicer = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.endpoint = f"127.0.0.1:{port}"
    yield servicer
    server.stop(0)


@pytest.fixture(scope="module")
def app(serve_cluster, receiver):
    telemetry = {"exporter": "otlp", "endpoint": receiver.endpoint, "export_delay_ms": 100}
    with running_app("observability", telemetry=telemetry) as running:
        yield running


@pytest.fixture(scope="module")
def client(app):
    with Client(app.grpc_address, timeout=60) as c:
        yield c


def complete_trace(receiver: Receiver, request_id: str) -> list[dict]:
    """Wait for the router's root and the worker's phases of one request."""

    def ready():
        spans = receiver.trace_of(request_id)
        names = {s["name"] for s in spans}
        return spans if {"pagedserve.request", "worker.request"} | PHASES <= names else None

    return wait_until(ready, 120, f"the spans of {request_id}")


def by_name(spans: list[dict]) -> dict[str, dict]:
    return {s["name"]: s for s in spans}


def test_one_trace_crosses_router_and_worker(client, receiver):
    response = client.generate(
        "hello tracing", request_id="traced-1", max_tokens=6, ignore_eos=True
    )
    assert len(response.completions[0].token_ids) == 6
    spans = complete_trace(receiver, "traced-1")
    assert len({s["trace_id"] for s in spans}) == 1
    named = by_name(spans)
    root, route, call = named["pagedserve.request"], named["route"], named["worker.call"]
    worker = named["worker.request"]
    assert root["parent_id"] is None
    assert route["parent_id"] == root["span_id"] and call["parent_id"] == root["span_id"]
    assert worker["parent_id"] == call["span_id"]
    for phase in PHASES:
        assert named[phase]["parent_id"] == worker["span_id"]
    # processes and resources
    assert root["resource"]["service.name"] == "pagedserve-router"
    assert worker["resource"]["service.name"] == "pagedserve-worker"
    chosen = route["attributes"]["pagedserve.routing.chosen"]
    assert worker["resource"]["pagedserve.worker_id"] == chosen
    assert call["attributes"]["pagedserve.worker_id"] == chosen
    # routing decision
    assert route["attributes"]["pagedserve.routing.policy"] == "kv_aware"
    candidates = [json.loads(c) for c in route["attributes"]["pagedserve.routing.candidates"]]
    assert {c["worker"] for c in candidates} == {"observability-worker-0", "observability-worker-1"}
    assert all("cost" in c for c in candidates)
    assert "pagedserve.routing.matched_blocks" in route["attributes"]
    # GenAI attributes
    assert root["attributes"]["pagedserve.ingress"] == "grpc"
    assert root["attributes"]["gen_ai.request.max_tokens"] == 6
    assert root["attributes"]["gen_ai.usage.output_tokens"] == 6
    assert root["attributes"]["gen_ai.usage.input_tokens"] > 0
    assert worker["attributes"]["gen_ai.usage.input_tokens"] > 0
    assert named["decode"]["attributes"]["gen_ai.usage.output_tokens"] == 6
    assert "finish" in worker["events"]


def test_incoming_traceparent_over_grpc_continues_the_trace(client, receiver):
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    request = build_request("continue me", request_id="traced-2", max_tokens=3)
    client.stub.Generate(request, timeout=60, metadata=(("traceparent", traceparent),))
    spans = complete_trace(receiver, "traced-2")
    root = by_name(spans)["pagedserve.request"]
    assert root["trace_id"] == CLIENT_TRACE_ID
    assert root["parent_id"] == CLIENT_SPAN_ID
    assert by_name(spans)["worker.request"]["trace_id"] == CLIENT_TRACE_ID


def test_incoming_traceparent_over_http_continues_the_trace(app, receiver):
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    body = {"model": "tiny-llama", "prompt": "over http", "max_tokens": 3, "request_id": "traced-3"}
    request = urllib.request.Request(
        f"{app.http_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={
            "content-type": "application/json",
            "traceparent": f"00-{trace_id}-b7ad6b7169203331-01",
        },
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
    spans = complete_trace(receiver, "traced-3")
    root = by_name(spans)["pagedserve.request"]
    assert root["trace_id"] == trace_id and root["attributes"]["pagedserve.ingress"] == "http"


def scrape(app) -> dict[str, float]:
    """Every sample of `/metrics`, keyed `name{labels}`."""
    with urllib.request.urlopen(f"{app.http_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.match(r"^(pagedserve_\S+?)(\{.*\})?\s+(\S+)$", line)
        if match:
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


def total(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def test_metrics_move_with_requests(app, client):
    before = scrape(app)
    for i in range(3):
        client.generate(f"metrics request {i} " * 4, max_tokens=4, ignore_eos=True)

    def moved():
        after = scrape(app)
        grew = all(
            total(after, name) > total(before, name)
            for name in (
                "pagedserve_routing_decisions_total",
                "pagedserve_ttft_seconds_count",
                "pagedserve_e2e_latency_seconds_count",
                "pagedserve_queue_time_seconds_count",
                "pagedserve_inter_token_latency_seconds_count",
                "pagedserve_requests_total",
                "pagedserve_prefix_cache_queries_tokens_total",
            )
        )
        return after if grew else None

    after = wait_until(moved, 120, "the metrics to move")
    assert total(after, "pagedserve_tokens_total") >= 3 * 4
    for gauge in (
        "pagedserve_requests_running",
        "pagedserve_requests_waiting",
        "pagedserve_kv_usage_fraction",
        "pagedserve_kv_blocks",
        "pagedserve_kv_positions",
    ):
        assert any(k.startswith(gauge + "{") for k in after), gauge
    assert 'pagedserve_kv_blocks{state="free",worker="observability-worker-0"}' in after
    assert total(after, "pagedserve_worker_up") == 2


def test_a_moved_request_traces_its_migration(app, receiver):
    """A request preempted by move continues on a peer inside the same trace (the router runs
    in this process here, on the app's Ray, so that the test can steer routing)."""
    telemetry = TelemetryConfig(exporter="otlp", endpoint=receiver.endpoint, export_delay_ms=100)
    engine = {"block_size": 8, "num_kv_blocks": 20, "attention_backend": "torch"}
    engine["model"] = "tiny-llama"
    engine.update(preemption_mode="move", watermark=0.0, enable_prefix_caching=False)
    config = ClusterConfig.from_dict(
        {
            "engine": engine,
            "name": "obs-move",
            "scaling": {"num_workers": 2},
            "placement": {"worker_num_cpus": 0.25},
            "routing": {"enable_pull": False, "enable_push": False},
            "failure": {"stats_interval_s": 0.2},
        }
    )
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(30)] for _ in range(5)]
    tracing = get_tracing(telemetry, ROUTER_SERVICE)

    async def main():
        core = RouterCore(RouterConfig.of(config), *start_worker_group(config, telemetry), tracing)
        await core.start()
        busy, target = core.workers.values()
        target.begin(10_000_000)  # everything lands on `busy`, whose pool cannot hold them all
        try:
            ids = [f"move-{i}" for i in range(len(prompts))]
            await asyncio.gather(
                *(
                    run_request(core, p, greedy(30), request_id=r)
                    for p, r in zip(prompts, ids, strict=True)
                )
            )
        finally:
            target.end(10_000_000)
        await core.close()
        return core.counters, ids

    def moved_trace():
        for request_id in ids:
            spans = receiver.trace_of(request_id)
            if {"migration.move", "worker.adopt"} <= {s["name"] for s in spans}:
                return spans
        return None

    try:
        counters, ids = asyncio.run(main())
        assert counters.moves >= 1
        tracing.flush()
        # Before the workers go: a killed actor drops the spans it has not exported yet.
        spans = wait_until(moved_trace, 120, "a trace with a move")
    finally:
        stop_worker_group(config)
    (root,) = [s for s in spans if s["name"] == "pagedserve.request"]
    # A request may move more than once: every move hangs off the root, every adopt off a move.
    moves = {s["span_id"]: s for s in spans if s["name"] == "migration.move"}
    adopts = [s for s in spans if s["name"] == "worker.adopt"]
    assert all(m["parent_id"] == root["span_id"] for m in moves.values())
    for adopt in adopts:
        move = moves[adopt["parent_id"]]
        attrs = move["attributes"]
        destination = attrs["pagedserve.migration.destination"]
        assert attrs["pagedserve.migration.source"] != destination
        assert adopt["resource"]["pagedserve.worker_id"] == destination
        assert attrs["pagedserve.migration.tokens"] > 30
