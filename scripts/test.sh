#!/usr/bin/env bash
# Set everything up, then run the whole test suite. Extra arguments go to pytest (in place of
# the default `tests` and its test processes).
#
# The whole suite runs in PAGEDSERVE_TEST_PROCESSES pytest-xdist processes (2 by default: CI's
# 2 cores), one test module at a time each (`--dist loadfile`), so a module's Ray cluster and
# its fixtures stay in one process. Most of an integration module's time is waiting (Ray and
# Serve starting, workers loading, streams), which the other process fills. 1: one process.
# Everything runs at niceness 10, test clusters included (tests/conftest.py): a test run on a
# shared machine yields the cores to a server's engine, and no test process starves another.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
processes="${PAGEDSERVE_TEST_PROCESSES:-2}"
if [ "$#" -gt 0 ]; then
    args=("$@")
elif [ "$processes" -gt 1 ]; then
    args=(-n "$processes" --dist loadfile tests)
else
    args=(tests)
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
