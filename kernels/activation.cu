// Module `activation`: SiLU-and-multiply of the fused gate/up projection.
#include "common.cuh"

// gate_up rows hold gate and up interleaved in blocks of `block` columns (the `interleave`
// bind of the gate_up weight): [g0 | u0 | g1 | u1 | ...], each piece `block` wide.
// act[r, i] = bf16(bf16(silu(g)) * u) (HF rounding: act_fn(gate) is a bf16 tensor).
// inter % block == 0. grid (ceil(rows*inter/256)), block (256).
extern "C" __global__ void silu_mul_bf16(const bf16* __restrict__ gate_up,
                                         bf16* __restrict__ act, int rows, int inter,
                                         int block) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)rows * inter) return;
  const long long row = idx / inter;
  const int i = (int)(idx % inter);
  const bf16* src = gate_up + row * 2LL * inter + (long long)(i / block) * 2 * block + i % block;
  const float g = __bfloat162float(src[0]);
  const float u = __bfloat162float(src[block]);
  const float s = round_bf16(g / (1.0f + expf(-g)));
  act[idx] = __float2bfloat16(s * u);
}
