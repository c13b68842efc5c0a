// Decode-shaped GEMMs: C[m, n] (=, += or f32 =) A[m, k] . W[n, k]^T for m <= 32, bf16 in,
// f32 accumulate. The cuda backend uses these for the GEMM externs (kernels/reference.py's
// cublaslt_bf16_tn, cublaslt_bf16_tn_acc, cublas_bf16_tn_f32) when m is small; their numpy
// references are the externs' own: bf16(f32(A) @ f32(W)^T), one rounding (+ f32(C) first when
// accumulating), f32 out unrounded.
//
// At small m the work is streaming W once from memory, so the kernel is built around that:
// * a block per 16 rows of W (one mma.m16n8k16 tile of "A" = W rows), GEMV_WARPS warps over
//   k: warp w takes the 32-wide k chunks w, w + GEMV_WARPS, ... (neighbouring warps read
//   neighbouring bytes of each row), GEMV_UNROLL chunks of loads in flight before any math;
// * every W load is 16 bytes (8 bf16 of one row), streamed past L1; a lane's 16 bytes feed
//   two tensor-core products. k's order inside an mma does not matter as long as W and the
//   activations use the same one, so lane t's 8 consecutive k are its fragment's k pairs t
//   and t+4 of one mma and of the next: both operands come straight from 16-byte loads;
// * the activations are the mma's "B" (8 columns = 8 rows of A per product, MB products for
//   m <= 8 MB), read through the read-only path (they are small and shared by every block);
//   rows past m and k past the end read as zeros, rows of W past n are neither read nor stored;
// * the warps' partial sums meet in shared memory and are added in warp order: no atomics,
//   fixed reduction order, so a launch gives the same bits every time (whole = stages).
// Programmatic dependent launch: a block waits (`pdl_begin`, common.cuh) before it loads W, A or
// C, then lets the next kernel start. Prefetching its rows of W into L2 before the wait was
// measured and dropped: 1.47 against 1.32 ms a decode step without it (docs/benchmarks.md).
//
// Needs k % 8 == 0 and A, W, C 16-byte aligned (the backend checks and falls back to cuBLAS).
// Grid: ceil(n / 16) blocks of 32 * WARPS threads.
#include "activation.cuh"
#include "gemv.cuh"
#include "norm.cuh"

// WARPS and UNROLL are template parameters: 16 warps (`_w16`) put twice the bytes in flight
// per multiprocessor, which the few-tile shapes (n = 2048: 128 blocks) need. Measured on an
// H200 (docs/benchmarks.md): _w16 beats 8 warps and cuBLAS at n = 2048 and loses at n >= 4096;
// 8 chunks in flight instead of 4 (186 registers, one block per multiprocessor) lost
// everywhere and was dropped.

// Output modes (param `mode`).
#define GEMV_BF16 0      // C bf16 = bf16(acc)
#define GEMV_BF16_ACC 1  // C bf16 = bf16(f32(C) + acc)
#define GEMV_F32 2       // C f32 = acc

__device__ __forceinline__ uint4 load_shared_ro(const bf16* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// Where a tile's activations come from (the `Act` of gemv_tile): `load` gives 8 bf16 of row
// `row` at k offset `at` (a multiple of 8; `p` is that element's address in a plain A),
// `prepare` runs once the block's first W loads are in flight, `write` after its products.
// PlainA reads A; NormA and SiluA compute it (the fused entries below).
struct PlainA {
  const bf16* a;
  __device__ __forceinline__ void prepare(int) const {}
  __device__ __forceinline__ uint4 load(const bf16* p, int, int) const { return load_shared_ro(p); }
  __device__ __forceinline__ void write(int, int) const {}
};

template <int MB, int GEMV_WARPS, int GEMV_UNROLL, class Act>
__device__ __forceinline__ void gemv_tile(const Act& src, const bf16* __restrict__ w,
                                          void* __restrict__ c, int m, int n, int k, int mode) {
  const bf16* __restrict__ a = src.a;
  constexpr int GEMV_THREADS = 32 * GEMV_WARPS;
  __shared__ float partial[GEMV_WARPS][MB * 4][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16;
  const int chunks = (k + 31) >> 5;
  const bool lo_ok = row0 + g < n, hi_ok = row0 + g + 8 < n;
  const bf16* w_lo = w + (size_t)(row0 + g) * k + 8 * t;
  const bf16* w_hi = w_lo + (size_t)8 * k;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  const bf16* a_row[MB];
  bool a_ok[MB];
#pragma unroll
  for (int j = 0; j < MB; ++j) {
    a_ok[j] = 8 * j + g < m;
    a_row[j] = a + (size_t)(8 * j + g) * k + 8 * t;
  }

  float acc[MB][4];
#pragma unroll
  for (int j = 0; j < MB; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[j][r] = 0.f;

  uint4 lo[GEMV_UNROLL], hi[GEMV_UNROLL];
  // The whole tile in rows and k a whole number of the warps' rounds of chunks (the model's
  // shapes): the same loads and products with no per-chunk bounds, pointers stepped, so the
  // loop issues about a third of the instructions (each warp turns its loads over sooner).
  constexpr int STEP = 32 * GEMV_WARPS;  // elements between one warp's chunks
  if (row0 + 16 <= n && k % (STEP * GEMV_UNROLL) == 0) {  // block-uniform: mma.sync needs the warp
    const bf16* pl = w_lo + 32 * warp;
    const bf16* ph = w_hi + 32 * warp;
    const bf16* pa[MB];
#pragma unroll
    for (int j = 0; j < MB; ++j) pa[j] = a_row[j] + 32 * warp;
    int at = 32 * warp + 8 * t;  // the k offset of pa's element
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
      lo[u] = load_stream(pl + STEP * u);
      hi[u] = load_stream(ph + STEP * u);
    }
    src.prepare(m);
    for (int left = k / (STEP * GEMV_UNROLL); left > 0; --left) {
      uint4 act[GEMV_UNROLL][MB];
#pragma unroll
      for (int u = 0; u < GEMV_UNROLL; ++u)
#pragma unroll
        for (int j = 0; j < MB; ++j)
          act[u][j] = a_ok[j] ? src.load(pa[j] + STEP * u, 8 * j + g, at + STEP * u) : zero;
      at += STEP * GEMV_UNROLL;
      uint4 lo_now[GEMV_UNROLL], hi_now[GEMV_UNROLL];
#pragma unroll
      for (int u = 0; u < GEMV_UNROLL; ++u) {
        lo_now[u] = lo[u];
        hi_now[u] = hi[u];
      }
      pl += STEP * GEMV_UNROLL;
      ph += STEP * GEMV_UNROLL;
#pragma unroll
      for (int j = 0; j < MB; ++j) pa[j] += STEP * GEMV_UNROLL;
      if (left > 1) {  // the next chunks' loads fly during this math
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
          lo[u] = load_stream(pl + STEP * u);
          hi[u] = load_stream(ph + STEP * u);
        }
      }
#pragma unroll
      for (int u = 0; u < GEMV_UNROLL; ++u) chunk_mma<MB>(acc, lo_now[u], hi_now[u], act[u]);
    }
  } else {
  auto load_w = [&](int base) {
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
      const int ch = base + u * GEMV_WARPS;
      const bool in_k = ch < chunks && 32 * ch + 8 * t < k;
      lo[u] = in_k && lo_ok ? load_stream(w_lo + 32 * ch) : zero;
      hi[u] = in_k && hi_ok ? load_stream(w_hi + 32 * ch) : zero;
    }
  };
  load_w(warp);
  src.prepare(m);
  for (int base = warp; base < chunks; base += GEMV_UNROLL * GEMV_WARPS) {
    uint4 act[GEMV_UNROLL][MB];
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
      const int ch = base + u * GEMV_WARPS;
      const bool in_k = ch < chunks && 32 * ch + 8 * t < k;
#pragma unroll
      for (int j = 0; j < MB; ++j)
        act[u][j] = in_k && a_ok[j] ? src.load(a_row[j] + 32 * ch, 8 * j + g, 32 * ch + 8 * t)
                                    : zero;
    }
    uint4 lo_now[GEMV_UNROLL], hi_now[GEMV_UNROLL];
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
      lo_now[u] = lo[u];
      hi_now[u] = hi[u];
    }
    const int next = base + GEMV_UNROLL * GEMV_WARPS;
    if (next < chunks) load_w(next);  // the next chunks' loads fly during this math
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) chunk_mma<MB>(acc, lo_now[u], hi_now[u], act[u]);
  }
  }
  src.write(m, k);

#pragma unroll
  for (int j = 0; j < MB; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) partial[warp][j * 4 + r][lane] = acc[j][r];
  __syncthreads();
  for (int i = threadIdx.x; i < MB * 4 * 32; i += GEMV_THREADS) {
    const int s = i >> 5, l = i & 31;
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < GEMV_WARPS; ++v) sum += partial[v][s][l];  // warp order: fixed
    const int j = s >> 2, r = s & 3;
    const int row = row0 + (l >> 2) + (r >= 2 ? 8 : 0);
    const int col = 8 * j + 2 * (l & 3) + (r & 1);
    if (row >= n || col >= m) continue;
    const size_t at = (size_t)col * n + row;
    if (mode == GEMV_F32) {
      reinterpret_cast<float*>(c)[at] = sum;
    } else {
      bf16* out = reinterpret_cast<bf16*>(c);
      // one rounding: C + A.W^T in f32, then bf16 (beta = 1 of the _acc extern)
      if (mode == GEMV_BF16_ACC) sum += __bfloat162float(out[at]);
      out[at] = __float2bfloat16(sum);
    }
  }
}

// gemv_bf16_tn_mb<MB>[_w<WARPS>][_u<UNROLL>]: m <= 8 * MB rows of A; 32 * WARPS threads.
extern "C" __global__ void __launch_bounds__(256)
    gemv_bf16_tn_mb1(const bf16* __restrict__ a, const bf16* __restrict__ w, void* __restrict__ c,
           int m, int n, int k, int mode) {
  pdl_begin();
  gemv_tile<1, 8, 4>(PlainA{a}, w, c, m, n, k, mode);
}
extern "C" __global__ void __launch_bounds__(256)
    gemv_bf16_tn_mb2(const bf16* __restrict__ a, const bf16* __restrict__ w, void* __restrict__ c,
           int m, int n, int k, int mode) {
  pdl_begin();
  gemv_tile<2, 8, 4>(PlainA{a}, w, c, m, n, k, mode);
}
extern "C" __global__ void __launch_bounds__(256)
    gemv_bf16_tn_mb3(const bf16* __restrict__ a, const bf16* __restrict__ w, void* __restrict__ c,
           int m, int n, int k, int mode) {
  pdl_begin();
  gemv_tile<3, 8, 4>(PlainA{a}, w, c, m, n, k, mode);
}
extern "C" __global__ void __launch_bounds__(256)
    gemv_bf16_tn_mb4(const bf16* __restrict__ a, const bf16* __restrict__ w, void* __restrict__ c,
           int m, int n, int k, int mode) {
  pdl_begin();
  gemv_tile<4, 8, 4>(PlainA{a}, w, c, m, n, k, mode);
}
extern "C" __global__ void __launch_bounds__(512)
    gemv_bf16_tn_mb1_w16(const bf16* __restrict__ a, const bf16* __restrict__ w, void* __restrict__ c,
           int m, int n, int k, int mode) {
  pdl_begin();
  gemv_tile<1, 16, 4>(PlainA{a}, w, c, m, n, k, mode);
}

// ---- the small kernel before a GEMV, computed in its prologue ---------------------------
// The cuda backend joins a launch of norm.cu's `rmsnorm_bf16` or activation.cu's
// `silu_mul_bf16` with the GEMV launch right after it that reads its output
// (runtime/backends/fuse.py): once its first W loads are in flight, every block computes the
// whole m x k activations into shared memory from the small kernel's inputs, with the small
// kernel's operations in its order, so they carry its bits and the products are the GEMV's; its
// tiles then read A from there. The blocks also write the small kernel's output between them (a
// few 16-byte pieces each, after their products), so whatever reads it later reads the same
// bytes; no block reads it. One launch instead of two: a grid less to ramp and drain a layer.
// m <= 8 (MB = 1); k % 8 == 0, 16-byte aligned rows, the output apart from every input, and
// dynamic shared memory of m rows of k + FUSED_PAD bf16 (the backend checks and sizes it; the
// pad keeps the rows' 16-byte pieces of one load on different banks).
#define FUSED_PAD 8

// The loader's 8-element pieces of its m x k output, a share of each block: piece
// blockIdx.x + gridDim.x * i for thread i, so every block writes.
template <class Act>
__device__ __forceinline__ void write_share(const Act& src, bf16* out, int m, int k) {
  const long long pieces = (long long)m * (k / 8);
  for (long long v = blockIdx.x + (long long)gridDim.x * threadIdx.x; v < pieces;
       v += (long long)gridDim.x * blockDim.x) {
    const int row = (int)(v / (k / 8)), at = (int)(v % (k / 8)) * 8;
    *reinterpret_cast<uint4*>(out + (long long)row * k + at) = src.load(nullptr, row, at);
  }
}

// y = rmsnorm(x) * gn as `rmsnorm_bf16` launched with `norm_threads` threads a block computes
// it (block_norm<8>): each row's sum of squares from the same threads' shares (squares<8>),
// each warp's by warp_sum, the warps' added in warp order, then y = bf16(bf16(x * r) * gn).
// This block's warps take the launch's warps in turn (norm_threads % 32 == 0, <= 1024).
struct NormA {
  bf16* a;  // y
  const bf16* x;
  const bf16* gn;
  float eps;
  int norm_threads, k;
  float* sums;  // [8 * 32 + 8]: each launch warp's sum of squares, then each row's 1 / rms
  bf16* rows;   // [m][k + FUSED_PAD]: the activations

  __device__ __forceinline__ void prepare(int m) const {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int launch_warps = norm_threads >> 5;
#pragma unroll 1
    for (int row = 0; row < m; ++row)
#pragma unroll 1
      for (int lw = warp; lw < launch_warps; lw += warps) {
        const float ss = warp_sum(squares<8>(x + (long long)row * k, k, 8 * (32 * lw + lane),
                                             8 * norm_threads));
        if (lane == 0) sums[row * 32 + lw] = ss;
      }
    __syncthreads();
    float* r = sums + 8 * 32;
    if (threadIdx.x < (unsigned)m) {
      float total = 0.f;
      for (int i = 0; i < launch_warps; ++i) total += sums[threadIdx.x * 32 + i];
      r[threadIdx.x] = rsqrtf(total / (float)k + eps);
    }
    __syncthreads();
#pragma unroll 1
    for (int v = threadIdx.x; v < m * (k / 8); v += blockDim.x) {
      const int row = v / (k / 8), at = (v % (k / 8)) * 8;
      float e[8], g[8];
      load_bf16<8>(x + (long long)row * k + at, e);
      load_bf16<8>(gn + at, g);
      const float rr = r[row];
#pragma unroll
      for (int i = 0; i < 8; ++i) e[i] = round_bf16(e[i] * rr) * g[i];
      store_bf16<8>(rows + row * (k + FUSED_PAD) + at, e);
    }
    __syncthreads();
  }

  __device__ __forceinline__ uint4 load(const bf16*, int row, int at) const {
    return *reinterpret_cast<const uint4*>(rows + row * (k + FUSED_PAD) + at);
  }

  __device__ __forceinline__ void write(int m, int) const { write_share(*this, a, m, k); }
};

// act = bf16(bf16(silu(g)) * u) from gate_up's rows of 2k, gate and up interleaved in pieces of
// `block` columns (block % 8 == 0), as `silu_mul_bf16` computes it (silu_mul, activation.cuh).
struct SiluA {
  bf16* a;  // act
  const bf16* gate_up;
  int block, k;
  bf16* rows;  // [m][k + FUSED_PAD]: the activations

  __device__ __forceinline__ void prepare(int m) const {
#pragma unroll 1
    for (int v = threadIdx.x; v < m * (k / 8); v += blockDim.x) {
      const int row = v / (k / 8), at = (v % (k / 8)) * 8;
      const bf16* p = gate_up + (long long)row * 2 * k + (long long)(at / block) * 2 * block +
                      at % block;
      *reinterpret_cast<uint4*>(rows + row * (k + FUSED_PAD) + at) =
          silu_mul8(__ldg(reinterpret_cast<const uint4*>(p)),
                    __ldg(reinterpret_cast<const uint4*>(p + block)));
    }
    __syncthreads();
  }

  __device__ __forceinline__ uint4 load(const bf16*, int row, int at) const {
    return *reinterpret_cast<const uint4*>(rows + row * (k + FUSED_PAD) + at);
  }

  __device__ __forceinline__ void write(int m, int) const { write_share(*this, a, m, k); }
};

// gemv_rmsnorm_bf16_tn_mb1[_w16]: C (mode) A . W^T, A = rmsnorm(x) * gn, also written to y.
extern "C" __global__ void __launch_bounds__(256)
    gemv_rmsnorm_bf16_tn_mb1(const bf16* __restrict__ x, const bf16* __restrict__ gn,
           bf16* __restrict__ y, float eps, int norm_threads, const bf16* __restrict__ w,
           void* __restrict__ c, int m, int n, int k, int mode) {
  pdl_begin();
  __shared__ float sums[8 * 32 + 8];
  extern __shared__ __align__(16) unsigned char fused_rows[];
  gemv_tile<1, 8, 4>(NormA{y, x, gn, eps, norm_threads, k, sums,
                           reinterpret_cast<bf16*>(fused_rows)}, w, c, m, n, k, mode);
}
extern "C" __global__ void __launch_bounds__(512)
    gemv_rmsnorm_bf16_tn_mb1_w16(const bf16* __restrict__ x, const bf16* __restrict__ gn,
           bf16* __restrict__ y, float eps, int norm_threads, const bf16* __restrict__ w,
           void* __restrict__ c, int m, int n, int k, int mode) {
  pdl_begin();
  __shared__ float sums[8 * 32 + 8];
  extern __shared__ __align__(16) unsigned char fused_rows[];
  gemv_tile<1, 16, 4>(NormA{y, x, gn, eps, norm_threads, k, sums,
                            reinterpret_cast<bf16*>(fused_rows)}, w, c, m, n, k, mode);
}

// gemv_silu_bf16_tn_mb1[_w16]: C (mode) A . W^T, A = silu_mul(gate_up), also written to act.
extern "C" __global__ void __launch_bounds__(256)
    gemv_silu_bf16_tn_mb1(const bf16* __restrict__ gate_up, bf16* __restrict__ act, int block,
           const bf16* __restrict__ w, void* __restrict__ c, int m, int n, int k, int mode) {
  pdl_begin();
  extern __shared__ __align__(16) unsigned char fused_rows[];
  gemv_tile<1, 8, 4>(SiluA{act, gate_up, block, k, reinterpret_cast<bf16*>(fused_rows)},
                           w, c, m, n, k, mode);
}
extern "C" __global__ void __launch_bounds__(512)
    gemv_silu_bf16_tn_mb1_w16(const bf16* __restrict__ gate_up, bf16* __restrict__ act, int block,
           const bf16* __restrict__ w, void* __restrict__ c, int m, int n, int k, int mode) {
  pdl_begin();
  extern __shared__ __align__(16) unsigned char fused_rows[];
  gemv_tile<1, 16, 4>(SiluA{act, gate_up, block, k, reinterpret_cast<bf16*>(fused_rows)},
                           w, c, m, n, k, mode);
}
