#!/usr/bin/env bash
# One batched session on the GPU machine: every GPU test, then the serving load at
# concurrency 1/8/32 on the small example, whole and cut in two stages on the same GPU.
# Usage (from the repository root, with the project installed): bash tests/bench/gpu_session.sh OUT
# Each step is bounded; logs land in OUT (gpu-tests.log, serve-whole.txt, serve-2stages.txt).
set -uo pipefail
out=${1:?usage: gpu_session.sh OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$out/gpu.txt"

timeout "${GPU_TESTS_S:-260}" python3 -m pytest -q -m gpu -p no:cacheprovider tests \
  -k 'not two_gpus and not over_nccl' 2>&1 | tee "$out/gpu-tests.log" | tail -25

bench() {  # name, extra flags...
  local name=$1; shift
  timeout "${SERVE_S:-150}" python3 tests/bench/serve_bench.py --size small --backend cuda \
    --dir /tmp/kerncc-serve-small --levels 1,8,32 --requests-per-level 2 --prompt-len 128 \
    --max-tokens 64 --budget 40 "$@" 2>&1 | tee "$out/serve-$name.txt" | tail -12
}
bench whole
bench 2stages --pipeline 'cut,slice-derive,emit'
