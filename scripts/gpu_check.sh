#!/usr/bin/env bash
# One call on the lent GPU machine: install the carried wheels (.whl: nixl-cu13, msgspec,
# pytest-asyncio, for that image's Python 3.12), then run the GPU smoke and measurements.
# Run through the device tool with carry=[".whl"]; logs land in $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 540 python3 scripts/gpu_smoke.py 2>&1 | grep -v "NIXL INFO" | tee "${OUT:-/tmp}/gpu_smoke.log"
