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
  silu_mul_span<false>(gate_up, act, rows, inter, block, gridDim.x, blockIdx.x, blockDim.x,
                       threadIdx.x);
}
