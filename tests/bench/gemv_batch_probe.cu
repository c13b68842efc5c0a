// Probes for the batched decode GEMMs (m = 9..32 rows of A; issue 20's 8- and 32-sequence
// steps), built by tests/bench/gemv_batch_probe.py with nvcc. kernels/gemv.cu's tile gives each
// warp one 16-row tile of W, so at m = 32 a block reads twice as many bytes of A (from L2) as of
// W, and its A loads sit in the loop's critical path; there cuBLAS is twice as fast. The probes
// vary what a warp holds:
//   R  16-row tiles of W a warp takes (its A fragments serve all R: A traffic / R),
//   U  32-wide k chunks in flight a round (registers: 16 U R for W),
//   P  whether the next round's A is loaded with its W (one round ahead, like W),
//   S  k split over S blocks, their f32 partials added in split order by the last to finish
//      (a counter a tile, reset by that block), for the shapes with few tiles (n = 2048),
// with WARPS warps over k as in gemv.cu (warp w takes chunks w, w + WARPS, ...). Full tiles and
// k a whole number of rounds only (the probe's shapes); C = bf16(acc) or bf16(C + acc).
#include "../../kernels/gemv.cuh"

template <int MB, int WARPS, int U, int R, int S, bool P>
__device__ __forceinline__ void tile(const bf16* __restrict__ a, const bf16* __restrict__ w,
                                     bf16* __restrict__ c, float* __restrict__ ws,
                                     unsigned* __restrict__ counts, int m, int n, int k, int acc_c) {
  constexpr int THREADS = 32 * WARPS;
  constexpr int STEP = 32 * WARPS;
  __shared__ float partial[WARPS][MB * 4][32];
  __shared__ unsigned last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16 * R;
  const int ks = k / S, k0 = blockIdx.y * ks;
  const uint4 zero = make_uint4(0, 0, 0, 0);

  const bf16* pw[R][2];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    pw[r][0] = w + (size_t)(row0 + 16 * r + g) * k + k0 + 8 * t + 32 * warp;
    pw[r][1] = pw[r][0] + (size_t)8 * k;
  }
  const bf16* pa[MB];
  bool a_ok[MB];
#pragma unroll
  for (int j = 0; j < MB; ++j) {
    a_ok[j] = 8 * j + g < m;
    pa[j] = a + (size_t)(8 * j + g) * k + k0 + 8 * t + 32 * warp;
  }
  float acc[R][MB][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < MB; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[r][j][q] = 0.f;

  uint4 wn[U][R][2];
  uint4 an[U][MB];
  auto load_w = [&]() {  // the round's W at pw
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) wn[u][r][h] = load_stream(pw[r][h] + STEP * u);
  };
  auto load_a = [&](uint4 (&into)[U][MB]) {  // the round's A at pa
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < MB; ++j)
        into[u][j] = a_ok[j] ? __ldg((const uint4*)(pa[j] + STEP * u)) : zero;
  };
  load_w();
  if (P) load_a(an);
  for (int left = ks / (STEP * U); left > 0; --left) {
    uint4 act[U][MB], wc[U][R][2];
    if (P) {
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int j = 0; j < MB; ++j) act[u][j] = an[u][j];
    } else {
      load_a(act);
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) wc[u][r][h] = wn[u][r][h];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      pw[r][0] += STEP * U;
      pw[r][1] += STEP * U;
    }
#pragma unroll
    for (int j = 0; j < MB; ++j) pa[j] += STEP * U;
    if (left > 1) {
      load_w();
      if (P) load_a(an);
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) chunk_mma<MB>(acc[r], wc[u][r][0], wc[u][r][1], act[u]);
  }

  if (S > 1 && threadIdx.x == 0) last = 0;
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int j = 0; j < MB; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) partial[warp][j * 4 + q][lane] = acc[r][j][q];
    __syncthreads();
    for (int i = threadIdx.x; i < MB * 4 * 32; i += THREADS) {
      const int s = i >> 5, l = i & 31;
      float sum = 0.f;
#pragma unroll
      for (int v = 0; v < WARPS; ++v) sum += partial[v][s][l];
      const int j = s >> 2, q = s & 3;
      const int row = row0 + 16 * r + (l >> 2) + (q >= 2 ? 8 : 0);
      const int col = 8 * j + 2 * (l & 3) + (q & 1);
      if (col >= m) continue;
      const size_t at = (size_t)col * n + row;
      if (S == 1) {
        if (acc_c) sum += __bfloat162float(c[at]);
        c[at] = __float2bfloat16(sum);
      } else {
        __stcg(ws + (size_t)blockIdx.y * 32 * n + at, sum);
      }
    }
    __syncthreads();
  }
  if (S == 1) return;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counts + blockIdx.x, 1u) == S - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int i = threadIdx.x; i < 16 * R * m; i += THREADS) {
    const int col = i / (16 * R), row = row0 + i % (16 * R);
    const size_t at = (size_t)col * n + row;
    float sum = 0.f;
#pragma unroll
    for (int s = 0; s < S; ++s) sum += __ldcg(ws + (size_t)s * 32 * n + at);
    if (acc_c) sum += __bfloat162float(c[at]);
    c[at] = __float2bfloat16(sum);
  }
  if (threadIdx.x == 0) counts[blockIdx.x] = 0;
}

#define PROBE(NAME, MB, WARPS, U, R, S, P)                                                   \
  extern "C" __global__ void __launch_bounds__(32 * WARPS)                                   \
      NAME(const bf16* __restrict__ a, const bf16* __restrict__ w, bf16* __restrict__ c,     \
           float* __restrict__ ws, unsigned* __restrict__ counts, int m, int n, int k,       \
           int acc_c) {                                                                      \
    pdl_begin();                                                                             \
    tile<MB, WARPS, U, R, S, P>(a, w, c, ws, counts, m, n, k, acc_c);                        \
  }

// name: b<MB>_w<WARPS>_u<U>_r<R>_s<S>[p]
PROBE(b4_w8_u4_r1_s1, 4, 8, 4, 1, 1, false)  // kernels/gemv.cu's mb4, for reference
PROBE(b4_w8_u2_r2_s1, 4, 8, 2, 2, 1, false)
PROBE(b4_w8_u2_r2_s1p, 4, 8, 2, 2, 1, true)
PROBE(b4_w8_u1_r4_s1, 4, 8, 1, 4, 1, false)
PROBE(b4_w8_u1_r2_s1, 4, 8, 1, 2, 1, false)
PROBE(b4_w8_u1_r2_s1p, 4, 8, 1, 2, 1, true)
PROBE(b4_w4_u2_r2_s1, 4, 4, 2, 2, 1, false)
PROBE(b4_w4_u2_r2_s1p, 4, 4, 2, 2, 1, true)
PROBE(b4_w16_u1_r2_s1, 4, 16, 1, 2, 1, false)
PROBE(b4_w8_u2_r2_s2, 4, 8, 2, 2, 2, false)
PROBE(b4_w8_u2_r2_s4, 4, 8, 2, 2, 4, false)
PROBE(b4_w8_u2_r1_s2, 4, 8, 2, 1, 2, false)
PROBE(b4_w8_u2_r1_s2p, 4, 8, 2, 1, 2, true)
PROBE(b4_w4_u2_r2_s2, 4, 4, 2, 2, 2, false)
PROBE(b4_w4_u2_r2_s4, 4, 4, 2, 2, 4, false)
PROBE(b2_w8_u4_r1_s1, 2, 8, 4, 1, 1, false)  // kernels/gemv.cu's mb2
PROBE(b2_w8_u2_r2_s1, 2, 8, 2, 2, 1, false)
PROBE(b2_w8_u2_r2_s1p, 2, 8, 2, 2, 1, true)
PROBE(b2_w8_u4_r2_s1, 2, 8, 4, 2, 1, false)
PROBE(b2_w4_u2_r2_s1, 2, 4, 2, 2, 1, false)
PROBE(b2_w8_u2_r2_s2, 2, 8, 2, 2, 2, false)
PROBE(b2_w8_u4_r1_s2, 2, 8, 4, 1, 2, false)
