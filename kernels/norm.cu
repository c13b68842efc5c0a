// Module `norm`: RMSNorm variants (HF Qwen3RMSNorm rounding: the normalized value is rounded
// to bf16 before the bf16 weight multiplies it, as `weight * x.to(bf16)` does).
// Each warp normalizes one row; blocks are 128 threads = 4 rows. cols (or head_dim) is even.
#include "common.cuh"

#define ROWS_PER_BLOCK 4

__device__ __forceinline__ float inv_rms(const bf16* x, int cols, float eps, int lane) {
  float ss = 0.f;
  for (int c = 2 * lane; c < cols; c += 64) {
    float2 v = unpack_bf16x2(*reinterpret_cast<const uint32_t*>(x + c));
    ss += v.x * v.x + v.y * v.y;
  }
  ss = warp_sum(ss);
  return rsqrtf(ss / (float)cols + eps);
}

// y = bf16(bf16(x * r) * w) for one row; x may alias y (each lane rewrites what it read).
__device__ __forceinline__ void norm_row(const bf16* x, const bf16* w, bf16* y, int cols,
                                         float eps, int lane) {
  const float r = inv_rms(x, cols, eps, lane);
  for (int c = 2 * lane; c < cols; c += 64) {
    float2 v = unpack_bf16x2(*reinterpret_cast<const uint32_t*>(x + c));
    float2 g = unpack_bf16x2(*reinterpret_cast<const uint32_t*>(w + c));
    *reinterpret_cast<uint32_t*>(y + c) =
        pack_bf16x2(round_bf16(v.x * r) * g.x, round_bf16(v.y * r) * g.y);
  }
}

// y[r] = rmsnorm(x[r]) * w. grid (ceil(rows/4)), block (128).
extern "C" __global__ void rmsnorm_bf16(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                        bf16* __restrict__ y, int rows, int cols, float eps) {
  const int row = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
  if (row >= rows) return;
  const long long off = (long long)row * cols;
  norm_row(x + off, w, y + off, cols, eps, threadIdx.x & 31);
}

// residual[r] = bf16(residual[r] + x[r]); y[r] = rmsnorm(residual[r]) * w.
// grid (ceil(rows/4)), block (128).
extern "C" __global__ void add_rmsnorm_bf16(bf16* __restrict__ residual,
                                            const bf16* __restrict__ x,
                                            const bf16* __restrict__ w, bf16* __restrict__ y,
                                            int rows, int cols, float eps) {
  const int row = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const long long off = (long long)row * cols;
  bf16* res = residual + off;
  // Pass 1 writes the new residual; pass 2 (norm_row) reads back only this lane's own words.
  for (int c = 2 * lane; c < cols; c += 64) {
    float2 a = unpack_bf16x2(*reinterpret_cast<const uint32_t*>(res + c));
    float2 b = unpack_bf16x2(*reinterpret_cast<const uint32_t*>(x + off + c));
    *reinterpret_cast<uint32_t*>(res + c) = pack_bf16x2(a.x + b.x, a.y + b.y);
  }
  norm_row(res, w, y + off, cols, eps, lane);
}

// Per-head RMSNorm of q and k inside a packed qkv row [q: nq*hd | k: nk*hd | v: nk*hd], in place.
// w = [q_norm (hd) | k_norm (hd)]. One warp per (row, head).
// grid (ceil(rows*(nq+nk)/4)), block (128).
extern "C" __global__ void head_rmsnorm_bf16(bf16* __restrict__ qkv, const bf16* __restrict__ w,
                                             int rows, int nq, int nk, int hd, float eps) {
  const int heads = nq + nk;
  const long long item = (long long)blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
  if (item >= (long long)rows * heads) return;
  const long long row = item / heads;
  const int head = (int)(item % heads);
  bf16* x = qkv + row * (long long)(nq + 2 * nk) * hd + (long long)head * hd;
  norm_row(x, w + (head < nq ? 0 : hd), x, hd, eps, threadIdx.x & 31);
}

// y[s] = rmsnorm(x[(s+1)*rows_per_seq - 1]) * w: the last row of each sequence's rows.
// grid (ceil(seqs/4)), block (128).
extern "C" __global__ void rmsnorm_last_bf16(const bf16* __restrict__ x,
                                             const bf16* __restrict__ w, bf16* __restrict__ y,
                                             int seqs, int rows_per_seq, int cols, float eps) {
  const int seq = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
  if (seq >= seqs) return;
  const long long src = ((long long)(seq + 1) * rows_per_seq - 1) * cols;
  norm_row(x + src, w, y + (long long)seq * cols, cols, eps, threadIdx.x & 31);
}
