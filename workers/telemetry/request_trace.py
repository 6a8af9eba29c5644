"""One request's spans on a worker, made from what the engine already records.

The engine is not threaded with spans: `WorkerCore` opens a `RequestTrace` when a request
arrives and feeds it the deltas it streams. The final delta carries the request's
`RequestMetrics` (queue time, TTFT, E2E on the engine's clock), from which the phases are drawn
after the fact. Prefill chunks are seen by `RequestTraces`, which compares each traced request's
computed tokens before and after every engine step; a load of the request's prefix from the
host or disk tier (`Engine.step_tier_loads`) is a `kv.tier_load` span as soon as its step ends:

    worker.request  ├──────────────────────────────────────────────┤  (child of the router's call)
      kv.tier_load    ├┤                                              prefix loaded from host/disk
      queue         ├────┤                                            add → first scheduled
      prefill            ├──────┤                                     first scheduled → first token
        prefill.chunk    ├─┤├──┤                                      one per engine step (tokens)
      decode                    ├─────────────────────────────────────┤ first token → finish
                                   * preempted (events)                 finish: reason, usage
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from pagedserve.workers.kv.tiers import StepTierLoad, TierLoad
from pagedserve.workers.protocol.sampling import SamplingParams
from pagedserve.workers.protocol.stream import RequestMoved, StreamDelta
from pagedserve.workers.telemetry.telemetry import NOOP, SpanAttributes, Tracing

logger = logging.getLogger(__name__)


class RequestTrace:
    """Owns the `worker.request` span of one request (or of one adopted continuation).

    Args:
        tracing: this worker's tracing (no-op when off).
        trace_context: the W3C carrier the router sent with the call (None: a new trace).
        request_id: the request's id.
        worker_id: this worker.
        params: the request's sampling params.
        name: the span name (`worker.request`, or `worker.adopt` for a moved request).
    """

    def __init__(
        self,
        tracing: Tracing,
        trace_context: dict[str, str] | None,
        request_id: str,
        worker_id: str,
        params: SamplingParams | None,
        name: str = "worker.request",
    ) -> None:
        self.tracing = tracing
        self.request_id = request_id
        self.start_ns = time.time_ns()
        # An adopted request's metrics count from its arrival at the source, this long before
        # the span began (`HandoffTimings`); its phases are drawn within the span.
        self.elapsed_ns = 0
        attrs: SpanAttributes = {
            "pagedserve.request_id": request_id,
            "pagedserve.worker_id": worker_id,
        }
        if params is not None:
            attrs.update(request_attributes(params))
        self.span = tracing.start_span(
            name, tracing.extract(trace_context), attrs, self.start_ns, SpanKind.SERVER
        )
        self._phases_drawn = False
        self.prefill_chunks: list[tuple[int, int, int]] = []  # (start ns, end ns, tokens)

    def on_delta(self, delta: StreamDelta | RequestMoved) -> None:
        if self.tracing is NOOP:
            return
        if isinstance(delta, RequestMoved):
            self.span.add_event(
                "migration.move.out",
                {"pagedserve.worker_id": delta.worker_id, "pagedserve.branch": delta.index},
            )
            return
        if delta.finish_reason is None:
            return
        try:
            self._on_finish(delta)
        except Exception:  # a tracing bug must never fail a request
            logger.exception("recording the spans of %s failed", delta.request_id)

    def _on_finish(self, delta: StreamDelta) -> None:
        if not self._phases_drawn and delta.metrics is not None and delta.usage is not None:
            self._phases_drawn = True
            self._draw_phases(delta)
        usage = delta.usage
        self.span.add_event(
            "finish",
            {
                "gen_ai.response.finish_reasons": [str(delta.finish_reason)],
                "pagedserve.branch": delta.index,
                "gen_ai.usage.output_tokens": usage.completion_tokens if usage else 0,
            },
        )
        if usage is not None:
            self.span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
            self.span.set_attribute("pagedserve.cached_tokens", usage.cached_tokens)
        if delta.error:
            self.span.set_status(Status(StatusCode.ERROR, delta.error))

    def _draw_phases(self, delta: StreamDelta) -> None:
        metrics, usage = delta.metrics, delta.usage
        arrival = self.start_ns - self.elapsed_ns
        end = time.time_ns()
        at = lambda seconds: max(self.start_ns, arrival + int(seconds * 1e9))  # noqa: E731
        scheduled = at(metrics.queue_time) if metrics.queue_time is not None else end
        first_token = at(metrics.ttft) if metrics.ttft is not None else end
        finished = min(at(metrics.e2e), end) if metrics.e2e is not None else end
        self._phase("queue", arrival, scheduled, {})
        self.prefill = self._phase(
            "prefill",
            scheduled,
            first_token,
            {
                "gen_ai.usage.input_tokens": usage.prompt_tokens,
                "pagedserve.cached_tokens": usage.cached_tokens,
                "pagedserve.prefill_tokens": usage.prompt_tokens - usage.cached_tokens,
                "pagedserve.prefill_chunks": len(self.prefill_chunks),
            },
        )
        for start, stop, tokens in self.prefill_chunks:  # a step's span, within the phase
            start, stop = max(start, scheduled), min(stop, first_token)
            self._phase("prefill.chunk", start, stop, {"pagedserve.tokens": tokens}, self.prefill)
        decode = self._phase(
            "decode",
            first_token,
            finished,
            {
                "gen_ai.usage.output_tokens": usage.completion_tokens,
                "pagedserve.preemptions": metrics.num_preemptions,
                "pagedserve.tpot_s": metrics.tpot,
            },
            end_span=False,
        )
        for i in range(metrics.num_preemptions):
            decode.add_event("preempted", {"pagedserve.preemption": i + 1})
        if metrics.num_verify_steps:
            drafts, accepted = metrics.num_draft_tokens, metrics.num_accepted_tokens
            decode.add_event(
                "speculative",
                {
                    "pagedserve.spec.verify_steps": metrics.num_verify_steps,
                    "pagedserve.spec.draft_tokens": drafts,
                    "pagedserve.spec.accepted_tokens": accepted,
                    "pagedserve.spec.acceptance_rate": accepted / drafts if drafts else 0.0,
                },
            )
        decode.end(finished)

    def _phase(
        self,
        name: str,
        start: int,
        end: int,
        attrs: SpanAttributes,
        parent: Span | None = None,
        *,
        end_span: bool = True,
    ) -> Span:
        span = self.tracing.start_span(name, parent or self.span, attrs, start)
        if end_span:
            span.end(max(start, end))
        return span

    def tier_load(self, start_ns: int, end_ns: int, load: TierLoad) -> None:
        """The `kv.tier_load` span of one load of this request's prefix from the lower tiers."""
        attrs = {
            "pagedserve.tier_load.blocks": load.blocks,
            "pagedserve.tier_load.host_blocks": load.host_blocks,
            "pagedserve.tier_load.disk_blocks": load.disk_blocks,
        }
        self._phase("kv.tier_load", start_ns, end_ns, attrs)

    def end(self, aborted: bool = False) -> None:
        if aborted:
            self.span.add_event("abort")
        self.span.end()


def request_attributes(params: SamplingParams) -> SpanAttributes:
    """GenAI semantic-convention attributes of a request's sampling params."""
    return {
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.top_k": params.top_k if params.top_k and params.top_k > 0 else None,
        "gen_ai.request.seed": params.seed,
        "gen_ai.request.choice.count": params.n,
    }


class RequestTraces:
    """Owns the open `RequestTrace` of every request on one worker, and sees prefill chunks.

    Args:
        tracing: this worker's tracing (no-op when off: then nothing is tracked at all).
        worker_id: this worker.
    """

    def __init__(self, tracing: Tracing, worker_id: str) -> None:
        self.tracing = tracing
        self.worker_id = worker_id
        self._open: dict[str, RequestTrace] = {}

    def open(self, request_id, trace_context, params, name="worker.request") -> RequestTrace:
        trace = RequestTrace(self.tracing, trace_context, request_id, self.worker_id, params, name)
        if self.tracing is not NOOP:  # a duplicate id (rejected) must not displace the first
            self._open.setdefault(request_id, trace)
        return trace

    def close(self, trace: RequestTrace, aborted: bool) -> None:
        if self._open.get(trace.request_id) is trace:
            del self._open[trace.request_id]
        trace.end(aborted)

    def before_step(self, scheduler: Any) -> dict[Any, int] | None:
        """Computed tokens of every traced request still prefilling (call on the engine's
        thread, before the step)."""
        if not self._open:
            return None
        return {
            r: r.num_computed_tokens
            for queue in (scheduler.waiting, scheduler.running)
            for r in queue
            if r.group_id in self._open and r.branch_index == 0 and r.is_prefilling
        }

    def on_tier_loads(self, loads: Sequence[StepTierLoad]) -> None:
        """Each traced request whose prefix a step loaded from a lower tier gets the span."""
        for step_load in loads:
            trace = self._open.get(step_load.group_id)
            if trace is not None:
                trace.tier_load(step_load.start_ns, step_load.end_ns, step_load.load)

    def after_step(self, before: dict[Any, int] | None, start_ns: int) -> None:
        """Each request that computed prompt tokens in the step gets a prefill chunk."""
        if not before:
            return
        end_ns = time.time_ns()
        for request, computed in before.items():
            trace = self._open.get(request.group_id)
            if trace is not None and request.num_computed_tokens > computed:
                tokens = request.num_computed_tokens - computed
                trace.prefill_chunks.append((start_ns, end_ns, tokens))


def migration_span(traces: RequestTraces, trace_context, num_blocks: int) -> Any:
    """The worker side of a pull or push: a `worker.import_prefix` span (bytes set on it)."""
    attrs = {
        "pagedserve.worker_id": traces.worker_id,
        "pagedserve.migration.blocks_asked": num_blocks,
    }
    tracing = traces.tracing
    return tracing.start_span("worker.import_prefix", tracing.extract(trace_context), attrs)
