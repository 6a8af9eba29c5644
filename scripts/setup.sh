#!/usr/bin/env bash
# Create .venv (if missing) and install the project with its test tools.
# torch goes in first and explicitly: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC="${PAGEDSERVE_TORCH:-torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
stamp=.venv/.pagedserve-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q "$TORCH_SPEC"
    .venv/bin/python -m pip install -q -e '.[dev]'
    touch "$stamp"
fi
