// Module `convert`: dtype conversions run by `derive` programs at load time.
#include "common.cuh"

// y[i] = bf16(x[i]) for i < n. grid (ceil(n/256)), block (256).
extern "C" __global__ void cast_f32_bf16(const float* __restrict__ x, bf16* __restrict__ y,
                                         int n) {
  pdl_begin();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __float2bfloat16(x[i]);
}
