#!/usr/bin/env bash
# One call on the lent GPU machine (device tool, carry=[".whl"]): install the carried wheels
# (nixl-cu13, msgspec, pytest-asyncio for that image's Python 3.12), run the CUDA tests, the GPU fetch benchmark, and the CPU fetch benchmark on its cores.
# Logs land in $OUT. Elsewhere: run the same steps by hand after installing those packages.
set -uo pipefail
OUT=${OUT:-/tmp}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
nproc | tee -a "$OUT/machine.txt"
quiet() { grep -v "NIXL INFO\|UCX  WARN"; }
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_pool.py 2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
timeout 150 python3 scripts/bench_fetch.py --device cuda --sizes 8192,32768 --runs 5 2>&1 | quiet | tail -6 | tee "$OUT/bench_gpu.log"
timeout 120 python3 scripts/bench_fetch.py --device cpu --sizes 8192,32768 --runs 5 2>&1 | quiet | tail -6 | tee "$OUT/bench_cpu16.log"
