#!/usr/bin/env bash
# One command with NVIDIA's MPS daemon up, started here and quit after it: the GPU then runs
# several processes' kernels without switching contexts between them, as a decode alone on its
# GPU meets it (docs/benchmarks.md#gpu-lane-end-to-end). The pipe and log folders go under /tmp;
# the GPU's compute mode is left as it is.
#   scripts/gpu_mps.sh python3 scripts/bench_fetch.py --device cuda --primes off
set -uo pipefail
[ $# -gt 0 ] || { echo "usage: $0 COMMAND..." >&2; exit 2; }
command -v nvidia-cuda-mps-control >/dev/null || { echo "nvidia-cuda-mps-control is not installed" >&2; exit 2; }
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/pdkv-mps-pipe}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/pdkv-mps-log}
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || exit 1
trap 'echo quit | nvidia-cuda-mps-control' EXIT
"$@"
