// Module `attention`: causal grouped-query attention over a layer's paged KV state.
//
// Shared layout facts (see kv_cache.cu): packed qkv rows [q: nq*hd | k: nk*hd | v: nk*hd];
// KV slot s holds [K: nk*hd | V: nk*hd] bf16 at byte s*4*nk*hd; key j of a sequence lives in
// slot block_table[seq*width + j/16]*16 + j%16. Output rows are [nq*hd] bf16.
// Limits: hd % 8 == 0 and hd <= 128; the prefill kernel needs 32 % (nq/nk) == 0, the decode
// kernel nq/nk <= 8. Softmax is the online (running max) form in f32, scale folded into log2.
#include "common.cuh"

#define MAX_WORDS 64  // bf16x2 words of one head (hd <= 128)
#define PAGE 16

__device__ __forceinline__ long long key_slot(const int* table_row, int key) {
  return (long long)table_row[key / PAGE] * PAGE + key % PAGE;
}

// ---------------------------------------------------------------------------------------------
// Prefill: one call = a chunk of `rows` consecutive rows of ONE sequence (block_table row 0)
// whose keys, including this chunk's own, are already in the state (kv_write runs first).
// Row r attends to keys 0..positions[r]. A block takes 32 (row, q head) pairs: 32/G rows times
// the G q heads of kv head blockIdx.y, so every K/V tile it stages in shared memory serves 32
// query vectors. Warp w owns pairs w, w+8, w+16, w+24; within a tile lane j scores key j.
// grid (ceil(rows / (32/G)), nk), block (256).
#define PF_PAIRS 32
#define PF_WARPS 8
#define PF_PER_WARP (PF_PAIRS / PF_WARPS)
#define PF_KEYS 32

extern "C" __global__ void __launch_bounds__(PF_WARPS * 32)
attn_prefill_bf16(const bf16* __restrict__ qkv, const uint8_t* __restrict__ kv,
                  const int* __restrict__ block_table, const int* __restrict__ positions,
                  bf16* __restrict__ out, int rows, int nq, int nk, int hd, int width,
                  float scale) {
  __shared__ uint32_t sq[PF_PAIRS][MAX_WORDS];
  __shared__ uint32_t sk[PF_KEYS][MAX_WORDS + 1];  // odd row stride: lane j reads row j
  __shared__ uint32_t sv[PF_KEYS][MAX_WORDS];
  __shared__ int spos[PF_PAIRS];
  (void)width;  // one sequence: its table row is row 0

  const int G = nq / nk, rows_per_block = PF_PAIRS / G, W = hd / 2;
  const int kvh = blockIdx.y, row0 = blockIdx.x * rows_per_block;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const long long qkv_stride = (long long)(nq + 2 * nk) * hd;
  const long long token_words = (long long)nk * hd;  // 32-bit words per slot

  for (int i = tid; i < PF_PAIRS * W; i += blockDim.x) {
    const int p = i / W, w = i % W, r = row0 + p / G;
    uint32_t v = 0;
    if (r < rows)
      v = reinterpret_cast<const uint32_t*>(qkv + r * qkv_stride + (kvh * G + p % G) * hd)[w];
    sq[p][w] = v;
  }
  if (tid < PF_PAIRS) {
    const int r = row0 + tid / G;
    spos[tid] = r < rows ? positions[r] : -1;
  }
  __syncthreads();
  int kend = 0;  // keys this block needs: 0 .. max position
  for (int p = 0; p < PF_PAIRS; ++p) kend = max(kend, spos[p] + 1);

  const float scale2 = scale * LOG2E;
  float m[PF_PER_WARP], l[PF_PER_WARP], acc[PF_PER_WARP][4];
#pragma unroll
  for (int i = 0; i < PF_PER_WARP; ++i) {
    m[i] = -INFINITY; l[i] = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
  }

  for (int k0 = 0; k0 < kend; k0 += PF_KEYS) {
    __syncthreads();  // the previous tile is consumed
    for (int i = tid; i < PF_KEYS * W; i += blockDim.x) {
      const int j = i / W, w = i % W, key = k0 + j;
      uint32_t kw = 0, vw = 0;
      if (key < kend) {
        const uint32_t* slot =
            reinterpret_cast<const uint32_t*>(kv) + key_slot(block_table, key) * token_words;
        kw = slot[kvh * W + w];
        vw = slot[token_words / 2 + kvh * W + w];
      }
      sk[j][w] = kw;
      sv[j][w] = vw;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < PF_PER_WARP; ++i) {
      const int p = warp + PF_WARPS * i;
      const int pos = spos[p];
      if (pos < k0) continue;  // warp-uniform: no key of this tile is visible (or no row)
      float s = 0.f;
      for (int w = 0; w < W; ++w) {
        const float2 q = unpack_bf16x2(sq[p][w]);
        const float2 k = unpack_bf16x2(sk[lane][w]);
        s += q.x * k.x + q.y * k.y;
      }
      s = (k0 + lane <= pos) ? s * scale2 : -INFINITY;
      const float mnew = fmaxf(m[i], warp_max(s));  // finite: key k0 <= pos is visible
      const float pr = exp2f(s - mnew);
      const float corr = exp2f(m[i] - mnew);
      l[i] = l[i] * corr + warp_sum(pr);
      m[i] = mnew;
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][e] *= corr;
      const int jend = min(PF_KEYS, pos - k0 + 1);
      for (int j = 0; j < jend; ++j) {
        const float pj = __shfl_sync(FULL_MASK, pr, j);
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const int a = lane + 32 * t;
          if (a < W) {
            const float2 v = unpack_bf16x2(sv[j][a]);
            acc[i][2 * t] += pj * v.x;
            acc[i][2 * t + 1] += pj * v.y;
          }
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < PF_PER_WARP; ++i) {
    const int p = warp + PF_WARPS * i, r = row0 + p / G;
    if (r >= rows || spos[p] < 0) continue;
    const float inv = 1.f / l[i];
    uint32_t* o = reinterpret_cast<uint32_t*>(out + (long long)r * nq * hd +
                                              (long long)(kvh * G + p % G) * hd);
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int a = lane + 32 * t;
      if (a < W) o[a] = pack_bf16x2(acc[i][2 * t] * inv, acc[i][2 * t + 1] * inv);
    }
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
