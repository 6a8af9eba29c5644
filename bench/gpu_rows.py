"""What the GPU benchmarks share: a row log written as rows are measured, timers, ceilings,
and a run's time budget (`out_of_time`).

A lent GPU may be taken back, or a step may hit its time limit, at any moment, so every
measurement is appended to a JSON-lines file and flushed at once; the Markdown tables and the
final JSON are rendered from whatever rows exist (`render_markdown`). On a machine without
CUDA (the CPU rehearsal, `GPU_CHECK_DRY_RUN=1`) the timers fall back to the host clock and the
rows say so (`"timer": "host"`): those figures are rehearsal output, never GPU figures.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


class RowLog:
    """Appends one JSON object per measured row to a file, flushed as it goes.

    Args:
        path: the JSON-lines file (appended to, so several commands can share it).
        section: the benchmark section every row of this log belongs to.
    """

    def __init__(self, path: pathlib.Path | None, section: str) -> None:
        self.path = path
        self.section = section
        self.rows: list[dict[str, Any]] = []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, **fields: Any) -> dict[str, Any]:
        row = {"section": self.section, **fields}
        self.rows.append(row)
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row, default=str) + "\n")
                f.flush()
        print(_short(row), flush=True)
        return row


def _short(row: dict[str, Any]) -> str:
    parts = []
    for key, value in row.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        parts.append(f"{key}={value}")
    return "  ".join(parts)


def read_rows(path: pathlib.Path) -> list[dict[str, Any]]:
    """Every row of a JSON-lines log; a line cut off by a kill is skipped."""
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def time_ms(fn: Callable[[], object], device: torch.device, rep_ms: int = 60) -> float:
    """Median milliseconds per call: CUDA events with L2 flushes on CUDA, host clock elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return float(
            triton.testing.do_bench(
                fn, warmup=max(rep_ms // 4, 5), rep=rep_ms, return_mode="median"
            )
        )
    fn()  # warm-up
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def graph_time_ms(fn: Callable[[], object], device: torch.device, rep_ms: int = 60) -> float | None:
    """Median milliseconds per replay of `fn` captured in a CUDA graph; None without CUDA."""
    if device.type != "cuda":
        return None
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


def copy_bandwidth_gbps(device: torch.device, mib: int = 2048) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, rep_ms=200)
    return 2 * (mib << 20) / (ms * 1e-3) / 1e9


def device_refusal(dry_run: bool, name: str) -> int | None:
    """The exit code a GPU benchmark stops with here, or None to go on: a dry run needs the
    Triton interpreter on from the start (2); a real one without CUDA has nothing to measure
    (0, saying so)."""
    import sys

    from pagedserve.kernels import triton_interpreter_active

    if dry_run and not triton_interpreter_active():
        print("--dry-run needs TRITON_INTERPRET=1 set before Python starts", file=sys.stderr)
        return 2
    if not dry_run and not torch.cuda.is_available():
        print(f"pagedserve.bench.{name}: no CUDA device here; nothing to measure.")
        return 0
    return None


def timer_name(device: torch.device) -> str:
    return "cuda-events" if device.type == "cuda" else "host"


def render_markdown(rows: list[dict[str, Any]], columns_by_section: dict[str, list[str]]) -> str:
    """One Markdown table per section, in the order given; sections without rows are left out."""
    out = []
    for section, columns in columns_by_section.items():
        section_rows = [r for r in rows if r.get("section") == section]
        if not section_rows:
            continue
        out.append(f"### {section}\n")
        out.append("| " + " | ".join(columns) + " |")
        out.append("|" + "---|" * len(columns))
        for row in section_rows:
            out.append("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
        out.append("")
    return "\n".join(out)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value).replace("|", "/")


# -------------------------------------------------------------- a run's budget
def out_of_time(args) -> bool:
    """Whether the run's `--budget-s` (its `deadline`) has passed: what is left is skipped."""
    return args.deadline is not None and time.monotonic() > args.deadline


def free_cache(device: torch.device) -> None:
    """Give the caching allocator's free blocks back between configurations."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
