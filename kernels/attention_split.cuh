// The decode attention's split on tensor cores (attn_decode_split_tc) and what it shares with
// the other split kernels of kernels/attention.cu.
#pragma once
#include "tc.cuh"

#ifndef PAGE
#define PAGE 16
#endif

#define DC_SPLIT 128  // keys per split (kernels/reference.py DECODE_SPLIT mirrors it)
#define DC_WARPS 8
#define DC_MAX_G 8
#define DC_MAX_HD 128

__device__ __forceinline__ uint32_t word_at(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Dot product of 8 bf16 pairs in f32, in dimension order.
__device__ __forceinline__ float dot_bf16x8(const uint4& a, const uint4& b) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = unpack_bf16x2(word_at(a, i)), y = unpack_bf16x2(word_at(b, i));
    s = fmaf(x.x, y.x, s);
    s = fmaf(x.y, y.y, s);
  }
  return s;
}

// (m, l, o) of a partial softmax absorbing (mo, lo, oo): both weighted by 2^(own max - new max);
// a side with no key (m = -inf) weighs 0.
template <int N>
__device__ __forceinline__ void merge_partial(float& m, float& l, float (&o)[N], float mo,
                                              float lo, const float (&oo)[N]) {
  const float mx = fmaxf(m, mo);
  const float ms = mx == -INFINITY ? 0.f : mx;
  const float fa = fast_exp2(m - ms), fb = fast_exp2(mo - ms);
  l = l * fa + lo * fb;
#pragma unroll
  for (int d = 0; d < N; ++d) o[d] = o[d] * fa + oo[d] * fb;
  m = mx;
}

// The split's entry from the warps' partials in shared memory (s_stats: m and l per (warp,
// head), s_acc: o per (warp, head, dim)), merged in warp order: thread (g, d) writes dim d of
// head g's entry (d == 0 also m and l). Callers have passed a barrier since the last write.
template <int HD, int G>
__device__ __forceinline__ void write_split_partial(float* __restrict__ part, int nq,
                                                    int max_splits, int split,
                                                    const float* s_stats, const float* s_acc) {
  const int b = blockIdx.x, kvh = blockIdx.y, tid = threadIdx.x;
  const long long entry = (long long)max_splits * (HD + 2);
  float* base = part + ((long long)b * nq + kvh * G) * entry + (long long)split * (HD + 2);
  for (int i = tid; i < G * HD; i += DC_WARPS * 32) {
    const int g = i / HD, d = i % HD;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < DC_WARPS; ++w) mx = fmaxf(mx, s_stats[(w * G + g) * 2]);
    const float ms = mx == -INFINITY ? 0.f : mx;
    float lsum = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < DC_WARPS; ++w) {
      const float f = fast_exp2(s_stats[(w * G + g) * 2] - ms);  // 0 for a warp with no key
      lsum += s_stats[(w * G + g) * 2 + 1] * f;
      o += s_acc[(w * G + g) * HD + d] * f;
    }
    float* e = base + g * entry;
    e[2 + d] = o;
    if (d == 0) {
      e[0] = mx;
      e[1] = lsum;
    }
  }
}

// The split on tensor cores (attn_decode_split_tc_bf16), for hd % 32 == 0: the function of
// attn_decode_split, other bits; per split they do not depend on the grid either.
// Warp w takes keys 16w..16w+15 of the split as one 16-row tile:
// * S[key][head] = K . Q^T by mma.m16n8k16: the K rows are the A operand straight from memory,
//   16 bytes a lane (lane t's 8 consecutive dims are its k pairs of two products, as gemv.cu
//   reads W), the kv head's G q rows (staged in shared memory) the B operand, heads past G zero;
// * the warp's softmax per head on the accumulator layout (a lane holds keys g and g + 8 of heads
//   2t and 2t + 1): max and sum by butterfly over g, p = 2^(s - m) in f32 for l;
// * O[dim][head] = V^T . P by mma: the warp's 16 V rows go to shared memory by cp.async (16-byte
//   chunks XOR-swizzled by row, so ldmatrix.trans reads without bank conflicts) and come back
//   transposed as the A operand; P, moved to the B layout by shuffles, goes in as two bf16
//   products (its bf16 rounding, then the rest), so the partials stay f32-accurate.
// Keys past the sequence load as zeros and score -inf. The V tiles share s_acc's memory: the
// warps write their partials there only after a barrier. Then the warps merge in order.
template <int HD, int G>
__device__ __forceinline__ void attn_decode_split_tc(const bf16* __restrict__ qkv,
                                                     const uint8_t* __restrict__ kv,
                                                     const int* __restrict__ table_row, int len,
                                                     int split, float* __restrict__ part, int nq,
                                                     int nk, int max_splits, float scale,
                                                     int* s_pages, uint4* s_q, float* s_stats,
                                                     float* s_acc) {
  constexpr int C = HD / 8;   // 16-byte chunks of one head's row
  constexpr int KC = HD / 32; // 32-dim chunks: two k16 products each
  constexpr int SWZ = (C & -C) >= 8 ? 7 : (C & -C) - 1;  // XOR within aligned runs of chunks
  static_assert(HD % 32 == 0 && DC_SPLIT == 16 * DC_WARPS, "a warp per 16 keys of the split");
  const int b = blockIdx.x, kvh = blockIdx.y;
  const int k0 = split * DC_SPLIT, kend = min(len, k0 + DC_SPLIT);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const long long slot_bytes = 4LL * nk * HD, v_offset = 2LL * nk * HD;

  if (tid < DC_SPLIT / PAGE && k0 + tid * PAGE < kend) s_pages[tid] = table_row[k0 / PAGE + tid];
  const uint4* qrow = reinterpret_cast<const uint4*>(qkv + (long long)b * (nq + 2 * nk) * HD +
                                                     (long long)kvh * G * HD);
  for (int i = tid; i < G * C; i += DC_WARPS * 32) s_q[i] = qrow[i];
  __syncthreads();
  if (k0 + warp * 16 >= kend) {  // no key of this warp: an empty partial
    if (lane < G) {
      s_stats[(warp * G + lane) * 2] = -INFINITY;
      s_stats[(warp * G + lane) * 2 + 1] = 0.f;
    }
    __syncthreads();  // the others' V tiles are read before s_acc is written
    for (int i = lane; i < G * HD; i += 32) s_acc[warp * G * HD + i] = 0.f;
    __syncthreads();
    write_split_partial<HD, G>(part, nq, max_splits, split, s_stats, s_acc);
    return;
  }
  auto row_of = [&](int j) {  // key j of the split: its K row (V is v_offset bytes on)
    const long long slot = (long long)s_pages[j / PAGE] * PAGE + j % PAGE;
    return kv + slot * slot_bytes + (long long)kvh * HD * 2;
  };

  // V rows into the warp's tile (16 x HD bf16), chunk c of row r at chunk c ^ (r & SWZ).
  bf16* vt = reinterpret_cast<bf16*>(s_acc) + warp * 16 * HD;
  for (int i = lane; i < 16 * C; i += 32) {
    const int r = i / C, c = i % C, j = warp * 16 + r;
    const bool on = k0 + j < kend;
    cp_async16(smem_u32(vt + r * HD + ((c ^ (r & SWZ)) * 8)),
               on ? row_of(j) + v_offset + c * 16 : kv, on);
  }
  cp_async_commit();

  const int j_lo = warp * 16 + g, j_hi = j_lo + 8;
  const bool on_lo = k0 + j_lo < kend, on_hi = k0 + j_hi < kend;
  const uint8_t* k_lo = on_lo ? row_of(j_lo) : kv;
  const uint8_t* k_hi = on_hi ? row_of(j_hi) : kv;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  uint4 klo[KC], khi[KC];
#pragma unroll
  for (int c = 0; c < KC; ++c) {
    klo[c] = on_lo ? __ldg(reinterpret_cast<const uint4*>(k_lo + (32 * c + 8 * t) * 2)) : zero;
    khi[c] = on_hi ? __ldg(reinterpret_cast<const uint4*>(k_hi + (32 * c + 8 * t) * 2)) : zero;
  }
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
  float mx[2] = {fmaxf(sc[0], sc[2]), fmaxf(sc[1], sc[3])};
#pragma unroll
  for (int o = 4; o < 32; o <<= 1)
#pragma unroll
    for (int h = 0; h < 2; ++h) mx[h] = fmaxf(mx[h], __shfl_xor_sync(FULL_MASK, mx[h], o));
  const float ms[2] = {mx[0] == -INFINITY ? 0.f : mx[0], mx[1] == -INFINITY ? 0.f : mx[1]};
  float pr[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) pr[i] = fast_exp2(sc[i] - ms[i & 1]);  // 0 for a masked key
  float ls[2] = {pr[0] + pr[2], pr[1] + pr[3]};
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
  uint32_t phi[2], plo[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    phi[i] = pack_bf16x2_rn(pb[2 * i], pb[2 * i + 1]);
    const float2 back = unpack_bf16x2(phi[i]);
    plo[i] = pack_bf16x2_rn(pb[2 * i] - back.x, pb[2 * i + 1] - back.y);
  }

  cp_async_wait<0>();
  __syncwarp();
  float oacc[HD / 16][4];
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

  __syncthreads();  // every warp has read its V tile: s_acc may be written
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
  __syncthreads();
  write_split_partial<HD, G>(part, nq, max_splits, split, s_stats, s_acc);
}
