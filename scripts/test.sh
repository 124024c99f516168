#!/usr/bin/env bash
# The README's test command: set up .venv, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
exec .venv/bin/python -m pytest "$@"
