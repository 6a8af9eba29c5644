"""What `pagedserve bench scale` measures and how it is reported: records, summaries, tables.

No Ray here. Each router replica returns a `RouterRun` per load level (its requests, the time
each routing decision took inside `RouterCore.route`, its process CPU and its view's feed
entries); `summarize` folds the runs of one (replicas, rate) cell with the index's counters
into a `ScaleSummary`; `format_report` prints one table per replica count and the rate each
held under the routing-p99 bound.

Hit rate vs oracle: the oracle is one worker holding every system prompt from its first use
on (`routing_workload.ideal_cached_tokens`): the best any routing can do on this workload.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestResult:
    """One request as its router saw it."""

    index: int
    e2e_s: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None


@dataclass(frozen=True)
class RouterRun:
    """One router replica's share of one load level."""

    requests: tuple[RequestResult, ...]
    route_s: tuple[float, ...]  # each decision's wall time inside `RouterCore.route`
    route_cpu_s: tuple[float, ...]  # and the router thread's CPU time over it
    cpu_s: float  # the router process's CPU (user + system) over the window
    view_entries: int  # feed entries its prefix view applied over the window
    window_s: float  # first arrival → last finish


@dataclass(frozen=True)
class ScaleSummary:
    """One (router replicas, offered rate) cell."""

    num_routers: int
    num_workers: int
    offered_rps: float
    completed: int
    errors: int
    achieved_rps: float
    route_p50_ms: float
    route_p99_ms: float
    route_cpu_p50_ms: float
    route_cpu_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    index_events_per_s: float
    view_entries_per_s: float  # per view (every view absorbs the whole feed)
    router_cpu_ms_per_request: float
    router_cpu_us_per_token: float
    router_cpu_util: float  # router CPU seconds per wall second, all replicas together
    host_cpu_util: float  # simulated workers' processes, together
    hit_rate: float
    oracle_hit_rate: float


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(
    num_routers: int,
    num_workers: int,
    offered_rps: float,
    runs: list[RouterRun],
    ideal_cached: int,
    index_events: int,
    host_cpu_s: float,
) -> ScaleSummary:
    """Fold one cell's router runs and the index's event count over the window."""
    requests = [r for run in runs for r in run.requests]
    done = [r for r in requests if r.error is None]
    window = max((run.window_s for run in runs), default=0.0) or 1e-9
    route = [t for run in runs for t in run.route_s]
    route_cpu = [t for run in runs for t in run.route_cpu_s]
    e2e = [r.e2e_s for r in done]
    tokens = sum(r.output_tokens for r in done)
    cpu = sum(run.cpu_s for run in runs)
    prompt = sum(r.prompt_tokens for r in requests) or 1
    return ScaleSummary(
        num_routers=num_routers,
        num_workers=num_workers,
        offered_rps=offered_rps,
        completed=len(done),
        errors=len(requests) - len(done),
        achieved_rps=len(done) / window,
        route_p50_ms=1e3 * percentile(route, 0.5),
        route_p99_ms=1e3 * percentile(route, 0.99),
        route_cpu_p50_ms=1e3 * percentile(route_cpu, 0.5),
        route_cpu_p99_ms=1e3 * percentile(route_cpu, 0.99),
        e2e_p50_ms=1e3 * percentile(e2e, 0.5),
        e2e_p99_ms=1e3 * percentile(e2e, 0.99),
        index_events_per_s=index_events / window,
        view_entries_per_s=statistics.mean(run.view_entries for run in runs) / window,
        router_cpu_ms_per_request=1e3 * cpu / max(1, len(done)),
        router_cpu_us_per_token=1e6 * cpu / max(1, tokens),
        router_cpu_util=cpu / window,
        host_cpu_util=host_cpu_s / window,
        hit_rate=sum(r.cached_tokens for r in done) / prompt,
        oracle_hit_rate=ideal_cached / prompt,
    )


def held_rate(
    cells: list[ScaleSummary], route_p99_ms: float, e2e_p99_ms: float
) -> ScaleSummary | None:
    """The highest offered rate served without errors whose routing p99 stays under
    `route_p99_ms` and whose end-to-end p99 under `e2e_p99_ms` (the workers kept up: an
    open-loop rate they cannot serve grows its queue, and so its tail, without bound)."""
    ok = [
        c
        for c in cells
        if c.errors == 0 and c.route_p99_ms <= route_p99_ms and c.e2e_p99_ms <= e2e_p99_ms
    ]
    return max(ok, key=lambda c: c.offered_rps, default=None)


_COLUMNS = (
    ("offered/s", "offered_rps", "{:.0f}"),
    ("done/s", "achieved_rps", "{:.1f}"),
    ("err", "errors", "{}"),
    ("route p50 ms", "route_p50_ms", "{:.3f}"),
    ("route p99 ms", "route_p99_ms", "{:.3f}"),
    ("route CPU p50 ms", "route_cpu_p50_ms", "{:.3f}"),
    ("route CPU p99 ms", "route_cpu_p99_ms", "{:.3f}"),
    ("e2e p50 ms", "e2e_p50_ms", "{:.0f}"),
    ("e2e p99 ms", "e2e_p99_ms", "{:.0f}"),
    ("index ev/s", "index_events_per_s", "{:.0f}"),
    ("view ent/s", "view_entries_per_s", "{:.0f}"),
    ("rtr CPU ms/req", "router_cpu_ms_per_request", "{:.2f}"),
    ("rtr CPU us/tok", "router_cpu_us_per_token", "{:.0f}"),
    ("rtr cores", "router_cpu_util", "{:.2f}"),
    ("sim cores", "host_cpu_util", "{:.2f}"),
    ("hit", "hit_rate", "{:.1%}"),
    ("oracle", "oracle_hit_rate", "{:.1%}"),
)


def format_table(cells: list[ScaleSummary]) -> str:
    """A Markdown table, one row per cell."""
    lines = [
        "| " + " | ".join(name for name, _, _ in _COLUMNS) + " |",
        "|" + "---:|" * len(_COLUMNS),
    ]
    for cell in cells:
        values = (fmt.format(getattr(cell, attr)) for _, attr, fmt in _COLUMNS)
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)


def format_report(cells: list[ScaleSummary], route_p99_ms: float, e2e_p99_ms: float) -> str:
    out = []
    for num_routers in sorted({c.num_routers for c in cells}):
        mine = [c for c in cells if c.num_routers == num_routers]
        held = held_rate(mine, route_p99_ms, e2e_p99_ms)
        held_text = f"{held.offered_rps:.0f} req/s" if held else "none of the rates"
        out.append(
            f"\n{num_routers} router replica(s), {mine[0].num_workers} simulated workers; "
            f"held at routing p99 <= {route_p99_ms} ms, e2e p99 <= {e2e_p99_ms} ms: "
            f"{held_text}\n"
        )
        out.append(format_table(mine))
    return "\n".join(out)
