// Module `attention`: causal grouped-query attention over a layer's paged KV state.
//
// Shared layout facts (see kv_cache.cu): packed qkv rows [q: nq*hd | k: nk*hd | v: nk*hd];
// KV slot s holds [K: nk*hd | V: nk*hd] bf16 at byte s*4*nk*hd; key j of a sequence lives in
// slot block_table[seq*width + j/16]*16 + j%16. Output rows are [nq*hd] bf16.
// Limits: hd % 8 == 0 and hd <= 128 (the prefill kernel: hd % 16 == 0); the prefill kernel
// needs 64 % (nq/nk) == 0, the decode kernel nq/nk <= 8. Softmax is the online (running max)
// form in f32, scale folded into log2.
#include "common.cuh"

#define MAX_WORDS 64  // bf16x2 words of one head (hd <= 128)
#define PAGE 16

__device__ __forceinline__ long long key_slot(const int* table_row, int key) {
  return (long long)table_row[key / PAGE] * PAGE + key % PAGE;
}

// ---------------------------------------------------------------------------------------------
// Prefill: one call = a chunk of `rows` consecutive rows of ONE sequence (block_table row 0)
// whose keys, including this chunk's own, are already in the state (kv_write runs first).
// Row r attends to keys 0..positions[r].
//
// Flash-attention-2 on tensor cores (mma.sync m16n8k16 bf16 -> f32, operands by ldmatrix).
// A block serves kv head blockIdx.y and 64 (row, q head) pairs: 64/G consecutive rows times
// the G q heads of that kv head (pair p = row_in_block * G + head_in_group), so every K/V
// tile it stages in shared memory serves 64 query vectors. Its 8 warps form two groups of 4;
// warp w of a group owns pairs 16w..16w+15 and group k takes key tiles k, k+2, k+4, ... (64
// keys each, double-buffered by cp.async, a named barrier per group). Each warp keeps Q in
// registers and runs its own online softmax (f32, scale folded into log2; P rounded to bf16
// for the PV product); at the end group 1 hands (m, l, O) to group 0 through shared memory
// and group 0 merges the two in a fixed order and writes the rows. Deterministic: no atomics,
// every sum in a fixed order.
// Limits: hd % 16 == 0, hd <= 128; 64 % G == 0.
// grid (ceil(rows / (64/G)), nk), block (256), dynamic shared memory PF_SMEM_ROWS * (2*hd+16)
// bytes = 576 * (2*hd + 16) (156672 for hd 128): Q [64 rows] | per group 2 stages of
// K [64 rows] + V [64 rows], each row hd bf16 plus 16 bytes of padding (so the 8 rows of an
// ldmatrix land in distinct banks).
#define PF_BM 64  // pairs per block
#define PF_BN 64  // keys per tile
#define PF_WARPS 8
#define PF_GROUP_THREADS 128
#define PF_SMEM_ROWS (PF_BM + 2 * 2 * 2 * PF_BN)

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a (16x16, row) * b (16x8, col); fragments as in the PTX ISA's m16n8k16 figures.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared; zero-fills the destination when !on (src is then not read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool on) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(dst), "l"(src), "r"(on ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// Barrier among the 128 threads of one warp group (ids 1 and 2; 0 is __syncthreads).
__device__ __forceinline__ void group_sync(int group) {
  asm volatile("bar.sync %0, %1;\n" :: "r"(1 + group), "n"(PF_GROUP_THREADS) : "memory");
}

__device__ __forceinline__ float fast_exp2(float x) {  // exp2(-inf) = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16x2_rn(float lo, float hi) {
  const bf162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
  uint32_t n;
  asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(n));
  return n;
}

// One warp's scores for one tile: s[j] = Q (16 pairs) x K^T (keys 8j..8j+7 of the tile).
template <int HD>
__device__ __forceinline__ void pf_scores(float (&s)[PF_BN / 8][4], const uint32_t (&qa)[HD / 16][4],
                                          uint32_t sk, int lane) {
  constexpr int RS = 2 * HD + 16;
  // ldmatrix x4 rows: keys 0-7 dims 0-7 | keys 0-7 dims 8-15 | keys 8-15 dims 0-7 | keys 8-15
  // dims 8-15, i.e. (b0, b1) of key tile 2jp then of 2jp+1.
  const uint32_t base = sk + ((lane & 7) + 8 * (lane >> 4)) * RS + 16 * ((lane >> 3) & 1);
#pragma unroll
  for (int j = 0; j < PF_BN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk)
#pragma unroll
    for (int jp = 0; jp < PF_BN / 16; ++jp) {
      uint32_t b[4];
      ldsm_x4(base + jp * 16 * RS + kk * 32, b);
      mma_bf16(s[2 * jp], qa[kk], b[0], b[1]);
      mma_bf16(s[2 * jp + 1], qa[kk], b[2], b[3]);
    }
}

// O += P (16 pairs x 64 keys, from the score registers) x V (64 keys x HD).
template <int HD>
__device__ __forceinline__ void pf_accumulate(float (&acc)[HD / 8][4],
                                              const float (&p)[PF_BN / 8][4], uint32_t sv,
                                              int lane) {
  constexpr int RS = 2 * HD + 16;
  // ldmatrix x4.trans rows: keys 0-7 dims 0-7 | keys 8-15 dims 0-7 | keys 0-7 dims 8-15 |
  // keys 8-15 dims 8-15, i.e. (b0, b1) of dim tile 2jd then of 2jd+1.
  const uint32_t base = sv + ((lane & 7) + 8 * ((lane >> 3) & 1)) * RS + 16 * (lane >> 4);
#pragma unroll
  for (int k2 = 0; k2 < PF_BN / 16; ++k2) {
    // The C fragments of key tiles 2k2, 2k2+1 are the A fragment of keys 16k2..16k2+15.
    const uint32_t a[4] = {pack_bf16x2_rn(p[2 * k2][0], p[2 * k2][1]),
                           pack_bf16x2_rn(p[2 * k2][2], p[2 * k2][3]),
                           pack_bf16x2_rn(p[2 * k2 + 1][0], p[2 * k2 + 1][1]),
                           pack_bf16x2_rn(p[2 * k2 + 1][2], p[2 * k2 + 1][3])};
#pragma unroll
    for (int jd = 0; jd < HD / 16; ++jd) {
      uint32_t b[4];
      ldsm_x4_trans(base + k2 * 16 * RS + jd * 32, b);
      mma_bf16(acc[2 * jd], a, b[0], b[1]);
      mma_bf16(acc[2 * jd + 1], a, b[2], b[3]);
    }
  }
}

template <int HD>
__device__ __forceinline__ void attn_prefill_tc(const bf16* __restrict__ qkv,
                                                const uint8_t* __restrict__ kv,
                                                const int* __restrict__ block_table,
                                                const int* __restrict__ positions,
                                                bf16* __restrict__ out, int rows, int nq, int nk,
                                                float scale, uint8_t* smem, int* s_kend) {
  constexpr int RS = 2 * HD + 16;        // shared row stride, bytes
  constexpr int CH = HD / 8;             // 16-byte chunks per row
  constexpr int ND = HD / 8;             // n tiles of O
  constexpr int STAGE = 2 * PF_BN * RS;  // K then V of one tile
  const int G = nq / nk, kvh = blockIdx.y, row0 = blockIdx.x * (PF_BM / G);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int group = warp >> 2, slab = warp & 3, gtid = tid & (PF_GROUP_THREADS - 1);
  const int g = lane >> 2, t = lane & 3;  // fragment row (and row + 8), column pair
  const long long qkv_stride = (long long)(nq + 2 * nk) * HD;
  const long long slot_bytes = 4LL * nk * HD;
  uint8_t* sq = smem;
  uint8_t* stages = smem + PF_BM * RS + group * 2 * STAGE;

  for (int c = tid; c < PF_BM * CH; c += PF_WARPS * 32) {
    const int p = c / CH, ch = c % CH, r = row0 + p / G;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r < rows)
      v = *reinterpret_cast<const uint4*>(qkv + r * qkv_stride + (kvh * G + p % G) * HD + ch * 8);
    *reinterpret_cast<uint4*>(sq + p * RS + ch * 16) = v;
  }
  if (warp == 0) {
    int mx = -1;
    for (int i = lane; i < PF_BM / G; i += 32)
      if (row0 + i < rows) mx = max(mx, positions[row0 + i]);
    mx = __reduce_max_sync(FULL_MASK, mx);
    if (lane == 0) *s_kend = mx + 1;
  }
  int pos[2];  // positions of this thread's fragment rows g and g+8; -1 past the chunk
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + (slab * 16 + g + 8 * h) / G;
    pos[h] = r < rows ? positions[r] : -1;
  }
  const int wmin = __reduce_min_sync(FULL_MASK, min(pos[0], pos[1]));
  const int wmax = __reduce_max_sync(FULL_MASK, max(pos[0], pos[1]));
  __syncthreads();
  const int kend = *s_kend;  // keys the block needs: 0 .. max position
  const int ntiles = (kend + PF_BN - 1) / PF_BN;

  uint32_t qa[HD / 16][4];
  {
    // ldmatrix x4 rows: pairs 0-7 dims 0-7 | pairs 8-15 dims 0-7 | pairs 0-7 dims 8-15 |
    // pairs 8-15 dims 8-15 = a0..a3.
    const int i = lane >> 3;
    const uint32_t base = smem_u32(sq + (slab * 16 + (lane & 7) + 8 * (i & 1)) * RS + 16 * (i >> 1));
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) ldsm_x4(base + kk * 32, qa[kk]);
  }

  // A group's thread stages chunks gtid, gtid+128, ... of the tile's K rows and V rows; keys
  // past kend are zero-filled (their page-table entries need not exist).
  auto load_tile = [&](int tile, int stage) {
    const uint32_t dst = smem_u32(stages + stage * STAGE);
#pragma unroll
    for (int i = 0; i < PF_BN * CH / PF_GROUP_THREADS; ++i) {
      const int c = gtid + i * PF_GROUP_THREADS, j = c / CH, ch = c % CH;
      const int key = tile * PF_BN + j;
      const bool on = key < kend;
      const uint8_t* k_src = kv;
      if (on) {
        const long long slot = (long long)block_table[key / PAGE] * PAGE + key % PAGE;
        k_src = kv + slot * slot_bytes + (long long)kvh * HD * 2 + ch * 16;
      }
      cp_async16(dst + j * RS + ch * 16, k_src, on);
      cp_async16(dst + (PF_BN + j) * RS + ch * 16, on ? k_src + (long long)nk * HD * 2 : kv, on);
    }
  };

  const float scale2 = scale * LOG2E;
  float acc[ND][4];
#pragma unroll
  for (int d = 0; d < ND; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[d][e] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // l: this thread's columns only

  if (group < ntiles) load_tile(group, 0);
  cp_async_commit();
  for (int it = 0, tile = group; tile < ntiles; ++it, tile += 2) {
    if (tile + 2 < ntiles) load_tile(tile + 2, (it + 1) & 1);
    cp_async_commit();
    cp_async_wait<1>();  // this tile's copies (all but the newest group) have landed
    group_sync(group);
    const int k0 = tile * PF_BN;
    if (k0 <= wmax) {  // warp-uniform: some pair of this warp sees a key of the tile
      const uint32_t sk = smem_u32(stages + (it & 1) * STAGE);
      float s[PF_BN / 8][4];
      pf_scores<HD>(s, qa, sk, lane);
      if (k0 + PF_BN - 1 > wmin) {  // some key of the tile is past some pair's position
#pragma unroll
        for (int j = 0; j < PF_BN / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (k0 + 8 * j + 2 * t + (e & 1) > pos[e >> 1]) s[j][e] = -INFINITY;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < PF_BN / 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
        const float mnew = fmaxf(m[h], mx);
        const float ms = mnew == -INFINITY ? 0.f : __fmul_rn(mnew, scale2);  // no key yet
        const float corr = fast_exp2(__fmul_rn(m[h], scale2) - ms);          // 0 from -inf
        m[h] = mnew;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < PF_BN / 8; ++j)
#pragma unroll
          for (int e = 2 * h; e < 2 * h + 2; ++e) {
            s[j][e] = fast_exp2(fmaf(s[j][e], scale2, -ms));
            sum += s[j][e];
          }
        l[h] = l[h] * corr + sum;
#pragma unroll
        for (int d = 0; d < ND; ++d) {
          acc[d][2 * h] *= corr;
          acc[d][2 * h + 1] *= corr;
        }
      }
      pf_accumulate<HD>(acc, s, sk + PF_BN * RS, lane);
    }
    group_sync(group);  // the stage is consumed before the next iteration refills it
  }
  cp_async_wait<0>();
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // whole-row sums, the same order on the quad's 4 lanes
    l[h] += __shfl_xor_sync(FULL_MASK, l[h], 1);
    l[h] += __shfl_xor_sync(FULL_MASK, l[h], 2);
  }

  // Group 1 hands its state to group 0 through its own stage buffers, laid out by thread so
  // that warp w+4's lane x lands with warp w's lane x (the same fragment positions).
  float* xch = reinterpret_cast<float*>(smem + PF_BM * RS + 2 * STAGE);
  const int xt = slab * 32 + lane;
  if (group == 1) {
#pragma unroll
    for (int d = 0; d < ND; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e) xch[(d * 4 + e) * PF_GROUP_THREADS + xt] = acc[d][e];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      xch[(ND * 4 + h) * PF_GROUP_THREADS + xt] = m[h];
      xch[(ND * 4 + 2 + h) * PF_GROUP_THREADS + xt] = l[h];
    }
  }
  __syncthreads();
  if (group == 1) return;

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float m1 = xch[(ND * 4 + h) * PF_GROUP_THREADS + xt];
    const float l1 = xch[(ND * 4 + 2 + h) * PF_GROUP_THREADS + xt];
    const float mx = fmaxf(m[h], m1);
    const float ms = mx == -INFINITY ? 0.f : __fmul_rn(mx, scale2);
    const float f0 = fast_exp2(__fmul_rn(m[h], scale2) - ms);  // 0 for a side with no key
    const float f1 = fast_exp2(__fmul_rn(m1, scale2) - ms);
    const float lsum = l[h] * f0 + l1 * f1;
    const int p = slab * 16 + g + 8 * h, r = row0 + p / G;
    if (r >= rows || !(lsum > 0.f)) continue;  // past the chunk
    const float inv = 1.f / lsum;
    uint32_t* o = reinterpret_cast<uint32_t*>(out + (long long)r * nq * HD +
                                              (long long)(kvh * G + p % G) * HD);
#pragma unroll
    for (int d = 0; d < ND; ++d) {
      const float o0 = acc[d][2 * h] * f0 + xch[(d * 4 + 2 * h) * PF_GROUP_THREADS + xt] * f1;
      const float o1 =
          acc[d][2 * h + 1] * f0 + xch[(d * 4 + 2 * h + 1) * PF_GROUP_THREADS + xt] * f1;
      o[(8 * d + 2 * t) / 2] = pack_bf16x2(o0 * inv, o1 * inv);
    }
  }
}

extern "C" __global__ void __launch_bounds__(PF_WARPS * 32, 1)
attn_prefill_bf16(const bf16* __restrict__ qkv, const uint8_t* __restrict__ kv,
                  const int* __restrict__ block_table, const int* __restrict__ positions,
                  bf16* __restrict__ out, int rows, int nq, int nk, int hd, int width,
                  float scale) {
  extern __shared__ __align__(16) uint8_t pf_smem[];
  __shared__ int s_kend;
  (void)width;  // one sequence: its table row is row 0
  if (dynamic_smem_bytes() < (uint32_t)(PF_SMEM_ROWS * (2 * hd + 16))) __trap();
  switch (hd) {
#define PF_CASE(HD)                                                                        \
  case HD:                                                                                 \
    attn_prefill_tc<HD>(qkv, kv, block_table, positions, out, rows, nq, nk, scale, pf_smem, \
                        &s_kend);                                                          \
    break;
    PF_CASE(16) PF_CASE(32) PF_CASE(48) PF_CASE(64) PF_CASE(80) PF_CASE(96) PF_CASE(112)
    PF_CASE(128)
#undef PF_CASE
    default:
      __trap();  // hd must be a multiple of 16 up to 128
  }
}

// ---------------------------------------------------------------------------------------------
// Decode: one row per sequence; row b is sequence b (block_table row b) and attends to keys
// 0..seq_lens[b]-1 (its own key included). A block serves (kv head blockIdx.x, sequence
// blockIdx.y) for all G q heads; warp w takes keys w, w+8, ... (one coalesced K and V row per
// key, a warp reduction per q head) and the 8 partial softmaxes are merged at the end.
// grid (nk, seqs), block (256).
#define DC_WARPS 8
#define DC_MAX_G 8

extern "C" __global__ void __launch_bounds__(DC_WARPS * 32)
attn_decode_bf16(const bf16* __restrict__ qkv, const uint8_t* __restrict__ kv,
                 const int* __restrict__ block_table, const int* __restrict__ seq_lens,
                 bf16* __restrict__ out, int seqs, int nq, int nk, int hd, int width,
                 float scale) {
  __shared__ float sm[DC_WARPS], sl[DC_WARPS];
  __shared__ float sacc[DC_WARPS][2 * MAX_WORDS];

  const int G = nq / nk, W = hd / 2;
  const int kvh = blockIdx.x, b = blockIdx.y;
  if (b >= seqs) return;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int len = seq_lens[b];
  const int* table_row = block_table + (long long)b * width;
  const long long token_words = (long long)nk * hd;
  const float scale2 = scale * LOG2E;

  float2 q[DC_MAX_G][2];
  float m[DC_MAX_G], l[DC_MAX_G];
  float2 acc[DC_MAX_G][2];
  const uint32_t* qrow = reinterpret_cast<const uint32_t*>(qkv + (long long)b * (nq + 2 * nk) * hd);
#pragma unroll
  for (int g = 0; g < DC_MAX_G; ++g) {
    m[g] = -INFINITY; l[g] = 0.f;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int a = lane + 32 * t;
      q[g][t] = (g < G && a < W) ? unpack_bf16x2(qrow[(kvh * G + g) * W + a])
                                 : make_float2(0.f, 0.f);
      acc[g][t] = make_float2(0.f, 0.f);
    }
  }

  for (int j = warp; j < len; j += DC_WARPS) {
    const uint32_t* slot =
        reinterpret_cast<const uint32_t*>(kv) + key_slot(table_row, j) * token_words;
    float2 k[2], v[2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int a = lane + 32 * t;
      const bool on = a < W;
      k[t] = on ? unpack_bf16x2(slot[kvh * W + a]) : make_float2(0.f, 0.f);
      v[t] = on ? unpack_bf16x2(slot[token_words / 2 + kvh * W + a]) : make_float2(0.f, 0.f);
    }
#pragma unroll
    for (int g = 0; g < DC_MAX_G; ++g) {
      if (g >= G) break;
      float s = 0.f;
#pragma unroll
      for (int t = 0; t < 2; ++t) s += q[g][t].x * k[t].x + q[g][t].y * k[t].y;
      s = warp_sum(s) * scale2;
      const float mnew = fmaxf(m[g], s);
      const float corr = exp2f(m[g] - mnew), pr = exp2f(s - mnew);
      l[g] = l[g] * corr + pr;
      m[g] = mnew;
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        acc[g][t].x = acc[g][t].x * corr + pr * v[t].x;
        acc[g][t].y = acc[g][t].y * corr + pr * v[t].y;
      }
    }
  }

  // Merge the warps' partial softmaxes, one q head at a time.
  uint32_t* orow = reinterpret_cast<uint32_t*>(out + (long long)b * nq * hd);
#pragma unroll
  for (int g = 0; g < DC_MAX_G; ++g) {
    if (g >= G) break;
    __syncthreads();  // the previous head's merge has read sacc
    if (lane == 0) { sm[warp] = m[g]; sl[warp] = l[g]; }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int a = lane + 32 * t;
      if (a < W) { sacc[warp][2 * a] = acc[g][t].x; sacc[warp][2 * a + 1] = acc[g][t].y; }
    }
    __syncthreads();
    if (tid < W) {
      float mx = -INFINITY;
      for (int w = 0; w < DC_WARPS; ++w) mx = fmaxf(mx, sm[w]);
      float lsum = 0.f, o0 = 0.f, o1 = 0.f;
      for (int w = 0; w < DC_WARPS; ++w) {
        const float f = sm[w] == -INFINITY ? 0.f : exp2f(sm[w] - mx);  // a warp with no key
        lsum += sl[w] * f;
        o0 += sacc[w][2 * tid] * f;
        o1 += sacc[w][2 * tid + 1] * f;
      }
      const float inv = lsum > 0.f ? 1.f / lsum : 0.f;  // len == 0 gives zeros, not NaN
      orow[(kvh * G + g) * W + tid] = pack_bf16x2(o0 * inv, o1 * inv);
    }
  }
}
