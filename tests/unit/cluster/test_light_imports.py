"""The control actors start without torch: the prefix index, the worker pool and the Router's
module import neither torch, transformers nor triton.

Each actor is a process of its own, started at every app start (and a pool and an index at
every cluster a test starts): importing torch and transformers there cost 1.6-4 CPU-seconds
per process on a 2-core machine, for nothing they use. The worker's module imports its engine
in the worker's constructor, so the pool can create workers from the class alone.
"""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "triton")
LIGHT_MODULES = [
    "pagedserve.cluster.index.prefix_index",  # the prefix index actor
    "pagedserve.cluster.pool.pool",  # the worker pool actor (creates `Worker` actors)
    "pagedserve.cluster.app",  # the Router replica and `build_app`
    "pagedserve.workers.worker.actor",  # the class the pool creates workers from
]


def heavy_imports(*modules: str) -> list[str]:
    """Which of HEAVY a fresh interpreter has loaded after importing `modules`."""
    code = (
        "import importlib, json, sys\n"
        f"for module in {modules!r}:\n"
        "    importlib.import_module(module)\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_control_actors_modules_import_no_torch():
    # One interpreter for all of them: none may import torch, so none may in any order.
    assert heavy_imports(*LIGHT_MODULES) == []


def test_the_check_sees_a_module_that_imports_torch():
    assert heavy_imports("pagedserve.workers.kv.cache") == ["torch"]
