// Module `activation`: SiLU-and-multiply of the fused gate/up projection.
#include "activation.cuh"

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
      const uint32_t gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
      uint32_t out[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 a = unpack_bf16x2(gw[k]), b = unpack_bf16x2(uw[k]);
        out[k] = pack_bf16x2(silu_mul(a.x, b.x), silu_mul(a.y, b.y));
      }
      *reinterpret_cast<uint4*>(act + idx) = make_uint4(out[0], out[1], out[2], out[3]);
    }
    return;
  }
  for (long long idx = first; idx < n; idx += stride) {
    const long long row = idx / inter;
    const int i = (int)(idx % inter);
    const bf16* src = gate_up + row * 2LL * inter + (long long)(i / block) * 2 * block + i % block;
    act[idx] = __float2bfloat16(silu_mul(__bfloat162float(src[0]), __bfloat162float(src[block])));
  }
}
