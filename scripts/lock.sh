#!/usr/bin/env bash
# Refresh requirements/lock.txt on purpose: resolve the project with its dev extra again,
# unpinned (the newest versions the package index serves), in a fresh temporary venv; write the
# lock from that venv's `pip freeze`; show the diff against the old lock; then run the whole
# suite on the new lock (scripts/test.sh installs it into .venv first). Commit the new lock only
# after the suite passed.
#
#   bash scripts/lock.sh [--no-test] [--torch VERSION]
#
# torch: the old lock's version unless --torch says another, this machine's CPU build (pip takes
# the wheel on this machine's disk); a lock that would hold CUDA packages is refused. ray: held
# at the Ray base image's version (deploy/Dockerfile's FROM tag). triton and the other exact
# pins of PyPI's CUDA build of torch: held at that build's versions, read from the index's
# metadata (nothing downloaded), so that the GPU image can install the same lock.
set -euo pipefail
cd "$(dirname "$0")/.."
LOCK=requirements/lock.txt
run_tests=1
torch_version="$(sed -n 's/^torch==\([^ ]*\)$/\1/p' "$LOCK" 2>/dev/null || true)"
torch_version="${torch_version:-2.13.0}"
while [ "$#" -gt 0 ]; do
    case "$1" in
        --no-test) run_tests=0 ;;
        --torch) torch_version="$2"; shift ;;
        *) echo "usage: bash scripts/lock.sh [--no-test] [--torch VERSION]" >&2; exit 2 ;;
    esac
    shift
done
if ! python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    echo "lock.sh: the lock is for CPython 3.11 (the Ray images' Python); python3 is not" >&2
    exit 1
fi
ray_version="$(sed -n 's|^FROM rayproject/ray:\([^-]*\)-.*|\1|p' deploy/Dockerfile)"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
pip=("$tmp/venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
# PyPI's torch (the CUDA build) from outside this machine's pip configuration (--isolated: its
# find-links would offer the CPU wheel): metadata only, for its exact pins.
"${pip[@]}" install -q --isolated --dry-run --ignore-installed --no-deps \
    --report "$tmp/cuda-torch.json" "torch==$torch_version"
{
    python3 scripts/lockfile.py cuda-pins "$tmp/cuda-torch.json"
    echo "ray==$ray_version"
} > "$tmp/constraints.txt"
echo "lock.sh: resolving torch==$torch_version and .[dev] with these held:" >&2
sed 's/^/  /' "$tmp/constraints.txt" >&2

# As scripts/setup.sh installs: torch first, by itself; then the project's build requirements
# (setup.sh builds it without isolation) and the project with its dev extra.
mapfile -t build_requires < <(python3 -c \
    'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"], sep="\n")')
"${pip[@]}" install -q -c "$tmp/constraints.txt" "torch==$torch_version"
"${pip[@]}" install -q -c "$tmp/constraints.txt" "${build_requires[@]}" -e '.[dev]'

"${pip[@]}" freeze --all --exclude-editable > "$tmp/freeze.txt"
if grep -iE '^(nvidia|cuda)[-_]' "$tmp/freeze.txt" >&2; then
    echo "lock.sh: torch==$torch_version came as a CUDA build (above): the lock is for the" \
        "CPU build that lies on this machine's disk" >&2
    exit 1
fi
# The file pip picks for each pin, with its sha256 (torch has no hash: see the lock's header).
grep -viE '^torch==' "$tmp/freeze.txt" > "$tmp/pins.txt"
"${pip[@]}" install -q --dry-run --ignore-installed --no-deps \
    --report "$tmp/files.json" -r "$tmp/pins.txt"
python3 scripts/lockfile.py write "$tmp/freeze.txt" "$tmp/files.json" "$tmp/lock.txt"

mkdir -p "$(dirname "$LOCK")"
[ -f "$LOCK" ] || : > "$LOCK"
if diff -u "$LOCK" "$tmp/lock.txt"; then
    echo "lock.sh: nothing changed" >&2
else
    cp "$tmp/lock.txt" "$LOCK"
    echo "lock.sh: wrote $LOCK (diff above)" >&2
fi
pinned="$(grep -c '==' "$LOCK")"
echo "lock.sh: $pinned packages pinned" >&2
if [ "$run_tests" -eq 0 ]; then
    echo "lock.sh: --no-test: run \`bash scripts/test.sh\` before committing $LOCK" >&2
    exit 0
fi
if bash scripts/test.sh; then
    echo "lock.sh: the suite passed on the new lock: commit $LOCK" >&2
else
    echo "lock.sh: the suite failed on the new lock: do not commit it" \
        "(\`git checkout $LOCK\` goes back)" >&2
    exit 1
fi
