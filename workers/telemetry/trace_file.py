"""The trace file (`telemetry.exporter: file`): one JSON object per finished span, a line each.

`JsonlSpanExporter` writes it from every process of a one-machine cluster; `pagedserve trace
show` (`cluster/trace_view`) reads it back. `SpanRecord` is a line's shape both ways, so the
writer and the reader cannot disagree on a key:

    {"trace_id": "<32 hex>", "span_id": "<16 hex>", "parent_id": "<16 hex>" | null,
     "name": "prefill", "service": "pagedserve-worker", "worker_id": "w0" | null,
     "start_ns": 1733.., "end_ns": 1733.., "attributes": {"pagedserve.cached_tokens": 0, ...},
     "events": [{"name": "preempted", "time_ns": 1733.., "attributes": {...}}],
     "status": "UNSET" | "OK" | "ERROR"}
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.workers.telemetry.telemetry import AttributeValue

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExportResult


@dataclass(frozen=True)
class SpanEvent:
    """A point in time on a span (`preempted`, `abort`, `finish`, ...)."""

    name: str
    time_ns: int
    attributes: dict[str, AttributeValue]


@dataclass(frozen=True)
class SpanRecord:
    """One finished span as the trace file holds it (ids in lower-case hex).

    Attributes:
        service: the resource's `service.name` (`pagedserve-router` or `pagedserve-worker`).
        worker_id: the resource's `pagedserve.worker_id` (None in the router).
        status: the name of the span's status code.
    """

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str | None
    worker_id: str | None
    start_ns: int
    end_ns: int
    attributes: dict[str, AttributeValue]
    events: tuple[SpanEvent, ...]
    status: str

    @classmethod
    def of_span(cls, span: ReadableSpan) -> SpanRecord:
        """The record of a finished SDK span."""
        ctx = span.get_span_context()
        resource = span.resource.attributes
        return cls(
            trace_id=f"{ctx.trace_id:032x}",
            span_id=f"{ctx.span_id:016x}",
            parent_id=f"{span.parent.span_id:016x}" if span.parent else None,
            name=span.name,
            service=resource.get("service.name"),
            worker_id=resource.get("pagedserve.worker_id"),
            start_ns=span.start_time,
            end_ns=span.end_time,
            attributes=dict(span.attributes or {}),
            events=tuple(
                SpanEvent(e.name, e.timestamp, dict(e.attributes or {})) for e in span.events
            ),
            status=span.status.status_code.name,
        )

    def to_json(self) -> str:
        """The record as one line of the file (without the newline)."""
        return json.dumps(dataclasses.asdict(self), default=str)

    @classmethod
    def from_json(cls, line: str) -> SpanRecord:
        """Parse one line; ValueError if it is not JSON or not a span record."""
        data = json.loads(line)
        try:
            events = tuple(SpanEvent(**event) for event in data.pop("events", ()))
            return cls(**data, events=events)
        except (AttributeError, TypeError) as error:  # not an object, or keys missing/unknown
            raise ValueError(f"not a span record: {error}") from None


def read_spans(path: str) -> list[SpanRecord]:
    """Every span in a trace file; lines that are not span records (a line cut short by a
    process that died mid-write) are skipped."""
    spans = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                spans.append(SpanRecord.from_json(line))
            except ValueError:
                continue
    return spans


class JsonlSpanExporter:
    """Appends one `SpanRecord` line per span to a file (every process of a one-machine
    cluster may share it: each batch is one `write` on a file opened for appending)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = "".join(SpanRecord.of_span(s).to_json() + "\n" for s in spans)
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
