#!/usr/bin/env bash
# Decode work on the GPU machine, in one batched session (written for session 12): the GPU
# tests of the GEMVs with their small kernel inside (runtime/backends/fuse.py, opt-in) and of
# the GEMV kernels, then decode_bench's alternating A/Bs (`fuse`: none / norm / silu / both;
# `join`: the joined attention, opt-in; `lookahead`: a step ahead, on) and the decode rows,
# then serve_bench's levels, then every GPU test (docs/benchmarks.md, session 12, has what
# they printed).
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
    tests/test_fuse_cuda.py tests/test_gemv_cuda.py 2>&1 | tee "$out/new-tests.log" | tail -25
  tests=${PIPESTATUS[0]}
fi

# the times mean something only when the bits are the same
if [[ $parts == *" decode "* && "$tests" -eq 0 ]]; then
  timeout "${DECODE_S:-300}" python3 tests/bench/decode_bench.py --out "$out" --defaults-only \
    --skip gemm,torch,attention,profile,prefill,bitwise 2>&1 | tee "$out/decode.txt" | tail -30
fi

if [[ $parts == *" serve "* ]]; then  # the engine's steps ahead (session 15): off and on, twice
  timeout "${SERVE_S:-400}" python3 tests/bench/serve_bench.py --size small --levels 1,8,32 \
    --requests-per-level 2 --prompt-len 128 --max-tokens 64 --budget 40 --ahead ab 2>&1 \
    | tee "$out/serve.txt" | tail -8
fi

if [[ $parts == *" gpu "* ]]; then
  timeout "${GPU_TESTS_S:-260}" python3 -m pytest -q -m gpu -p no:cacheprovider tests \
    -k 'not two_gpus and not over_nccl' 2>&1 | tee "$out/gpu-tests.log" | tail -25
fi
