#!/usr/bin/env bash
# Session 11's decode work on the GPU machine, in one batched session: the joined decode
# attention (runtime/backends/attention.py, opt-in with KERNCC_JOIN_ATTENTION=1), greedy
# decoding a step ahead of the host (runtime/generate.py LOOKAHEAD, on) and the serving
# engine's lighter host step. Their GPU tests first (the bits against the two launches, and
# against one step at a time), then decode_bench's alternating A/Bs (`join`, `lookahead`) and
# decode rows, then serve_bench's levels (against issue 19's and session 10's rows, or run it
# on fb7ce1c alternately for a side by side), then every GPU test. Written when no machine was
# lent after the session's first run: what it prints decides whether the join becomes the
# default (kerncc/config.py) and whether the lookahead stays on.
# Usage (from the repository root, with the project installed): bash tests/bench/decode_session.sh OUT
# Each step is bounded; logs land in OUT (new-tests.log, decode.txt, serve.txt, gpu-tests.log).
# Together they may pass one device call's 10 minutes: PARTS picks the steps of a call, e.g.
# PARTS="tests decode" then PARTS="serve gpu" (default: all four).
set -uo pipefail
out=${1:?usage: decode_session.sh OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
parts=" ${PARTS:-tests decode serve gpu} "
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$out/gpu.txt"
tests=0

if [[ $parts == *" tests "* ]]; then
  timeout "${NEW_TESTS_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider -x \
    tests/test_attention_cuda.py tests/test_attention_join_cuda.py \
    tests/test_generate_lookahead_cuda.py 2>&1 | tee "$out/new-tests.log" | tail -25
  tests=${PIPESTATUS[0]}
fi

# the times mean something only when the bits are the same
if [[ $parts == *" decode "* && "$tests" -eq 0 ]]; then
  timeout "${DECODE_S:-300}" python3 tests/bench/decode_bench.py --out "$out" --defaults-only \
    --skip gemm,torch,attention,profile,prefill,bitwise 2>&1 | tee "$out/decode.txt" | tail -30
fi

if [[ $parts == *" serve "* ]]; then
  timeout "${SERVE_S:-300}" python3 tests/bench/serve_bench.py --size small --levels 1,8,32 \
    --requests-per-level 2 --prompt-len 128 --max-tokens 64 --budget 40 2>&1 \
    | tee "$out/serve.txt" | tail -12
fi

if [[ $parts == *" gpu "* ]]; then
  timeout "${GPU_TESTS_S:-260}" python3 -m pytest -q -m gpu -p no:cacheprovider tests \
    -k 'not two_gpus and not over_nccl' 2>&1 | tee "$out/gpu-tests.log" | tail -25
fi
