#!/usr/bin/env bash
# The README's main job: set up .venv, then run the layer-split pool demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
exec .venv/bin/python scripts/bench_broadcast.py "$@"
