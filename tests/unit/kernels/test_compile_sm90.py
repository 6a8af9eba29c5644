"""The Triton kernels compile for sm_90 (H100/H200) on a machine without a GPU."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

from pagedserve.kernels.launch import DECODE_CANDIDATES, PREFILL_CANDIDATES
from pagedserve.workers.model.registry import default_cache_dir

SCRIPT = pathlib.Path(__file__).with_name("compile_sm90.py")
# 3 dtypes x (decode and reduce, each plain and VARLEN, + prefill) + write_kv + 3 block movers,
# + decode and prefill over an 8-bit pool: e4m3, e5m2 and int8.
DEFAULT_KERNELS = 3 * 5 + 4 + 3 * 2

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None
    or not (
        pathlib.Path(importlib.util.find_spec("triton.backends.nvidia").origin).parent
        / "bin"
        / "ptxas"
    ).exists(),
    reason="Triton's NVIDIA backend (ptxas) is absent",
)


# Triton's cache is content-addressed: a kernel's entry is keyed by its source and the source
# of every function it calls, the signature and constexprs, the options, the target, Triton's
# version and its backend (ptxas included). An entry is there only if that exact compile
# succeeded, so a hit proves what a compile would, and any change to a kernel, a launch
# config or the toolchain compiles again. Kept beside the model cache, apart from the default
# Triton cache that GPU runs and the interpreter share: the first run on a machine compiles
# (~40 s of CPU per build), later runs (a fresh clone's included) read it.
CACHE = pathlib.Path(default_cache_dir()) / "triton-sm90"


def _start(cache_dir: pathlib.Path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="module")
def compiled(request) -> dict[str, subprocess.Popen]:
    """Both builds started at once: each is one process compiling kernel after kernel, so on a
    machine with two cores they take the time of the longer one instead of the sum. (The
    candidates' build only when its test runs: the fast tier leaves it out.)"""
    runs = {"defaults": _start(CACHE / "defaults")}
    selected = {item.name for item in request.session.items}
    if test_every_swept_launch_config_compiles_within_shared_memory.__name__ in selected:
        runs["candidates"] = _start(CACHE / "candidates", "--candidates")
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
