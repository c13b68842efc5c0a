// Neox rope pieces shared by kernels/rope.cu and kernels/qk_rope_kv.cu.
#pragma once
#include "common.cuh"

// x1' = x1*cos - x2*sin, x2' = x2*cos + x1*sin (x1, x2 = first and second half of a head),
// each product rounded (no fused multiply-add): the wide and narrow paths, compiled apart,
// give the same bits, as the numpy reference computes them.
__device__ __forceinline__ void rotate(float& x1, float& x2, float c, float s) {
  const float a = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
  const float b = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
  x1 = a;
  x2 = b;
}

// The pairs (i .. i+3, half+i .. half+i+3) of one head x at table row t (cos | sin), 8-byte
// bf16 and 16-byte table accesses (i % 4 == 0, pointers aligned), and the pair (i, half+i).
__device__ __forceinline__ void rope_quad(bf16* x, const float* t, int half, int i) {
  const float4 c = *reinterpret_cast<const float4*>(t + i);
  const float4 s = *reinterpret_cast<const float4*>(t + half + i);
  const uint2 lo = *reinterpret_cast<const uint2*>(x + i);
  const uint2 hi = *reinterpret_cast<const uint2*>(x + half + i);
  float2 a0 = unpack_bf16x2(lo.x), a1 = unpack_bf16x2(lo.y);
  float2 b0 = unpack_bf16x2(hi.x), b1 = unpack_bf16x2(hi.y);
  rotate(a0.x, b0.x, c.x, s.x);
  rotate(a0.y, b0.y, c.y, s.y);
  rotate(a1.x, b1.x, c.z, s.z);
  rotate(a1.y, b1.y, c.w, s.w);
  *reinterpret_cast<uint2*>(x + i) = make_uint2(pack_bf16x2(a0.x, a0.y), pack_bf16x2(a1.x, a1.y));
  *reinterpret_cast<uint2*>(x + half + i) = make_uint2(pack_bf16x2(b0.x, b0.y),
                                                       pack_bf16x2(b1.x, b1.y));
}

__device__ __forceinline__ void rope_pair(bf16* x, const float* t, int half, int i) {
  float x1 = __bfloat162float(x[i]), x2 = __bfloat162float(x[half + i]);
  rotate(x1, x2, t[i], t[half + i]);
  x[i] = __float2bfloat16(x1);
  x[half + i] = __float2bfloat16(x2);
}

// One head (x: hd bf16, rotated in place) at the table row t, by the 32 lanes of a warp: 4
// pairs a lane at a time when `quads` (half % 4 == 0 and the pointers aligned), else one.
// Each pair's bits are those of rope_neox_bf16.
__device__ __forceinline__ void rope_head(bf16* x, const float* t, int half, int lane,
                                          bool quads) {
  if (quads) {
    for (int i = 4 * lane; i < half; i += 128) rope_quad(x, t, half, i);
    return;
  }
  for (int i = lane; i < half; i += 32) rope_pair(x, t, half, i);
}
