#!/usr/bin/env bash
# Make .venv in the checkout with torch's CPU build first (a bare `torch` would pull a
# multi-GB CUDA build), then the project and its test extra. Idempotent and quiet.
#   scripts/setup_env.sh [sglang]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q torch==2.13.0
fi
.venv/bin/pip install -q -e ".[test]"
# With `sglang` (the tests): SGLang for its conformance test, without its dependencies
# (they would replace the CPU torch): the pinned wheel and what importing its
# transfer-backend classes needs. The main job does not need it.
if [ "${1:-}" = sglang ] && ! .venv/bin/python -c "import sglang.srt.disaggregation.base.conn" 2>/dev/null; then
  .venv/bin/pip install -q --no-deps -r scripts/sglang-cpu.txt
fi
