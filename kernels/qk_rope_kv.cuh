// One head of the q/k norm, rope and KV copy in registers (head dim 128), shared by
// kernels/qk_rope_kv.cu's rows128 and kernels/persist.cu's rope tasks.
#pragma once
#include "norm.cuh"
#include "rope.cuh"

// One head's 4 elements a lane: x rewritten when it is a q or k head (`norm_rope`, warp-
// uniform), copied to dst when that is not null (a k or v head with a slot).
__device__ __forceinline__ void head128_apply(float (&f)[4], bool norm_rope, const float (&g)[4],
                                              const float4& c, const float4& sn, bf16* x,
                                              bf16* dst, float eps, int lane) {
  if (norm_rope) {
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) ss += f[k] * f[k];
    const float r = rsqrtf(warp_sum(ss) / 128.f + eps);
#pragma unroll
    for (int k = 0; k < 4; ++k) f[k] = round_bf16(round_bf16(f[k] * r) * g[k]);  // as stored
    const float cs[4] = {c.x, c.y, c.z, c.w}, s[4] = {sn.x, sn.y, sn.z, sn.w};
    // the rope's pairs (i, 64 + i) sit in lanes l and l + 16: a shuffle brings the partner
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float other = __shfl_xor_sync(FULL_MASK, f[k], 16);
      float x1 = lane < 16 ? f[k] : other, x2 = lane < 16 ? other : f[k];
      rotate(x1, x2, cs[k], s[k]);
      f[k] = lane < 16 ? x1 : x2;
    }
    store_bf16<4>(x, f);
  }
  if (dst) store_bf16<4>(dst, f);
}
