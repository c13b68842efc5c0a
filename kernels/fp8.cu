// Module `fp8`: block-scaled FP8 (e4m3) weights, in the layout of FP8 checkpoints such as
// Qwen3-8B-FP8: a linear's weight W[n, k] is e4m3 and its scales S[ceil(n/128), ceil(k/128)]
// are f32 "scale_inv" values, one per 128 x 128 block: the weight's value is
// f32(W[i, j]) * S[i / 128, j / 128]. Activations stay bf16; products accumulate in f32.
// kernels/reference.py holds the numpy references (the same ABI).
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common.cuh"
#include "gemv.cuh"

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

// ---- gemv_fp8_bf16_tc: the same function on the tensor cores --------------------------------
// C[m, n] (=, += or f32 =) A[m, k] . W[n, k]^T, the ABI and modes of gemv_fp8_bf16, built like
// the bf16 decode GEMV (gemv.cu): a block per 16-row tile of W, its warps over k. Each warp
// takes the 64-wide k chunks w, w + WARPS, ... (neighbouring warps read neighbouring bytes of a
// row); lane (g, t) streams 16 bytes (16 e4m3) of rows g and g + 8 of a chunk, at k = 64 c +
// 16 t, past L1, UNROLL chunks of loads in flight before any math (the next chunks' loads fly
// during this chunk's math). The e4m3 bytes are widened to bf16 in registers, exactly (every
// e4m3 value is a bf16 value: e4m3 -> f16 -> f32 -> bf16, none rounds), and enter the bf16
// mma.m16n8k16 as its "A" (W rows), 8 rows of the activations as its "B": lane t's 16
// consecutive k are its fragment's k pairs t and t + 4 of four products, W and the
// activations in the same order, so both come straight from 16-byte loads.
//
// The order of the sums (fixed, no atomics, so a launch gives the same bits every time):
//   out = sum over warps 0, 1, .., WARPS - 1 (in that order, in shared memory) of
//         the warp's sum over its chunks in increasing k of fl(S[row / 128, c / 2] * P_c),
// P_c the f32 sum of a 64-wide chunk's products (four mma.m16n8k16 into a zeroed fragment):
// a 128-wide scale block is two chunks, each scaled on its own (the 16 rows of a tile share
// one row block of S, since 128 % 16 == 0, so the scale is per k block only). Each column of
// an mma (a row of A) is computed from that row alone, so a row of C gets the same bits
// whatever m and whichever of a job's 8 columns it sits in.
//
// Rows of A come 8 at a time (one "B" operand); m > 8 takes more jobs a tile: job = tile *
// groups + q, q the group of 8 rows (neighbouring jobs share a tile, read while it is in L2).
// A block runs jobs blockIdx.x, blockIdx.x + gridDim.x, ..., so any grid is correct;
// ceil(n / 16) * ceil(m / 8) blocks run each job once (runtime/backends/fp8_gemv.py).
// Rows of W past n and k past the end are neither read nor stored (read as zeros).
// Needs k % 16 == 0 and A, W 16-byte aligned: the needs of gemv_fp8_bf16, which the backend
// takes otherwise. Block: 32 * WARPS threads.
#define FP8_TC_CHUNK 64  // k per chunk: 4 lanes x 16 bytes

// Two e4m3 (the low and high byte of `v`) as a bf16x2 word, exactly.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint16_t v) {
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(v));
  const float lo = __half2float(__ushort_as_half(static_cast<unsigned short>(h2 & 0xffffu)));
  const float hi = __half2float(__ushort_as_half(static_cast<unsigned short>(h2 >> 16)));
  uint32_t out;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));  // hi -> upper half
  return out;
}

// 16 e4m3 (one 16-byte load) as 8 bf16x2 words: word p holds bytes 2p, 2p + 1.
__device__ __forceinline__ void widen16(const uint4& q, uint32_t (&out)[8]) {
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = e4m3x2_to_bf16x2(static_cast<uint16_t>(words[i] & 0xffffu));
    out[2 * i + 1] = e4m3x2_to_bf16x2(static_cast<uint16_t>(words[i] >> 16));
  }
}

__device__ __forceinline__ uint4 load_stream_u8(const uint8_t* p) {
  return load_stream(reinterpret_cast<const bf16*>(p));
}

// One 64-wide chunk: lane (g, t)'s W of rows g (`wl`) and g + 8 (`wh`), widened, and its 16
// activations (`a0`, `a1`: row g of the job's 8, the same k), scaled into `acc`.
__device__ __forceinline__ void fp8_mma(float (&acc)[4], const uint32_t (&wl)[8],
                                        const uint32_t (&wh)[8], const uint4& a0,
                                        const uint4& a1, float scale) {
  const uint32_t x[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
  float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int j = 0; j < 4; ++j) mma_16816(d, wl[2 * j], wh[2 * j], wl[2 * j + 1], wh[2 * j + 1],
                                        x[2 * j], x[2 * j + 1]);
#pragma unroll
  for (int r = 0; r < 4; ++r) acc[r] = fmaf(scale, d[r], acc[r]);
}

// One job: 16 rows of W from row0, 8 rows of A from col0 (m rows in all).
template <int WARPS, int UNROLL>
__device__ __forceinline__ void gemv_fp8_tc_job(const bf16* __restrict__ a,
                                                const uint8_t* __restrict__ w,
                                                const float* __restrict__ s, void* __restrict__ c,
                                                int m, int n, int k, int mode, int row0,
                                                int col0, float (&partial)[WARPS][4][32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int chunks = (k + FP8_TC_CHUNK - 1) / FP8_TC_CHUNK;
  const float* srow = s + (size_t)(row0 / FP8_BLOCK) * ((k + FP8_BLOCK - 1) / FP8_BLOCK);
  const bool lo_ok = row0 + g < n, hi_ok = row0 + g + 8 < n, a_ok = col0 + g < m;
  const uint8_t* w_lo = w + (size_t)(row0 + g) * k + 16 * t;
  const uint8_t* w_hi = w_lo + (size_t)8 * k;
  const bf16* a_row = a + (size_t)(col0 + g) * k + 16 * t;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  uint4 lo[UNROLL], hi[UNROLL];
  constexpr int STEP = FP8_TC_CHUNK * WARPS;  // k between one warp's chunks
  if (row0 + 16 <= n && k % (STEP * UNROLL) == 0) {  // block-uniform (mma.sync)
    // The whole tile and k a whole number of the warps' rounds: no per-chunk bounds. A chunk's
    // registers take the load UNROLL chunks on as soon as they are widened, so UNROLL chunks
    // of W stay in flight with no second copy of them.
    const uint8_t* pl = w_lo + FP8_TC_CHUNK * warp;
    const uint8_t* ph = w_hi + FP8_TC_CHUNK * warp;
    const bf16* pa = a_row + FP8_TC_CHUNK * warp;
    const float* ps = srow + warp / 2;  // chunk c's scale is srow[c / 2]; STEP is even
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      lo[u] = load_stream_u8(pl + STEP * u);
      hi[u] = load_stream_u8(ph + STEP * u);
    }
    for (int left = k / (STEP * UNROLL); left > 0; --left) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const uint4* p = reinterpret_cast<const uint4*>(pa + STEP * u);
        const uint4 a0 = a_ok ? __ldg(p) : zero, a1 = a_ok ? __ldg(p + 1) : zero;
        const float sc = __ldg(ps + (STEP / FP8_BLOCK) * u);
        uint32_t wl[8], wh[8];
        widen16(lo[u], wl);
        widen16(hi[u], wh);
        if (left > 1) {
          lo[u] = load_stream_u8(pl + STEP * (UNROLL + u));
          hi[u] = load_stream_u8(ph + STEP * (UNROLL + u));
        }
        fp8_mma(acc, wl, wh, a0, a1, sc);
      }
      pl += STEP * UNROLL;
      ph += STEP * UNROLL;
      pa += STEP * UNROLL;
      ps += (STEP / FP8_BLOCK) * UNROLL;
    }
  } else {
    auto load_w = [&](int u, int ch) {
      const bool in_k = ch < chunks && FP8_TC_CHUNK * ch + 16 * t < k;
      lo[u] = in_k && lo_ok ? load_stream_u8(w_lo + FP8_TC_CHUNK * ch) : zero;
      hi[u] = in_k && hi_ok ? load_stream_u8(w_hi + FP8_TC_CHUNK * ch) : zero;
    };
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) load_w(u, warp + u * WARPS);
    for (int base = warp; base < chunks; base += UNROLL * WARPS) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int ch = base + u * WARPS;
        if (ch >= chunks) break;  // warp-uniform: past k, nothing to add
        const bool in_k = FP8_TC_CHUNK * ch + 16 * t < k;
        const uint4* p = reinterpret_cast<const uint4*>(a_row + FP8_TC_CHUNK * ch);
        const uint4 a0 = in_k && a_ok ? __ldg(p) : zero;
        const uint4 a1 = in_k && a_ok ? __ldg(p + 1) : zero;
        const float sc = __ldg(srow + ch / 2);
        uint32_t wl[8], wh[8];
        widen16(lo[u], wl);
        widen16(hi[u], wh);
        load_w(u, ch + UNROLL * WARPS);
        fp8_mma(acc, wl, wh, a0, a1, sc);
      }
    }
  }

#pragma unroll
  for (int r = 0; r < 4; ++r) partial[warp][r][lane] = acc[r];
  __syncthreads();
  for (int e = threadIdx.x; e < 4 * 32; e += 32 * WARPS) {
    const int r = e >> 5, l = e & 31;
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < WARPS; ++v) sum += partial[v][r][l];  // warp order: fixed
    const int row = row0 + (l >> 2) + (r >= 2 ? 8 : 0);
    const int col = col0 + 2 * (l & 3) + (r & 1);
    if (row >= n || col >= m) continue;
    const size_t at = (size_t)col * n + row;
    if (mode == FP8_OUT_F32) {
      static_cast<float*>(c)[at] = sum;
    } else {
      bf16* out = static_cast<bf16*>(c) + at;
      *out = __float2bfloat16(mode == FP8_OUT_BF16_ACC ? __bfloat162float(*out) + sum : sum);
    }
  }
}

template <int WARPS, int UNROLL>
__device__ __forceinline__ void gemv_fp8_tc(const bf16* __restrict__ a,
                                            const uint8_t* __restrict__ w,
                                            const float* __restrict__ s, void* __restrict__ c,
                                            int m, int n, int k, int mode) {
  __shared__ float partial[WARPS][4][32];
  const long long groups = (m + 7) / 8, jobs = (long long)((n + 15) / 16) * groups;
  for (long long job = blockIdx.x; job < jobs; job += gridDim.x) {
    if (job != blockIdx.x) __syncthreads();  // every thread has read the job before
    gemv_fp8_tc_job<WARPS, UNROLL>(a, w, s, c, m, n, k, mode, (int)(job / groups) * 16,
                                   (int)(job % groups) * 8, partial);
  }
}

// gemv_fp8_bf16_tc: 8 warps a block, 4 chunks in flight a warp (the warp count fixes the order
// of the sums); a row of C has the same bits whatever m. Sixteen warps a block was measured
// slower at every 8B shape on an H100 (0.99-1.10x the old kernel at m = 1) and went.
extern "C" __global__ void __launch_bounds__(256)
    gemv_fp8_bf16_tc(const bf16* __restrict__ a, const uint8_t* __restrict__ w,
                     const float* __restrict__ s, void* __restrict__ c, int m, int n, int k,
                     int mode) {
  pdl_begin();
  gemv_fp8_tc<8, 4>(a, w, s, c, m, n, k, mode);
}
// y f32[n] = x bf16[n], exact: the bf16 block scales some FP8 checkpoints ship (Qwen3's dense
// FP8 models), widened at load for the kernels above. Grid-stride: any grid is correct.
extern "C" __global__ void cast_bf16_f32(const bf16* __restrict__ x, float* __restrict__ y,
                                         int n) {
  pdl_begin();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    y[i] = __bfloat162float(x[i]);
}
