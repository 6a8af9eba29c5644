"""Markdown, JSON and PNG outputs of `bench serve` and `bench ablate` (matplotlib Agg, lazily)."""

from __future__ import annotations

from typing import Any

from pagedserve.bench.bench_io import write_json, write_text

_ROWS = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"))
_ROWS_QUEUE = (("queue (worker)", "queue_time_s"),)
_SLOS = (("TTFT", "slo_ttft_ms"), ("TPOT", "slo_tpot_ms"))


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1e3:.1f}"


def latency_table(summary: dict[str, Any]) -> list[str]:
    lines = ["| latency (ms) | mean | median | p90 | p99 |", "|---|---:|---:|---:|---:|"]
    for label, key in _ROWS + _ROWS_QUEUE:
        d = summary[key]
        lines.append(
            f"| {label} | {_ms(d['mean'])} | {_ms(d['median'])} | {_ms(d['p90'])} |"
            f" {_ms(d['p99'])} |"
        )
    return lines


def format_serve_markdown(data: dict[str, Any]) -> str:
    """The summary of one `bench serve` run as Markdown."""
    s = data["summary"]
    bounds = [f"{name} ≤ {s[key]:g} ms" for name, key in _SLOS if s[key] is not None]
    slo = ", ".join(bounds) or "no SLO given: every completed request"
    peak = max((k["used_blocks"] for k in data["kv_samples"]), default=None)
    total = max((k["total_blocks"] for k in data["kv_samples"]), default=None)
    lines = [
        "# pagedserve bench serve",
        "",
        f"- workload: {data['workload']['description']}",
        f"- front end: {data['front_end']} at "
        f"{data['address'] or 'a local app started for the run'}",
        f"- requests: {s['num_requests']}, completed {s['completed']}, failed {s['failed']}"
        + (f" {s['failures_by_reason']}" if s["failures_by_reason"] else ""),
        f"- window {s['duration_s']:.2f} s: {s['request_throughput']:.2f} req/s, "
        f"{s['output_token_throughput']:.1f} output tok/s, "
        f"{s['total_token_throughput']:.1f} total tok/s",
        f"- goodput ({slo}): {s['goodput']:.2f} req/s ({s['goodput_fraction']:.0%} of requests)",
        f"- prefix hit rate {s['prefix_hit_rate']:.1%}, preemptions {s['preemptions']}, "
        f"peak KV blocks used {peak} of {total}",
        "- per-request migrations: not exposed by the API (null in the JSON)",
        _refusal_line(s),
        "",
        *latency_table(s),
    ]
    return "\n".join(lines)


def _refusal_line(s: dict[str, Any]) -> str:
    """How fast a refusal came (time from sending to RESOURCE_EXHAUSTED): router work only."""
    refusal = s.get("refusal_s") or {}
    if not s.get("refused"):
        return "- refused for load: none"
    return (
        f"- refused for load: {s['refused']}, answered after median "
        f"{refusal['median'] * 1e3:.1f} ms, p99 {refusal['p99'] * 1e3:.1f} ms"
    )


def write_serve_outputs(
    data: dict[str, Any], json_path: str | None, md_path: str | None, plot_prefix: str | None
) -> list[str]:
    """Write whichever outputs were asked for; returns the paths written."""
    written = []
    if json_path:
        write_json(json_path, data)
        written.append(json_path)
    if md_path:
        write_text(md_path, format_serve_markdown(data) + "\n")
        written.append(md_path)
    if plot_prefix:
        written.append(plot_latency_cdfs({"serve": data["records"]}, f"{plot_prefix}_cdf.png"))
        written.append(plot_kv_usage({"serve": data["kv_samples"]}, f"{plot_prefix}_kv.png"))
    return written


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(records_by_run: dict[str, list[dict[str, Any]]], path: str) -> str:
    """TTFT, TPOT and E2E CDFs of successful requests, one line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (label, key) in zip(axes, (_ROWS[0], _ROWS[1], _ROWS[3]), strict=True):
        for run, records in records_by_run.items():
            values = sorted(r[key] * 1e3 for r in records if r["ok"] and r[key] is not None)
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=run)
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_kv_usage(samples_by_run: dict[str, list[dict[str, Any]]], path: str) -> str:
    """Used and cached-free KV blocks over time (summed over workers), one colour per run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for run, samples in samples_by_run.items():
        if not samples:
            continue
        ts = [s["t_s"] for s in samples]
        line = ax.plot(ts, [s["used_blocks"] for s in samples], label=f"{run}: used")[0]
        cached = [s["cached_free_blocks"] for s in samples]
        ax.plot(ts, cached, linestyle="--", color=line.get_color(), label=f"{run}: cached free")
    ax.set_xlabel("time since first arrival (s)")
    ax.set_ylabel("KV blocks (all workers)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ablation_bars(rows: list[dict[str, Any]], path: str) -> str:
    """Arm / baseline ratios of throughput, TTFT p99 and E2E p99, one group per arm."""
    plt = _pyplot()
    rows = [r for r in rows if r.get("throughput_ratio") is not None]
    metrics = (("throughput_ratio", "throughput"), ("ttft_p99_ratio", "TTFT p99"))
    metrics += (("e2e_p99_ratio", "E2E p99"),)
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 3.8))
    width = 0.8 / len(metrics)
    for m, (key, label) in enumerate(metrics):
        xs = [i + (m - 1) * width for i in range(len(rows))]
        ax.bar(xs, [r[key] or 0 for r in rows], width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [r["arm"] for r in rows], rotation=20, fontsize=8)
    ax.set_ylabel("arm / baseline")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
