"""`pagedserve trace show [REQUEST_ID]`: a request's span tree as a waterfall in the terminal.

Reads the JSON-lines file that `pagedserve serve --trace-file F.jsonl` writes (one span a line,
from the router and every worker process; each line is read once into a `SpanRecord`, see
`workers/telemetry/trace_file.py`):

    trace 516ec8e9…  request cmpl-1  63.5 ms
    pagedserve.request     router |████████████████████|  63.5 ms  grpc out 16
      route                router |█                   |   0.1 ms  kv_aware → w-0
      worker.call          router |████████████████████|  63.4 ms  w-0
        worker.request     w-0    |████████████████    |  50.5 ms
          queue            w-0    |█                   |   0.7 ms
          prefill          w-0    |█████               |  15.4 ms  in 37 cached 0
            prefill.chunk  w-0    |██                  |   7.1 ms  16 tokens
            prefill.chunk  w-0    |  ██                |   5.4 ms  16 tokens
            prefill.chunk  w-0    |    █               |   3.6 ms  5 tokens
          decode           w-0    |     ███████████    |  33.9 ms  out 16
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

from pagedserve.workers.telemetry.trace_file import SpanRecord, read_spans

BAR_WIDTH = 40


def find_trace(spans: list[SpanRecord], request_id: str | None) -> list[SpanRecord]:
    """The spans of the trace of `request_id` (None: the latest request). Empty if not found."""
    roots = [s for s in spans if s.name == "pagedserve.request"]
    if request_id is not None:
        roots = [s for s in roots if s.attributes.get("pagedserve.request_id") == request_id]
    if not roots:
        return []
    root = max(roots, key=lambda s: s.start_ns)
    return [s for s in spans if s.trace_id == root.trace_id]


def render(trace: list[SpanRecord], width: int = BAR_WIDTH) -> str:
    """The waterfall of one trace: one line per span, children under their parent by start."""
    ids = {s.span_id for s in trace}
    children: dict[str | None, list[SpanRecord]] = defaultdict(list)
    for span in trace:
        parent = span.parent_id if span.parent_id in ids else None
        children[parent].append(span)
    for group in children.values():
        group.sort(key=lambda s: s.start_ns)
    start = min(s.start_ns for s in trace)
    end = max(s.end_ns for s in trace)
    total = max(end - start, 1)
    rows: list[tuple[str, SpanRecord]] = []

    def walk(span: SpanRecord, depth: int) -> None:
        rows.append(("  " * depth + span.name, span))
        for child in children[span.span_id]:
            walk(child, depth + 1)

    for root in children[None]:
        walk(root, 0)
    name_w = max(len(label) for label, _ in rows)
    who_w = max(len(_component(span)) for _, span in rows)
    request = next((s for _, s in rows if s.name == "pagedserve.request"), rows[0][1])
    request_id = request.attributes.get("pagedserve.request_id", "?")
    lines = [f"trace {trace[0].trace_id[:8]}…  request {request_id}  {total / 1e6:.1f} ms"]
    for label, span in rows:
        a = int((span.start_ns - start) / total * width)
        b = max(a + 1, int((span.end_ns - start) / total * width))
        bar = " " * a + "█" * (b - a) + " " * (width - b)
        ms = (span.end_ns - span.start_ns) / 1e6
        who = _component(span)
        summary = _summary(span)
        lines.append(f"{label:<{name_w}}  {who:<{who_w}} |{bar}| {ms:8.1f} ms  {summary}".rstrip())
        for event in span.events:
            if event.name in ("preempted", "abort", "worker_lost", "migration.move.out"):
                at = (event.time_ns - start) / 1e6
                lines.append(f"{'':<{name_w}}  {'':<{who_w}} * {event.name} at {at:.1f} ms")
    return "\n".join(lines)


def _component(span: SpanRecord) -> str:
    if span.service == "pagedserve-worker":
        return str(span.worker_id or span.attributes.get("pagedserve.worker_id") or "worker")
    return "router"


def _summary(span: SpanRecord) -> str:
    a = span.attributes
    name = span.name
    if name == "pagedserve.request":
        return f"{a.get('pagedserve.ingress', '')} out {a.get('gen_ai.usage.output_tokens', '?')}"
    if name == "route":
        return (
            f"{a.get('pagedserve.routing.policy', '')} → {a.get('pagedserve.routing.chosen', '')}"
            f" matched {a.get('pagedserve.routing.matched_blocks', 0)} blocks"
        )
    if name == "worker.call":
        return str(a.get("pagedserve.worker_id", ""))
    if name == "prefill":
        return f"in {a.get('gen_ai.usage.input_tokens')} cached {a.get('pagedserve.cached_tokens')}"
    if name == "prefill.chunk":
        return f"{a.get('pagedserve.tokens')} tokens"
    if name == "decode":
        return (
            f"out {a.get('gen_ai.usage.output_tokens')} preempted {a.get('pagedserve.preemptions')}"
        )
    if name.startswith("migration."):
        return (
            f"{a.get('pagedserve.migration.source')} → {a.get('pagedserve.migration.destination')}"
            f" {a.get('pagedserve.migration.blocks', '')} blocks"
        )
    return ""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("trace", help="look at traces written by serve --trace-file")
    commands = parser.add_subparsers(dest="trace_command", metavar="COMMAND", required=True)
    show = commands.add_parser("show", help="draw a request's span tree as a waterfall")
    show.add_argument("request_id", nargs="?", help="the request id (default: the latest)")
    show.add_argument("--trace-file", default="traces.jsonl", help="default: traces.jsonl")
    show.add_argument("--width", type=int, default=BAR_WIDTH, help="bar width in characters")
    show.set_defaults(func=run_show)


def run_show(args: argparse.Namespace) -> int:
    try:
        spans = read_spans(args.trace_file)
    except OSError as error:
        print(f"pagedserve trace show: error: {error}", file=sys.stderr)
        return 2
    trace = find_trace(spans, args.request_id)
    if not trace:
        what = f"request {args.request_id!r}" if args.request_id else "any request"
        print(f"pagedserve trace show: no trace of {what} in {args.trace_file}", file=sys.stderr)
        return 1
    print(render(trace, args.width))
    return 0
