// Module `attention`: causal grouped-query attention over a layer's paged KV state.
//
// Shared layout facts (see kv_cache.cu): packed qkv rows [q: nq*hd | k: nk*hd | v: nk*hd];
// KV slot s holds [K: nk*hd | V: nk*hd] bf16 at byte s*4*nk*hd; key j of a sequence lives in
// slot block_table[seq*width + j/16]*16 + j%16. Output rows are [nq*hd] bf16.
// Limits: hd % 16 == 0 and hd <= 128; the prefill kernel needs 64 % (nq/nk) == 0, the decode
// kernels nq/nk in {1, 2, 4, 8}. Softmax is the online (running max) form in f32, scale folded
// into log2.
#include "tc.cuh"

#define PAGE 16

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

// Barrier among the 128 threads of one warp group (ids 1 and 2; 0 is __syncthreads).
__device__ __forceinline__ void group_sync(int group) {
  asm volatile("bar.sync %0, %1;\n" :: "r"(1 + group), "n"(PF_GROUP_THREADS) : "memory");
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
  pdl_begin();
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

// Packed prefill: one call = chunks of `seqs` sequences laid end to end, sequence s's rows
// [cu_seqlens[s], cu_seqlens[s+1]) with its page-table row s (block_table + s*width). Block z
// serves sequence z exactly as attn_prefill_bf16 serves a one-sequence chunk (same blocks over
// the same rows, so a sequence's bits do not depend on what it is packed with); blocks past a
// sequence's rows return at once.
// grid (ceil(rows / (64/G)), nk, seqs), block (256), dynamic shared memory as attn_prefill_bf16.
extern "C" __global__ void __launch_bounds__(PF_WARPS * 32, 1)
attn_prefill_varlen_bf16(const bf16* __restrict__ qkv, const uint8_t* __restrict__ kv,
                         const int* __restrict__ block_table, const int* __restrict__ positions,
                         const int* __restrict__ cu_seqlens, bf16* __restrict__ out, int rows,
                         int seqs, int nq, int nk, int hd, int width, float scale) {
  pdl_begin();
  extern __shared__ __align__(16) uint8_t pf_smem[];
  __shared__ int s_kend;
  if (dynamic_smem_bytes() < (uint32_t)(PF_SMEM_ROWS * (2 * hd + 16))) __trap();
  const int seq = blockIdx.z;
  if (seq >= seqs) return;
  const int start = cu_seqlens[seq], len = min(cu_seqlens[seq + 1], rows) - start;
  if ((int)blockIdx.x * (PF_BM / (nq / nk)) >= len) return;  // the whole block: no barrier hit
  const long long row_elems = (long long)(nq + 2 * nk) * hd;
  const bf16* q = qkv + start * row_elems;
  const int* table = block_table + (long long)seq * width;
  bf16* o = out + (long long)start * nq * hd;
  switch (hd) {
#define PFV_CASE(HD)                                                                        \
  case HD:                                                                                  \
    attn_prefill_tc<HD>(q, kv, table, positions + start, o, len, nq, nk, scale, pf_smem,   \
                        &s_kend);                                                           \
    break;
    PFV_CASE(16) PFV_CASE(32) PFV_CASE(48) PFV_CASE(64) PFV_CASE(80) PFV_CASE(96) PFV_CASE(112)
    PFV_CASE(128)
#undef PFV_CASE
    default:
      __trap();  // hd must be a multiple of 16 up to 128
  }
}

// ---------------------------------------------------------------------------------------------
// Decode: one row per sequence; row b is sequence b (block_table row b) and attends to keys
// 0..seq_lens[b]-1 (its own key included). Flash-decoding in two launches that share the f32
// workspace `part` (seqs * nq * max_splits * (hd + 2) floats); deterministic: no atomics, every
// merge in a fixed order.
// 1. attn_decode_split_bf16 (CUDA cores, any hd) or attn_decode_split_tc_bf16 (tensor cores,
//    hd % 32 == 0; the same function, other bits): split s of sequence b covers keys
//    [s*DC_SPLIT, (s+1)*DC_SPLIT)
//    and writes, per q head h, the softmax partial of those keys to the entry
//    part + ((b*nq + h)*max_splits + s)*(hd + 2) = [m | l | o[0..hd)]: m the largest score in
//    log2 units (score = q.k * scale * log2 e), l = sum 2^(score - m), o = sum 2^(score - m) v
//    (unnormalised). Entries of splits past the sequence are not written.
// 2. attn_decode_combine_bf16: merges the entries of splits 0..ceil(len/DC_SPLIT)-1 in order,
//    row = bf16(O / L) with O = sum_s o_s 2^(m_s - M), L = sum_s l_s 2^(m_s - M), M = max m_s;
//    an empty sequence (len <= 0) writes zeros.
// max_splits * DC_SPLIT must cover the longest sequence (keys past it are not attended).
#include "attention_split.cuh"

// One split block. KL lanes (hd/8 rounded up to a power of 2) hold one key: 16 bytes of its K
// row and of its V row each, dims 8c..8c+7 on lane c of the group; a warp holds 32/KL keys, the
// block DC_KPS = 8*32/KL keys per step. Each thread issues the loads of U keys before it uses
// any, then updates its key group's running softmax per q head once per U keys. At the end the
// key groups of a warp merge by butterfly (xor KL, 2KL, ..., 16), and the 8 warps' partials
// merge in warp order through shared memory.
template <int HD, int G>
__device__ __forceinline__ void attn_decode_split(const bf16* __restrict__ qkv,
                                                  const uint8_t* __restrict__ kv,
                                                  const int* __restrict__ table_row, int len,
                                                  int split, float* __restrict__ part, int nq,
                                                  int nk, int max_splits, float scale, int* s_pages,
                                                  uint4* s_q, float* s_stats, float* s_acc) {
  constexpr int C = HD / 8;  // 16-byte chunks of one head's row
  constexpr int KL = C <= 2 ? 2 : C <= 4 ? 4 : C <= 8 ? 8 : 16;
  constexpr int KPW = 32 / KL, KPS = DC_WARPS * KPW, STEPS = DC_SPLIT / KPS;
  constexpr int UMAX = G <= 2 ? 8 : 16 / G;  // keys in flight per thread (registers bound it)
  constexpr int U = STEPS < UMAX ? STEPS : UMAX;
  static_assert(STEPS % U == 0 && DC_SPLIT % PAGE == 0, "a split is whole batches and pages");
  const int b = blockIdx.x, kvh = blockIdx.y;
  const int k0 = split * DC_SPLIT, kend = min(len, k0 + DC_SPLIT);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int kg = lane / KL, c = lane % KL;
  const bool chunk_on = c < C;
  const long long slot_bytes = 4LL * nk * HD;

  if (tid < DC_SPLIT / PAGE && k0 + tid * PAGE < kend) s_pages[tid] = table_row[k0 / PAGE + tid];
  // The G q rows of this kv head, contiguous in the qkv row, staged in shared memory.
  const uint4* qrow = reinterpret_cast<const uint4*>(qkv + (long long)b * (nq + 2 * nk) * HD +
                                                     (long long)kvh * G * HD);
  for (int i = tid; i < G * C; i += DC_WARPS * 32) s_q[i] = qrow[i];
  __syncthreads();

  const float scale2 = scale * LOG2E;
  float m[G], l[G], acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int d = 0; d < 8; ++d) acc[g][d] = 0.f;
  }

  for (int i0 = 0; i0 < STEPS; i0 += U) {
    if (k0 + i0 * KPS >= kend) break;  // block-uniform: the rest of the split is past the end
    uint4 kr[U], vr[U];
    bool on[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = (i0 + u) * KPS + warp * KPW + kg;  // key within the split
      on[u] = k0 + j < kend;
      kr[u] = make_uint4(0u, 0u, 0u, 0u);
      vr[u] = kr[u];
      if (on[u] && chunk_on) {
        const long long slot = (long long)s_pages[j / PAGE] * PAGE + j % PAGE;
        const uint4* src = reinterpret_cast<const uint4*>(kv + slot * slot_bytes +
                                                          (long long)kvh * HD * 2 + c * 16);
        kr[u] = __ldg(src);
        vr[u] = __ldg(src + (long long)nk * HD / 8);
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const uint4 q = chunk_on ? s_q[g * C + c] : make_uint4(0u, 0u, 0u, 0u);
      float s[U];
#pragma unroll
      for (int u = 0; u < U; ++u) s[u] = dot_bf16x8(q, kr[u]);
#pragma unroll
      for (int o = KL / 2; o > 0; o >>= 1)  // butterfly within the key group: same bits on all
#pragma unroll
        for (int u = 0; u < U; ++u) s[u] += __shfl_xor_sync(FULL_MASK, s[u], o);
      float mx = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        s[u] = on[u] ? s[u] * scale2 : -INFINITY;
        mx = fmaxf(mx, s[u]);
      }
      const float ms = mx == -INFINITY ? 0.f : mx;  // no key yet
      const float corr = fast_exp2(m[g] - ms);       // 0 from -inf
      m[g] = mx;
      l[g] *= corr;
#pragma unroll
      for (int d = 0; d < 8; ++d) acc[g][d] *= corr;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float p = fast_exp2(s[u] - ms);
        l[g] += p;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 v = unpack_bf16x2(word_at(vr[u], i));
          acc[g][2 * i] = fmaf(p, v.x, acc[g][2 * i]);
          acc[g][2 * i + 1] = fmaf(p, v.y, acc[g][2 * i + 1]);
        }
      }
    }
  }

  // Key groups of the warp, by butterfly: lanes 0..KL-1 end with the warp's partial.
#pragma unroll
  for (int o = KL; o < 32; o <<= 1)
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float other[8];
#pragma unroll
      for (int d = 0; d < 8; ++d) other[d] = __shfl_xor_sync(FULL_MASK, acc[g][d], o);
      const float mo = __shfl_xor_sync(FULL_MASK, m[g], o);
      const float lo = __shfl_xor_sync(FULL_MASK, l[g], o);
      merge_partial(m[g], l[g], acc[g], mo, lo, other);
    }
  if (lane < KL) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (lane == 0) {
        s_stats[(warp * G + g) * 2] = m[g];
        s_stats[(warp * G + g) * 2 + 1] = l[g];
      }
      if (chunk_on) {
        float4* dst = reinterpret_cast<float4*>(s_acc + (warp * G + g) * HD + c * 8);
        dst[0] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
        dst[1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
      }
    }
  }
  __syncthreads();

  write_split_partial<HD, G>(part, nq, max_splits, split, s_stats, s_acc);
}

// The split loop of one block at head dim hd: on CUDA cores (attn_decode_split), or with TC on
// tensor cores (attn_decode_split_tc, hd % 32 == 0).
template <int G, bool TC>
__device__ __forceinline__ void attn_decode_split_hd(int hd, const bf16* qkv, const uint8_t* kv,
                                                     const int* table_row, int len, float* part,
                                                     int nq, int nk, int max_splits, float scale,
                                                     int* s_pages, uint4* s_q, float* s_stats,
                                                     float* s_acc) {
  switch (hd) {
#define DC_CASE(HD)                                                                        \
  case HD:                                                                                 \
    if constexpr (TC && HD % 32 != 0) {                                                    \
      __trap(); /* the tensor-core kernel takes hd % 32 == 0 */                            \
    } else {                                                                               \
      for (int split = blockIdx.z; split < max_splits && split * DC_SPLIT < len;           \
           split += gridDim.z) {                                                           \
        if constexpr (TC)                                                                  \
          attn_decode_split_tc<HD, G>(qkv, kv, table_row, len, split, part, nq, nk,        \
                                      max_splits, scale, s_pages, s_q, s_stats, s_acc);    \
        else                                                                               \
          attn_decode_split<HD, G>(qkv, kv, table_row, len, split, part, nq, nk,           \
                                   max_splits, scale, s_pages, s_q, s_stats, s_acc);       \
        __syncthreads(); /* the shared staging is the next split's */                      \
      }                                                                                    \
    }                                                                                      \
    break;
    DC_CASE(16) DC_CASE(32) DC_CASE(48) DC_CASE(64) DC_CASE(80) DC_CASE(96) DC_CASE(112)
    DC_CASE(128)
#undef DC_CASE
    default:
      __trap();  // hd must be a multiple of 16 up to 128
  }
}

// The body of both split entries (after pdl_begin): a block's shared staging, its sequence,
// the head group's kernel.
template <bool TC>
__device__ __forceinline__ void attn_decode_split_entry(const bf16* __restrict__ qkv,
                                                        const uint8_t* __restrict__ kv,
                                                        const int* __restrict__ block_table,
                                                        const int* __restrict__ seq_lens,
                                                        float* __restrict__ part, int seqs, int nq,
                                                        int nk, int hd, int width,
                                                        int max_splits, float scale) {
  __shared__ __align__(16) float s_acc[DC_WARPS * DC_MAX_G * DC_MAX_HD];
  __shared__ uint4 s_q[DC_MAX_G * DC_MAX_HD / 8];
  __shared__ float s_stats[DC_WARPS * DC_MAX_G * 2];
  __shared__ int s_pages[DC_SPLIT / PAGE];
  const int b = blockIdx.x;
  if (b >= seqs) return;
  const int* table_row = block_table + (long long)b * width;
  const int len = seq_lens[b];
  switch (nq == nk * (nq / nk) ? nq / nk : 0) {
#define DC_GROUP(G)                                                                           \
  case G:                                                                                     \
    attn_decode_split_hd<G, TC>(hd, qkv, kv, table_row, len, part, nq, nk, max_splits, scale, \
                                s_pages, s_q, s_stats, s_acc);                                \
    break;
    DC_GROUP(1) DC_GROUP(2) DC_GROUP(4) DC_GROUP(8)
#undef DC_GROUP
    default:
      __trap();  // nq/nk must be 1, 2, 4 or 8
  }
}

// Limits: hd % 16 == 0, hd <= 128; G = nq/nk is 1, 2, 4 or 8.
// grid (seqs, nk, Z), block (256): block z takes splits z, z + Z, ... of its sequence that start
// before its length (and below max_splits), each exactly as a block of its own would, so the
// bits do not depend on Z. Z = max_splits gives a block per split (most exit at once when the
// sequences are short); a smaller Z launches fewer blocks that loop (the batched decode: at 32
// sequences of 512 keys and Z = max_splits = 32, seven in eight blocks only exit).
extern "C" __global__ void __launch_bounds__(DC_WARPS * 32, 2)
attn_decode_split_bf16(const bf16* __restrict__ qkv, const uint8_t* __restrict__ kv,
                       const int* __restrict__ block_table, const int* __restrict__ seq_lens,
                       float* __restrict__ part, int seqs, int nq, int nk, int hd, int width,
                       int max_splits, float scale) {
  pdl_begin();
  attn_decode_split_entry<false>(qkv, kv, block_table, seq_lens, part, seqs, nq, nk, hd, width,
                                 max_splits, scale);
}

// attn_decode_split_bf16's function on tensor cores (attn_decode_split_tc above), for hd a
// multiple of 32 up to 128; the same ABI, grid and partials, other bits. Two blocks a
// multiprocessor, as the CUDA-core kernel: measured on an H200 (docs/benchmarks.md), bounds of
// three and four blocks (80 and 64 registers) made it 3-18% slower.
extern "C" __global__ void __launch_bounds__(DC_WARPS * 32, 2)
attn_decode_split_tc_bf16(const bf16* __restrict__ qkv, const uint8_t* __restrict__ kv,
                          const int* __restrict__ block_table, const int* __restrict__ seq_lens,
                          float* __restrict__ part, int seqs, int nq, int nk, int hd, int width,
                          int max_splits, float scale) {
  pdl_begin();
  attn_decode_split_entry<true>(qkv, kv, block_table, seq_lens, part, seqs, nq, nk, hd, width,
                                max_splits, scale);
}

// grid (seqs, nq), block (128): thread d writes dim d of q head blockIdx.y (hd <= 128). Each
// warp finds M by a butterfly max (exact in any order); every thread then weighs the splits
// itself, in split order, so the weights agree bit for bit across threads.
extern "C" __global__ void __launch_bounds__(DC_MAX_HD)
attn_decode_combine_bf16(const float* __restrict__ part, const int* __restrict__ seq_lens,
                         bf16* __restrict__ out, int seqs, int nq, int hd, int max_splits) {
  pdl_begin();
  const int b = blockIdx.x, h = blockIdx.y, d = threadIdx.x, lane = threadIdx.x & 31;
  if (b >= seqs) return;
  const int len = seq_lens[b];
  const int n = len <= 0 ? 0 : min((len + DC_SPLIT - 1) / DC_SPLIT, max_splits);
  const long long stride = hd + 2;
  const float* e = part + ((long long)b * nq + h) * max_splits * stride;
  float mx = -INFINITY;
  for (int s = lane; s < n; s += 32) mx = fmaxf(mx, e[s * stride]);
  mx = warp_max(mx);
  const bool on = d < hd;  // lanes past hd still take part in the warp max
  float lsum = 0.f, o = 0.f;
#pragma unroll 8
  for (int s = 0; s < n; ++s) {
    const float f = fast_exp2(e[s * stride] - mx);
    lsum += e[s * stride + 1] * f;
    o += (on ? e[s * stride + 2 + d] : 0.f) * f;
  }
  const float inv = lsum > 0.f ? 1.f / lsum : 0.f;  // len == 0 gives zeros, not NaN
  if (on) out[((long long)b * nq + h) * hd + d] = __float2bfloat16(o * inv);
}

// ---------------------------------------------------------------------------------------------
// The tensor-core split pipelined across a block's splits (attn_decode_split_pipe_tc_bf16): the
// ABI, grid and partials of attn_decode_split_tc_bf16, bit for bit, for any Z. A block of
// attn_decode_split_tc_bf16 works through its splits one after the other, each a serial chain
// (page-table entries, then K and V loads, then the mma's, then the partial's stores), so with
// few blocks a multiprocessor the KV stream idles between splits. Here a block brings the K and
// V rows of its next splits into shared memory by cp.async while it computes the current one.
//
// Each warp keeps its own ring of DP slots (dp_slots below), each slot one 16-key tile (16 x hd
// bf16) of K or of V. A warp only ever reads its own 16 keys of a split (keys 16w..16w+15: one
// page-table entry, PAGE == 16), so it loads its own tiles and synchronises with its own lanes
// only (cp.async.wait_group + __syncwarp); the block meets only where the split kernel's warps
// meet, at the merge of their partials. The tiles go through the ring in the order K of split 0,
// V of split 0, K of split 1, ...: tile i in slot i % DP; the first DP are issued up front, and
// once the warp has read tile i (its scores from K, or its products with V) it issues tile
// i + DP into the same slot, so DP - 1 tiles stay in flight while one is computed. The warp's
// page-table entries for 32 of the block's splits at a time sit in a register a lane.
// * K: chunk c of row r at chunk c ^ ((r & 1) * KSWZ), KSWZ = 4 where a row is a whole number of
//   128-byte lines (hd 64, 128), else 0 (hd 32, 96: odd rows already start half a line on).
//   Lane (g, t) reads 16 bytes of rows g and g + 8 at chunk 4c + t (the registers the split
//   kernel __ldg's): the 8 lanes of each quarter warp cover rows 2p, 2p + 1 x 4 chunks, all
//   eight 16-byte bank groups once, so the reads are conflict free.
// * V: the split kernel's tile layout (chunk c of row r at c ^ (r & SWZ)) and ldmatrix.trans.
// Rows past the sequence are zero-filled and score -inf, as in the split kernel; a warp with no
// key in a split loads nothing and writes an empty partial. The partials then merge in warp
// order through s_acc (write_split_partial), two barriers a split, as in the split kernel.
//
// Dynamic shared memory, dp_smem_bytes(hd, G): ring (8 warps x DP slots x 32 * hd bytes) |
// s_acc (8 x G x hd f32) | q (G x hd bf16) | stats (8 x G x 2 f32). DP is the most slots (at
// most DP_MAX_SLOTS: three splits) that let two blocks share a multiprocessor, or, where that
// leaves fewer than three, the most one block may take (hd 128, G 4 and 8). kerncc.runtime.
// backends.attention_pipe.shared_bytes computes the same on the host.
#define DP_MAX_SLOTS 6
#define DP_SM_SHARED 233472        // shared memory of an sm_90 multiprocessor (228 KiB)
#define DP_BLOCK_RESERVED 1024     // the driver's reserve per block
#define DP_BLOCK_SHARED_MAX 232448 // the most one block may take (227 KiB)

__host__ __device__ constexpr int dp_fixed_bytes(int hd, int g) {  // s_acc, q, stats
  return DC_WARPS * g * hd * 4 + g * hd * 2 + DC_WARPS * g * 2 * 4;
}

__host__ __device__ constexpr int dp_slot_bytes(int hd) { return DC_WARPS * 16 * hd * 2; }

__host__ __device__ constexpr int dp_slots(int hd, int g) {
  const int two = (DP_SM_SHARED / 2 - DP_BLOCK_RESERVED - dp_fixed_bytes(hd, g)) /
                  dp_slot_bytes(hd);  // two blocks a multiprocessor
  const int one = (DP_BLOCK_SHARED_MAX - dp_fixed_bytes(hd, g)) / dp_slot_bytes(hd);
  const int most = two >= 3 ? two : one;
  return most < DP_MAX_SLOTS ? most : DP_MAX_SLOTS;
}

__host__ __device__ constexpr int dp_smem_bytes(int hd, int g) {
  return dp_slots(hd, g) * dp_slot_bytes(hd) + dp_fixed_bytes(hd, g);
}

// The tensor-core split's warp work after its loads, for the pipelined split (below): statement
// for statement the arithmetic of attn_decode_split_tc above (the same operations on the same
// values in the same order, so the same bits; tests/test_attention_pipe_cuda.py compares them).
// It is a copy rather than shared code so that attn_decode_split_tc's machine code stays as it
// was (calling these helpers from it changed its schedule). Warp w holds keys 16w..16w+15 of the
// split; lane (g, t) holds 16 bytes of keys g and g + 8 at dims 32c + 8t .. 32c + 8t + 7 in
// klo[c] and khi[c] (zeros past the sequence, where on_lo / on_hi are false).
// 1. tc_warp_softmax: S = K . Q^T by mma (the G q rows in s_q the B operand), the warp's
//    softmax per head (mx, ls: max and sum of its keys), and P moved to the B layout as two bf16
//    halves (phi, plo).
template <int HD, int G>
__device__ __forceinline__ void tc_warp_softmax(const uint4 (&klo)[HD / 32],
                                                const uint4 (&khi)[HD / 32], const uint4* s_q,
                                                bool on_lo, bool on_hi, float scale, int lane,
                                                float (&mx)[2], float (&ls)[2],
                                                uint32_t (&phi)[2], uint32_t (&plo)[2]) {
  constexpr int C = HD / 8;   // 16-byte chunks of one head's row
  constexpr int KC = HD / 32; // 32-dim chunks: two k16 products each
  const int g = lane >> 2, t = lane & 3;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  float sacc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int c = 0; c < KC; ++c) {
    const uint4 q = g < G ? s_q[g * C + 4 * c + t] : zero;
    const uint32_t a0[4] = {klo[c].x, khi[c].x, klo[c].y, khi[c].y};
    mma_bf16(sacc, a0, q.x, q.y);
    const uint32_t a1[4] = {klo[c].z, khi[c].z, klo[c].w, khi[c].w};
    mma_bf16(sacc, a1, q.z, q.w);
  }

  // sacc: [0] key g head 2t, [1] key g head 2t+1, [2] key g+8 head 2t, [3] key g+8 head 2t+1
  const float scale2 = scale * LOG2E;
  float sc[4];
  sc[0] = on_lo ? sacc[0] * scale2 : -INFINITY;
  sc[1] = on_lo ? sacc[1] * scale2 : -INFINITY;
  sc[2] = on_hi ? sacc[2] * scale2 : -INFINITY;
  sc[3] = on_hi ? sacc[3] * scale2 : -INFINITY;
  mx[0] = fmaxf(sc[0], sc[2]);
  mx[1] = fmaxf(sc[1], sc[3]);
#pragma unroll
  for (int o = 4; o < 32; o <<= 1)
#pragma unroll
    for (int h = 0; h < 2; ++h) mx[h] = fmaxf(mx[h], __shfl_xor_sync(FULL_MASK, mx[h], o));
  const float ms[2] = {mx[0] == -INFINITY ? 0.f : mx[0], mx[1] == -INFINITY ? 0.f : mx[1]};
  float pr[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) pr[i] = fast_exp2(sc[i] - ms[i & 1]);  // 0 for a masked key
  ls[0] = pr[0] + pr[2];
  ls[1] = pr[1] + pr[3];
#pragma unroll
  for (int o = 4; o < 32; o <<= 1)
#pragma unroll
    for (int h = 0; h < 2; ++h) ls[h] += __shfl_xor_sync(FULL_MASK, ls[h], o);

  // P as the B operand (16 keys x 8 heads): lane (g, t) needs keys 2t, 2t+1, 2t+8, 2t+9 of head
  // g, held by lanes (2t, g/2) and (2t+1, g/2) in registers (g & 1) and 2 + (g & 1).
  const int src_a = (2 * t) * 4 + (g >> 1), src_b = src_a + 4;
  const bool odd = g & 1;
  float pb[4];
  {
    const float a0 = __shfl_sync(FULL_MASK, pr[0], src_a);
    const float a1 = __shfl_sync(FULL_MASK, pr[1], src_a);
    const float b0 = __shfl_sync(FULL_MASK, pr[0], src_b);
    const float b1 = __shfl_sync(FULL_MASK, pr[1], src_b);
    const float a2 = __shfl_sync(FULL_MASK, pr[2], src_a);
    const float a3 = __shfl_sync(FULL_MASK, pr[3], src_a);
    const float b2 = __shfl_sync(FULL_MASK, pr[2], src_b);
    const float b3 = __shfl_sync(FULL_MASK, pr[3], src_b);
    pb[0] = odd ? a1 : a0;  // key 2t
    pb[1] = odd ? b1 : b0;  // key 2t + 1
    pb[2] = odd ? a3 : a2;  // key 2t + 8
    pb[3] = odd ? b3 : b2;  // key 2t + 9
  }
  // p = hi + lo, each a bf16 (lo the rounding error of hi): two products carry p to 2^-17 of
  // itself, so the f32 partials keep the CUDA-core kernel's accuracy
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    phi[i] = pack_bf16x2_rn(pb[2 * i], pb[2 * i + 1]);
    const float2 back = unpack_bf16x2(phi[i]);
    plo[i] = pack_bf16x2_rn(pb[2 * i] - back.x, pb[2 * i + 1] - back.y);
  }
}

// 2. tc_warp_pv: O[dim][head] = V^T . P from the warp's V tile (16 x HD bf16 in shared memory,
//    chunk c of row r at chunk c ^ (r & SWZ)) by ldmatrix.trans and two mma's per 16 dims.
template <int HD>
__device__ __forceinline__ void tc_warp_pv(const bf16* vt, const uint32_t (&phi)[2],
                                           const uint32_t (&plo)[2], int lane,
                                           float (&oacc)[HD / 16][4]) {
  constexpr int C = HD / 8;
  constexpr int SWZ = (C & -C) >= 8 ? 7 : (C & -C) - 1;
  const int mq = lane >> 3, mr = lane & 7;  // ldmatrix: matrix mq, row mr
  const int vrow = mr + (mq & 2 ? 8 : 0);
#pragma unroll
  for (int db = 0; db < HD / 16; ++db) {
    const int chunk = 2 * db + (mq & 1);
    uint32_t a[4];
    ldsm_x4_trans(smem_u32(vt + vrow * HD + ((chunk ^ (vrow & SWZ)) * 8)), a);
#pragma unroll
    for (int i = 0; i < 4; ++i) oacc[db][i] = 0.f;
    mma_bf16(oacc[db], a, phi[0], phi[1]);
    mma_bf16(oacc[db], a, plo[0], plo[1]);
  }
}

// 3. tc_warp_store: the warp's partial (mx, ls per head; O) to s_stats and s_acc, for
//    write_split_partial.
template <int HD, int G>
__device__ __forceinline__ void tc_warp_store(int warp, int lane, const float (&mx)[2],
                                              const float (&ls)[2],
                                              const float (&oacc)[HD / 16][4], float* s_stats,
                                              float* s_acc) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    const int h = 2 * t + h2;
    if (h >= G) continue;
    if (g == 0) {
      s_stats[(warp * G + h) * 2] = mx[h2];
      s_stats[(warp * G + h) * 2 + 1] = ls[h2];
    }
    float* dst = s_acc + (warp * G + h) * HD;
#pragma unroll
    for (int db = 0; db < HD / 16; ++db) {
      dst[db * 16 + g] = oacc[db][h2];
      dst[db * 16 + g + 8] = oacc[db][2 + h2];
    }
  }
}

template <int HD, int G>
__device__ __forceinline__ void attn_decode_split_pipe_tc(const bf16* __restrict__ qkv,
                                                          const uint8_t* __restrict__ kv,
                                                          const int* __restrict__ table_row,
                                                          int len, float* __restrict__ part,
                                                          int nq, int nk, int max_splits,
                                                          float scale, uint8_t* smem) {
  constexpr int C = HD / 8;    // 16-byte chunks of one head's row
  constexpr int KC = HD / 32;  // 32-dim chunks: two k16 products each
  constexpr int SWZ = (C & -C) >= 8 ? 7 : (C & -C) - 1;  // V: attn_decode_split_tc's swizzle
  constexpr int KSWZ = C % 8 == 0 ? 4 : 0;               // K: odd rows' chunks XOR 4
  constexpr int DP = dp_slots(HD, G);
  constexpr int TILE = 16 * HD;  // bf16 of one warp's K or V tile
  static_assert(HD % 32 == 0 && DC_SPLIT == 16 * DC_WARPS && PAGE == 16,
                "a warp per 16 keys (one page) of the split");
  static_assert(DP >= 3 && dp_smem_bytes(HD, G) <= DP_BLOCK_SHARED_MAX, "the ring fits");
  if (blockDim.x != DC_WARPS * 32 || dynamic_smem_bytes() < (uint32_t)dp_smem_bytes(HD, G))
    __trap();  // launched with a block of 256 and dp_smem_bytes(hd, G) of dynamic shared memory
  const int b = blockIdx.x, kvh = blockIdx.y, z = blockIdx.z, Z = gridDim.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const long long slot_bytes = 4LL * nk * HD, v_offset = 2LL * nk * HD;
  bf16* ring = reinterpret_cast<bf16*>(smem) + warp * DP * TILE;  // this warp's slots
  float* s_acc = reinterpret_cast<float*>(smem + DP * dp_slot_bytes(HD));
  uint4* s_q = reinterpret_cast<uint4*>(s_acc + DC_WARPS * G * HD);
  float* s_stats = reinterpret_cast<float*>(s_q + G * C);

  // This block's splits: z, z + Z, ... below n (attn_decode_split_hd's loop), k-th at z + k Z.
  const int n = len <= 0 ? 0 : min((len + DC_SPLIT - 1) / DC_SPLIT, max_splits);
  const int count = z < n ? (n - 1 - z) / Z + 1 : 0;
  if (count == 0) return;  // block-uniform
  const uint4* qrow = reinterpret_cast<const uint4*>(qkv + (long long)b * (nq + 2 * nk) * HD +
                                                     (long long)kvh * G * HD);
  for (int i = tid; i < G * C; i += DC_WARPS * 32) s_q[i] = qrow[i];

  // Lane L: the page-table entry of this warp's 16 keys in the block's split pbase + L.
  int pbase = 0, page = 0;
  auto pages_from = [&](int k) {
    pbase = k;
    const int split = z + (k + lane) * Z;
    page = k + lane < count && split * DC_SPLIT + warp * 16 < len
               ? table_row[split * (DC_SPLIT / PAGE) + warp] : 0;
  };
  pages_from(0);

  // Tile i of the warp's ring (K of split i / 2, or V when i is odd) into slot i % DP: one
  // commit group, empty past the block's splits or where the warp has no key.
  auto issue = [&](int i) {
    const int k = i >> 1;
    if (k < count) {
      const int w0 = (z + k * Z) * DC_SPLIT + warp * 16;  // the warp's first key
      if (k - pbase >= 32) pages_from(k);
      const int entry = __shfl_sync(FULL_MASK, page, k - pbase);
      if (w0 < len) {
        const bool is_v = i & 1;
        const uint8_t* rows = kv + (long long)entry * PAGE * slot_bytes +
                              (long long)kvh * HD * 2 + (is_v ? v_offset : 0);
        bf16* tile = ring + (i % DP) * TILE;
#pragma unroll
        for (int m = 0; m < C / 2; ++m) {  // 16 rows x C chunks, 32 lanes
          const int e = lane + 32 * m, r = e / C, c = e % C;
          const bool on = w0 + r < len;
          const int at = is_v ? c ^ (r & SWZ) : c ^ ((r & 1) * KSWZ);
          cp_async16(smem_u32(tile + r * HD + at * 8), on ? rows + r * slot_bytes + c * 16 : kv,
                     on);
        }
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < DP; ++i) issue(i);
  __syncthreads();  // s_q

  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int k = 0; k < count; ++k) {
    const int split = z + k * Z;
    const int k0 = split * DC_SPLIT, kend = min(len, k0 + DC_SPLIT);
    const bool live = k0 + warp * 16 < kend;  // warp-uniform: the warp has a key
    const int j_lo = warp * 16 + g, j_hi = j_lo + 8;
    const bool on_lo = k0 + j_lo < kend, on_hi = k0 + j_hi < kend;
    float mx[2], ls[2];
    uint32_t phi[2], plo[2];
    float oacc[HD / 16][4];
    cp_async_wait<DP - 1>();  // tile 2k: K of this split
    __syncwarp();
    if (live) {
      const bf16* kt = ring + ((2 * k) % DP) * TILE;
      uint4 klo[KC], khi[KC];
#pragma unroll
      for (int c = 0; c < KC; ++c) {
        const int at = ((4 * c + t) ^ ((g & 1) * KSWZ)) * 8;  // rows g, g + 8: the same parity
        klo[c] = on_lo ? *reinterpret_cast<const uint4*>(kt + g * HD + at) : zero;
        khi[c] = on_hi ? *reinterpret_cast<const uint4*>(kt + (g + 8) * HD + at) : zero;
      }
      tc_warp_softmax<HD, G>(klo, khi, s_q, on_lo, on_hi, scale, lane, mx, ls, phi, plo);
    }
    __syncwarp();  // every lane has read the K tile
    issue(2 * k + DP);
    cp_async_wait<DP - 1>();  // tile 2k + 1: V of this split
    __syncwarp();
    if (live) tc_warp_pv<HD>(ring + ((2 * k + 1) % DP) * TILE, phi, plo, lane, oacc);
    __syncwarp();  // every lane has read the V tile
    issue(2 * k + 1 + DP);

    __syncthreads();  // the merge of the split before has read s_stats and s_acc
    if (live) {
      tc_warp_store<HD, G>(warp, lane, mx, ls, oacc, s_stats, s_acc);
    } else {  // no key of this warp: an empty partial (attn_decode_split_tc's)
      if (lane < G) {
        s_stats[(warp * G + lane) * 2] = -INFINITY;
        s_stats[(warp * G + lane) * 2 + 1] = 0.f;
      }
      for (int i = lane; i < G * HD; i += 32) s_acc[warp * G * HD + i] = 0.f;
    }
    __syncthreads();
    write_split_partial<HD, G>(part, nq, max_splits, split, s_stats, s_acc);
  }
  cp_async_wait<0>();  // nothing left in flight (the groups past the last split are empty)
}

// The pipelined split at head dim hd (a multiple of 32 up to 128).
template <int G>
__device__ __forceinline__ void attn_decode_split_pipe_hd(int hd, const bf16* qkv,
                                                          const uint8_t* kv, const int* table_row,
                                                          int len, float* part, int nq, int nk,
                                                          int max_splits, float scale,
                                                          uint8_t* smem) {
  switch (hd) {
#define DP_CASE(HD)                                                                          \
  case HD:                                                                                   \
    attn_decode_split_pipe_tc<HD, G>(qkv, kv, table_row, len, part, nq, nk, max_splits,      \
                                     scale, smem);                                           \
    break;
    DP_CASE(32) DP_CASE(64) DP_CASE(96) DP_CASE(128)
#undef DP_CASE
    default:
      __trap();  // the tensor-core kernels take hd % 32 == 0 up to 128
  }
}

// attn_decode_split_tc_bf16 pipelined across each block's splits (above): the same ABI, grid
// (seqs, nk, Z), block (256) and partials, bit for bit, for any Z; dynamic shared memory
// dp_smem_bytes(hd, G) (it traps with less, or with another block size). Its numpy reference is
// the split kernels'; the cuda backend launches it in place of attn_decode_split_tc_bf16 where a
// block loops over splits, with a Z of its own (KERNCC_PIPE_ATTENTION,
// runtime/backends/attention_pipe.py).
extern "C" __global__ void __launch_bounds__(DC_WARPS * 32, 2)
attn_decode_split_pipe_tc_bf16(const bf16* __restrict__ qkv, const uint8_t* __restrict__ kv,
                               const int* __restrict__ block_table,
                               const int* __restrict__ seq_lens, float* __restrict__ part,
                               int seqs, int nq, int nk, int hd, int width, int max_splits,
                               float scale) {
  pdl_begin();
  extern __shared__ __align__(128) uint8_t dp_smem[];
  const int b = blockIdx.x;
  if (b >= seqs) return;
  const int* table_row = block_table + (long long)b * width;
  const int len = seq_lens[b];
  switch (nq == nk * (nq / nk) ? nq / nk : 0) {
#define DP_GROUP(G)                                                                       \
  case G:                                                                                 \
    attn_decode_split_pipe_hd<G>(hd, qkv, kv, table_row, len, part, nq, nk, max_splits,   \
                                 scale, dp_smem);                                         \
    break;
    DP_GROUP(1) DP_GROUP(2) DP_GROUP(4) DP_GROUP(8)
#undef DP_GROUP
    default:
      __trap();  // nq/nk must be 1, 2, 4 or 8
  }
}
