"""`pagedserve bench routing`: routing policies on one shared-prefix workload, same arrivals.

Workload (constructed from `--seed`, no dataset): K system prompts of S random byte tokens each;
request i picks one of them uniformly and appends U random tokens of its own; arrivals are a
Poisson process at `--request-rate` (exponential gaps). Every request is greedy and produces
exactly `--max-tokens` tokens (`ignore_eos`).

Each policy runs in turn on a fresh worker group (prefix index + N CPU workers of tiny-llama)
with a `RouterCore` in this process. By default only kv_aware runs with the cluster's KV
migrations (pull when routing, push under eviction pressure); the others run plain (`--pull`,
`--push`). Every worker first serves one short warm-up request of its own (random tokens no
request shares), so model start-up and first-forward costs are excluded. Then the requests go
out at their arrival times as concurrent tasks. Per request:

    TTFT    scheduled arrival → first delta carrying tokens (routing, index lookup, any pull,
            queueing and prefill included)
    E2E     scheduled arrival → final delta
    cached  `usage.cached_tokens` of the final delta (blocks pulled or pushed count too)

Prefix hit rate = Σ cached / Σ prompt tokens. The ideal is what one worker holding every prefix
would get: request i, with block size B, hits

    ideal_i = B · min(⌊S/B⌋, ⌊(S+U−1)/B⌋)   when an earlier request used its system prompt,
    ideal_i = 0                             for the first request of each system prompt,

(the full blocks of its system prompt; the engine always leaves one token to compute), and the
ideal hit rate is Σ ideal_i / Σ (S+U). Throughput is over the window from the first arrival to
the last finish. Goals: kv_aware's TTFT p50 ≥ 3x better than round_robin's, and its hit rate
≥ 90% of the ideal.

The defaults fit a 2-core machine in a few minutes. A default pool (256 MiB per worker) holds
every system prompt, so round_robin too ends up caching every prefix on every worker: it misses
only the first request of each prompt on each worker (about K·N requests), its median request
is a hit as kv_aware's is, and the policies differ in hit rate more than in TTFT p50. With
`--num-kv-blocks` below K prefixes per worker the others keep evicting while kv_aware keeps each
prefix on few workers, and the TTFT p50 gap opens.

    $ pagedserve bench routing --json routing.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

POLICIES = ("kv_aware", "round_robin", "least_loaded")
MIGRATION_MODES = ("none", "kv_aware", "all")  # which policies run with pull (or push) on
TTFT_GOAL = 3.0  # kv_aware TTFT p50 at least 3x better than round_robin
HIT_RATE_GOAL = 0.90  # hit rate at least 90% of the ideal

_WARMUP_PROMPT_LEN = 40
_WARMUP_TOKENS = 2
_SETTLE_S = 10.0  # how long workers get to report idle pools after the run


@dataclass(frozen=True)
class RoutingBenchConfig:
    """One run's settings (`num_kv_blocks` None: the engine default, 256 MiB per CPU worker)."""

    policies: tuple[str, ...] = POLICIES
    num_workers: int = 3
    num_requests: int = 96
    request_rate: float = 6.0
    num_system_prompts: int = 8
    system_prompt_len: int = 1024
    user_len: int = 32
    max_tokens: int = 16
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None
    pull: str = "kv_aware"
    pull_min_blocks: int = 4
    push: str = "kv_aware"
    worker_num_cpus: float = 1.0
    kv_aware_options: tuple[tuple[str, Any], ...] = ()  # KvAwarePolicy keyword options

    def __post_init__(self) -> None:
        unknown = sorted(set(self.policies) - set(POLICIES))
        if unknown or not self.policies:
            raise ValueError(f"policies must be some of {POLICIES}, got {self.policies}")
        for name in ("pull", "push"):
            if getattr(self, name) not in MIGRATION_MODES:
                raise ValueError(f"{name} must be one of {MIGRATION_MODES}")
        for name in ("num_workers", "num_requests", "num_system_prompts", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.system_prompt_len < 1 or self.user_len < 0:
            raise ValueError("system_prompt_len must be >= 1 and user_len >= 0")
        if self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")

    def pulls(self, policy: str) -> bool:
        return self.pull in ("all", policy)

    def pushes(self, policy: str) -> bool:
        return self.push in ("all", policy)

    @property
    def prefix_blocks(self) -> int:
        """KV blocks one worker needs to cache every system prompt."""
        return self.num_system_prompts * -(-self.system_prompt_len // self.block_size)


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    arrival_s: float
    system_prompt: int
    token_ids: tuple[int, ...]


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


# --- workload ------------------------------------------------------------------------------


def make_workload(config: RoutingBenchConfig) -> list[PlannedRequest]:
    """The seeded requests every policy gets: prompts, suffixes and Poisson arrival times."""
    rng = random.Random(config.seed)
    systems = [
        [rng.randrange(256) for _ in range(config.system_prompt_len)]
        for _ in range(config.num_system_prompts)
    ]
    requests, now = [], 0.0
    for index in range(config.num_requests):
        now += rng.expovariate(config.request_rate) if index else 0.0
        which = rng.randrange(config.num_system_prompts)
        user = [rng.randrange(256) for _ in range(config.user_len)]
        requests.append(PlannedRequest(index, now, which, tuple(systems[which] + user)))
    return requests


def ideal_cached_tokens(
    workload: list[PlannedRequest], system_prompt_len: int, block_size: int
) -> list[int]:
    """Per request (in `workload` order), the tokens one worker holding every prefix would
    find cached: the full blocks of its system prompt, unless it is the first of that prompt."""
    first_arrival: dict[int, int] = {}
    for request in sorted(workload, key=lambda r: (r.arrival_s, r.index)):
        first_arrival.setdefault(request.system_prompt, request.index)
    ideal = []
    for request in workload:
        full_blocks = min(system_prompt_len, len(request.token_ids) - 1) // block_size
        first = first_arrival[request.system_prompt] == request.index
        ideal.append(0 if first else full_blocks * block_size)
    return ideal


# --- one policy ----------------------------------------------------------------------------


@dataclass
class PolicyResult:
    summary: PolicySummary
    records: list[RequestRecord]
    cluster_stats: dict[str, Any]


def cluster_config(config: RoutingBenchConfig, policy: str):
    """The `ClusterConfig` of one policy's worker group."""
    from pagedserve.cluster.config import ClusterConfig
    from pagedserve.workers.engine_config import EngineConfig

    engine = EngineConfig(
        model="tiny-llama", block_size=config.block_size, num_kv_blocks=config.num_kv_blocks
    )
    # The router builds the policy from `routing_options` alone, so kv_aware learns the block
    # size here (it turns in-flight tokens into blocks).
    options = {"block_size": config.block_size, **dict(config.kv_aware_options)}
    options = options if policy == "kv_aware" else {}
    return ClusterConfig(
        engine=engine,
        num_workers=config.num_workers,
        worker_num_cpus=config.worker_num_cpus,
        routing_policy=policy,
        routing_options=options,
        enable_pull=config.pulls(policy),
        pull_min_blocks=config.pull_min_blocks,
        enable_push=config.pushes(policy),
        name=f"bench-{policy}",
    )


def run_policy(
    config: RoutingBenchConfig, policy: str, workload: list[PlannedRequest]
) -> PolicyResult:
    """Start a fresh worker group for `policy`, run the workload on it, stop the group."""
    from pagedserve.cluster.worker_group import start_worker_group, stop_worker_group

    cluster = cluster_config(config, policy)
    index, workers = start_worker_group(cluster)
    try:
        return asyncio.run(_measure(config, cluster, index, workers, workload))
    finally:
        stop_worker_group(cluster)


async def _measure(config, cluster, index, workers, workload) -> PolicyResult:
    from pagedserve.cluster.router import RouterCore

    core = RouterCore(cluster, index, workers)
    try:
        await core.start()
        await asyncio.gather(*(_warm_up(wid, handle) for wid, handle in workers.items()))
        ideal = ideal_cached_tokens(workload, config.system_prompt_len, config.block_size)
        loop = asyncio.get_running_loop()
        t0 = loop.time() + 0.1  # every task is scheduled before the first arrival
        records = await asyncio.gather(
            *(
                _send(core, planned, t0, ideal[planned.index], config.max_tokens)
                for planned in workload
            )
        )
        stats = await _settled_stats(core)
    finally:
        await core.close()
    summary = summarize(cluster.routing_policy, records, stats)
    return PolicyResult(summary, list(records), stats)


async def _warm_up(worker_id: str, handle: Any) -> None:
    """One short request straight to the worker: its first forward is slow, keep it out."""
    from pagedserve.workers.sampling_params import SamplingParams

    rng = random.Random(f"warm-up {worker_id}")
    tokens = [rng.randrange(256) for _ in range(_WARMUP_PROMPT_LEN)]
    params = SamplingParams(max_tokens=_WARMUP_TOKENS, temperature=0.0, ignore_eos=True)
    async for ref in handle.generate.remote(f"warm-up-{worker_id}", tokens, params):
        await ref


async def _send(
    core, planned: PlannedRequest, t0: float, ideal: int, max_tokens: int
) -> RequestRecord:
    """Send one request at its arrival time and time its stream."""
    from pagedserve.cluster.router import GenerateRequest
    from pagedserve.workers.sampling_params import SamplingParams

    loop = asyncio.get_running_loop()
    arrived = t0 + planned.arrival_s
    await asyncio.sleep(max(0.0, arrived - loop.time()))
    record = RequestRecord(
        planned.index, planned.system_prompt, planned.arrival_s, len(planned.token_ids), ideal
    )
    request = GenerateRequest(
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        prompt_token_ids=list(planned.token_ids),
        request_id=f"bench-{planned.index}",
    )
    try:
        async for delta in core.generate(request):
            now = loop.time()
            if delta.token_ids and record.ttft_s is None:
                record.ttft_s = now - arrived
            record.output_tokens += len(delta.token_ids)
            record.worker_id = delta.worker_id
            if delta.finish_reason is not None:
                record.e2e_s = now - arrived
                record.cached_tokens = delta.usage.cached_tokens if delta.usage else 0
                record.worker_ttft_s = delta.metrics.ttft if delta.metrics else None
                record.error = delta.error
    except Exception as error:  # recorded and counted; one failure must not end the run
        record.error = f"{type(error).__name__}: {error}"
    return record


async def _settled_stats(core) -> dict[str, Any]:
    """The router's cluster stats once every worker's pool is idle (or the deadline passed)."""
    deadline = time.monotonic() + _SETTLE_S
    while True:
        stats = await core.cluster_stats()
        busy = [w for w in stats["workers"].values() if w.get("num_streams") or _used_blocks(w)]
        if not busy or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.1)


# --- summary -------------------------------------------------------------------------------


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
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok]
    e2es = [r.e2e_s for r in ok]
    duration = max(r.arrival_s + r.e2e_s for r in ok) - min(r.arrival_s for r in ok) if ok else 0.0
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    per_worker = Counter(_short_worker_id(r.worker_id) for r in ok)
    for worker_id in stats["workers"]:
        per_worker.setdefault(_short_worker_id(worker_id), 0)
    router = stats["router"]
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
        pulls=router.get("migrations.pull", 0),
        pulled_blocks=router.get("migrations.pull_blocks", 0),
        pushes=router.get("migrations.push", 0),
        pushed_blocks=router.get("migrations.push_blocks", 0),
        blocks_in_use_at_end=sum(_used_blocks(w) for w in stats["workers"].values()),
    )


def _used_blocks(worker_stats: dict[str, Any]) -> int:
    return worker_stats.get("kv", {}).get("used_blocks", 0)


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
    c = config
    pulled = ", ".join(p for p in c.policies if c.pulls(p)) or "off"
    pushed = ", ".join(p for p in c.policies if c.pushes(p)) or "off"
    options = f"; kv_aware options: {dict(c.kv_aware_options)}" if c.kv_aware_options else ""
    lines = [
        f"routing bench: {c.num_requests} requests, Poisson {c.request_rate:g} req/s "
        f"(seed {c.seed}); {c.num_system_prompts} system prompts x {c.system_prompt_len} tokens "
        f"+ {c.user_len}-token user suffix (constructed: random byte tokens), "
        f"{c.max_tokens} output tokens, greedy",
        f"cluster: {c.num_workers} CPU workers of tiny-llama, B={c.block_size}, "
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


# --- command line --------------------------------------------------------------------------


def ensure_ray(address: str | None, num_cpus: int) -> None:
    """Join `address`, or start a local Ray with `num_cpus` CPUs, unless already initialised."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        # "local": a new cluster even when another one runs on this machine.
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)


def run_routing_bench(config: RoutingBenchConfig) -> tuple[dict[str, PolicyResult], int]:
    """Every policy of `config` in turn on the same workload; also returns the pool size."""
    workload = make_workload(config)
    results = {}
    for policy in config.policies:
        results[policy] = run_policy(config, policy, workload)
    any_stats = next(iter(results.values())).cluster_stats["workers"].values()
    num_kv_blocks = next(iter(any_stats))["kv"]["total_blocks"]
    return results, num_kv_blocks


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each flag; the module docstring kept as written."""


def register(subparsers: argparse._SubParsersAction) -> None:
    d = RoutingBenchConfig()
    parser = subparsers.add_parser(
        "routing",
        help="kv_aware vs round_robin vs least_loaded on a shared-prefix workload",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    add = parser.add_argument
    add("--policies", nargs="+", choices=POLICIES, default=list(d.policies), help="run in turn")
    add("--num-workers", type=int, default=d.num_workers, help="CPU workers per policy")
    add("--num-requests", type=int, default=d.num_requests, help="requests per policy")
    add("--request-rate", type=float, default=d.request_rate, help="Poisson arrivals, req/s")
    add("--num-system-prompts", type=int, default=d.num_system_prompts, help="K shared prompts")
    add("--system-prompt-len", type=int, default=d.system_prompt_len, help="S tokens each")
    add("--user-len", type=int, default=d.user_len, help="U tokens of each request's own suffix")
    add("--max-tokens", type=int, default=d.max_tokens, help="output tokens of every request")
    add("--seed", type=int, default=d.seed, help="seeds prompts, suffixes and arrivals")
    add("--block-size", type=int, default=d.block_size, help="B, tokens per KV block")
    add("--num-kv-blocks", type=int, default=None, help="KV blocks per worker; None: 256 MiB of KV")
    add("--pull", choices=MIGRATION_MODES, default=d.pull, help="policies that pull prefixes")
    add("--pull-min-blocks", type=int, default=d.pull_min_blocks, help="ClusterConfig field")
    add("--push", choices=MIGRATION_MODES, default=d.push, help="policies that push under pressure")
    add("--worker-num-cpus", type=float, default=d.worker_num_cpus, help="Ray CPUs per worker")
    add(
        "--kv-aware-option",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="an option of the kv_aware policy, e.g. prefill_weight=4 (repeatable)",
    )
    add("--ray-address", default=None, help="join this Ray cluster instead of a local one")
    add("--ray-num-cpus", type=int, default=None, help="local Ray CPUs; None: workers + 1")
    add("--json", metavar="FILE", default=None, help="write config, records and summaries")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = RoutingBenchConfig(
        policies=tuple(dict.fromkeys(args.policies)),
        num_workers=args.num_workers,
        num_requests=args.num_requests,
        request_rate=args.request_rate,
        num_system_prompts=args.num_system_prompts,
        system_prompt_len=args.system_prompt_len,
        user_len=args.user_len,
        max_tokens=args.max_tokens,
        seed=args.seed,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        pull=args.pull,
        pull_min_blocks=args.pull_min_blocks,
        push=args.push,
        worker_num_cpus=args.worker_num_cpus,
        kv_aware_options=tuple(_parse_option(text) for text in args.kv_aware_option),
    )
    num_cpus = args.ray_num_cpus or int(-(-config.num_workers * config.worker_num_cpus // 1)) + 1
    ensure_ray(args.ray_address, num_cpus)
    results, num_kv_blocks = run_routing_bench(config)
    summaries = {policy: result.summary for policy, result in results.items()}
    print(format_report(config, summaries, num_kv_blocks))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_as_json(config, results, num_kv_blocks), f, indent=1, default=str)
    return 0 if all(s.num_errors == 0 for s in summaries.values()) else 1


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"--kv-aware-option wants KEY=VALUE, got {text!r}")
    return key, json.loads(value)


def _as_json(config, results: dict[str, PolicyResult], num_kv_blocks: int) -> dict[str, Any]:
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
