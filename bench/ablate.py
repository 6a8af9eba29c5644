"""`pagedserve bench ablate`: one switch at a time against a baseline, on identical arrivals.

The baseline is `paged` allocation, prefix caching on, `kv_aware` routing, chunked prefill on,
`recompute` preemption and the `torch` attention backend. Each arm changes one of them:

    allocation       reserve-max   (same KV byte budget: same block size and block count)
    prefix-caching   off
    routing          least_loaded, round_robin
    chunked-prefill  off
    preemption       swap          (CPU swap area as large as the device pool)
    attention        triton        (GPU only; skipped with a note on CPU)
    tiers            host+disk     (KV host tier `--host-tier-bytes` and a disk tier in a fresh
                                    temporary directory per arm run, `--disk-tier-bytes`)
    pd               1+1           (prefill/decode disaggregation: 1 prefill + 1 decode worker
                                    against `--num-workers` 2 mixed ones; compare TPOT p99,
                                    TTFT p99 on a mixed workload, e.g. `--workload lognormal
                                    --sigma 1.0`: long prompts arriving while many decode)

Every arm starts its own worker group (prefix index + `--num-workers` workers) and drives it
with a `RouterCore` in this process — the router the Serve app runs, without Serve's proxy, to
keep a 2-core machine's runs short (`bench serve` is the one through gRPC). Every worker serves
one short warm-up request first. The same seeded workload (`serve_workload`) goes out at the
same arrival times to every arm; records and KV samples are `bench serve`'s. Ratios are arm /
baseline: throughput (output tok/s), TTFT p50 and p99, TPOT p99, E2E p99, and the most
sequences running at once (sampled from worker stats every `--poll-interval`). With
`--repeats N` the arms run N rounds, alternated (baseline, arm, ..., baseline, arm, ...):
each round's arm is compared with that round's baseline, and the table gives the median of
those ratios (each round's in the JSON).

    $ pagedserve bench ablate --workload shared-prefix --json ablate.json --plot-prefix ablate
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
from dataclasses import dataclass, field
from typing import Any

from pagedserve.bench.bench_io import ensure_ray, report
from pagedserve.bench.extras import require_bench_extra
from pagedserve.bench.serve_metrics import Delta, kv_sample_from_cluster, record_dict, summarize
from pagedserve.bench.serve_runner import RunResult, run_workload
from pagedserve.bench.serve_workload import PlannedRequest
from pagedserve.workers.protocol.requests import WorkerRequest

BASELINE: dict[str, Any] = {
    "kv_allocation": "paged",
    "enable_prefix_caching": True,
    "routing_policy": "kv_aware",
    "enable_chunked_prefill": True,
    "preemption_mode": "recompute",
    "attention_backend": "torch",
    "kv_tiers": "off",
    "pd_layout": "off",
}
# (factor, setting, the values other than the baseline's)
FACTORS: tuple[tuple[str, str, tuple[Any, ...]], ...] = (
    ("allocation", "kv_allocation", ("reserve-max",)),
    ("prefix-caching", "enable_prefix_caching", (False,)),
    ("routing", "routing_policy", ("least_loaded", "round_robin")),
    ("chunked-prefill", "enable_chunked_prefill", (False,)),
    ("preemption", "preemption_mode", ("swap",)),
    ("attention", "attention_backend", ("triton",)),
    ("tiers", "kv_tiers", ("host+disk",)),
    ("pd", "pd_layout", ("1+1",)),
)
GPU_ONLY = {("attention_backend", "triton")}


@dataclass(frozen=True)
class Arm:
    """One configuration: the baseline with at most one setting changed."""

    name: str
    factor: str | None = None
    setting: str | None = None
    value: Any = None

    def settings(self) -> dict[str, Any]:
        return {**BASELINE, **({self.setting: self.value} if self.setting else {})}


def arms(factors: list[str] | None = None) -> list[Arm]:
    """The baseline, then one arm per non-baseline value of each chosen factor."""
    chosen = [f for f in FACTORS if factors is None or f[0] in factors]
    result = [Arm("baseline")]
    for factor, setting, values in chosen:
        result += [Arm(f"{setting}={value}", factor, setting, value) for value in values]
    return result


@dataclass(frozen=True)
class AblateConfig:
    """The cluster every arm shares (besides its own switch)."""

    num_workers: int = 2
    block_size: int = 16
    num_kv_blocks: int = 160
    max_model_len: int = 1024
    max_num_seqs: int = 64
    device: str = "cpu"
    poll_interval_s: float = 0.1
    host_tier_bytes: int = 4 << 20
    disk_tier_bytes: int = 256 << 20
    model: str = "tiny-llama"

    def cluster(self, arm: Arm, tier_dir: str | None = None) -> dict[str, Any]:
        """`ClusterConfig` data of one arm's worker group (`tier_dir`: its disk tier's)."""
        settings = arm.settings()
        routing = settings.pop("routing_policy")
        layout = settings.pop("pd_layout")  # "off", or "<prefill>+<decode>" workers
        roles = {}
        if layout != "off":
            prefill, decode = (int(n) for n in layout.split("+"))
            roles = {"prefill_workers": prefill, "decode_workers": decode}
        if settings.pop("kv_tiers") != "off":
            settings |= {
                "kv_host_tier_bytes": self.host_tier_bytes,
                "kv_disk_tier_dir": tier_dir,
                "kv_disk_tier_bytes": self.disk_tier_bytes,
            }
        engine = {
            "model": self.model,
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "device": self.device,
            **settings,
        }
        gpus = 1.0 / self.num_workers if self.device == "cuda" else 0.0
        name = "bench-ablate-" + arm.name.replace("=", "-").replace("_", "-").replace("+", "p")
        name = name.lower()
        return {
            "engine": engine,
            "scaling": {"num_workers": self.num_workers, **roles},
            "placement": {"worker_num_gpus": gpus},
            "routing": {"routing_policy": routing},
            "failure": {"stats_interval_s": 0.1},
            "name": name,
        }


@dataclass
class ArmResult:
    arm: Arm
    cluster: dict[str, Any]
    run: RunResult | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None

    @property
    def max_running(self) -> int | None:
        if not self.run or not self.run.kv_samples:
            return None
        return max(s["num_running"] for s in self.run.kv_samples)


# --- one arm -------------------------------------------------------------------------------


def run_arm(
    config: AblateConfig, arm: Arm, workload: list[PlannedRequest], slo: tuple
) -> ArmResult:
    """Start the arm's worker group, run the workload through a `RouterCore`, stop the group."""
    from pagedserve.cluster.config import ClusterConfig
    from pagedserve.cluster.pool.group import start_worker_group, stop_worker_group

    tier_dir = tempfile.TemporaryDirectory(prefix="pagedserve-ablate-kv-")
    cluster = config.cluster(arm, tier_dir.name)
    result = ArmResult(arm, cluster)
    if (arm.setting, arm.value) in GPU_ONLY and config.device != "cuda":
        result.skipped = "needs a GPU (Triton kernels); this run is CPU only"
        tier_dir.cleanup()
        return result
    cluster_config = ClusterConfig.from_dict(cluster)
    index, workers = start_worker_group(cluster_config)
    try:
        result.run = asyncio.run(_drive(cluster_config, index, workers, workload, config))
    finally:
        stop_worker_group(cluster_config)
        tier_dir.cleanup()
    result.summary = summarize(result.run.records, result.run.duration_s, *slo)
    return result


async def _drive(cluster_config, index, workers, workload, config: AblateConfig) -> RunResult:
    from pagedserve.cluster.router.config import RouterConfig
    from pagedserve.cluster.router.router import RouterCore

    core = RouterCore(RouterConfig.of(cluster_config), index, workers)
    try:
        await core.start()
        await asyncio.gather(*(_warm_up(wid, handle) for wid, handle in workers.items()))

        async def poll(t_s: float) -> dict[str, Any]:
            return kv_sample_from_cluster(t_s, await core.cluster_stats())

        return await run_workload(
            workload,
            _core_sender(core),
            poll,
            poll_interval_s=config.poll_interval_s,
            error_reason=core_error_reason,
        )
    finally:
        await core.close()


def core_error_reason(error: BaseException) -> str:
    """`Type: message` of the error a worker raised (unwrapped from Ray's task error)."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        error = cause
    return f"{type(error).__name__}: {error}"


def _core_sender(core):
    async def send(planned: PlannedRequest):
        from pagedserve.workers.protocol.requests import GenerateRequest
        from pagedserve.workers.protocol.sampling import SamplingParams

        params = SamplingParams(max_tokens=planned.max_tokens, temperature=0.0, ignore_eos=True)
        request = GenerateRequest(
            params=params,
            prompt_token_ids=list(planned.token_ids),
            request_id=f"ablate-{planned.index}",
        )
        async for delta in core.generate(request):
            metrics, usage = delta.metrics, delta.usage
            yield Delta(
                num_tokens=len(delta.token_ids),
                finish_reason=delta.finish_reason,
                prompt_tokens=usage.prompt_tokens if usage else None,
                cached_tokens=usage.cached_tokens if usage else None,
                queue_time_s=metrics.queue_time if metrics else None,
                worker_ttft_s=metrics.ttft if metrics else None,
                preemptions=metrics.num_preemptions if metrics else None,
                worker_id=delta.worker_id,
                error=delta.error,
            )

    return send


async def _warm_up(worker_id: str, handle: Any) -> None:
    """One short request straight to the worker: its first forward is slow, keep it out."""
    from pagedserve.workers.protocol.sampling import SamplingParams

    rng = random.Random(f"warm-up {worker_id}")
    tokens = [rng.randrange(256) for _ in range(24)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    async for ref in handle.generate.remote(
        WorkerRequest.fresh(f"warm-up-{worker_id}", tokens, params)
    ):
        await ref


# --- ratios --------------------------------------------------------------------------------


def ratio_rows(results: list[ArmResult]) -> list[dict[str, Any]]:
    """One row per non-baseline arm: arm / baseline ratios (None where either is missing)."""
    base = results[0]
    rows = []
    for result in results[1:]:
        row = {"arm": result.arm.name, "factor": result.arm.factor, "skipped": result.skipped}
        if not result.skipped:
            s, b = result.summary, base.summary
            row.update(
                throughput_ratio=_ratio(s["output_token_throughput"], b["output_token_throughput"]),
                ttft_p50_ratio=_ratio(s["ttft_s"]["median"], b["ttft_s"]["median"]),
                ttft_p99_ratio=_ratio(s["ttft_s"]["p99"], b["ttft_s"]["p99"]),
                tpot_p99_ratio=_ratio(s["tpot_s"]["p99"], b["tpot_s"]["p99"]),
                e2e_p99_ratio=_ratio(s["e2e_s"]["p99"], b["e2e_s"]["p99"]),
                max_running=result.max_running,
                max_running_ratio=_ratio(result.max_running, base.max_running),
                hit_rate=s["prefix_hit_rate"],
                preemptions=s["preemptions"],
                failed=s["failed"],
            )
        rows.append(row)
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def median_ratio_rows(rounds: list[list[ArmResult]]) -> list[dict[str, Any]]:
    """Per non-baseline arm, the median over rounds of each round's ratio to its own
    baseline (`per_round` keeps every round's figures)."""
    per_round = [ratio_rows(results) for results in rounds]
    rows = []
    for arm_rows in zip(*per_round, strict=True):
        row = dict(arm_rows[0])
        if not row["skipped"]:
            for key in [k for k in row if k not in ("arm", "factor", "skipped")]:
                values = [r[key] for r in arm_rows if r[key] is not None]
                row[key] = statistics.median(values) if values else None
            row["per_round"] = list(arm_rows)
        row["rounds"] = len(arm_rows)
        rows.append(row)
    return rows


def format_markdown(data: dict[str, Any]) -> str:
    """The ablation table (arm / baseline) and the baseline's absolute figures."""
    base = data["arms"][0]["summary"]
    lines = [
        "# pagedserve bench ablate",
        "",
        f"- workload: {data['workload']['description']}",
        f"- front end: {data['front_end']}",
        f"- cluster: {data['config']}",
        f"- baseline: {BASELINE}; {base['output_token_throughput']:.1f} output tok/s, TTFT p99"
        f" {_fmt(base['ttft_s']['p99'], 1e3)} ms, TPOT p99 {_fmt(base['tpot_s']['p99'], 1e3)} ms,"
        f" E2E p99 {_fmt(base['e2e_s']['p99'], 1e3)} ms,"
        f" max running {data['arms'][0]['max_running']}, hit rate {base['prefix_hit_rate']:.1%},"
        f" preemptions {base['preemptions']}, failed {base['failed']}",
        "",
        "| factor | arm | throughput × | TTFT p50 × | TTFT p99 × | TPOT p99 × | E2E p99 × |"
        " max running (×) | hit rate | preemptions | failed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in data["ratios"]:
        if row["skipped"]:
            lines.append(f"| {row['factor']} | {row['arm']} | skipped: {row['skipped']} |||||||||")
            continue
        lines.append(
            f"| {row['factor']} | {row['arm']} | {_fmt(row['throughput_ratio'])} |"
            f" {_fmt(row['ttft_p50_ratio'])} | {_fmt(row['ttft_p99_ratio'])} |"
            f" {_fmt(row.get('tpot_p99_ratio'))} | {_fmt(row['e2e_p99_ratio'])} |"
            f" {row['max_running']} ({_fmt(row['max_running_ratio'])}) |"
            f" {row['hit_rate']:.1%} | {row['preemptions']} | {row['failed']} |"
        )
    return "\n".join(lines)


def _fmt(value: float | None, scale: float = 1.0) -> str:
    return "—" if value is None else f"{value * scale:.2f}"


# --- command line --------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction) -> None:
    from pagedserve.bench.serve import add_workload_args

    d = AblateConfig()
    parser = subparsers.add_parser(
        "ablate",
        help="paged vs reserve-max, prefix caching, routing, chunked prefill, KV tiers, P/D, ...",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--factors", nargs="+", choices=[f[0] for f in FACTORS], default=None, help="all")
    add("--num-workers", type=int, default=d.num_workers, help="workers per arm")
    add("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    add("--num-kv-blocks", type=int, default=d.num_kv_blocks, help="KV blocks per worker")
    add("--max-model-len", type=int, default=d.max_model_len, help="reserve-max reserves this")
    add("--max-num-seqs", type=int, default=d.max_num_seqs, help="running sequences at most")
    add("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if any")
    add("--poll-interval", type=float, default=d.poll_interval_s, help="stats sample period, s")
    add("--model", default=d.model, help="the model every arm serves")
    add("--repeats", type=int, default=1, help="rounds of every arm, alternated (median ratios)")
    add("--host-tier-bytes", type=int, default=d.host_tier_bytes, help="tiers arm: host tier")
    add("--disk-tier-bytes", type=int, default=d.disk_tier_bytes, help="tiers arm: disk tier")
    add_workload_args(parser)
    parser.set_defaults(func=run, workload="shared-prefix", request_rate=16.0, output_len=24)


def run(args: argparse.Namespace) -> int:
    from pagedserve.bench.serve import workload_config
    from pagedserve.bench.serve_report import plot_ablation_bars, plot_kv_usage, plot_latency_cdfs
    from pagedserve.bench.serve_workload import make_workload

    require_bench_extra("tqdm", *(["matplotlib"] if args.plot_prefix else []))
    workload_cfg = workload_config(args)
    workload = make_workload(workload_cfg)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    config = AblateConfig(
        args.num_workers,
        args.block_size,
        args.num_kv_blocks,
        args.max_model_len,
        args.max_num_seqs,
        device,
        args.poll_interval,
        args.host_tier_bytes,
        args.disk_tier_bytes,
        args.model,
    )
    if args.repeats < 1:
        print(f"pagedserve bench ablate: error: --repeats must be >= 1, got {args.repeats}")
        return 2
    ensure_ray(num_cpus=args.num_workers + 1)
    slo = (args.slo_ttft_ms, args.slo_tpot_ms)
    chosen = arms(args.factors)
    rounds = [[run_arm(config, arm, workload, slo) for arm in chosen] for _ in range(args.repeats)]
    results = [result for results in rounds for result in results]
    data = {
        "command": "ablate",
        "front_end": "RouterCore in this process (no Serve proxy), one worker group per arm",
        "workload": {**vars(workload_cfg), "description": workload_cfg.describe()},
        "config": vars(config),
        "baseline": BASELINE,
        "repeats": args.repeats,
        "ratios": ratio_rows(rounds[0]) if args.repeats == 1 else median_ratio_rows(rounds),
        "arms": [_arm_json(r) for r in results],
    }
    report(data, format_markdown(data), args.json, args.markdown)
    if args.plot_prefix:
        ran = [r for r in results if r.run]
        plot_ablation_bars(data["ratios"], f"{args.plot_prefix}_ratios.png")
        records = {r.arm.name: [record_dict(x) for x in r.run.records] for r in ran}
        plot_latency_cdfs(records, f"{args.plot_prefix}_cdf.png")
        plot_kv_usage({r.arm.name: r.run.kv_samples for r in ran}, f"{args.plot_prefix}_kv.png")
    return 0


def _arm_json(result: ArmResult) -> dict[str, Any]:
    run = result.run
    return {
        "arm": result.arm.name,
        "factor": result.arm.factor,
        "settings": result.arm.settings(),
        "cluster": result.cluster,
        "skipped": result.skipped,
        "summary": result.summary,
        "max_running": result.max_running,
        "duration_s": run.duration_s if run else None,
        "records": [record_dict(r) for r in run.records] if run else [],
        "kv_samples": run.kv_samples if run else [],
    }
