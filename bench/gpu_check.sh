#!/usr/bin/env bash
# One short run on a GPU machine: kernel correctness on CUDA, then the decode benchmark.
#
#   bash bench/gpu_check.sh          # PYTHON=... to pick the interpreter
#
# With CUDA: the kernel tests (tests/unit/kernels, tests/gpu) run the compiled Triton kernels,
# then `python -m pagedserve.bench.kernels` writes its table (and JSON under $OUT or out/).
# Total well under 5 minutes on an H200. Without CUDA: the same unit tests run under the
# Triton interpreter, then it says there is no CUDA and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -n "${PYTHON:-}" ]; then
    py="$PYTHON"
elif [ -x .venv/bin/python ]; then
    py=.venv/bin/python
else
    py=python3
fi
out_dir="${OUT:-out}"
start=$SECONDS

if "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    "$py" -c 'import torch; print("CUDA:", torch.cuda.get_device_name(0), "| torch", torch.__version__)'
    echo "== kernel correctness on CUDA (compiled Triton) =="
    # The interpreter must be off: it is chosen when triton is imported.
    env -u TRITON_INTERPRET timeout 240 "$py" -m pytest tests/unit/kernels tests/gpu -q \
        -p no:cacheprovider
    echo "== decode benchmark ($((SECONDS - start))s so far) =="
    mkdir -p "$out_dir"
    env -u TRITON_INTERPRET timeout 150 "$py" -m pagedserve.bench.kernels \
        --json "$out_dir/kernels_bench.json"
    echo "gpu_check: done in $((SECONDS - start))s"
else
    echo "== kernel correctness under the Triton interpreter (no CUDA) =="
    TRITON_INTERPRET=1 "$py" -m pytest tests/unit/kernels -q -p no:cacheprovider
    "$py" -m pagedserve.bench.kernels
    echo "gpu_check: no CUDA device, so no CUDA tests and no benchmark; exiting 0" \
        "after $((SECONDS - start))s"
fi
