"""The order the whole suite hands its modules out in (scripts/test.sh: two pytest-xdist
processes, `--dist loadfile`, in collection order): each process takes the next module when it
is almost done with its own, so the run's wall time is the longer of the two, and a long module
taken last leaves the other process idle meanwhile. The suite is CPU-bound on 2 cores (beside a
busy loop on one core it took 1.84 times as long), so an idle process is lost time.

- Integration modules first, as before: each process keeps one shared Ray cluster for all of
  them (support/shared_cluster.py) and stops it when it moves on to the unit modules. Among
  them, those that start their own Ray (`OWN_RAY`) go first: while one runs, no shared cluster
  of that process idles beside it (it starts at the first module that asks for it).
- Then the rest, the longest first (`LONGEST_FIRST`, measured), then every other module in
  collection order: what is left for the end is many modules of seconds, which the two
  processes share out evenly.

The lists only decide the order: a module missing from them (new, renamed) runs in collection
order, and no test depends on what ran before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

TESTS = Path(__file__).parent.parent
INTEGRATION = TESTS / "integration"

# Integration modules that start a Ray of their own (`pagedserve serve` processes, a local Ray
# with the dashboard), longest first.
OWN_RAY = (
    "integration/test_serve_process.py",
    "integration/test_deploy.py",
)

# The longest other modules, longest first: the unit modules that took 20 s or more in a run
# of tests/unit and tests/gpu (2 processes, 2026-12-05, a machine loaded ~5 times over: 1660
# test-seconds in all; the first took 467 s there, ~90 s on a quiet machine). Those that ran last
# in collection order before (tests/unit/workers/...) left the other process idle at the end.
LONGEST_FIRST = (
    "unit/scripts/test_gpu_check_dry_run.py",
    "unit/bench/test_offline_bench.py",
    "unit/workers/engine/test_real_model.py",
    "unit/bench/test_compare.py",
    "unit/cluster/api/test_fuzz_inputs.py",
    "unit/cluster/serve/test_serve_preflight.py",
    "unit/kernels/test_split_and_knobs.py",
    "unit/workers/spec/test_spec_decode.py",
    "unit/workers/sampling/test_sampler.py",
    "unit/kernels/test_attention_triton.py",
    "unit/workers/kv/test_kv_manager_stateful.py",
    "unit/cluster/index/test_prefix_index.py",
    "unit/workers/engine/test_engine_equivalence.py",
    "unit/bench/test_kv_calc.py",
)


def module_rank(path: Path) -> tuple[int, int]:
    """Where a module goes: (tier, place in its list); collection order breaks ties."""
    name = path.relative_to(TESTS).as_posix() if TESTS in path.parents else str(path)
    if INTEGRATION in path.parents:
        if name in OWN_RAY:
            return 0, OWN_RAY.index(name)
        return 1, _place(name)
    return 2, _place(name)


def _place(name: str) -> int:
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def order_modules(items: Sequence[pytest.Item]) -> list[pytest.Item]:
    """`items` with each module's tests together, in their own order, modules by rank."""
    first_seen: dict[Path, int] = {}
    for item in items:
        first_seen.setdefault(item.path, len(first_seen))

    def key(item: pytest.Item) -> tuple[int, int, int]:
        return (*module_rank(item.path), first_seen[item.path])

    return sorted(items, key=key)  # stable: a module's tests keep their order
