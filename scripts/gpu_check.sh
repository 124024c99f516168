#!/usr/bin/env bash
# One call on the lent GPU machine (device tool, carry=[".whl", ".whl4"]): install the carried
# wheels (nixl-cu13, msgspec, pytest-asyncio for that image's Python 3.12) and, where carried,
# the `gpu` extra's (GPU_WHEELS, default .whl4: nccl4py and cuda-pathfinder; the image has
# cuda-bindings), run the CUDA tests and the GPU fetch benchmark (UCX and the same-host GPU
# lane). Logs land in $OUT.
#   scripts/gpu_check.sh [tests|bench|lane|sglang|all]     (default all)
# `lane`: the lane's figures for docs/benchmarks.md: how soon the host sees a kernel end, by
# mechanism (bench_gather.py --seen), and bench_fetch's pool and engine-buffer lanes.
# `sglang` (also in `all` where SGLang imports): its conformance test on CUDA buffers and
# bench_sglang's GPU row. The image lacks SGLang: carry its wheel's package in SGLANG_DIR
# (default .sgl), unpacked or as `sglang.tar.xz` (its `sglang/` without the `.so` files: ~11
# MB, where unpacked it is about what a call may carry beside nixl's wheel), and the few wheels
# its imports need in SGLANG_WHEELS (default .whl2; `scripts/sglang-cpu.txt` lists them).
# Elsewhere: run the same steps by hand after installing those packages.
set -uo pipefail
OUT=${OUT:-/tmp}
STAGE=${1:-all}
GPU_WHEELS=${GPU_WHEELS:-.whl4}
SGLANG_DIR=${SGLANG_DIR:-.sgl}
SGLANG_WHEELS=${SGLANG_WHEELS:-.whl2}
wheels=(.whl/*.whl)
for extra in "$GPU_WHEELS" "$SGLANG_WHEELS"; do
  if compgen -G "$extra/*.whl" >/dev/null; then wheels+=("$extra"/*.whl); fi
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" || exit 1
if [ -f "$SGLANG_DIR/sglang.tar.xz" ]; then tar -xJf "$SGLANG_DIR/sglang.tar.xz" -C /tmp/site || exit 1; fi
export PYTHONPATH=/tmp/site:$PWD/$SGLANG_DIR:$PWD PYTHONUNBUFFERED=1
python3 -c "import cuda.bindings.driver, nccl.bindings.nccl" 2>&1 | tail -1 || true  # the gpu extra: say if missing
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
nproc | tee -a "$OUT/machine.txt"
quiet() { grep -v "NIXL INFO\|UCX  WARN"; }
if [ "$STAGE" = tests ] || [ "$STAGE" = all ]; then
  timeout 420 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_gpu.py tests/test_gather.py tests/test_plan.py tests/test_lease_launch.py tests/test_stream_fetch.py tests/test_pool.py tests/test_engine_kv.py 2>&1 | quiet | tail -40 | tee "$OUT/gpu_tests.log"
fi
if [ "$STAGE" = bench ] || [ "$STAGE" = all ]; then
  timeout 300 python3 scripts/bench_fetch.py --device cuda --sizes 1024,8192,32768 --runs 5 2>&1 | quiet | tail -14 | tee "$OUT/bench_gpu.log"
fi
if [ "$STAGE" = lane ]; then
  timeout 120 python3 scripts/bench_gather.py --seen 2>&1 | tee "$OUT/seen.log"
  timeout 300 python3 scripts/bench_fetch.py --device cuda --sizes 1024,8192,32768 --runs 8 --engine-buffers --vmm 2>&1 | quiet | tail -32 | tee "$OUT/bench_lane.log"
fi
if [ "$STAGE" = sglang ] || { [ "$STAGE" = all ] && python3 -c "import sglang.srt.disaggregation.base.conn" 2>/dev/null; }; then
  timeout 300 python3 -m pytest -p no:cacheprovider -v --tb=short tests/test_sglang.py -k cuda 2>&1 | quiet | tail -30 | tee "$OUT/sglang_tests.log"
  timeout 120 python3 scripts/bench_sglang.py --device cuda --sizes 8192,32768 --runs 10 2>&1 | quiet | tail -9 | tee "$OUT/bench_sglang.log"
fi
