#!/usr/bin/env bash
# The joined decode attention (runtime/backends/attention.py, opt-in with
# KERNCC_JOIN_ATTENTION=1) on the GPU machine, in one batched session: its GPU tests first (the
# bits against the two launches), then the alternating A/B and the decode rows, then every GPU
# test. Written in session 11, when no machine was lent after the first run: what it prints
# decides whether the join becomes the default (kerncc/config.py).
# Usage (from the repository root, with the project installed): bash tests/bench/join_session.sh OUT
# Each step is bounded; logs land in OUT (join-tests.log, decode.txt, gpu-tests.log).
set -uo pipefail
out=${1:?usage: join_session.sh OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$out/gpu.txt"

timeout "${JOIN_TESTS_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider -x \
  tests/test_attention_cuda.py tests/test_attention_join_cuda.py 2>&1 \
  | tee "$out/join-tests.log" | tail -25
tests=${PIPESTATUS[0]}

if [ "$tests" -eq 0 ]; then  # the times mean something only when the bits are the two launches'
  timeout "${DECODE_S:-300}" python3 tests/bench/decode_bench.py --out "$out" --defaults-only \
    --skip gemm,torch,attention,profile,prefill,bitwise 2>&1 | tee "$out/decode.txt" | tail -30
fi

timeout "${GPU_TESTS_S:-260}" python3 -m pytest -q -m gpu -p no:cacheprovider tests \
  -k 'not two_gpus and not over_nccl' 2>&1 | tee "$out/gpu-tests.log" | tail -25
