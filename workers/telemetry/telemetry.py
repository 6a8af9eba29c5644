"""Tracing for every process of the cluster, behind one module with a no-op fallback.

Both the router (`cluster/`) and the workers use this module, so it lives in `workers/` (which
never imports `cluster`). It owns the per-process `TracerProvider` and the W3C trace-context
propagation; everything else asks it for a `Tracing` object and makes spans through that.

    tracing = get_tracing(TelemetryConfig.from_dict({"exporter": "otlp"}), "pagedserve-worker",
                          worker_id="w0")
    span = tracing.start_span("worker.request", parent=tracing.extract(trace_context))
    ...
    carrier = tracing.inject(span)   # {"traceparent": "00-..."}: crosses Ray and gRPC calls
    span.end()

Spans are never made "current" (no `with start_as_current_span`): the router and worker are
async generators that suspend between tokens, where a context token attached in one step cannot
be detached in another. Parents are passed explicitly instead.

Off (`exporter: none`, the default) or without the OpenTelemetry SDK, `Tracing` wraps the API's
no-op tracer: spans cost one object and record nothing.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

EXPORTERS = ("none", "otlp", "console", "file")
ROUTER_SERVICE = "pagedserve-router"
WORKER_SERVICE = "pagedserve-worker"
_PROPAGATOR = TraceContextTextMapPropagator()

# An OpenTelemetry attribute value: a primitive or a sequence of one type of them (what the
# spec allows; the SDK drops anything else with a warning).
AttributeValue = (
    str | bool | int | float | Sequence[str] | Sequence[bool] | Sequence[int] | Sequence[float]
)
# Attributes as this code builds them for a span: a None value ("not known", e.g. an unset
# seed) is left off the span, since OpenTelemetry has no null.
SpanAttributes = dict[str, AttributeValue | None]


@dataclass(frozen=True)
class TelemetryConfig:
    """How this app traces and measures.

    Attributes:
        exporter: `otlp` (to `endpoint`, else `OTEL_EXPORTER_OTLP_ENDPOINT`), `console`,
            `file` (JSON lines to `trace_file`, for `pagedserve trace show`) or `none`.
            Unset in the data: `OTEL_TRACES_EXPORTER` if set, else `file` with a `trace_file`,
            else `none`.
        trace_file: where the `file` exporter appends spans.
        endpoint: OTLP/gRPC endpoint (`host:port` or a URL); None: the standard OTEL_*
            variables (`OTEL_EXPORTER_OTLP_ENDPOINT`, default localhost:4317).
        insecure: OTLP without TLS; None: plain unless the endpoint is `https://` (or, with no
            endpoint, as `OTEL_EXPORTER_OTLP_INSECURE` says).
        export_delay_ms: the batch span processor's schedule delay.
        metrics: serve Prometheus metrics at the router's `/metrics`.
    """

    exporter: str = "none"
    trace_file: str | None = None
    endpoint: str | None = None
    insecure: bool | None = None
    export_delay_ms: int = 1000
    metrics: bool = True

    def __post_init__(self) -> None:
        if self.exporter not in EXPORTERS:
            raise ValueError(
                f"telemetry.exporter must be one of {EXPORTERS}, got {self.exporter!r}"
            )
        if self.exporter == "file" and not self.trace_file:
            raise ValueError("telemetry.exporter 'file' needs telemetry.trace_file")

    @classmethod
    def from_dict(
        cls, data: dict[str, Any] | None, env: dict[str, str] | None = None
    ) -> TelemetryConfig:
        """Build from plain data; `env` (default: this process's) supplies `exporter` when the
        data leaves it out, from the standard `OTEL_TRACES_EXPORTER`."""
        data = dict(data or {})
        env = os.environ if env is None else env
        if "exporter" not in data and env.get("OTEL_TRACES_EXPORTER") in EXPORTERS:
            data["exporter"] = env["OTEL_TRACES_EXPORTER"]
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown telemetry keys: {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        if data.get("trace_file") and "exporter" not in data:
            data["exporter"] = "file"
        return cls(**data)


class Tracing:
    """Makes spans for one component of one process and moves their context across calls.

    Args:
        tracer: an OpenTelemetry tracer (the no-op one when tracing is off).
        provider: the SDK provider behind it, flushed by `flush` (None when off).
    """

    def __init__(self, tracer: Any, provider: Any = None) -> None:
        self.tracer = tracer
        self.provider = provider

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def start_span(
        self,
        name: str,
        parent: Any = None,
        attributes: SpanAttributes | None = None,
        start_ns: int | None = None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
    ) -> trace.Span:
        """A started span; `parent` is a span, a context (from `extract`) or None (a root)."""
        if isinstance(parent, trace.Span):
            parent = trace.set_span_in_context(parent)
        return self.tracer.start_span(
            name, context=parent, kind=kind, attributes=_clean(attributes), start_time=start_ns
        )

    def inject(self, span: trace.Span | None) -> dict[str, str] | None:
        """The W3C `traceparent` (and `tracestate`) of `span`, as a plain dict, or None."""
        if span is None or not span.get_span_context().is_valid:
            return None
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return carrier or None

    @staticmethod
    def extract(carrier: dict[str, str] | None) -> Any:
        """The context a `traceparent` carrier names, or None (then spans start a new trace)."""
        if not carrier:
            return None
        return _PROPAGATOR.extract(carrier=carrier)

    def flush(self, timeout_ms: int = 5000) -> None:
        if self.provider is not None:
            self.provider.force_flush(timeout_ms)


NOOP = Tracing(trace.NoOpTracer())
_PROCESS: dict[tuple, Tracing] = {}
_LOCK = threading.Lock()


def get_tracing(config: TelemetryConfig | None, service: str, **resource: str) -> Tracing:
    """This process's tracing for `service` (one provider per process and settings).

    Args:
        config: the telemetry config; None or `exporter: none` gives the no-op tracer.
        service: `service.name` of the resource (`pagedserve-router` or `pagedserve-worker`).
        resource: more resource attributes, e.g. `worker_id="w0"` (as `pagedserve.worker_id`).
    """
    if config is None or config.exporter == "none":
        return NOOP
    key = (config, service, tuple(sorted(resource.items())))
    with _LOCK:
        if key not in _PROCESS:
            _PROCESS[key] = _build(config, service, resource)
        return _PROCESS[key]


def worker_tracing(telemetry: TelemetryConfig | None, worker_id: str) -> Tracing:
    """A worker actor's tracing from the `TelemetryConfig` it was created with."""
    return get_tracing(telemetry or TelemetryConfig(), WORKER_SERVICE, worker_id=worker_id)


def _build(config: TelemetryConfig, service: str, resource: dict[str, str]) -> Tracing:
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        logger.warning("opentelemetry-sdk is not installed; tracing is off")
        return NOOP
    attrs = {"service.name": service, "service.namespace": "pagedserve"}
    attrs.update({f"pagedserve.{k}": v for k, v in resource.items()})
    # The SDK reads OTEL_TRACES_SAMPLER / _ARG itself when no sampler is given.
    provider = TracerProvider(resource=Resource.create(attrs))
    provider.add_span_processor(
        BatchSpanProcessor(_exporter(config), schedule_delay_millis=config.export_delay_ms)
    )
    return Tracing(provider.get_tracer("pagedserve"), provider)


def _exporter(config: TelemetryConfig) -> Any:
    if config.exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = config.insecure
        if insecure is None and config.endpoint:
            insecure = not config.endpoint.startswith("https://")
        return OTLPSpanExporter(endpoint=config.endpoint, insecure=insecure)
    if config.exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    from pagedserve.workers.telemetry.trace_file import JsonlSpanExporter  # it imports this module

    return JsonlSpanExporter(config.trace_file)


def _clean(attributes: SpanAttributes | None) -> dict[str, AttributeValue] | None:
    """Drop None values (OpenTelemetry rejects them)."""
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if v is not None}


def otel_env() -> dict[str, str]:
    """The standard OTEL_* variables of this process, to hand to the actors it starts."""
    return {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}
