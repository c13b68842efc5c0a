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
#include "gemv.cuh"
#include "tc.cuh"  // cp.async, shared-memory addresses (gemv_smem_tile)

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

// The warps' sums of each output of a block, added in shared memory in warp order (fixed: no
// atomics), TR tiles a round, then stored in `mode` with one rounding; `partial` holds
// GEMV_WARPS x TR * MB * 4 x 32 floats. Every entry ends here, so every entry of a warp count
// gives an output the same bits.
template <int MB, int T, int TR, int GEMV_WARPS>
__device__ __forceinline__ void gemv_sum_store(float (*partial)[TR * MB * 4][32],
                                               const float (&acc)[T][MB][4], void* __restrict__ c,
                                               int row0, int col0, int m, int n, int mode) {
  constexpr int GEMV_THREADS = 32 * GEMV_WARPS;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int round = 0; round < T / TR; ++round) {
    if (round > 0) __syncthreads();  // every thread has read the round before
#pragma unroll
    for (int ii = 0; ii < TR; ++ii)
#pragma unroll
      for (int j = 0; j < MB; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          partial[warp][(ii * MB + j) * 4 + r][lane] = acc[round * TR + ii][j][r];
    __syncthreads();
    for (int e = threadIdx.x; e < TR * MB * 4 * 32; e += GEMV_THREADS) {
      const int s = e >> 5, l = e & 31;
      float sum = 0.f;
#pragma unroll
      for (int v = 0; v < GEMV_WARPS; ++v) sum += partial[v][s][l];  // warp order: fixed
      const int i = round * TR + s / (MB * 4), j = (s >> 2) % MB, r = s & 3;
      const int row = row0 + 16 * i + (l >> 2) + (r >= 2 ? 8 : 0);
      const int col = 8 * j + 2 * (l & 3) + (r & 1);
      if (row >= n || col >= m) continue;
      const size_t at = (size_t)(col0 + col) * n + row;
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
}

template <int MB, int T, int GEMV_WARPS, int GEMV_UNROLL>
__device__ __forceinline__ void gemv_tile(const bf16* __restrict__ a, const bf16* __restrict__ w,
                                          void* __restrict__ c, int m, int n, int k, int mode) {
  // The warps' sums meet in shared memory TR tiles at a time (all T where they fit in 48 KB):
  // the same adds in the same warp order whatever TR, so TR changes no bit.
  constexpr int TR = (T * MB * GEMV_WARPS * 512 <= 49152) ? T
                     : (T % 2 == 0 && (T / 2) * MB * GEMV_WARPS * 512 <= 49152) ? T / 2 : 1;
  static_assert(T % TR == 0, "the tiles a block reduce in whole rounds");
  __shared__ float partial[GEMV_WARPS][TR * MB * 4][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  // Row groups: m > 8 * MB takes ceil(m / (8 * MB)) blocks per tile, neighbours in launch
  // order (so they read the tile's W rows while they are in L2); group q takes rows
  // 8 * MB * q .. of A as a launch of its own would (the same bits: the rows never meet).
  const int groups = (m + 8 * MB - 1) / (8 * MB);
  const int q = blockIdx.x % groups;
  a += (size_t)q * 8 * MB * k;
  const int col0 = q * 8 * MB;
  m -= col0;
  const int row0 = (blockIdx.x / groups) * 16 * T;
  const int chunks = (k + 31) >> 5;
  const bf16* w_lo[T];
  bool lo_ok[T], hi_ok[T];
#pragma unroll
  for (int i = 0; i < T; ++i) {
    lo_ok[i] = row0 + 16 * i + g < n;
    hi_ok[i] = row0 + 16 * i + g + 8 < n;
    w_lo[i] = w + (size_t)(row0 + 16 * i + g) * k + 8 * t;
  }
  const uint4 zero = make_uint4(0, 0, 0, 0);
  const bf16* a_row[MB];
  bool a_ok[MB];
#pragma unroll
  for (int j = 0; j < MB; ++j) {
    a_ok[j] = 8 * j + g < m;
    a_row[j] = a + (size_t)(8 * j + g) * k + 8 * t;
  }

  float acc[T][MB][4] = {};  // each output's sum starts at 0.f

  uint4 lo[GEMV_UNROLL][T], hi[GEMV_UNROLL][T];
  // The whole tile in rows and k a whole number of the warps' rounds of chunks (the model's
  // shapes): the same loads and products with no per-chunk bounds, pointers stepped, so the
  // loop issues about a third of the instructions (each warp turns its loads over sooner).
  constexpr int STEP = 32 * GEMV_WARPS;  // elements between one warp's chunks
  if (row0 + 16 * T <= n && k % (STEP * GEMV_UNROLL) == 0) {  // block-uniform (mma.sync)
    const bf16* pl[T];
#pragma unroll
    for (int i = 0; i < T; ++i) pl[i] = w_lo[i] + 32 * warp;
    const bf16* pa[MB];
#pragma unroll
    for (int j = 0; j < MB; ++j) pa[j] = a_row[j] + 32 * warp;
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u)
#pragma unroll
      for (int i = 0; i < T; ++i) {
        lo[u][i] = load_stream(pl[i] + STEP * u);
        hi[u][i] = load_stream(pl[i] + (size_t)8 * k + STEP * u);
      }
    for (int left = k / (STEP * GEMV_UNROLL); left > 0; --left) {
      uint4 act[GEMV_UNROLL][MB];
#pragma unroll
      for (int u = 0; u < GEMV_UNROLL; ++u)
#pragma unroll
        for (int j = 0; j < MB; ++j)
          act[u][j] = a_ok[j] ? load_shared_ro(pa[j] + STEP * u) : zero;
      uint4 lo_now[GEMV_UNROLL][T], hi_now[GEMV_UNROLL][T];
#pragma unroll
      for (int u = 0; u < GEMV_UNROLL; ++u)
#pragma unroll
        for (int i = 0; i < T; ++i) {
          lo_now[u][i] = lo[u][i];
          hi_now[u][i] = hi[u][i];
        }
#pragma unroll
      for (int i = 0; i < T; ++i) pl[i] += STEP * GEMV_UNROLL;
#pragma unroll
      for (int j = 0; j < MB; ++j) pa[j] += STEP * GEMV_UNROLL;
      if (left > 1) {  // the next chunks' loads fly during this math
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u)
#pragma unroll
          for (int i = 0; i < T; ++i) {
            lo[u][i] = load_stream(pl[i] + STEP * u);
            hi[u][i] = load_stream(pl[i] + (size_t)8 * k + STEP * u);
          }
      }
#pragma unroll
      for (int u = 0; u < GEMV_UNROLL; ++u)
#pragma unroll
        for (int i = 0; i < T; ++i) chunk_mma<MB>(acc[i], lo_now[u][i], hi_now[u][i], act[u]);
    }
  } else {
  auto load_w = [&](int base) {
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
      const int ch = base + u * GEMV_WARPS;
      const bool in_k = ch < chunks && 32 * ch + 8 * t < k;
#pragma unroll
      for (int i = 0; i < T; ++i) {
        lo[u][i] = in_k && lo_ok[i] ? load_stream(w_lo[i] + 32 * ch) : zero;
        hi[u][i] = in_k && hi_ok[i] ? load_stream(w_lo[i] + (size_t)8 * k + 32 * ch) : zero;
      }
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
    uint4 lo_now[GEMV_UNROLL][T], hi_now[GEMV_UNROLL][T];
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u)
#pragma unroll
      for (int i = 0; i < T; ++i) {
        lo_now[u][i] = lo[u][i];
        hi_now[u][i] = hi[u][i];
      }
    const int next = base + GEMV_UNROLL * GEMV_WARPS;
    if (next < chunks) load_w(next);  // the next chunks' loads fly during this math
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u)
#pragma unroll
      for (int i = 0; i < T; ++i) chunk_mma<MB>(acc[i], lo_now[u][i], hi_now[u][i], act[u]);
  }
  }

  gemv_sum_store<MB, T, TR, GEMV_WARPS>(partial, acc, c, row0, col0, m, n, mode);
}

// gemv_bf16_tn_mb<MB>[_w<WARPS>][_t<T>]: blocks of 8 * MB rows of A (any m: more rows take
// more blocks), T 16-row tiles of W a block, 32 * WARPS threads. For a given WARPS every entry
// gives each row of C the same bits (the same chunks a warp, in the same order, summed over
// the warps in the same order), whatever MB, T, the unroll or m: the batch-invariant decode
// GEMMs (kerncc.runtime.backends.gemv) rely on it.
extern "C" __global__ void __launch_bounds__(256)
    gemv_bf16_tn_mb1(const bf16* __restrict__ a, const bf16* __restrict__ w, void* __restrict__ c,
           int m, int n, int k, int mode) {
  pdl_begin();
  gemv_tile<1, 1, 8, 4>(a, w, c, m, n, k, mode);
}
extern "C" __global__ void __launch_bounds__(512)
    gemv_bf16_tn_mb1_w16(const bf16* __restrict__ a, const bf16* __restrict__ w, void* __restrict__ c,
           int m, int n, int k, int mode) {
  pdl_begin();
  gemv_tile<1, 1, 16, 4>(a, w, c, m, n, k, mode);
}
extern "C" __global__ void __launch_bounds__(256)
    gemv_bf16_tn_mb2_t2(const bf16* __restrict__ a, const bf16* __restrict__ w, void* __restrict__ c,
           int m, int n, int k, int mode) {
  pdl_begin();
  gemv_tile<2, 2, 8, 2>(a, w, c, m, n, k, mode);
}
extern "C" __global__ void __launch_bounds__(256)
    gemv_bf16_tn_mb4_t2(const bf16* __restrict__ a, const bf16* __restrict__ w, void* __restrict__ c,
           int m, int n, int k, int mode) {
  pdl_begin();
  gemv_tile<4, 2, 8, 2>(a, w, c, m, n, k, mode);
}
extern "C" __global__ void __launch_bounds__(256)
    gemv_bf16_tn_mb4_t3(const bf16* __restrict__ a, const bf16* __restrict__ w, void* __restrict__ c,
           int m, int n, int k, int mode) {
  pdl_begin();
  gemv_tile<4, 3, 8, 2>(a, w, c, m, n, k, mode);
}
extern "C" __global__ void __launch_bounds__(512)
    gemv_bf16_tn_mb2_w16_t2(const bf16* __restrict__ a, const bf16* __restrict__ w, void* __restrict__ c,
           int m, int n, int k, int mode) {
  pdl_begin();
  gemv_tile<2, 2, 16, 2>(a, w, c, m, n, k, mode);
}
extern "C" __global__ void __launch_bounds__(512)
    gemv_bf16_tn_mb3_w16_t2(const bf16* __restrict__ a, const bf16* __restrict__ w, void* __restrict__ c,
           int m, int n, int k, int mode) {
  pdl_begin();
  gemv_tile<3, 2, 16, 2>(a, w, c, m, n, k, mode);
}
extern "C" __global__ void __launch_bounds__(512)
    gemv_bf16_tn_mb4_w16_t2(const bf16* __restrict__ a, const bf16* __restrict__ w, void* __restrict__ c,
           int m, int n, int k, int mode) {
  pdl_begin();
  gemv_tile<4, 2, 16, 1>(a, w, c, m, n, k, mode);
}

// ---------------------------------------------------------------------------------------------
// gemv_smem_tile: the same function and the same bits as gemv_tile of the same GEMV_WARPS, with
// A (and W) staged through shared memory, for 17 to 64 rows of A.
//
// Why: gemv_tile holds a chunk's activations in registers (4 * MB a lane), so at MB = 8 a
// block can afford one W tile (126 registers; two tiles took 182 and lost), and every
// block re-reads all its rows of A from L2 per 16 rows of W (at m = 64, k = 4096: 512 KB of A
// a block against 128 KB of W). Here each warp streams its own chunks of A and of the block's
// T W tiles into a private ring of STAGES shared-memory slots by cp.async (16-byte copies,
// zero-filled where gemv_tile reads zeros), STAGES - 1 chunks ahead of its math, and feeds the
// mma operands from shared memory with 16-byte lds; registers hold the accumulators and one
// chunk's W fragments. A block reads A once for T tiles (T = 4: a quarter of the A traffic).
// A warp's ring is its own, so the pipeline needs no block barrier (cp.async.wait_group and
// __syncwarp); the block meets only for the warps' sum.
//
// Why the bits equal gemv_tile's (of the same GEMV_WARPS, hence every entry of that warp
// count, whatever MB, T, m):
// 1. warp w takes the chunks w, w + GEMV_WARPS, ... in ascending order, as gemv_tile does;
// 2. lane (g, t) gets the very words gemv_tile's loads give it: `lo`/`hi` = W rows
//    row0 + 16 i + g (+ 8), k 32 ch + 8 t .. + 7; `act[j]` = A row 8 j + g of the group, the
//    same k; zero exactly where gemv_tile's are (k piece past k, W row past n, A row past m);
// 3. per accumulator acc[i][j] the products are the same two mma.m16n8k16 (words .x .y, then
//    .z .w, as chunk_mma) a chunk, chunk after chunk, from 0.f; the loop order over (i, j)
//    differs, but each acc[i][j] is touched by its own mma only;
// 4. the warps' sums are added in warp order from 0.f, then C is written with the same mode
//    handling (one rounding; + f32(C) first for _ACC; f32 out for _F32), element for element
//    of the same (row, col) mapping. Rows of other groups never meet (row groups as gemv_tile).
// Dynamic shared memory: GEMV_WARPS * STAGES * (8 MB + 16 T) * 64 bytes (the backend's
// gemv.SHARED must say the same; a launch with less traps), reused for the warps' sums.
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}

template <int MB, int T, int GEMV_WARPS, int STAGES>
__device__ __forceinline__ void gemv_smem_tile(const bf16* __restrict__ a,
                                               const bf16* __restrict__ w,
                                               void* __restrict__ c, int m, int n, int k,
                                               int mode) {
  constexpr int ROWS = 8 * MB + 16 * T;  // a slot: the chunk's rows of A, then of W
  constexpr int SLOT = ROWS * 64;        // bytes: 32 bf16 a row
  constexpr int SMEM = GEMV_WARPS * STAGES * SLOT;
  // The warps' sums meet TR tiles at a time in the same memory (the adds and their order do
  // not depend on TR).
  constexpr int TILE_SUMS = GEMV_WARPS * MB * 512;  // bytes of one tile's partial sums
  constexpr int TR = (T * TILE_SUMS <= SMEM) ? T
                     : (T % 2 == 0 && (T / 2) * TILE_SUMS <= SMEM) ? T / 2 : 1;
  static_assert(T % TR == 0 && TILE_SUMS <= SMEM, "the tiles' sums fit in whole rounds");
  static_assert(STAGES >= 2, "a chunk in flight while one is multiplied");
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  if (dynamic_smem_bytes() < SMEM) __trap();  // launched without the slots it needs

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int groups = (m + 8 * MB - 1) / (8 * MB);  // row groups, as gemv_tile
  const int q = blockIdx.x % groups;
  a += (size_t)q * 8 * MB * k;
  const int col0 = q * 8 * MB;
  m -= col0;
  const int row0 = (blockIdx.x / groups) * 16 * T;
  const int chunks = (k + 31) >> 5;
  const int mine = chunks > warp ? (chunks - warp + GEMV_WARPS - 1) / GEMV_WARPS : 0;
  const uint32_t ring = smem_u32(gemv_smem) + warp * STAGES * SLOT;

  // The warp's i-th chunk (k chunk warp + GEMV_WARPS * i) into slot s: row r of the slot,
  // 16-byte part p; lane l copies part l & 3 of rows l >> 2, l >> 2 + 8, ... (A rows first).
  auto stage = [&](int i, int s) {
    const int k0 = 32 * (warp + GEMV_WARPS * i) + 8 * t;
    const bool in_k = k0 < k;  // k % 8 == 0: a part is wholly in or out
    const uint32_t dst = ring + s * SLOT + g * 64 + t * 16;
#pragma unroll
    for (int it = 0; it < MB; ++it) {
      const int r = g + 8 * it;
      const bool on = in_k && r < m;
      cp_async16(dst + it * 512, on ? a + (size_t)r * k + k0 : a, on);
    }
#pragma unroll
    for (int it = 0; it < 2 * T; ++it) {
      const int r = row0 + g + 8 * it;
      const bool on = in_k && r < n;
      cp_async16(dst + (MB + it) * 512, on ? w + (size_t)r * k + k0 : w, on);
    }
  };

  float acc[T][MB][4] = {};  // each output's sum starts at 0.f

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < mine) stage(s, s);
    cp_async_commit();  // one group a slot, empty or not: the wait below counts groups
  }
  int slot = 0;
  for (int i = 0; i < mine; ++i) {
    cp_async_wait<STAGES - 2>();  // chunk i's copies (this lane's) have landed
    __syncwarp();                 // ... and every lane's; all have read the slot refilled next
    const int ahead = i + STAGES - 1;
    if (ahead < mine) stage(ahead, slot == 0 ? STAGES - 1 : slot - 1);
    cp_async_commit();
    const uint32_t base = ring + slot * SLOT + g * 64 + t * 16;
    uint4 lo[T], hi[T];
#pragma unroll
    for (int ti = 0; ti < T; ++ti) {
      lo[ti] = lds128(base + (8 * MB + 16 * ti) * 64);
      hi[ti] = lds128(base + (8 * MB + 16 * ti + 8) * 64);
    }
#pragma unroll
    for (int j = 0; j < MB; ++j) {
      const uint4 act = lds128(base + 8 * j * 64);
#pragma unroll
      for (int ti = 0; ti < T; ++ti) {  // chunk_mma's two products, in its order
        mma_16816(acc[ti][j], lo[ti].x, hi[ti].x, lo[ti].y, hi[ti].y, act.x, act.y);
        mma_16816(acc[ti][j], lo[ti].z, hi[ti].z, lo[ti].w, hi[ti].w, act.z, act.w);
      }
    }
    slot = slot == STAGES - 1 ? 0 : slot + 1;
  }
  cp_async_wait<0>();  // only empty groups are left; the slots become the sums' memory
  __syncthreads();

  float (*partial)[TR * MB * 4][32] = reinterpret_cast<float (*)[TR * MB * 4][32]>(gemv_smem);
  gemv_sum_store<MB, T, TR, GEMV_WARPS>(partial, acc, c, row0, col0, m, n, mode);
}

// gemv_bf16_tn_mb<MB>_t<T>_smem: gemv_smem_tile entries, 8 warps (the bits of every 8-warp
// entry above), three slots a warp (two chunks in flight while one is multiplied).
// mb8_t4: 64 rows of A, 64 of W a block, 192 KB; mb4_t4: 32 rows of A, 64 of W, 144 KB.
// Measured on an H100 (`python -m bench.gemv --every`): at 33-64 rows mb8_t4 takes 0.85-0.88x
// the time of the register-held 64-row entry it replaced on the 8B model's gate_up and
// lm_head; mb4_t4 is as fast or faster than the register-held entries on the narrower
// shapes there (0.86x on the 8B down at 64 rows) and on the widest at 17-32 rows.
extern "C" __global__ void __launch_bounds__(256, 1)
    gemv_bf16_tn_mb8_t4_smem(const bf16* __restrict__ a, const bf16* __restrict__ w,
                             void* __restrict__ c, int m, int n, int k, int mode) {
  pdl_begin();
  gemv_smem_tile<8, 4, 8, 3>(a, w, c, m, n, k, mode);
}
extern "C" __global__ void __launch_bounds__(256, 1)
    gemv_bf16_tn_mb4_t4_smem(const bf16* __restrict__ a, const bf16* __restrict__ w,
                             void* __restrict__ c, int m, int n, int k, int mode) {
  pdl_begin();
  gemv_smem_tile<4, 4, 8, 3>(a, w, c, m, n, k, mode);
}

// ---------------------------------------------------------------------------------------------
// gemv_seq_tile: C[m, n] (=, += or f32 =) A[m, k] . W[n, k]^T with the bits of cuBLASLt's
// split-free algorithms (runtime/backends/cublas.py PinnedGemm), for a decode step's one row.
//
// A split-free cuBLASLt algorithm sums each output in one f32 accumulator, 16 k at a time in
// increasing k (one tensor-core product of a 16-wide k slice into the accumulator), whatever its
// tiles, and its beta = 1 epilogue rounds that sum to bf16 before it adds C in f32. Measured on
// an H100 (cuBLASLt 13): an mma.m16n8k16 chain over the k slices 0-15, 16-31, ... in that order,
// from 0.f, gives their C bit for bit at every m, n and k tried, in the three externs' modes; the
// order of the 16 products inside a slice does not change a bit, a slice summed apart and then
// added does (tests/test_gemv_cuda.py checks the rows against the pinned algorithms'). So a site
// on the pinned algorithms can run its one-row launches here, where the launch overlaps its
// neighbours (programmatic dependent launch) as cuBLASLt's do not, with the same bits.
//
// k is not split (the chain is the bits): a block runs one 16-row tile of W through its whole k.
// Its warps copy the tile's rows of W and the group's rows of A through a ring of STAGES
// shared-memory slots by cp.async, 128 k a slot (rows padded to 272 bytes so ldmatrix reads
// without bank conflicts), STAGES - 2 slots in flight; warp 0 runs the chain, one slot's
// fragments in registers while the next slot's load (ldmatrix, the mma's own layout). The
// chain is the floor: about 25 cycles a slice, so a deep, narrow W (the example's down_proj)
// takes longer here than on the pinned algorithms, whose tiles cover more rows.
// Rows of W past n and of A past m, and k past the end, read as zeros (zero-filled copies) and
// are not stored. Needs k % 8 == 0 and A, W, C 16-byte aligned. m > 8 MB takes more blocks a
// tile (row groups, as gemv_tile). Grid: ceil(n / 16) * ceil(m / (8 MB)) blocks of 32 WARPS
// threads. Dynamic shared memory: STAGES * (16 + 8 MB) * 272 bytes (gemv.SHARED).
template <int MB, int STAGES, int WARPS, int GEMV_SEQ_KC = 128>
__device__ __forceinline__ void gemv_seq_tile(const bf16* __restrict__ a,
                                              const bf16* __restrict__ w, void* __restrict__ c,
                                              int m, int n, int k, int mode) {
  constexpr int GEMV_SEQ_ROW = 2 * GEMV_SEQ_KC + 16;
  constexpr int ROWS = 16 + 8 * MB;  // a slot: the tile's 16 rows of W, then 8 MB of A
  constexpr int SLOT = ROWS * GEMV_SEQ_ROW;
  constexpr int STEPS = GEMV_SEQ_KC / 16;  // k slices a slot
  constexpr int THREADS = 32 * WARPS;
  constexpr int PARTS = ROWS * (GEMV_SEQ_KC / 8);  // 16-byte copies a slot
  static_assert(STAGES >= 3, "a slot in registers, one landed, one in flight");
  constexpr int COPIES = (PARTS + THREADS - 1) / THREADS;
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  if (dynamic_smem_bytes() < STAGES * SLOT) __trap();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int groups = (m + 8 * MB - 1) / (8 * MB);
  const int q = blockIdx.x % groups;
  a += (size_t)q * 8 * MB * k;
  const int col0 = q * 8 * MB;
  m -= col0;
  const int row0 = (blockIdx.x / groups) * 16;
  const int slots = (k + GEMV_SEQ_KC - 1) / GEMV_SEQ_KC;
  const uint32_t ring = smem_u32(gemv_smem);

  // Every thread copies the 16-byte part tid % 16 of the slot's rows tid / 16 + (THREADS / 16) i:
  // W rows row0 + r for r < 16, then A rows r - 16 of the group (zeros past n, m and k).
  const int part = tid & 15;
  const bf16* src[COPIES];
  bool row_ok[COPIES], row_in[COPIES];
#pragma unroll
  for (int i = 0; i < COPIES; ++i) {
    const int r = tid / 16 + (THREADS / 16) * i;
    const bool w_row = r < 16;
    const int at = w_row ? row0 + r : r - 16;
    row_in[i] = r < ROWS;
    row_ok[i] = at < (w_row ? n : m);
    src[i] = (w_row ? w : a) + (size_t)(row_ok[i] ? at : 0) * k + 8 * part;
  }
  const uint32_t dst0 = ring + (tid / 16) * GEMV_SEQ_ROW + 16 * part;
  auto stage = [&](int slice, int s) {
    const int k0 = slice * GEMV_SEQ_KC;
    const bool in_k = k0 + 8 * part < k;  // k % 8 == 0: a part is wholly in or out
#pragma unroll
    for (int i = 0; i < COPIES; ++i) {
      if (!row_in[i]) continue;
      const bool on = in_k && row_ok[i];
      cp_async16(dst0 + s * SLOT + (THREADS / 16) * i * GEMV_SEQ_ROW, on ? src[i] + k0 : w, on);
    }
  };

  // Fragments of slice st (ldmatrix, the mma's own layout): W's a slice (x4: rows 0-7 / 8-15,
  // k 0-7 / 8-15: a0..a3), A's for two slices (x4: the group's rows, k 0-7, 8-15 of slice st,
  // then st + 1: b0, b1 of each).
  const uint32_t w_at = ring + ((lane & 7) + 8 * ((lane >> 3) & 1)) * GEMV_SEQ_ROW + 16 * (lane >> 4);
  const uint32_t a_at = ring + (16 + (lane & 7)) * GEMV_SEQ_ROW + 16 * (lane >> 3);
  struct Frags {
    uint32_t w[STEPS][4], a[STEPS / 2][MB][4];
  };
  auto load = [&](int s, Frags& f) {  // slot s's fragments into registers
#pragma unroll
    for (int st = 0; st < STEPS; ++st) ldsm_x4(w_at + s * SLOT + 32 * st, f.w[st]);
#pragma unroll
    for (int sp = 0; sp < STEPS / 2; ++sp)
#pragma unroll
      for (int j = 0; j < MB; ++j) ldsm_x4(a_at + s * SLOT + 8 * j * GEMV_SEQ_ROW + 64 * sp, f.a[sp][j]);
  };
  float acc[MB][4] = {};  // each output's chain starts at 0.f
  // One slot ahead in registers: while the chain runs over slot i's fragments, slot i + 1's are
  // loaded, and slots i + 2 .. i + STAGES - 1 are in flight.
  auto step = [&](int i, const Frags& now, Frags& next) {
    cp_async_wait<STAGES - 3>();  // slot i + 1's copies (this thread's) have landed
    __syncthreads();              // ... and every thread's; slot i - 1's fragments were read
    if (i + STAGES - 1 < slots) stage(i + STAGES - 1, (i + STAGES - 1) % STAGES);
    cp_async_commit();
    if (warp != 0) return;  // one warp runs the chain (the other warps only copy)
    if (i + 1 < slots) load((i + 1) % STAGES, next);
    if ((i + 1) * GEMV_SEQ_KC <= k) {  // a whole slot: the chain with no branch inside
#pragma unroll
      for (int st = 0; st < STEPS; ++st)
#pragma unroll
        for (int j = 0; j < MB; ++j)
          mma_16816(acc[j], now.w[st][0], now.w[st][1], now.w[st][2], now.w[st][3],
                    now.a[st / 2][j][2 * (st & 1)], now.a[st / 2][j][2 * (st & 1) + 1]);
      return;
    }
    const int steps = (k - i * GEMV_SEQ_KC + 8) / 16;  // the last slot's slices (k % 8 == 0)
#pragma unroll
    for (int st = 0; st < STEPS; ++st) {
      if (st >= steps) break;  // warp-uniform
#pragma unroll
      for (int j = 0; j < MB; ++j)
        mma_16816(acc[j], now.w[st][0], now.w[st][1], now.w[st][2], now.w[st][3],
                  now.a[st / 2][j][2 * (st & 1)], now.a[st / 2][j][2 * (st & 1) + 1]);
    }
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < slots) stage(s, s);
    cp_async_commit();  // one group a slot, empty or not: the waits count groups
  }
  Frags fa, fb;
  cp_async_wait<STAGES - 2>();  // slot 0
  __syncthreads();
  if (warp == 0) load(0, fa);
  for (int i = 0; i < slots; i += 2) {
    step(i, fa, fb);
    if (i + 1 < slots) step(i + 1, fb, fa);
  }
  cp_async_wait<0>();  // only empty groups are left
  if (warp != 0) return;

#pragma unroll
  for (int j = 0; j < MB; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = row0 + g + (r >= 2 ? 8 : 0);
      const int col = 8 * j + 2 * t + (r & 1);
      if (row >= n || col >= m) continue;
      const size_t at = (size_t)(col0 + col) * n + row;
      if (mode == GEMV_F32) {
        reinterpret_cast<float*>(c)[at] = acc[j][r];
      } else {
        // cuBLASLt's epilogue: the sum rounded to bf16, then + C in f32 (beta = 1), rounded
        float sum = __bfloat162float(__float2bfloat16(acc[j][r]));
        bf16* out = reinterpret_cast<bf16*>(c);
        if (mode == GEMV_BF16_ACC) sum += __bfloat162float(out[at]);
        out[at] = __float2bfloat16(sum);
      }
    }
}

// gemv_bf16_tn_seq: one W tile a block, 4 warps (one runs the chain), 8 slots.
extern "C" __global__ void __launch_bounds__(128)
    gemv_bf16_tn_seq(const bf16* __restrict__ a, const bf16* __restrict__ w, void* __restrict__ c,
                     int m, int n, int k, int mode) {
  pdl_begin();
  gemv_seq_tile<1, 8, 4>(a, w, c, m, n, k, mode);
}
