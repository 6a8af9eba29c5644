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


def _compile(tmp_path: pathlib.Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, never from a warm cache
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_kernels_compile_for_sm90(tmp_path: pathlib.Path) -> None:
    out = _compile(tmp_path)
    assert out.count(": ok in") == DEFAULT_KERNELS, out


@pytest.mark.slow
def test_every_swept_launch_config_compiles_within_shared_memory(tmp_path) -> None:
    """The GPU sweep's candidates all build for sm_90 and fit a block's shared memory."""
    out = _compile(tmp_path, "--candidates")
    assert out.count(": ok in") >= len(PREFILL_CANDIDATES) + 4, out
    assert len(DECODE_CANDIDATES) >= 4
