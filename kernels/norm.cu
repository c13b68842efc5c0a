// Module `norm`: RMSNorm variants (HF Qwen3RMSNorm rounding: the normalized value is rounded
// to bf16 before the bf16 weight multiplies it, as `weight * x.to(bf16)` does).
// rmsnorm, add_rmsnorm and rmsnorm_last: a block normalizes a row at a time (grid-stride over
// the rows, so any grid is correct; the block is a whole number of warps: the example
// launches one block of cols/8 threads, at most 256, per row), its warps' sums added in a
// fixed order. head_rmsnorm: a warp per (row, head), 4 per block (kernels/norm.cuh). A thread
// reads 8 bf16 (16 bytes) at a time when cols is a multiple of 8 and the rows 16-byte
// aligned, 4 when a multiple of 4 (8-byte aligned), else 2 (cols is even): with every load of
// a row in flight at once, a row costs about one memory latency instead of a chain of them.
#include "norm.cuh"

#define ROWS_PER_BLOCK 4

// ---- a block per row ------------------------------------------------------------------

// The sum of `v` over the block, the same bits in every thread: each warp's butterfly, then
// the warps' sums added in warp order. `scratch` holds 32 floats; a barrier first, so a loop
// over rows may call it again.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.f;
  const int warps = (blockDim.x + 31) >> 5;
  for (int i = 0; i < warps; ++i) total += scratch[i];
  return total;
}


template <int V>
__device__ __forceinline__ void block_norm(const bf16* x, const bf16* w, bf16* y, int cols,
                                           float eps, float* scratch) {
  const int first = V * threadIdx.x, step = V * blockDim.x;
  const float ss = block_sum(squares<V>(x, cols, first, step), scratch);
  scale<V>(x, w, y, cols, rsqrtf(ss / (float)cols + eps), first, step);
}

// y[r] = rmsnorm(x[r]) * w. grid (rows), block (cols/8 rounded up to a warp, at most 256).
extern "C" __global__ void rmsnorm_bf16(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                        bf16* __restrict__ y, int rows, int cols, float eps) {
  pdl_begin();
  __shared__ float scratch[32];
  const int v = block_width(cols, bits(x, w, y) | (uintptr_t)(cols * 2));
  for (int row = blockIdx.x; row < rows; row += gridDim.x) {
    const long long off = (long long)row * cols;
    if (v == 8) block_norm<8>(x + off, w, y + off, cols, eps, scratch);
    else if (v == 4) block_norm<4>(x + off, w, y + off, cols, eps, scratch);
    else block_norm<2>(x + off, w, y + off, cols, eps, scratch);
  }
}

// residual[r] = bf16(residual[r] + x[r]); y[r] = rmsnorm(residual[r]) * w.
// grid (rows), block (cols/8 rounded up to a warp, at most 256).
extern "C" __global__ void add_rmsnorm_bf16(bf16* __restrict__ residual,
                                            const bf16* __restrict__ x,
                                            const bf16* __restrict__ w, bf16* __restrict__ y,
                                            int rows, int cols, float eps) {
  pdl_begin();
  __shared__ float scratch[32];
  const int v = block_width(cols, bits(residual, x, w) | reinterpret_cast<uintptr_t>(y) |
                                      (uintptr_t)(cols * 2));
  for (int row = blockIdx.x; row < rows; row += gridDim.x) {
    const long long off = (long long)row * cols;
    bf16* res = residual + off;
    if (v == 8) {
      row_add<8>(res, x + off, cols);
      block_norm<8>(res, w, y + off, cols, eps, scratch);
    } else if (v == 4) {
      row_add<4>(res, x + off, cols);
      block_norm<4>(res, w, y + off, cols, eps, scratch);
    } else {
      row_add<2>(res, x + off, cols);
      block_norm<2>(res, w, y + off, cols, eps, scratch);
    }
  }
}

// Per-head RMSNorm of q and k inside a packed qkv row [q: nq*hd | k: nk*hd | v: nk*hd], in place.
// w = [q_norm (hd) | k_norm (hd)]. One warp per (row, head).
// grid (ceil(rows*(nq+nk)/4)), block (128).
extern "C" __global__ void head_rmsnorm_bf16(bf16* __restrict__ qkv, const bf16* __restrict__ w,
                                             int rows, int nq, int nk, int hd, float eps) {
  pdl_begin();
  const int heads = nq + nk;
  const long long item = (long long)blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
  if (item >= (long long)rows * heads) return;
  const long long row = item / heads;
  const int head = (int)(item % heads);
  bf16* x = qkv + row * (long long)(nq + 2 * nk) * hd + (long long)head * hd;
  norm_row(x, w + (head < nq ? 0 : hd), x, hd, eps, threadIdx.x & 31,
           width(hd, bits(qkv, w, w) | (uintptr_t)(hd * 2)));
}

// y[s] = rmsnorm(x[cu_seqlens[s+1] - 1]) * w: the last row of each sequence of a packed
// chunk (rows of sequence s are [cu_seqlens[s], cu_seqlens[s+1])). grid (seqs), block as above.
extern "C" __global__ void rmsnorm_last_varlen_bf16(const bf16* __restrict__ x,
                                                    const bf16* __restrict__ w,
                                                    bf16* __restrict__ y,
                                                    const int* __restrict__ cu_seqlens,
                                                    int seqs, int cols, float eps) {
  pdl_begin();
  __shared__ float scratch[32];
  const int v = block_width(cols, bits(x, w, y) | (uintptr_t)(cols * 2));
  for (int seq = blockIdx.x; seq < seqs; seq += gridDim.x) {
    const bf16* src = x + ((long long)cu_seqlens[seq + 1] - 1) * cols;
    bf16* dst = y + (long long)seq * cols;
    if (v == 8) block_norm<8>(src, w, dst, cols, eps, scratch);
    else if (v == 4) block_norm<4>(src, w, dst, cols, eps, scratch);
    else block_norm<2>(src, w, dst, cols, eps, scratch);
  }
}

// y[s] = rmsnorm(x[(s+1)*rows_per_seq - 1]) * w: the last row of each sequence's rows.
// grid (seqs), block (cols/8 rounded up to a warp, at most 256).
extern "C" __global__ void rmsnorm_last_bf16(const bf16* __restrict__ x,
                                             const bf16* __restrict__ w, bf16* __restrict__ y,
                                             int seqs, int rows_per_seq, int cols, float eps) {
  pdl_begin();
  __shared__ float scratch[32];
  const int v = block_width(cols, bits(x, w, y) | (uintptr_t)(cols * 2));
  for (int seq = blockIdx.x; seq < seqs; seq += gridDim.x) {
    const bf16* src = x + ((long long)(seq + 1) * rows_per_seq - 1) * cols;
    bf16* dst = y + (long long)seq * cols;
    if (v == 8) block_norm<8>(src, w, dst, cols, eps, scratch);
    else if (v == 4) block_norm<4>(src, w, dst, cols, eps, scratch);
    else block_norm<2>(src, w, dst, cols, eps, scratch);
  }
}
