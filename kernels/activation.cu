// Module `activation`: SiLU-and-multiply of the fused gate/up projection.
#include "common.cuh"

// act = bf16(bf16(silu(g)) * u) (HF rounding: act_fn(gate) is a bf16 tensor). silu in the
// hardware's exp2 and reciprocal (__expf, __fdividef: 2 ulp in f32, before the bf16 rounding):
// the accurate expf and IEEE division made a 2048-row chunk's launches issue-bound (about 250
// instructions per 8 outputs) below the memory's rate. g -> -inf gives -0 (g / inf).
__device__ __forceinline__ float silu_mul(float g, float u) {
  const float s = round_bf16(__fdividef(g, 1.0f + __expf(-g)));
  return s * u;
}

// Eight outputs from 16 bytes of gate and 16 of up.
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

// gate_up rows hold gate and up interleaved in blocks of `block` columns (the `interleave`
// bind of the gate_up weight): [g0 | u0 | g1 | u1 | ...], each piece `block` wide.
// act[r, i] = bf16(bf16(silu(g)) * u). inter % block == 0.
// Grid-stride over the outputs: 8 at a time (16-byte loads and stores) when inter and block
// are multiples of 8 and the buffers 16-byte aligned, else one at a time, so any grid is
// correct; the example sizes it grid (ceil(rows*inter/8/256)), block (256), when it can.
extern "C" __global__ void silu_mul_bf16(const bf16* __restrict__ gate_up,
                                         bf16* __restrict__ act, int rows, int inter,
                                         int block) {
  pdl_begin();
  const long long n = (long long)rows * inter;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const uintptr_t bases = reinterpret_cast<uintptr_t>(gate_up) | reinterpret_cast<uintptr_t>(act);
  if (inter % 8 == 0 && block % 8 == 0 && bases % 16 == 0) {
    for (long long v = first; v < n / 8; v += stride) {
      const long long idx = v * 8;
      const long long row = idx / inter;
      const int i = (int)(idx % inter);  // 8 outputs inside one `block`-wide piece
      const bf16* src = gate_up + row * 2LL * inter + (long long)(i / block) * 2 * block + i % block;
      const uint4 g = *reinterpret_cast<const uint4*>(src);
      const uint4 u = *reinterpret_cast<const uint4*>(src + block);
      *reinterpret_cast<uint4*>(act + idx) = silu_mul8(g, u);
    }
    return;
  }
  for (long long idx = first; idx < n; idx += stride) {
    const long long row = idx / inter;
    const int i = (int)(idx % inter);
    const bf16* src = gate_up + row * 2LL * inter + (long long)(i / block) * 2 * block + i % block;
    const bf16 g = src[0], u = src[block];
    act[idx] = __float2bfloat16(silu_mul(__bfloat162float(g), __bfloat162float(u)));
  }
}
