#!/usr/bin/env bash
# Before/after on the lent GPU machine in one call (device tool, carry=[".whl", TREES...]): runs
# one command in each of several source trees in turn, ROUNDS times, so that both versions meet
# the same machine state. Each tree is a whole checkout (say `git archive <commit> | tar -x -C
# .cmp/before`, in a folder that .git/info/exclude ignores); the wheels are installed as
# scripts/gpu_check.sh installs them. Each run's output goes to $OUT/compare.log; its last TAIL
# lines (default 14) are printed.
#   scripts/gpu_compare.sh ROUNDS TREE1 TREE2 [...] -- python3 scripts/bench_fetch.py --device cuda ...
set -uo pipefail
OUT=${OUT:-/tmp}
TAIL=${TAIL:-14}
ROUNDS=$1
shift
trees=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  trees+=("$1")
  shift
done
shift
[ $# -gt 0 ] || { echo "usage: $0 ROUNDS TREE... -- COMMAND..." >&2; exit 2; }
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
root=$PWD
for round in $(seq 1 "$ROUNDS"); do
  for tree in "${trees[@]}"; do
    echo "=== round $round: $tree: $*" | tee -a "$OUT/compare.log"
    (cd "$root/$tree" && PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 timeout "${RUN_TIMEOUT:-240}" "$@") 2>&1 \
      | grep -v "NIXL INFO\|UCX  WARN" >"$OUT/run.log"
    cat "$OUT/run.log" >>"$OUT/compare.log"
    tail -n "$TAIL" "$OUT/run.log"
  done
done
rm -f "$OUT/run.log"
