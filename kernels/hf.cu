// Module `hf`: load-time kernels of manifests imported from Hugging Face checkpoints
// (kerncc import): dtype casts run by `derive` programs, the Llama 3 rope table run once.
#include "common.cuh"
#include <cuda_fp16.h>

// y[i] = bf16(x[i]) for i < n: an f16 checkpoint tensor converted at load.
// grid (ceil(n/256)), block (256).
extern "C" __global__ void cast_f16_bf16(const __half* __restrict__ x, bf16* __restrict__ y,
                                         int n) {
  pdl_begin();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __float2bfloat16(__half2float(x[i]));
}

// rope_table_f32's table (cos | sin per position) with the frequencies of Llama 3's
// `rope_scaling` (rope_type llama3): wavelengths longer than original/low_freq_factor are
// divided by `factor`, shorter than original/high_freq_factor kept, and those between blended
// linearly in original/wavelength. Computed in double (run once at load).
// grid (ceil(max_pos*hd/2/256)), block (256).
extern "C" __global__ void rope_table_llama3_f32(float* __restrict__ table, int max_pos, int hd,
                                                 float theta, float factor, float low_freq,
                                                 float high_freq, int original) {
  pdl_begin();
  const int half = hd / 2;
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)max_pos * half) return;
  const long long pos = idx / half;
  const int i = (int)(idx % half);
  const double base = pow((double)theta, -2.0 * (double)i / (double)hd);
  const double wavelen = 2.0 * 3.14159265358979323846 / base;
  double inv_freq = base;
  if (wavelen > (double)original / (double)low_freq) {
    inv_freq = base / (double)factor;
  } else if (wavelen >= (double)original / (double)high_freq) {
    const double smooth = ((double)original / wavelen - (double)low_freq) /
                          ((double)high_freq - (double)low_freq);
    inv_freq = (1.0 - smooth) * base / (double)factor + smooth * base;
  }
  const double angle = (double)pos * inv_freq;
  table[pos * hd + i] = (float)cos(angle);
  table[pos * hd + half + i] = (float)sin(angle);
}
