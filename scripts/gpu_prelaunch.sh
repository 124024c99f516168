#!/usr/bin/env bash
# A GPU-lane change to a ticket fetch's host time, measured before and after in one call on the
# lent GPU machine (device tool, carry=[".whl", ".cmp"]), within BUDGET seconds (default 320):
# bench_fetch alternately in both trees (`scripts/gpu_compare.sh`); on the after tree the GPU
# tests of the launch (the kernel's, the launch-first fakes, the stream's); where an 8k fetch's
# time goes in each tree (gpu_profile_ticket.py: put the same copy of it in both, so that both
# are stamped alike); the rest of test_gpu.py; a second round of the bench in the other order;
# the engine-buffer lane on the after tree. Each step runs only where the budget still allows it,
# in that order. Logs land in $OUT.
#   scripts/gpu_prelaunch.sh [BEFORE] [AFTER]      (default .cmp/before .cmp/after)
set -uo pipefail
export OUT=${OUT:-/tmp}
BEFORE=${1:-.cmp/before}
AFTER=${2:-.cmp/after}
BUDGET=${BUDGET:-320}
left() { echo $((BUDGET - SECONDS)); }
quiet() { grep -v "NIXL INFO\|UCX  WARN"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
bench=(python3 scripts/bench_fetch.py --device cuda --sizes 1024,8192,32768 --runs 8)
tests() {  # the after tree's tests: $1 seconds, then pytest's arguments
  local limit=$1
  shift
  (cd "$AFTER" && PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 timeout "$limit" python3 -m pytest -q -p no:cacheprovider "$@") \
    2>&1 | quiet | tail -12 | tee -a "$OUT/gpu_tests.log"
}
cap() { local n=$(($(left) - $1)); echo $((n > $2 ? $2 : n)); }  # what is left less $1, at most $2
echo "=== bench round 1 ($SECONDS s)"
RUN_TIMEOUT=90 scripts/gpu_compare.sh 1 "$BEFORE" "$AFTER" -- "${bench[@]}"
echo "=== tests: the kernel's, the launch-first fakes, the stream's ($SECONDS s)"
first="gather or prime"
tests "$(cap 40 90)" tests/test_gpu.py -k "not nccl and ($first)"
tests "$(cap 40 60)" tests/test_gather.py tests/test_stream_fetch.py
for tree in "$AFTER" "$BEFORE"; do
  if [ "$(left)" -gt 35 ]; then
    echo "=== profile, 8k, $tree ($SECONDS s)"
    TAIL=34 RUN_TIMEOUT=$(cap 5 45) scripts/gpu_compare.sh 1 "$tree" -- python3 scripts/gpu_profile_ticket.py --tokens 8192 --runs 20
  fi
done
if [ "$(left)" -gt 40 ]; then
  echo "=== tests, the rest of test_gpu.py ($SECONDS s)"
  tests "$(cap 10 200)" tests/test_gpu.py -k "not nccl and not ($first)"
fi
if [ "$(left)" -gt 110 ]; then
  echo "=== bench round 2 ($SECONDS s)"
  RUN_TIMEOUT=$((($(left) - 10) / 2)) scripts/gpu_compare.sh 1 "$AFTER" "$BEFORE" -- "${bench[@]}"
fi
if [ "$(left)" -gt 50 ]; then
  echo "=== engine buffers, after ($SECONDS s)"
  (cd "$AFTER" && PYTHONPATH=/tmp/site:$PWD timeout $(($(left) - 5)) "${bench[@]}" --engine-buffers --vmm) 2>&1 | quiet \
    | tail -32 | tee "$OUT/bench_engine.log"
fi
echo "=== done ($SECONDS s)"
