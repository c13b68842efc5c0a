// Module `fp8`: block-scaled FP8 (e4m3) weights, in the layout of FP8 checkpoints such as
// Qwen3-8B-FP8: a linear's weight W[n, k] is e4m3 and its scales S[ceil(n/128), ceil(k/128)]
// are f32 "scale_inv" values, one per 128 x 128 block: the weight's value is
// f32(W[i, j]) * S[i / 128, j / 128]. Activations stay bf16; products accumulate in f32.
// kernels/reference.py holds the numpy references (the same ABI).
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common.cuh"

#define FP8_BLOCK 128
#define FP8_MAX 448.0f
#define GEMV_FP8_WARPS 8
#define GEMV_FP8_ROWS 4  // rows of A a warp carries at once

// Output modes of gemv_fp8_bf16 (param `mode`), the bf16 GEMV's (gemv.cu).
#define FP8_OUT_BF16 0      // C bf16 = bf16(acc)
#define FP8_OUT_BF16_ACC 1  // C bf16 = bf16(f32(C) + acc)
#define FP8_OUT_F32 2       // C f32 = acc

__device__ __forceinline__ float fp8_to_float(uint8_t v) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(v), __NV_E4M3);
  return __half2float(__half(h));  // e4m3 -> f16 is exact
}

// Quantize a bf16 weight W[n, k] to e4m3 with one f32 scale per 128 x 128 block:
// amax = the block's largest |w| (NaNs ignored), S = amax / 448 (1 when amax is 0),
// Q = e4m3(f32(w) / S), rounded to nearest even and saturated to +-448 (f32 division,
// correctly rounded). Grid (ceil(k / 128), ceil(n / 128)), 256 threads.
extern "C" __global__ void fp8_quantize_bf16(const bf16* __restrict__ w, uint8_t* __restrict__ q,
                                             float* __restrict__ s, int n, int k) {
  pdl_begin();
  __shared__ float warp_amax[8];
  __shared__ float block_scale;
  const int row0 = blockIdx.y * FP8_BLOCK, col0 = blockIdx.x * FP8_BLOCK;
  const int rows = min(FP8_BLOCK, n - row0), cols = min(FP8_BLOCK, k - col0);
  float amax = 0.0f;
  for (int i = threadIdx.x; i < rows * FP8_BLOCK; i += blockDim.x) {
    const int r = i / FP8_BLOCK, c = i % FP8_BLOCK;
    if (c < cols) amax = fmaxf(amax, fabsf(__bfloat162float(w[(size_t)(row0 + r) * k + col0 + c])));
  }
  amax = warp_max(amax);
  if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x >> 5] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = 0.0f;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) m = fmaxf(m, warp_amax[i]);
    const float scale = m > 0.0f ? m / FP8_MAX : 1.0f;
    block_scale = scale;
    s[(size_t)blockIdx.y * ((k + FP8_BLOCK - 1) / FP8_BLOCK) + blockIdx.x] = scale;
  }
  __syncthreads();
  const float scale = block_scale;
  for (int i = threadIdx.x; i < rows * FP8_BLOCK; i += blockDim.x) {
    const int r = i / FP8_BLOCK, c = i % FP8_BLOCK;
    if (c >= cols) continue;
    const size_t at = (size_t)(row0 + r) * k + col0 + c;
    const float x = __bfloat162float(w[at]) / scale;
    q[at] = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
  }
}

// W bf16[n, k] = bf16(f32(Q[i, j]) * S[i / 128, j / 128]): one rounding (the product of an
// e4m3 value and an f32 scale, rounded to bf16). Grid-stride: any grid is correct; the
// example sizes it ceil(n * k / 4096) blocks of 256.
extern "C" __global__ void fp8_dequantize_bf16(const uint8_t* __restrict__ q,
                                               const float* __restrict__ s,
                                               bf16* __restrict__ w, int n, int k) {
  pdl_begin();
  const size_t total = (size_t)n * k;
  const int kb = (k + FP8_BLOCK - 1) / FP8_BLOCK;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t r = i / k, c = i % k;
    w[i] = __float2bfloat16(fp8_to_float(q[i]) * s[(r / FP8_BLOCK) * kb + c / FP8_BLOCK]);
  }
}

// C[m, n] (=, += or f32 =) A[m, k] . W[n, k]^T with W e4m3 and its block scales S: each
// output is the f32 sum over 128-wide k blocks of S[row / 128, block] times the block's
// f32 products a * w, in a fixed order (lane by lane 16 consecutive k, then the warp's
// butterfly), no atomics. A warp per row of W (one block of 8 warps per 8 rows of W), each
// lane streaming 16 bytes of W at a time; rows of A in groups of 4. Needs k % 16 == 0 and A,
// W 16-byte aligned. Grid: ceil(n / 8) blocks of 256 threads.
extern "C" __global__ void gemv_fp8_bf16(const bf16* __restrict__ a, const uint8_t* __restrict__ w,
                                         const float* __restrict__ s, void* __restrict__ c,
                                         int m, int n, int k, int mode) {
  pdl_begin();
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * GEMV_FP8_WARPS + (threadIdx.x >> 5);
  if (row >= n) return;
  const int kb = (k + FP8_BLOCK - 1) / FP8_BLOCK;
  const float* srow = s + (size_t)(row / FP8_BLOCK) * kb;
  const uint8_t* wrow = w + (size_t)row * k;
  for (int r0 = 0; r0 < m; r0 += GEMV_FP8_ROWS) {
    float acc[GEMV_FP8_ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 2
    for (int kk = lane * 16; kk < k; kk += 32 * 16) {
      const uint4 packed = __ldg(reinterpret_cast<const uint4*>(wrow + kk));
      const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&packed);
      float wf[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) wf[j] = fp8_to_float(bytes[j]);
      const float scale = srow[kk / FP8_BLOCK];
#pragma unroll
      for (int r = 0; r < GEMV_FP8_ROWS; ++r) {
        if (r0 + r >= m) break;
        const uint4* ap = reinterpret_cast<const uint4*>(a + (size_t)(r0 + r) * k + kk);
        const uint4 lo = __ldg(ap), hi = __ldg(ap + 1);
        const uint32_t words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float2 x = unpack_bf16x2(words[j]);
          dot = fmaf(x.x, wf[2 * j], dot);
          dot = fmaf(x.y, wf[2 * j + 1], dot);
        }
        acc[r] = fmaf(scale, dot, acc[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < GEMV_FP8_ROWS; ++r) {
      if (r0 + r >= m) break;
      const float v = warp_sum(acc[r]);
      if (lane != 0) continue;
      const size_t at = (size_t)(r0 + r) * n + row;
      if (mode == FP8_OUT_F32) {
        static_cast<float*>(c)[at] = v;
      } else {
        bf16* out = static_cast<bf16*>(c) + at;
        *out = __float2bfloat16(mode == FP8_OUT_BF16_ACC ? __bfloat162float(*out) + v : v);
      }
    }
  }
}

// y f32[n] = x bf16[n], exact: the bf16 block scales some FP8 checkpoints ship (Qwen3's dense
// FP8 models), widened at load for the kernels above. Grid-stride: any grid is correct.
extern "C" __global__ void cast_bf16_f32(const bf16* __restrict__ x, float* __restrict__ y,
                                         int n) {
  pdl_begin();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    y[i] = __bfloat162float(x[i]);
}
