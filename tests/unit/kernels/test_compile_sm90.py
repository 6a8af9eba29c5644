"""The Triton kernels compile for sm_90 (H100/H200) on a machine without a GPU."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

from pagedserve.kernels.launch import DECODE_CANDIDATES, PREFILL_CANDIDATES

SCRIPT = pathlib.Path(__file__).with_name("compile_sm90.py")
# 3 dtypes x (decode and reduce, each plain and VARLEN, + prefill) + write_kv + 3 block movers.
DEFAULT_KERNELS = 3 * 5 + 4

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None
    or not (
        pathlib.Path(importlib.util.find_spec("triton.backends.nvidia").origin).parent
        / "bin"
        / "ptxas"
    ).exists(),
    reason="Triton's NVIDIA backend (ptxas) is absent",
)


def _start(cache_dir: pathlib.Path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)  # compile for real, never from a warm cache
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, subprocess.Popen]:
    """Both builds started at once: each is one process compiling kernel after kernel, so on a
    machine with two cores they take the time of the longer one instead of the sum."""
    runs = {
        "defaults": _start(tmp_path_factory.mktemp("triton-defaults")),
        "candidates": _start(tmp_path_factory.mktemp("triton-candidates"), "--candidates"),
    }
    yield runs
    for run in runs.values():
        if run.poll() is None:
            run.kill()
            run.wait()


def _output(run: subprocess.Popen) -> str:
    out, _ = run.communicate(timeout=600)
    assert run.returncode == 0, out
    return out


def test_kernels_compile_for_sm90(compiled) -> None:
    out = _output(compiled["defaults"])
    assert out.count(": ok in") == DEFAULT_KERNELS, out


@pytest.mark.slow
def test_every_swept_launch_config_compiles_within_shared_memory(compiled) -> None:
    """The GPU sweep's candidates all build for sm_90 and fit a block's shared memory."""
    out = _output(compiled["candidates"])
    assert out.count(": ok in") >= len(PREFILL_CANDIDATES) + 4, out
    assert len(DECODE_CANDIDATES) >= 4
