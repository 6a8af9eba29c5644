"""The trace file: what `JsonlSpanExporter` writes is what `read_spans` reads back."""

from __future__ import annotations

import json

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Status, StatusCode

from pagedserve.workers.telemetry.telemetry import Tracing
from pagedserve.workers.telemetry.trace_file import (
    JsonlSpanExporter,
    SpanEvent,
    SpanRecord,
    read_spans,
)


def write_two_spans(path: str) -> None:
    resource = Resource.create({"service.name": "pagedserve-worker", "pagedserve.worker_id": "w0"})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(path)))
    tracing = Tracing(provider.get_tracer("test"), provider)
    root = tracing.start_span("worker.request", None, {"a": 1, "seed": None}, start_ns=10)
    child = tracing.start_span("decode", root, {"reasons": ["length"]}, start_ns=20)
    child.add_event("preempted", {"pagedserve.preemption": 1}, timestamp=25)
    child.set_status(Status(StatusCode.ERROR, "boom"))
    child.end(30)
    root.end(40)


def test_spans_round_trip_through_the_file(tmp_path):
    path = str(tmp_path / "t.jsonl")
    write_two_spans(path)
    decode, root = read_spans(path)
    assert (root.name, root.parent_id, root.start_ns, root.end_ns) == (
        "worker.request",
        None,
        10,
        40,
    )
    assert root.attributes == {"a": 1}  # the None was never set
    assert (root.service, root.worker_id, root.status) == ("pagedserve-worker", "w0", "UNSET")
    assert decode.parent_id == root.span_id and decode.trace_id == root.trace_id
    assert decode.attributes == {"reasons": ["length"]}
    assert decode.events == (SpanEvent("preempted", 25, {"pagedserve.preemption": 1}),)
    assert decode.status == "ERROR"
    assert len(root.trace_id) == 32 and len(root.span_id) == 16


def test_line_format_keys_in_order(tmp_path):
    path = tmp_path / "t.jsonl"
    write_two_spans(str(path))
    line = json.loads(path.read_text().splitlines()[0])
    assert list(line) == [
        "trace_id", "span_id", "parent_id", "name", "service", "worker_id",
        "start_ns", "end_ns", "attributes", "events", "status",
    ]  # fmt: skip
    assert line["events"] == [
        {"name": "preempted", "time_ns": 25, "attributes": {"pagedserve.preemption": 1}}
    ]


def test_lines_that_are_not_span_records_are_skipped(tmp_path):
    path = tmp_path / "t.jsonl"
    write_two_spans(str(path))
    good = path.read_text()
    path.write_text('{"trace_id": "ab", "span\n[1, 2]\n{"name": "x"}\n' + good)
    assert [s.name for s in read_spans(str(path))] == ["decode", "worker.request"]
    assert SpanRecord.from_json(good.splitlines()[0]).name == "decode"
