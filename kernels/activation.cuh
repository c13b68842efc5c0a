// SiLU-and-multiply, shared by kernels/activation.cu and kernels/persist.cu.
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

// Eight outputs from 16 bytes of gate and 16 of up (kernels/gemv.cu's fused tiles too).
__device__ __forceinline__ uint4 silu_mul8(const uint4& g, const uint4& u) {
  const uint32_t gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
  uint32_t out[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 a = unpack_bf16x2(gw[k]), b = unpack_bf16x2(uw[k]);
    out[k] = pack_bf16x2(silu_mul(a.x, b.x), silu_mul(a.y, b.y));
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// act = bf16(bf16(silu(g)) * u) over the outputs of block `at` of `blocks` (`threads` each, this
// one `thread`), grid-stride, of rows x inter, the gate_up rows holding gate and up
// interleaved in blocks of `block` columns: 8 at a time
// (16-byte loads and stores) when inter and block are multiples of 8 and the buffers 16-byte
// aligned, else one at a time. L2: gate_up read at L2, for data other blocks of the same launch
// wrote (kernels/persist.cu), never through the non-coherent path.
template <bool L2>
__device__ __forceinline__ void silu_mul_span(const bf16* gate_up, bf16* act, int rows,
                                              int inter, int block, unsigned blocks,
                                              unsigned at, unsigned threads, unsigned thread) {
  const long long n = (long long)rows * inter;
  const long long stride = (long long)blocks * threads;
  const long long first = (long long)at * threads + thread;
  const uintptr_t bases = reinterpret_cast<uintptr_t>(gate_up) | reinterpret_cast<uintptr_t>(act);
  if (inter % 8 == 0 && block % 8 == 0 && bases % 16 == 0) {
    for (long long v = first; v < n / 8; v += stride) {
      const long long idx = v * 8;
      const long long row = idx / inter;
      const int i = (int)(idx % inter);  // 8 outputs inside one `block`-wide piece
      const bf16* src = gate_up + row * 2LL * inter + (long long)(i / block) * 2 * block + i % block;
      const uint4* gp = reinterpret_cast<const uint4*>(src);
      const uint4* up = reinterpret_cast<const uint4*>(src + block);
      const uint4 g = L2 ? __ldcg(gp) : *gp;
      const uint4 u = L2 ? __ldcg(up) : *up;
      *reinterpret_cast<uint4*>(act + idx) = silu_mul8(g, u);
    }
    return;
  }
  for (long long idx = first; idx < n; idx += stride) {
    const long long row = idx / inter;
    const int i = (int)(idx % inter);
    const bf16* src = gate_up + row * 2LL * inter + (long long)(i / block) * 2 * block + i % block;
    const bf16 g = L2 ? __ldcg(src) : src[0], u = L2 ? __ldcg(src + block) : src[block];
    act[idx] = __float2bfloat16(silu_mul(__bfloat162float(g), __bfloat162float(u)));
  }
}
