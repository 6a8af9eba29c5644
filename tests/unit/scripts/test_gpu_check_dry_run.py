"""The CPU rehearsal of scripts/gpu_check.sh: the script a lent GPU runs, tested where CI runs.

`GPU_CHECK_DRY_RUN=1` takes every step of the real run (install through a symlinked tree,
tests, kernel benchmark, end-to-end engine figure, report) at tiny shapes under the Triton
interpreter. The tests assert on the files it leaves in $OUT, which are what comes back from a
lent machine: at most 8 flat files with plain names.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import stat
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
# The script's own time plan (an 8-minute budget, each step capped) is the plan for an idle GPU.
# The rehearsal checks every step's flow, not that plan: it takes ~90 s on a quiet 2-core machine
# and more than 300 s beside the other test process of a CI run, so it gets a budget and step caps
# sized for a loaded machine, and the subprocess a failsafe past that budget.
REHEARSAL_TIME_PLAN = {
    "GPU_CHECK_BUDGET_S": "1500",
    "GPU_CHECK_TESTS_S": "450",
    "GPU_CHECK_KERNELS_S": "450",
    "GPU_CHECK_E2E_S": "450",
}
REHEARSAL_FAILSAFE_S = int(REHEARSAL_TIME_PLAN["GPU_CHECK_BUDGET_S"]) + 120
EXPECTED_FILES = {
    "gpu_check.log",
    "junit.xml",
    "bench_rows.jsonl",
    "kernels.json",
    "kernels.md",
    "e2e.json",
    "summary.md",
}


def _run(out: pathlib.Path, extra_env: dict[str, str], timeout: int = 300):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    env.pop("TRITON_INTERPRET", None)  # the script must set it itself for the rehearsal
    env.update({"OUT": str(out), "PYTHON": sys.executable, **extra_env})
    return subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> tuple[subprocess.CompletedProcess, pathlib.Path]:
    out = tmp_path_factory.mktemp("gpu_check")
    env = {"GPU_CHECK_DRY_RUN": "1", **REHEARSAL_TIME_PLAN}
    return _run(out, env, timeout=REHEARSAL_FAILSAFE_S), out


@pytest.mark.slow  # the whole rehearsal: ~40 s on a quiet 2-core machine
def test_rehearsal_passes_and_leaves_only_returnable_files(rehearsal) -> None:
    result, out = rehearsal
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    names = {p.name for p in out.iterdir()}
    assert names == EXPECTED_FILES
    assert len(names) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names)
    assert all((out / n).is_file() for n in names)


@pytest.mark.slow  # the whole rehearsal: ~40 s on a quiet 2-core machine
def test_rehearsal_measures_every_section_and_says_it_is_no_gpu_figure(rehearsal) -> None:
    _, out = rehearsal
    rows = [json.loads(line) for line in (out / "bench_rows.jsonl").read_text().splitlines()]
    sections = {r["section"] for r in rows}
    wanted = {"device", "decode", "prefill", "mixed", "uneven", "cuda_graph", "movers", "sweep",
              "sweep_winner", "jit", "e2e"}  # fmt: skip
    assert wanted <= sections
    assert not [r for r in rows if r.get("error")]
    assert {r["timer"] for r in rows if "timer" in r} == {"host"}
    impls = {r.get("impl") for r in rows if r["section"] == "decode"}
    assert {"triton", "sdpa", "sdpa_flash"} <= impls
    arms = {r["arm"] for r in rows if r["section"] == "e2e"}
    assert {"hf_generate", "engine_triton", "engine_torch"} <= arms
    summary = (out / "summary.md").read_text()
    assert "CPU rehearsal" in summary and "No figure below is a GPU figure" in summary
    assert "| tests | pass |" in summary and "| e2e | pass |" in summary
    assert "failures 0" in summary


def test_a_run_out_of_budget_skips_its_steps_and_fails(tmp_path: pathlib.Path) -> None:
    """Steps the budget no longer covers are skipped, reported, and make the run fail."""
    out = tmp_path / "out"
    # 25 s less the 20 s kept for the report leaves under the 10 s a step needs.
    env = {"GPU_CHECK_DRY_RUN": "1", "GPU_CHECK_BUDGET_S": "25", "GPU_CHECK_RESERVE_S": "20"}
    result = _run(out, env)
    assert result.returncode == 1, result.stdout[-3000:]
    summary = (out / "summary.md").read_text()
    for step in ("tests", "kernels", "e2e"):
        assert f"| {step} | skipped | 0 | out of time |" in summary
    assert "the test step did not finish" in summary
    assert "some steps FAILED" in result.stdout


def _fake_nvidia_smi(tmp_path: pathlib.Path) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "nvidia-smi"
    tool.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-fake)'\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return f"{bin_dir}:{os.environ.get('PATH', '')}"


def test_gpu_without_cuda_in_torch_fails_loudly(tmp_path: pathlib.Path) -> None:
    """nvidia-smi sees a GPU but this torch has no CUDA: exit 2, never a pass."""
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "out"
    result = _run(out, {"PATH": _fake_nvidia_smi(tmp_path), "GPU_CHECK_INSTALL": "shim"})
    assert result.returncode == 2, result.stdout[-3000:]
    assert "torch.cuda.is_available() is False" in result.stdout
    assert "| cuda | FAIL |" in (out / "summary.md").read_text()


def test_no_gpu_and_no_dry_run_is_not_a_pass(tmp_path: pathlib.Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    empty = tmp_path / "empty_bin"
    empty.mkdir()
    path = ":".join(p for p in os.environ.get("PATH", "").split(":") if p)
    # Shadow any real nvidia-smi with one that lists nothing.
    (empty / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    (empty / "nvidia-smi").chmod(0o755)
    result = _run(tmp_path / "out", {"PATH": f"{empty}:{path}", "GPU_CHECK_INSTALL": "shim"})
    assert result.returncode == 3, result.stdout[-3000:]
