#!/usr/bin/env bash
# The README's test command: set up .venv, check lint and format, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
