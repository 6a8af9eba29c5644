"""`summary.md` of a `scripts/gpu_check.sh` run: the steps, then every benchmark table.

    python scripts/gpu_report.py --out-dir DIR --steps STEPS.tsv [--dry-run 0|1]

Rendered from `DIR/bench_rows.jsonl` alone, so a run cut short still gets a summary of
whatever was measured before the cut.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from pagedserve.bench.gpu_rows import read_rows, render_markdown

E2E_COLUMNS = ["arm", "tokens_per_s", "seconds", "greedy_match_share", "full_matches",
               "compiles_in_timed_run", "params_b", "prompts", "prompt_len", "max_new",
               "error"]  # fmt: skip
DEVICE_COLUMNS = ["name", "torch", "copy_gbps", "timer"]


def steps_table(steps_path: pathlib.Path) -> str:
    lines = ["| step | result | seconds | note |", "|---|---|---:|---|"]
    if steps_path.exists():
        for line in steps_path.read_text(encoding="utf-8").splitlines():
            fields = (line.split("\t") + ["", "", "", ""])[:4]
            lines.append("| " + " | ".join(f.replace("|", "/") for f in fields) + " |")
    return "\n".join(lines)


def junit_line(out_dir: pathlib.Path) -> str:
    """Test counts from junit.xml, or why there are none."""
    import xml.etree.ElementTree as ET

    path = out_dir / "junit.xml"
    if not path.exists():
        return "no junit.xml (the test step did not finish)"
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        return f"junit.xml unreadable: {exc}"
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return "junit.xml has no testsuite"
    keys = ("tests", "failures", "errors", "skipped", "time")
    return ", ".join(f"{k} {suite.get(k)}" for k in keys)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=pathlib.Path, required=True)
    p.add_argument("--steps", type=pathlib.Path, required=True)
    p.add_argument("--dry-run", default="0")
    p.add_argument("--elapsed", default="?")
    args = p.parse_args(argv)
    from pagedserve.bench.kernels import TABLE_COLUMNS

    rows = read_rows(args.out_dir / "bench_rows.jsonl")
    head = "# gpu_check summary\n\n"
    if args.dry_run == "1":
        head += (
            "**CPU rehearsal (GPU_CHECK_DRY_RUN=1): Triton interpreter, tiny shapes, host "
            "clock. No figure below is a GPU figure.**\n\n"
        )
    parts = [
        head + f"Elapsed: {args.elapsed} s\n",
        "## Steps\n",
        steps_table(args.steps) + "\n",
        f"Tests: {junit_line(args.out_dir)}\n",
        "## Device\n",
        render_markdown(rows, {"device": DEVICE_COLUMNS}),
        "## End to end\n",
        render_markdown(rows, {"e2e": E2E_COLUMNS}) or "no rows\n",
        "## Kernels\n",
        render_markdown(rows, TABLE_COLUMNS) or "no rows\n",
        _errors(rows),
    ]
    (args.out_dir / "summary.md").write_text("\n".join(parts), encoding="utf-8")
    print(f"wrote {args.out_dir / 'summary.md'} ({len(rows)} rows)")
    return 0


def _errors(rows: list[dict]) -> str:
    errors = [r for r in rows if r.get("error")]
    if not errors:
        return ""
    lines = ["## Errors\n"]
    lines += [f"- {r.get('section')}: {r.get('impl') or r.get('arm') or r.get('kernel')}: "
              f"{r['error']}" for r in errors]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
