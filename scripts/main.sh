#!/usr/bin/env bash
# Set everything up, then start the main job. Extra arguments go to `pagedserve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -eq 0 ]; then
    set -- kv-calc --lengths 37,91,128,201,511 --block-sizes 16,32 --max-len 512
fi
exec .venv/bin/pagedserve "$@"
