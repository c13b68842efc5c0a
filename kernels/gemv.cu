// Decode-shaped GEMMs: C[m, n] (=, += or f32 =) A[m, k] . W[n, k]^T for m <= 8, bf16 in,
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
#include "common.cuh"

// The primitives: a 16-byte weight load streamed past L1, the bf16 tensor-core product
// m16n8k16 accumulating in f32, and one k chunk of a tile as two such products.
__device__ __forceinline__ uint4 load_stream(const bf16* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void mma_16816(float* d, uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 32-wide k chunk of a 16-row tile of W (lane t's 16-byte loads `lo` and `hi`: rows g and
// g + 8) against MB blocks of 8 activation rows (`act`, the same lane's 16 bytes of each).
template <int MB>
__device__ __forceinline__ void chunk_mma(float (&acc)[MB][4], const uint4& lo, const uint4& hi,
                                          const uint4 (&act)[MB]) {
#pragma unroll
  for (int j = 0; j < MB; ++j) {
    mma_16816(acc[j], lo.x, hi.x, lo.y, hi.y, act[j].x, act[j].y);
    mma_16816(acc[j], lo.z, hi.z, lo.w, hi.w, act[j].z, act[j].w);
  }
}

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

template <int MB, int GEMV_WARPS, int GEMV_UNROLL>
__device__ __forceinline__ void gemv_tile(const bf16* __restrict__ a, const bf16* __restrict__ w,
                                          void* __restrict__ c, int m, int n, int k, int mode) {
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
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
      lo[u] = load_stream(pl + STEP * u);
      hi[u] = load_stream(ph + STEP * u);
    }
    for (int left = k / (STEP * GEMV_UNROLL); left > 0; --left) {
      uint4 act[GEMV_UNROLL][MB];
#pragma unroll
      for (int u = 0; u < GEMV_UNROLL; ++u)
#pragma unroll
        for (int j = 0; j < MB; ++j)
          act[u][j] = a_ok[j] ? load_shared_ro(pa[j] + STEP * u) : zero;
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
  for (int base = warp; base < chunks; base += GEMV_UNROLL * GEMV_WARPS) {
    uint4 act[GEMV_UNROLL][MB];
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
      const int ch = base + u * GEMV_WARPS;
      const bool in_k = ch < chunks && 32 * ch + 8 * t < k;
#pragma unroll
      for (int j = 0; j < MB; ++j)
        act[u][j] = in_k && a_ok[j] ? load_shared_ro(a_row[j] + 32 * ch) : zero;
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

// gemv_bf16_tn_mb1[_w16]: m <= 8 rows of A; 32 * 8 (or 16) threads. Larger m goes to cuBLAS:
// tiles of 2-4 activation blocks (m 16-32) never came within 18% of it (docs/design-notes.md).
extern "C" __global__ void __launch_bounds__(256)
    gemv_bf16_tn_mb1(const bf16* __restrict__ a, const bf16* __restrict__ w, void* __restrict__ c,
           int m, int n, int k, int mode) {
  pdl_begin();
  gemv_tile<1, 8, 4>(a, w, c, m, n, k, mode);
}
extern "C" __global__ void __launch_bounds__(512)
    gemv_bf16_tn_mb1_w16(const bf16* __restrict__ a, const bf16* __restrict__ w, void* __restrict__ c,
           int m, int n, int k, int mode) {
  pdl_begin();
  gemv_tile<1, 16, 4>(a, w, c, m, n, k, mode);
}
