#!/usr/bin/env bash
# One prepared run on a bare lent GPU machine: install, CUDA sanity, GPU tests, benchmarks.
#
#   OUT=/some/dir bash scripts/gpu_check.sh             # on the GPU machine (no network needed)
#   GPU_CHECK_DRY_RUN=1 OUT=/tmp/x bash scripts/gpu_check.sh   # CPU rehearsal (CI runs this)
#
# Steps, each under its own time cap and all under one overall guard (GPU_CHECK_BUDGET_S,
# default 480 s), so the files under $OUT can still be read back when a step overruns:
#   1 install   pip install --no-deps --no-build-isolation -e . (offline), after any wheels
#               carried in .whl/; falls back to a symlinked package tree on PYTHONPATH
#   2 cuda      fails loudly (exit 2) when nvidia-smi lists a GPU but torch sees no CUDA,
#               and (exit 3) when there is no GPU at all outside a dry run
#   3 tests     tests/gpu + tests/unit/kernels on the compiled kernels, pytest -n (xdist)
#               when present, serially otherwise; a failure does not stop the run
#   4 kernels   python -m pagedserve.bench.kernels: rows appended as measured
#   5 e2e       python scripts/gpu_e2e.py: engine tokens/s vs HF generate
#   5b tp       with more than one GPU: `bench offline --tensor-parallel-size 2` on SmolLM2
#               (its figures in gpu_check.log); step 3 runs tests/gpu/test_tp_gpu.py, k = 2
#               over NCCL against k = 1, which skips itself on one GPU
#   6 report    summary.md from whatever rows exist
# Files in $OUT (flat, at most 8): gpu_check.log, junit.xml, bench_rows.jsonl, kernels.json,
# kernels.md, e2e.json, summary.md. Exit status: 0 only if every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

dry=${GPU_CHECK_DRY_RUN:-0}
budget=${GPU_CHECK_BUDGET_S:-480}
reserve=${GPU_CHECK_RESERVE_S:-20} # kept back at the end for the report
out_dir=${OUT:-out/gpu_check}
mkdir -p "$out_dir"
out_dir=$(cd "$out_dir" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
steps="$work/steps.tsv"
: >"$steps"
exec > >(tee -a "$out_dir/gpu_check.log") 2>&1
start=$SECONDS
failed=0

if [ -n "${PYTHON:-}" ]; then
    py="$PYTHON"
elif [ -x .venv/bin/python ]; then
    py=.venv/bin/python
else
    py=python3
fi
export PYTHONUNBUFFERED=1

remaining() { echo $((budget - (SECONDS - start))); }

# run_step NAME CAP_S CMD...: run under min(CAP, time left - reserve); record the outcome.
run_step() {
    local name=$1 cap=$2
    shift 2
    local left=$(($(remaining) - reserve))
    local limit=$((cap < left ? cap : left))
    if [ "$limit" -lt 10 ]; then
        echo "== $name: skipped, ${left}s left in the budget =="
        printf '%s\tskipped\t0\tout of time\n' "$name" >>"$steps"
        failed=1
        return
    fi
    echo "== $name (limit ${limit}s, $((SECONDS - start))s so far) =="
    local t0=$SECONDS rc
    # SIGINT first: pytest and Python then still write their junit / final files.
    timeout -s INT -k 15 "$limit" "$@"
    rc=$?
    local note=ok
    [ "$rc" -eq 124 ] && note="hit its ${limit}s limit"
    [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && note="exit $rc"
    [ "$rc" -ne 0 ] && failed=1
    printf '%s\t%s\t%s\t%s\n' "$name" "$([ "$rc" -eq 0 ] && echo pass || echo FAIL)" \
        "$((SECONDS - t0))" "$note" >>"$steps"
}

report() {
    "$py" scripts/gpu_report.py --out-dir "$out_dir" --steps "$steps" \
        --dry-run "$dry" --elapsed $((SECONDS - start)) || echo "report failed"
    rm -rf "$work"
}

# --- 1 install -------------------------------------------------------------------------
make_shim() {
    # The package-dir mapping of pyproject.toml as a tree of symlinks: pagedserve.kernels
    # exists only through that mapping, so a plain PYTHONPATH=. cannot import it.
    "$py" - "$repo" "$work/shim" <<'PY'
import pathlib, sys, tomllib
repo, shim = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
dirs = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
root = shim / "pagedserve"
root.mkdir(parents=True)
for item in (repo / dirs["pagedserve"]).iterdir():
    (root / item.name).symlink_to(item)
for package, folder in dirs.items():
    if package.count(".") == 1:
        (root / package.split(".")[1]).symlink_to(repo / folder)
PY
}

install() {
    if compgen -G ".whl/*.whl" >/dev/null; then
        echo "installing carried wheels: $(ls .whl)"
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$work/site" .whl/*.whl || return 1
        export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    local mode=${GPU_CHECK_INSTALL:-$([ "$dry" = 1 ] && echo shim || echo pip)}
    if [ "$mode" = pip ] &&
        "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1; then
        echo "installed pagedserve (editable)"
    else
        [ "$mode" = pip ] && echo "pip install -e . failed: falling back to a symlinked tree"
        make_shim || return 1
        export PYTHONPATH="$work/shim${PYTHONPATH:+:$PYTHONPATH}"
        echo "pagedserve importable from $work/shim"
    fi
    "$py" -c 'import pagedserve.kernels, pagedserve.bench.kernels; print("import ok")'
}

echo "gpu_check: $(date -u +%FT%TZ) dry_run=$dry budget=${budget}s out=$out_dir"
"$py" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "| torch",
torch.__version__, "| triton", triton.__version__)' || true
install_t0=$SECONDS
if install; then
    printf 'install\tpass\t%s\tok\n' "$((SECONDS - install_t0))" >>"$steps"
else
    printf 'install\tFAIL\t%s\tpagedserve not importable\n' "$((SECONDS - install_t0))" >>"$steps"
    echo "gpu_check: cannot import pagedserve; stopping"
    report
    exit 1
fi

# --- 2 cuda ------------------------------------------------------------------------------
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "$dry" = 1 ]; then
    printf 'cuda\tskipped\t0\tdry run: CPU rehearsal under the Triton interpreter\n' >>"$steps"
    export TRITON_INTERPRET=1 # before any Python starts: triton picks it at import
elif "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem \
        --format=csv 2>/dev/null || true
    name=$("$py" -c 'import torch; print(torch.cuda.get_device_name(0))')
    printf 'cuda\tpass\t0\t%s\n' "$name" >>"$steps"
    unset TRITON_INTERPRET # compiled kernels: the interpreter is chosen when triton imports
elif [ "$gpus" -gt 0 ]; then
    echo "gpu_check: FAIL: nvidia-smi lists $gpus GPU(s) but torch.cuda.is_available() is False"
    "$py" -c 'import torch; print("torch", torch.__version__, "built for CUDA", torch.version.cuda)'
    printf 'cuda\tFAIL\t0\tnvidia-smi lists %s GPU(s), torch sees no CUDA\n' "$gpus" >>"$steps"
    report
    exit 2
else
    echo "gpu_check: FAIL: no GPU here; GPU_CHECK_DRY_RUN=1 runs the CPU rehearsal"
    printf 'cuda\tFAIL\t0\tno GPU and not a dry run\n' >>"$steps"
    report
    exit 3
fi

# --- 3 tests -----------------------------------------------------------------------------
if [ "$dry" = 1 ]; then
    # One xdist worker rehearses the -n path; two cost the suite ~20 s more on a 2-core CI box.
    tests=(tests/gpu tests/unit/kernels/test_jit_specialisations.py)
    workers=1
else
    tests=(tests/gpu tests/unit/kernels)
    workers=${GPU_CHECK_TEST_WORKERS:-8}
fi
xdist=()
if "$py" -c 'import xdist' 2>/dev/null; then
    xdist=(-n "$workers")
else
    echo "pytest-xdist not installed: tests run serially"
fi
run_step tests "${GPU_CHECK_TESTS_S:-120}" "$py" -m pytest "${tests[@]}" "${xdist[@]}" -q \
    -m "not slow" -p no:cacheprovider -o timeout=120 --junitxml="$out_dir/junit.xml"

# --- 4 kernels, 5 e2e ----------------------------------------------------------------------
bench_flags=()
[ "$dry" = 1 ] && bench_flags=(--dry-run)
kernels_cap=${GPU_CHECK_KERNELS_S:-160}
run_step kernels "$kernels_cap" "$py" -m pagedserve.bench.kernels "${bench_flags[@]}" \
    --out-dir "$out_dir" --budget-s $((kernels_cap - 25))
run_step e2e "${GPU_CHECK_E2E_S:-110}" "$py" scripts/gpu_e2e.py "${bench_flags[@]}" \
    --out-dir "$out_dir"

if [ "$dry" != 1 ] && [ "$gpus" -gt 1 ]; then
    run_step tp "${GPU_CHECK_TP_S:-70}" "$py" -m pagedserve bench offline --device cuda \
        --tensor-parallel-size 2 --num-prompts 16 --max-tokens 64
else
    printf 'tp\tskipped\t0\t%s GPU(s): tensor parallelism needs 2\n' "$gpus" >>"$steps"
fi

# --- 6 report ----------------------------------------------------------------------------
report
echo "gpu_check: done in $((SECONDS - start))s; $([ "$failed" = 0 ] && echo 'all passed' || echo 'some steps FAILED')"
exit "$failed"
