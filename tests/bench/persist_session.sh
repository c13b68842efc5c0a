#!/usr/bin/env bash
# Issue 20's persistent decode runs on the GPU machine, in one batched session: their GPU
# tests first (the bits against the launches), the persistent GEMV-chain probe, then the
# decode rows with and without the runs side by side, then every GPU test.
# Usage (from the repository root, with the project installed): bash tests/bench/persist_session.sh OUT
# Each step is bounded; logs land in OUT (persist-tests.log, probe.txt, decode.txt, gpu-tests.log).
set -uo pipefail
out=${1:?usage: persist_session.sh OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$out/gpu.txt"

timeout "${PERSIST_TESTS_S:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider -x \
  tests/test_persist_cuda.py 2>&1 | tee "$out/persist-tests.log" | tail -25
tests=${PIPESTATUS[0]}

timeout "${PROBE_S:-120}" python3 tests/bench/persistent_probe.py --out "$out" 2>&1 \
  | tee "$out/probe.txt" | tail -30

if [ "$tests" -eq 0 ]; then  # the rows mean something only when the bits are the launches'
  timeout "${DECODE_S:-240}" python3 tests/bench/decode_bench.py --out "$out" --defaults-only \
    --skip gemm,torch,attention,profile,prefill,bitwise 2>&1 | tee "$out/decode.txt" | tail -30
fi

timeout "${GPU_TESTS_S:-260}" python3 -m pytest -q -m gpu -p no:cacheprovider tests \
  -k 'not two_gpus and not over_nccl' 2>&1 | tee "$out/gpu-tests.log" | tail -25
