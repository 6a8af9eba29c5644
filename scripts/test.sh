#!/usr/bin/env bash
# Set everything up, then run the whole test suite (what CI runs), or with `--fast` its fast
# tier. Extra arguments go to pytest: in place of the default `tests` and its test processes,
# or after the fast tier's selection.
#
# The whole suite runs in PAGEDSERVE_TEST_PROCESSES pytest-xdist processes (2 by default: CI's
# 2 cores), one test module at a time each (`--dist loadfile`), so a module's fixtures stay in
# one process, in collection order (`--no-loadscope-reorder`, pyproject.toml), which
# tests/support/module_order.py sets: each process takes integration modules first (those with
# a Ray of their own before the rest), keeping one Ray cluster and one Serve instance for all
# of them (tests/support/shared_cluster.py), then unit modules, the longest first. The two
# processes keep both cores busy (beside a busy loop on one core the suite took 1.84 times as
# long): what makes it faster is less CPU work, not more overlap. 1: one process.
#
# `--fast`: the unit tests (every module's logic, Ray-free) but those marked `slow` (the
# GPU-check rehearsal, the sm_90 builds of the sweep's launch configs, real-model engine
# runs): a few minutes, for the inner loop. The integration tests need the whole suite.
#
# Everything runs at niceness 10, test clusters included (tests/conftest.py): a test run on a
# shared machine yields the cores to a server's engine, and no test process starves another.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
processes="${PAGEDSERVE_TEST_PROCESSES:-2}"
xdist=()
if [ "$processes" -gt 1 ]; then
    xdist=(-n "$processes" --dist loadfile)
fi
if [ "${1:-}" = "--fast" ]; then
    shift
    args=("${xdist[@]}" tests/unit tests/gpu -m "not slow" "$@")
elif [ "$#" -gt 0 ]; then
    args=("$@")
else
    args=("${xdist[@]}" tests)
fi
set +e
nice -n 10 .venv/bin/python -m pytest "${args[@]}"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing on purpose" >&2
    exit 1
fi
exit "$rc"
