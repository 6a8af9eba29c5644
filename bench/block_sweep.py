"""`pagedserve bench block-sweep`: block size B against useful KV, tail waste and table bytes.

For each B (default 8, 16, 32, 64, 128), on one seeded workload (`serve_workload`; the seed's
five lengths by default, constructed):

analytic  `kv.memory.paged_usage` over the final lengths n = prompt + output of every request
          (all resident at once): useful Σn, allocated Σ B·ceil(n/B), tail waste, block-table
          bytes; `reserve_max_usage` at `--max-model-len` beside it.
measured  an offline `Engine` (tiny-llama, this process, torch attention) runs the same requests
          with a pool of `--kv-positions` // B blocks; `engine.usage()` is sampled after every
          step. Reported: the sample with the most allocated positions (useful, allocated, tail
          waste, block-table bytes there), the mean position utilization over busy steps, the
          most cached-free blocks seen and the cached-free blocks left when idle (prefix blocks
          kept for reuse), and steps / wall time.

The measured peak can sit below the analytic figure: the last sampled token of a sequence has
no KV yet, and short requests may finish before long ones reach their final length.

    $ pagedserve bench block-sweep --json sweep.json --plot sweep.png
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from typing import Any

from pagedserve.bench.bench_io import report
from pagedserve.bench.extras import require_bench_extra
from pagedserve.bench.serve_workload import PlannedRequest, WorkloadConfig, make_workload
from pagedserve.workers.kv.memory import paged_usage, reserve_max_usage

BLOCK_SIZES = (8, 16, 32, 64, 128)


def analytic(lengths: list[int], block_size: int) -> dict[str, Any]:
    usage = paged_usage(lengths, block_size)
    return {
        "useful": usage.useful,
        "allocated": usage.allocated,
        "tail_waste": usage.wasted,
        "utilization": usage.utilization,
        "block_table_entries": usage.block_table_entries,
        "block_table_bytes": usage.block_table_bytes,
    }


def measure(
    workload: list[PlannedRequest], block_size: int, kv_positions: int, loaded: Any = None
) -> tuple[dict[str, Any], Any]:
    """Run the workload on a fresh engine with B = `block_size`; sample its pool every step.

    Returns:
        The measured figures, and the loaded model (to reuse for the next B).
    """
    from pagedserve.workers.engine.config import EngineConfig
    from pagedserve.workers.engine.engine import Engine
    from pagedserve.workers.protocol.sampling import SamplingParams

    config = EngineConfig(
        model="tiny-llama",
        block_size=block_size,
        num_kv_blocks=kv_positions // block_size,
        attention_backend="torch",
        max_num_seqs=len(workload),
    )
    engine = Engine(config, loaded=loaded)
    for planned in workload:
        params = SamplingParams(max_tokens=planned.max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(str(planned.index), list(planned.token_ids), params)
    start, samples = time.perf_counter(), []
    while engine.has_unfinished_requests():
        engine.step()
        samples.append(engine.usage())
    wall = time.perf_counter() - start
    idle = engine.usage()
    peak = max(samples, key=lambda u: u.allocated_positions)
    busy = [u for u in samples if u.allocated_positions]
    return {
        "num_blocks": config.num_kv_blocks,
        "peak_useful": peak.useful_tokens,
        "peak_allocated": peak.allocated_positions,
        "peak_tail_waste": peak.wasted_positions,
        "peak_utilization": peak.utilization,
        "peak_block_table_bytes": peak.block_table_bytes,
        "mean_utilization": sum(u.utilization for u in busy) / len(busy) if busy else None,
        "max_cached_free_blocks": max(u.cached_free_blocks for u in samples),
        "idle_cached_free_blocks": idle.cached_free_blocks,
        "idle_used_blocks": idle.used_blocks,
        "steps": len(samples),
        "wall_s": wall,
        "samples": [asdict(u) for u in samples],
    }, engine.loaded


def sweep(
    workload: list[PlannedRequest], block_sizes: list[int], kv_positions: int, max_model_len: int
) -> dict[str, Any]:
    """Analytic and measured figures for every block size on the same workload."""
    lengths = [len(p.token_ids) + p.max_tokens for p in workload]
    reserve = reserve_max_usage(lengths, max_model_len)
    # Untimed warm-up: the model's first forwards are slow and would be charged to the first B.
    _, loaded = measure(workload[:1], block_sizes[0], kv_positions)
    rows = []
    for block_size in block_sizes:
        measured, loaded = measure(workload, block_size, kv_positions, loaded)
        rows.append(
            {
                "block_size": block_size,
                "analytic": analytic(lengths, block_size),
                "measured": measured,
            }
        )
    return {
        "lengths": lengths,
        "reserve_max": {
            "max_len": max_model_len,
            "useful": reserve.useful,
            "allocated": reserve.allocated,
            "utilization": reserve.utilization,
        },
        "rows": rows,
    }


def format_markdown(data: dict[str, Any]) -> str:
    r = data["result"]["reserve_max"]
    lines = [
        "# pagedserve bench block-sweep",
        "",
        f"- workload: {data['workload']['description']}",
        f"- final lengths n = prompt + output: {data['result']['lengths']}",
        f"- reserve-max at {r['max_len']}: {r['useful']} useful of {r['allocated']} "
        f"({r['utilization']:.2%})",
        f"- measured: offline engine, torch attention, {data['kv_positions']} KV positions per B",
        "",
        "| B | analytic alloc | analytic waste | util | table bytes |"
        " measured peak useful / alloc | peak waste | peak util | mean util |"
        " peak table bytes | cached free max / idle | steps | wall s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in data["result"]["rows"]:
        a, m = row["analytic"], row["measured"]
        lines.append(
            f"| {row['block_size']} | {a['allocated']} | {a['tail_waste']} |"
            f" {a['utilization']:.2%} | {a['block_table_bytes']} |"
            f" {m['peak_useful']} / {m['peak_allocated']} |"
            f" {m['peak_tail_waste']} | {m['peak_utilization']:.2%} |"
            f" {m['mean_utilization']:.2%} | {m['peak_block_table_bytes']} |"
            f" {m['max_cached_free_blocks']} / {m['idle_cached_free_blocks']} |"
            f" {m['steps']} | {m['wall_s']:.2f} |"
        )
    return "\n".join(lines)


def plot(data: dict[str, Any], path: str) -> str:
    """Analytic and measured-peak utilization, and block-table bytes, by block size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["result"]["rows"]
    sizes = [r["block_size"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for key, style, label in (
        (("analytic", "utilization"), "o-", "analytic"),
        (("measured", "peak_utilization"), "s--", "measured peak"),
        (("measured", "mean_utilization"), "^:", "measured mean"),
    ):
        left.plot(sizes, [r[key[0]][key[1]] for r in rows], style, label=label)
    left.set_ylabel("useful / allocated positions")
    right.plot(sizes, [r["analytic"]["block_table_bytes"] for r in rows], "o-", label="analytic")
    right.plot(
        sizes, [r["measured"]["peak_block_table_bytes"] for r in rows], "s--", label="measured peak"
    )
    right.set_ylabel("block-table bytes")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("block size B (tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "block-sweep",
        help="block size vs useful KV, tail waste, block-table bytes: analytic and measured",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--block-sizes", default=",".join(map(str, BLOCK_SIZES)), help="comma-separated")
    add(
        "--workload",
        choices=("seed-lengths", "uniform", "lognormal", "shared-prefix", "file"),
        default="seed-lengths",
    )
    add("--num-requests", type=int, default=10, help="requests (all submitted at once)")
    add("--output-len", type=int, default=16, help="output tokens (mean / median)")
    add("--input-len", type=int, default=128, help="uniform / lognormal prompt tokens")
    add("--length-file", default=None, help="file workload: `prompt_len output_len` lines")
    add("--seed", type=int, default=0)
    add("--kv-positions", type=int, default=16384, help="pool size in token positions, every B")
    add("--max-model-len", type=int, default=2048, help="reserve-max reservation")
    add("--json", metavar="FILE", default=None)
    add("--markdown", metavar="FILE", default=None)
    add("--plot", metavar="FILE.png", default=None)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        block_sizes = [int(b) for b in args.block_sizes.split(",")]
        config = WorkloadConfig(
            kind=args.workload,
            num_requests=args.num_requests,
            seed=args.seed,
            input_len=args.input_len,
            output_len=args.output_len,
            length_file=args.length_file,
        )
        workload = make_workload(config)
        if args.plot:
            require_bench_extra("matplotlib")
    except (OSError, ValueError) as error:
        print(f"pagedserve bench block-sweep: error: {error}")
        return 2
    result = sweep(workload, block_sizes, args.kv_positions, args.max_model_len)
    data = {
        "command": "block-sweep",
        "workload": {**vars(config), "description": config.describe()},
        "kv_positions": args.kv_positions,
        "result": result,
    }
    report(data, format_markdown(data), args.json, args.markdown)
    if args.plot:
        plot(data, args.plot)
    return 0
