#!/usr/bin/env bash
# One call on a lent machine with 2+ GPUs (device tool, kind nvidia-h200-x2, carry=[".whl"]):
# the multi-GPU tests (NCCL owner broadcast across GPUs, decode assembling from owners on
# other GPUs), the broadcast benchmark against a plain NCCL broadcast, and GPU-to-GPU fetch.
set -uo pipefail
OUT=${OUT:-/tmp}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
nvidia-smi topo -m | head -5 | tee -a "$OUT/machine.txt"
quiet() { grep -v "NIXL INFO\|UCX  WARN"; }
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | quiet | tail -15 | tee "$OUT/gpu_tests.log"
timeout 150 python3 scripts/bench_broadcast.py --device cuda --world 2 --tokens 65536 --runs 5 2>&1 | quiet | tail -12 | tee "$OUT/bench_broadcast_gpu.log"
timeout 150 python3 scripts/bench_fetch.py --device cuda --sizes 8192,32768 --runs 5 2>&1 | quiet | tail -5 | tee "$OUT/bench_fetch_gpu2.log"
