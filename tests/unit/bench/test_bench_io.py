"""`bench_io.exit_on_sigterm`: a bench stopped with SIGTERM runs its `finally` blocks (where
it stops the servers it started) and exits 143."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import os, signal, sys
from pagedserve.bench.bench_io import exit_on_sigterm
exit_on_sigterm()
try:
    os.kill(os.getpid(), signal.SIGTERM)
    signal.pause()
finally:
    print("cleaned up", flush=True)
"""


def test_sigterm_runs_the_finally_blocks():
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 143
    assert done.stdout.strip() == "cleaned up"
