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

from pagedserve.bench.ablate_arms import BASELINE, FACTORS, AblateConfig, arms, run_arm
from pagedserve.bench.ablate_report import arm_json, format_markdown, median_ratio_rows, ratio_rows
from pagedserve.bench.bench_io import ensure_ray, report
from pagedserve.bench.extras import require_bench_extra
from pagedserve.bench.serve_metrics import record_dict


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
        "arms": [arm_json(r) for r in results],
    }
    report(data, format_markdown(data), args.json, args.markdown)
    if args.plot_prefix:
        ran = [r for r in results if r.run]
        plot_ablation_bars(data["ratios"], f"{args.plot_prefix}_ratios.png")
        records = {r.arm.name: [record_dict(x) for x in r.run.records] for r in ran}
        plot_latency_cdfs(records, f"{args.plot_prefix}_cdf.png")
        plot_kv_usage({r.arm.name: r.run.kv_samples for r in ran}, f"{args.plot_prefix}_kv.png")
    return 0
