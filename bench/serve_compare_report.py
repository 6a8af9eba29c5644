"""What `bench serve-compare` reports of its runs: per load, per arm, and per alternated pair.

Per load (`LoadPoint`) and arm (`ArmFigures`): every run's TTFT p50/p99, TPOT p50/p99, E2E
p50, output tok/s, goodput (requests/s that met the SLO) and failures, and their median over
runs; the spread (min-max over runs) of TTFT p50 and TPOT p50; the CPU-ms per streamed output
token of the engine and of everything outside it (`proc_cpu.engine_split`: every other process
of the server's session; the client's own left out), median over runs, with the roles outside
that spent most. Per alternated pair (the i-th run of two arms at one load): every arm of ours
over vLLM, and over the engine alone, of TTFT p50, TPOT p50 and output tok/s, as their median
and min-max. A closing table puts the loads side by side.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from pagedserve.bench.openai_load import Slo
from pagedserve.bench.proc_cpu import engine_split, is_engine_role
from pagedserve.bench.serve_compare_arms import ENGINE, OURS, VLLM, ArmRun

# (summary field, column title, width) of the per-run table; goodput and failures follow.
COLUMNS = (
    ("ttft_p50_ms", "TTFT p50", 10),
    ("ttft_p99_ms", "TTFT p99", 10),
    ("tpot_p50_ms", "TPOT p50", 10),
    ("tpot_p99_ms", "TPOT p99", 10),
    ("e2e_p50_ms", "E2E p50", 10),
    ("output_tokens_per_s", "out tok/s", 11),
)
RATIO_FIGURES = {
    "ttft_p50_ms": "TTFT p50",
    "tpot_p50_ms": "TPOT p50",
    "output_tokens_per_s": "out tok/s",
}
CLIENT = "client"  # the load client's own CPU in `ArmRun.cpu_s`: not the server's


def slo_of(args: argparse.Namespace) -> Slo:
    return Slo(args.slo_ttft_ms, args.slo_tpot_ms)


# ------------------------------------------------------------------- per run
def run_figures(run: ArmRun, slo: Slo) -> dict[str, float]:
    """A run's table figures: the `COLUMNS`, goodput and failures."""
    figures = {name: getattr(run.summary, name) for name, _, _ in COLUMNS}
    return figures | {
        "goodput_per_s": slo.goodput_per_s(run.records),
        "failures": run.summary.failures,
    }


def row_cells(run: ArmRun, slo: Slo) -> str:
    return _cells(run_figures(run, slo))


def _cells(figures: dict[str, float]) -> str:
    cells = "".join(f"{figures[name]:>{width}.1f}" for name, _, width in COLUMNS)
    return cells + f"{figures['goodput_per_s']:>9.2f}{figures['failures']:>10.0f}"


def cpu_cells(cpu_s: dict[str, float], shown: int = 8) -> str:
    """The roles that spent the most CPU, then the total."""
    top = list(cpu_s.items())[:shown]
    return ", ".join(f"{role} {s:.1f}" for role, s in top) + f"; total {sum(cpu_s.values()):.1f}"


def cpu_ms_per_token(run: ArmRun) -> dict[str, float]:
    """The server's CPU-ms per output token of a run: ``engine``, ``outside`` (the rest of its
    session; the client's own left out), and each role."""
    tokens = run.summary.output_tokens
    if not tokens:
        return {}
    server = {role: s for role, s in run.cpu_s.items() if role != CLIENT}
    engine, outside = engine_split(server)
    per_role = {role: s * 1e3 / tokens for role, s in server.items()}
    return {"engine": engine * 1e3 / tokens, "outside": outside * 1e3 / tokens, **per_role}


# ------------------------------------------------------------------- over runs
@dataclass(frozen=True)
class ArmFigures:
    """One arm at one load, over its runs: medians (failures: their total), the spread of the
    p50 latencies, and CPU-ms per output token (median per key; a role a run lacks counts 0)."""

    median: dict[str, float]
    ttft_p50_spread: tuple[float, float]
    tpot_p50_spread: tuple[float, float]
    cpu_ms_per_token: dict[str, float]

    @classmethod
    def of(cls, runs: Sequence[ArmRun], slo: Slo) -> ArmFigures:
        per_run = [run_figures(r, slo) for r in runs]
        median = {k: statistics.median(f[k] for f in per_run) for k in per_run[0]}
        median["failures"] = sum(f["failures"] for f in per_run)
        cpu = [cpu_ms_per_token(r) for r in runs]
        keys = dict.fromkeys(k for c in cpu for k in c)
        return cls(
            median=median,
            ttft_p50_spread=_spread([f["ttft_p50_ms"] for f in per_run]),
            tpot_p50_spread=_spread([f["tpot_p50_ms"] for f in per_run]),
            cpu_ms_per_token={k: statistics.median(c.get(k, 0.0) for c in cpu) for k in keys},
        )

    def outside_roles(self, shown: int = 5) -> list[tuple[str, float]]:
        """The roles outside the engine that spent the most per token."""
        roles = [
            (k, v)
            for k, v in self.cpu_ms_per_token.items()
            if k not in ("engine", "outside") and not is_engine_role(k)
        ]
        return sorted(roles, key=lambda item: -item[1])[:shown]


def _spread(values: Sequence[float]) -> tuple[float, float]:
    return min(values), max(values)


def by_load(runs: Sequence[ArmRun]) -> dict:
    """LoadPoint → arm → its runs, loads and arms in the order they first ran."""
    grouped: dict = {}
    for run in runs:
        grouped.setdefault(run.point, {}).setdefault(run.arm, []).append(run)
    return grouped


def ratio_pairs(arms: Sequence[str]) -> list[tuple[str, str]]:
    """(arm, peer) pairs the report divides: every arm of ours by vLLM (or, without it, by
    `ours`), and every arm of ours by the engine alone."""
    ours = [a for a in arms if a not in (VLLM, ENGINE)]
    peer = VLLM if VLLM in arms else OURS
    pairs = [(a, peer) for a in ours if a != peer]
    return pairs + [(a, ENGINE) for a in ours if ENGINE in arms]


def pair_ratios(runs: Sequence[ArmRun], arm: str, peer: str) -> dict[str, list[float]]:
    """`arm` / `peer` of TTFT p50, TPOT p50 and tok/s, one per alternated pair: the i-th run
    of each at one load (`runs` are of one load; empty without either arm)."""
    mine = sorted((r for r in runs if r.arm == arm), key=lambda r: r.repeat)
    theirs = sorted((r for r in runs if r.arm == peer), key=lambda r: r.repeat)
    if not mine or not theirs:
        return {}
    pairs = list(zip(mine, theirs, strict=True))
    return {
        name: [_ratio(getattr(o.summary, name), getattr(p.summary, name)) for o, p in pairs]
        for name in RATIO_FIGURES
    }


def _ratio(mine: float, theirs: float) -> float:
    return mine / theirs if theirs else float("nan")


def ratio_text(ratios: Sequence[float]) -> str:
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


# ------------------------------------------------------------------- the text
def format_report(
    args: argparse.Namespace,
    runs: Sequence[ArmRun],
    prompt_lens: Sequence[int],
    arms: dict[str, str],
) -> str:
    """The whole report; `arms`: each arm's name and what it runs."""
    slo = slo_of(args)
    lines = [
        f"model {args.model}: {len(prompt_lens)} requests, prompts {min(prompt_lens)}-"
        f"{max(prompt_lens)} tokens (mean {statistics.mean(prompt_lens):.0f}), "
        f"{args.output_len} greedy tokens each; {args.repeats} alternated runs per arm at "
        f"each load; latencies in ms; goodput: requests/s with TTFT <= {slo.ttft_ms:g} ms and "
        f"TPOT <= {slo.tpot_ms:g} ms",
        *(f"  {arm}: {what}" for arm, what in arms.items()),
    ]
    loads = by_load(runs)
    figures = {
        p: {a: ArmFigures.of(rs, slo) for a, rs in arms_at.items()} for p, arms_at in loads.items()
    }
    for point, arms_at in loads.items():
        lines += ["", *_load_lines(point, arms_at, figures[point], slo)]
    lines += ["", *_summary_lines(loads, figures)]
    uncounted = [r for run in runs for r in run.records if r.ok and r.output_tokens is None]
    if uncounted:
        reasons = sorted({str(r.finish_reason) for r in uncounted})
        lines.append(
            f"WARNING: {len(uncounted)} requests finished other than 'length' "
            f"({', '.join(reasons)}): their token counts are unknown, left out of TPOT and tok/s"
        )
    return "\n".join(lines)


def _load_lines(point, arms_at: dict, figures: dict, slo: Slo) -> list[str]:
    """One load's table, then per arm its spreads and CPU per token, then the pair ratios."""
    count = len(next(iter(arms_at.values()))[0].records)
    titles = "".join(f"{title:>{width}}" for _, title, width in COLUMNS)
    lines = [
        f"== {point.label}: {count} requests ==",
        f"{'arm':<12}{'run':>7}{titles}{'goodput':>9}{'failures':>10}",
    ]
    for arm, runs in arms_at.items():
        lines += [f"{arm:<12}{r.repeat + 1:>7}" + row_cells(r, slo) for r in runs]
        lines.append(f"{arm:<12}{'median':>7}" + _cells(figures[arm].median))
    for arm, f in figures.items():
        (t0, t1), (p0, p1), cpu = f.ttft_p50_spread, f.tpot_p50_spread, f.cpu_ms_per_token
        line = f"{arm}: spread over runs TTFT p50 {t0:.1f}-{t1:.1f}, TPOT p50 {p0:.1f}-{p1:.1f}"
        if cpu:
            roles = ", ".join(f"{k} {v:.1f}" for k, v in f.outside_roles())
            line += (
                f"; CPU-ms per output token: engine {cpu['engine']:.1f}, outside the "
                f"engine {cpu['outside']:.1f}" + (f" ({roles})" if roles else "")
            )
        lines.append(line)
    runs = [r for rs in arms_at.values() for r in rs]
    for arm, peer in ratio_pairs(list(arms_at)):
        ratios = pair_ratios(runs, arm, peer)
        text = ", ".join(f"{RATIO_FIGURES[n]} {ratio_text(r)}" for n, r in ratios.items())
        lines.append(f"{arm}/{peer} per pair, median (min-max): {text}")
    return lines


def _summary_lines(loads: dict, figures: dict) -> list[str]:
    """Every load side by side: medians over runs, then the ratios per pair."""
    lines = [
        "== every load: medians over runs; CPU-ms per output token ==",
        f"{'load':<18}{'arm':<12}{'TTFT p50':>10}{'TPOT p50':>10}{'out tok/s':>11}"
        f"{'goodput':>9}{'engine':>9}{'outside':>9}",
    ]
    ratio_lines = ["", "== every load: ratios per pair, median (min-max) =="]
    for point, arms_at in loads.items():
        for arm, f in figures[point].items():
            m, cpu = f.median, f.cpu_ms_per_token
            lines.append(
                f"{point.label:<18}{arm:<12}{m['ttft_p50_ms']:>10.1f}{m['tpot_p50_ms']:>10.1f}"
                f"{m['output_tokens_per_s']:>11.1f}{m['goodput_per_s']:>9.2f}"
                f"{cpu.get('engine', float('nan')):>9.1f}{cpu.get('outside', float('nan')):>9.1f}"
            )
        runs = [r for rs in arms_at.values() for r in rs]
        for arm, peer in ratio_pairs(list(arms_at)):
            ratios = pair_ratios(runs, arm, peer)
            text = "  ".join(f"{RATIO_FIGURES[n]} {ratio_text(r)}" for n, r in ratios.items())
            ratio_lines.append(f"{point.label:<18}{arm + '/' + peer:<16}{text}")
    return lines + (ratio_lines if len(ratio_lines) > 2 else [])


# ------------------------------------------------------------------- JSON
def to_json(
    args: argparse.Namespace, runs: Sequence[ArmRun], workloads: dict, arms: dict[str, str]
) -> dict:
    """Config, the arms, every load's workload and figures, and every run with its records;
    `workloads`: each load's `PlannedRequest`s."""
    slo = slo_of(args)
    config = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "func"}
    loads = by_load(runs)
    points = []
    for point, workload in workloads.items():
        arms_at = loads.get(point, {})
        at = [r for rs in arms_at.values() for r in rs]
        points.append(
            {
                "key": point.key,
                "label": point.label,
                "rate": point.rate,
                "concurrency": point.concurrency,
                "workload": [
                    {"index": p.index, "arrival_s": p.arrival_s, "prompt_tokens": len(p.token_ids)}
                    for p in workload
                ],
                "arms": {a: asdict(ArmFigures.of(rs, slo)) for a, rs in arms_at.items()},
                "pair_ratios": {
                    f"{a}/{p}": pair_ratios(at, a, p) for a, p in ratio_pairs(list(arms_at))
                },
            }
        )
    return {
        "config": config,
        "arms": arms,
        "points": points,
        "runs": [_run_json(r, slo) for r in runs],
    }


def _run_json(r: ArmRun, slo: Slo) -> dict:
    records = [
        asdict(x)
        | {"ttft_s": x.ttft_s, "tpot_s": x.tpot_s, "e2e_s": x.e2e_s, "slo_met": slo.met_by(x)}
        for x in r.records
    ]
    return {
        "arm": r.arm,
        "point": r.point.key,
        "repeat": r.repeat,
        "startup_s": r.startup_s,
        "summary": asdict(r.summary),
        "goodput_per_s": slo.goodput_per_s(r.records),
        "cpu_s": r.cpu_s,
        "cpu_ms_per_token": cpu_ms_per_token(r),
        "records": records,
    }
