// The SiLU-and-multiply of one element, shared by kernels/activation.cu and kernels/persist.cu.
#pragma once
#include "common.cuh"

// act = bf16(bf16(silu(g)) * u) (HF rounding: act_fn(gate) is a bf16 tensor). silu in the
// hardware's exp2 and reciprocal (__expf, __fdividef: 2 ulp in f32, before the bf16 rounding):
// the accurate expf and IEEE division made a 2048-row chunk's launches issue-bound (about 250
// instructions per 8 outputs) below the memory's rate. g -> -inf gives -0 (g / inf).
__device__ __forceinline__ float silu_mul(float g, float u) {
  const float s = round_bf16(__fdividef(g, 1.0f + __expf(-g)));
  return s * u;
}
