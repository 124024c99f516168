#!/usr/bin/env bash
# Make .venv in the checkout with torch's CPU build first (a bare `torch` from PyPI is the
# multi-GB CUDA build on Linux), then the project and its test extra. Idempotent and quiet.
#   scripts/setup_env.sh [sglang]
# The CPU build is asked for by its local version, torch==2.13.0+cpu, which only CPU indexes
# carry: from pip's own sources where they have it (a mirror, a find-links directory), else
# from PDKV_TORCH_INDEX (default: PyTorch's CPU index). A torch already in .venv is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=torch==2.13.0+cpu
TORCH_INDEX=${PDKV_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
# torch comes through pip, which knows this machine's sources for it; the rest through uv,
# which installs in parallel (a minute of pip's on two cores, ~20 s of uv's), else pip.
# PDKV_PIP_COMPILE=0: no bytecode compiled at install (scripts/test.sh, whose processes write
# it at first import): every file of torch and SGLang, most of which nothing imports.
PIP=(.venv/bin/pip install -q)
UV=(.venv/bin/uv pip install -q --python .venv/bin/python)
if [ "${PDKV_PIP_COMPILE:-1}" = 0 ]; then
  PIP+=(--no-compile)
else
  UV+=(--compile-bytecode)
fi
install() { "${UV[@]}" "$@" || "${PIP[@]}" "$@"; }
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if [ -z "${PDKV_TORCH_INDEX:-}" ] && "${PIP[@]}" --dry-run --no-deps "$TORCH" >/dev/null 2>&1; then
    "${PIP[@]}" "$TORCH"
  else
    "${PIP[@]}" "$TORCH" --extra-index-url "$TORCH_INDEX"
  fi
fi
if [ ! -x .venv/bin/uv ]; then
  "${PIP[@]}" "uv==0.13.9" || true  # without it, pip installs the rest
fi
install -e ".[test]"
# With `sglang` (the tests): SGLang for its conformance test, without its dependencies
# (they would replace the CPU torch): the pinned wheel and what importing its
# transfer-backend classes needs. The main job does not need it.
if [ "${1:-}" = sglang ] && ! .venv/bin/python -c "import sglang.srt.disaggregation.base.conn" 2>/dev/null; then
  install --no-deps -r scripts/sglang-cpu.txt
fi
