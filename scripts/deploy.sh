#!/usr/bin/env bash
# The README's main job: set up .venv, then run a local PD deployment (see transfer/app/cli.py: python -m transfer.app).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
exec .venv/bin/python -m transfer.app "$@"
