"""The router's spans of one request (the worker's are in `workers/telemetry/request_trace.py`).

    pagedserve.request (SERVER; child of the client's traceparent, if any)   ingress, usage
      route                      policy, candidates and their costs, chosen worker, matched blocks
        migration.pull           source, destination, blocks     → worker.import_prefix (worker)
      worker.call (CLIENT)       worker id                       → worker.request (worker process)
      migration.move             source, destination, tokens     → worker.adopt (worker process)

Context crosses into a worker as a W3C `traceparent` carrier: a plain dict given as the
`trace_context` argument of the actor call.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from pagedserve.workers.protocol.requests import GenerateRequest
from pagedserve.workers.protocol.stream import StreamDelta
from pagedserve.workers.telemetry.request_trace import request_attributes
from pagedserve.workers.telemetry.telemetry import AttributeValue, SpanAttributes, Tracing

if TYPE_CHECKING:
    from pagedserve.cluster.router.types import MigrationKind


class RouterTrace:
    """Owns the root span of one request on the router and makes its children.

    Args:
        tracing: the router's tracing (no-op when off).
        request: the `GenerateRequest` (its `trace_context` parents the root span).
        request_id: the request's id.
        model: the served model's name.
    """

    def __init__(self, tracing: Tracing, request: Any, request_id: str, model: str) -> None:
        self.tracing = tracing
        attrs: SpanAttributes = {
            "pagedserve.request_id": request_id,
            "pagedserve.ingress": request.ingress,
            "gen_ai.operation.name": "text_completion",
            "gen_ai.system": "pagedserve",
            "gen_ai.request.model": model or None,
            **request_attributes(request.params),
        }
        parent = tracing.extract(request.trace_context)
        self.root = tracing.start_span("pagedserve.request", parent, attrs, kind=SpanKind.SERVER)
        self.output_tokens = 0
        self.finish_reasons: list[str] = []

    def child(self, name: str, parent: Span | None = None, **attrs: AttributeValue | None) -> Span:
        kind = SpanKind.CLIENT if name == "worker.call" else SpanKind.INTERNAL
        return self.tracing.start_span(name, parent or self.root, attrs, kind=kind)

    def carrier(self, span: Span) -> dict[str, str] | None:
        return self.tracing.inject(span)

    def on_prompt(self, num_tokens: int) -> None:
        self.root.set_attribute("gen_ai.usage.input_tokens", num_tokens)

    def on_delta(self, delta: StreamDelta) -> None:
        if delta.finish_reason is None:
            return
        if delta.usage is not None:
            self.output_tokens += delta.usage.completion_tokens
            self.root.set_attribute("pagedserve.cached_tokens", delta.usage.cached_tokens)
        self.finish_reasons.append(str(delta.finish_reason))

    def end(self, error: BaseException | None = None) -> None:
        self.root.set_attribute("gen_ai.usage.output_tokens", self.output_tokens)
        if self.finish_reasons:
            self.root.set_attribute("gen_ai.response.finish_reasons", self.finish_reasons)
        if error is not None:
            self.root.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        self.root.end()


def migration_span(
    tracing: Tracing,
    parent: Any,
    kind: MigrationKind,
    source: str | None,
    target: Any,
    tokens: int = 0,
) -> Span:
    """A router-side `migration.<kind>` span from `source` (an id) to `target` (a WorkerState)."""
    attrs: SpanAttributes = {
        "pagedserve.migration.kind": kind,
        "pagedserve.migration.source": source,
        "pagedserve.migration.destination": target.worker_id,
        "pagedserve.migration.tokens": tokens or None,
    }
    return tracing.start_span(f"migration.{kind}", parent, attrs)


def pd_transfer_span(
    tracing: Tracing, parent: Any, handoff: Any, source: str | None, target: Any
) -> Span:
    """A router-side `pd.transfer` span: a request handed from the prefill worker `source`
    (an id) to the decode worker `target` (a WorkerState) after its prefill; it lasts while
    the decode worker fetches the KV and streams on (its `worker.adopt` span is a child)."""
    attrs: SpanAttributes = {
        "pagedserve.pd.prefill_worker": source,
        "pagedserve.pd.decode_worker": target.worker_id,
        "pagedserve.pd.tokens": len(handoff.all_token_ids),
        "pagedserve.pd.kv_tokens": handoff.num_computed_tokens,
    }
    return tracing.start_span("pd.transfer", parent, attrs)


def record_decision(span: Span, decision: Any, num_blocks: int, matched: int) -> None:
    """The routing decision on the `route` span: policy, chosen worker, every candidate's cost."""
    if not span.is_recording():
        return
    span.set_attribute("pagedserve.routing.policy", decision.policy)
    span.set_attribute("pagedserve.routing.chosen", decision.worker_id)
    span.set_attribute("pagedserve.routing.prompt_blocks", num_blocks)
    span.set_attribute("pagedserve.routing.matched_blocks", matched)
    span.set_attribute("pagedserve.routing.outcome", "prefix_hit" if matched else "prefix_miss")
    span.set_attribute(
        "pagedserve.routing.candidates",
        [
            json.dumps(
                {
                    "worker": c.worker_id,
                    "cost": c.cost,
                    "matched_blocks": c.matched_blocks,
                    "prefill_blocks": c.prefill_blocks,
                    "load": c.load,
                    "excluded": c.excluded,
                }
            )
            for c in decision.candidates
        ],
    )


TRACE_HEADERS = ("traceparent", "tracestate")


def carrier_from_headers(pairs: Any) -> dict[str, str] | None:
    """The W3C trace-context entries of HTTP headers or gRPC invocation metadata, or None."""
    carrier = {}
    for key, value in pairs or ():
        key = key.lower()
        if key in TRACE_HEADERS:
            carrier[key] = value.decode() if isinstance(value, bytes) else value
    return carrier or None


def tag_ingress(requests: list[GenerateRequest], pairs: Any, ingress: str) -> list[GenerateRequest]:
    """The requests marked with their front end and the caller's trace context (from headers
    or metadata): copies, once per request (a `GenerateRequest` is frozen)."""
    carrier = carrier_from_headers(pairs)
    return [replace(request, trace_context=carrier, ingress=ingress) for request in requests]
