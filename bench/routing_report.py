"""What one run of `pagedserve bench routing` produced, and how it is shown.

Per request a `RequestRecord`; per policy a `PolicySummary` of those records and the router's
cluster stats; then the table, the goal verdicts and the JSON file.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedserve.bench.routing_workload import RoutingBenchConfig
from pagedserve.cluster.router.types import WorkerView

TTFT_GOAL = 3.0  # kv_aware TTFT p50 at least 3x better than round_robin
HIT_RATE_GOAL = 0.90  # hit rate at least 90% of the ideal


@dataclass
class RequestRecord:
    """What one request saw; times in seconds from its scheduled arrival."""

    index: int
    system_prompt: int
    arrival_s: float
    prompt_tokens: int
    ideal_cached_tokens: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    worker_ttft_s: float | None = None  # arrival at the worker → first token, worker clock
    output_tokens: int = 0
    cached_tokens: int = 0
    worker_id: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e_s is not None and self.ttft_s is not None


@dataclass(frozen=True)
class PolicySummary:
    """One policy's latencies, throughput, hit rate and migrations over its successful requests."""

    policy: str
    num_ok: int
    num_errors: int
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    duration_s: float
    requests_per_s: float
    tokens_per_s: float
    hit_rate: float
    ideal_hit_rate: float
    num_misses: int = 0  # requests that found nothing cached
    requests_per_worker: dict[str, int] = field(default_factory=dict)
    pulls: int = 0
    pulled_blocks: int = 0
    pushes: int = 0
    pushed_blocks: int = 0
    blocks_in_use_at_end: int = 0

    @property
    def ratio_to_ideal(self) -> float:
        return self.hit_rate / self.ideal_hit_rate if self.ideal_hit_rate else 0.0


@dataclass
class PolicyResult:
    """One policy's run: its summary, every request's record and the settled cluster stats."""

    summary: PolicySummary
    records: list[RequestRecord]
    cluster_stats: dict[str, Any]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(policy: str, records: list[RequestRecord], stats: dict[str, Any]) -> PolicySummary:
    """One policy's summary.

    Args:
        policy: the routing policy's name.
        records: every request's record; failed ones only count as errors.
        stats: the router's `cluster_stats()` after the run (migration counters, worker pools).

    Returns:
        Percentiles, throughput over first arrival → last finish, hit rates and counters.
    """
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok]
    e2es = [r.e2e_s for r in ok]
    duration = max(r.arrival_s + r.e2e_s for r in ok) - min(r.arrival_s for r in ok) if ok else 0.0
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    per_worker = Counter(_short_worker_id(r.worker_id) for r in ok)
    for worker_id in stats.workers:
        per_worker.setdefault(_short_worker_id(worker_id), 0)
    router = stats.router
    return PolicySummary(
        policy=policy,
        num_ok=len(ok),
        num_errors=len(records) - len(ok),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        e2e_p50_s=percentile(e2es, 50),
        e2e_p99_s=percentile(e2es, 99),
        duration_s=duration,
        requests_per_s=len(ok) / duration if duration else 0.0,
        tokens_per_s=sum(r.output_tokens for r in ok) / duration if duration else 0.0,
        hit_rate=sum(r.cached_tokens for r in ok) / prompt_tokens if prompt_tokens else 0.0,
        ideal_hit_rate=(
            sum(r.ideal_cached_tokens for r in ok) / prompt_tokens if prompt_tokens else 0.0
        ),
        num_misses=sum(1 for r in ok if r.cached_tokens == 0),
        requests_per_worker=dict(sorted(per_worker.items())),
        pulls=router.pulls,
        pulled_blocks=router.pull_blocks,
        pushes=router.pushes,
        pushed_blocks=router.push_blocks,
        blocks_in_use_at_end=sum(used_blocks(w) for w in stats.workers.values()),
    )


def used_blocks(worker: WorkerView) -> int:
    """KV blocks a worker's pool has in use, from its entry in `cluster_stats().workers`."""
    return worker.stats.kv.used_blocks if worker.stats is not None else 0


def _short_worker_id(worker_id: str | None) -> str:
    """`bench-kv_aware-worker-2` → `w2`."""
    return "w" + worker_id.rsplit("-", 1)[-1] if worker_id else "?"


def speedups(summaries: dict[str, PolicySummary]) -> dict[str, float]:
    """kv_aware's TTFT p50 speedup over each other policy that ran (their p50 / its p50)."""
    kv = summaries.get("kv_aware")
    if kv is None or not kv.ttft_p50_s > 0:
        return {}
    return {
        name: s.ttft_p50_s / kv.ttft_p50_s for name, s in summaries.items() if name != "kv_aware"
    }


def format_report(
    config: RoutingBenchConfig, summaries: dict[str, PolicySummary], num_kv_blocks: int
) -> str:
    """The printed report: the run's settings, one row per policy, then the goal verdicts."""
    c = config
    pulled = ", ".join(p for p in c.policies if c.pulls(p)) or "off"
    pushed = ", ".join(p for p in c.policies if c.pushes(p)) or "off"
    options = f"; kv_aware options: {dict(c.kv_aware_options)}" if c.kv_aware_options else ""
    lines = [
        f"routing bench: {c.num_requests} requests, Poisson {c.request_rate:g} req/s "
        f"(seed {c.seed}); {c.num_system_prompts} system prompts x {c.system_prompt_len} tokens "
        f"+ {c.user_len}-token user suffix (constructed: random byte tokens), "
        f"{c.max_tokens} output tokens, greedy",
        f"cluster: {c.num_workers} CPU workers of {c.model}, B={c.block_size}, "
        f"{num_kv_blocks} KV blocks per worker (all {c.num_system_prompts} prefixes: "
        f"{c.prefix_blocks}); pull: {pulled} (pull_min_blocks={c.pull_min_blocks}); "
        f"push: {pushed}{options}",
        "ideal hit rate = sum(ideal_i) / sum(prompt tokens), ideal_i = B*min(S//B, (S+U-1)//B) "
        "for each request after the first of its system prompt, else 0",
        "",
        f"{'policy':<13}{'TTFT p50':>10}{'p99':>9}{'E2E p50':>10}{'p99':>9}{'req/s':>8}"
        f"{'tok/s':>8}{'hit rate':>10}{'ideal':>7}{'/ideal':>8}{'misses':>8}{'pull/push':>11}"
        "  requests per worker",
        *(_row(s) for s in summaries.values()),
        "",
        *_verdicts(summaries),
    ]
    return "\n".join(lines)


def _row(s: PolicySummary) -> str:
    workers = " ".join(f"{w}:{n}" for w, n in s.requests_per_worker.items())
    errors = f"  ({s.num_errors} failed)" if s.num_errors else ""
    return (
        f"{s.policy:<13}{_ms(s.ttft_p50_s):>10}{_ms(s.ttft_p99_s):>9}{_ms(s.e2e_p50_s):>10}"
        f"{_ms(s.e2e_p99_s):>9}{s.requests_per_s:>8.2f}{s.tokens_per_s:>8.1f}"
        f"{s.hit_rate:>10.3f}{s.ideal_hit_rate:>7.3f}{s.ratio_to_ideal:>8.2f}{s.num_misses:>8}"
        f"{f'{s.pulls}/{s.pushes}':>11}  {workers}{errors}"
    )


def _verdicts(summaries: dict[str, PolicySummary]) -> list[str]:
    lines = []
    for name, ratio in speedups(summaries).items():
        goal = f" (goal >= {TTFT_GOAL:g}x: {'met' if ratio >= TTFT_GOAL else 'NOT met'})"
        lines.append(
            f"TTFT p50 speedup of kv_aware over {name} ({name} p50 / kv_aware p50): {ratio:.2f}x"
            + (goal if name == "round_robin" else "")
        )
    if "kv_aware" in summaries:
        ratio = summaries["kv_aware"].ratio_to_ideal
        verdict = "met" if ratio >= HIT_RATE_GOAL else "NOT met"
        lines.append(
            f"kv_aware hit rate / ideal: {ratio:.2f} (goal >= {HIT_RATE_GOAL:.2f}: {verdict})"
        )
    return lines


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f}ms"


def as_json(
    config: RoutingBenchConfig, results: dict[str, PolicyResult], num_kv_blocks: int
) -> dict[str, Any]:
    """The `--json` file: the settings, kv_aware's speedups, and per policy everything measured."""
    summaries = {p: r.summary for p, r in results.items()}
    return {
        "config": asdict(config),
        "num_kv_blocks": num_kv_blocks,
        "kv_aware_ttft_p50_speedup": speedups(summaries),
        "policies": {
            policy: {
                "summary": {**asdict(r.summary), "ratio_to_ideal": r.summary.ratio_to_ideal},
                "records": [asdict(record) for record in r.records],
                "cluster_stats": r.cluster_stats,
            }
            for policy, r in results.items()
        },
    }
