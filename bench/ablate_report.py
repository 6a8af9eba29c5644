"""`pagedserve bench ablate`'s report: each arm against its round's baseline (`ratio_rows`),
the median over rounds (`median_ratio_rows`), the Markdown table and each arm's JSON."""

from __future__ import annotations

import statistics
from typing import Any

from pagedserve.bench.ablate_arms import BASELINE, ArmResult
from pagedserve.bench.serve_metrics import record_dict


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


def arm_json(result: ArmResult) -> dict[str, Any]:
    """One arm's settings, summary, records and KV samples, for the `--json` file."""
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
