#!/usr/bin/env bash
# One call on a lent machine with two or more GPUs (device tool, kind nvidia-h200-x2,
# carry=[".whl"]): the CUDA tests (the two-GPU ones included), the gather kernel alone, and
# the owner broadcast against a plain NCCL broadcast, and bench_fetch with owners and decode
# on one GPU and owners on GPU 1 with the decode on GPU 0 (`spread` adds owners over both).
# Logs land in $OUT; the whole call stays under the device tool's 10 minutes.
set -uo pipefail
OUT=${OUT:-/tmp}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
nvidia-smi topo -m 2>&1 | head -4 | tee -a "$OUT/machine.txt"
quiet() { grep -v "NIXL INFO\|UCX  WARN"; }
timeout 190 python3 -m pytest -q -p no:cacheprovider -p no:hypothesispytest tests/test_gpu.py tests/test_pool.py > "$OUT/gpu_tests.log" 2>&1
grep -E "^E |passed|failed|^FAILED" "$OUT/gpu_tests.log" | head -20
timeout 50 python3 scripts/bench_gather.py --runs 10 2>&1 | tail -19 | tee "$OUT/bench_gather.log"
for ctas in "--nccl-ctas 0" ""; do
  timeout 70 python3 scripts/bench_broadcast.py --device cuda --world 2 --runs 5 $ctas 2>&1 | tail -13 | tee -a "$OUT/bench_broadcast.log"
done
bench() { timeout 90 python3 scripts/bench_fetch.py --device cuda --sizes 1024,8192,32768 --runs 3 "$@" 2>&1 | quiet | tail -10; }
bench --prefill-device cuda:0 --decode-device cuda:0 | tee "$OUT/bench_one_gpu.log"
bench --prefill-device cuda:1 --decode-device cuda:0 | tee "$OUT/bench_peer.log"
[ "${1:-}" = spread ] && bench --prefill-device cuda --decode-device cuda:0 | tee "$OUT/bench_spread.log"
