#!/usr/bin/env bash
# Set everything up, then start the main job. Extra arguments go to `pagedserve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -eq 0 ]; then
    set -- serve
fi
exec .venv/bin/pagedserve "$@"
