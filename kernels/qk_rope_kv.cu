// Module `qk_rope_kv`: what happens to a layer's packed qkv rows between the projection and
// attention, in one launch: head_rmsnorm_bf16, rope_neox_bf16 and kv_write_bf16 in sequence.
#include "norm.cuh"
#include "rope.cuh"

// One head's 4 elements a lane: x rewritten when it is a q or k head (`norm_rope`, warp-
// uniform), copied to dst when that is not null (a k or v head with a slot).
__device__ __forceinline__ void head128_apply(float (&f)[4], bool norm_rope, const float (&g)[4],
                                              const float4& c, const float4& sn, bf16* x,
                                              bf16* dst, float eps, int lane) {
  if (norm_rope) {
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) ss += f[k] * f[k];
    const float r = rsqrtf(warp_sum(ss) / 128.f + eps);
#pragma unroll
    for (int k = 0; k < 4; ++k) f[k] = round_bf16(round_bf16(f[k] * r) * g[k]);  // as stored
    const float cs[4] = {c.x, c.y, c.z, c.w}, s[4] = {sn.x, sn.y, sn.z, sn.w};
    // the rope's pairs (i, 64 + i) sit in lanes l and l + 16: a shuffle brings the partner
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float other = __shfl_xor_sync(FULL_MASK, f[k], 16);
      float x1 = lane < 16 ? f[k] : other, x2 = lane < 16 ? other : f[k];
      rotate(x1, x2, cs[k], s[k]);
      f[k] = lane < 16 ? x1 : x2;
    }
    store_bf16<4>(x, f);
  }
  if (dst) store_bf16<4>(dst, f);
}

// Head dim 128, aligned: a block takes rows (blockIdx.x, + gridDim.x, ...), and the W warps of
// the gridDim.y blocks of a row (warp w of block y: w' = y * warps + w) take its heads w', w' +
// W, ... QK_HEADS_PER_WARP at a time, each head held in registers (4 elements a lane)
// for the whole of norm -> rope -> KV write. What every head of a row shares
// is read once per warp: the norm weights once per launch, the position, table row and KV slot
// once per row; all of a batch's x loads go out before any use, so a warp waits about one
// memory latency for QK_HEADS_PER_WARP heads. The expressions are those of norm_row_v<4>,
// rope_quad and the KV copy on each head, so the bits are the three kernels' whichever warp
// takes a head. (An item a warp, each re-reading its row's table and slot, kept a 2048-row
// chunk's 24 launches at 0.61 ms, a third of the bandwidth; 4 heads of different rows a warp
// needed 110 registers and lost: docs/benchmarks.md.)
#define QK_HEADS_PER_WARP 4

__device__ __forceinline__ void rows128(bf16* qkv, const bf16* w, const int* positions,
                                        const float* table, const int* slot_mapping, uint8_t* kv,
                                        int rows, int nq, int nk, float eps, int lane) {
  const int heads = nq + 2 * nk, warps = gridDim.y * (blockDim.x >> 5);
  const int warp = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
  float gq[4], gk[4];  // [q_norm | k_norm]
  load_bf16<4>(w + 4 * lane, gq);
  load_bf16<4>(w + 128 + 4 * lane, gk);
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    bf16* x = qkv + row * heads * 128 + 4 * lane;
    const float* t = table + (long long)positions[row] * 128 + 4 * (lane & 15);
    const long long slot = slot_mapping[row];
    bf16* kv_row = slot < 0 ? nullptr  // a padding row owns no slot
                            : reinterpret_cast<bf16*>(kv + slot * 4LL * nk * 128) + 4 * lane;
    for (int h0 = warp; h0 < heads; h0 += warps * QK_HEADS_PER_WARP) {  // warp-uniform
      float f[QK_HEADS_PER_WARP][4];
#pragma unroll
      for (int k = 0; k < QK_HEADS_PER_WARP; ++k)
        if (h0 + k * warps < heads) load_bf16<4>(x + (h0 + k * warps) * 128, f[k]);
      // after the x loads: these wait for the position, the x loads need not
      const float4 c = *reinterpret_cast<const float4*>(t);
      const float4 sn = *reinterpret_cast<const float4*>(t + 64);
#pragma unroll
      for (int k = 0; k < QK_HEADS_PER_WARP; ++k) {
        const int head = h0 + k * warps;
        if (head >= heads) break;
        float g[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) g[i] = head < nq ? gq[i] : gk[i];
        bf16* dst = head >= nq && kv_row ? kv_row + (head - nq) * 128 : nullptr;
        head128_apply(f[k], head < nq + nk, g, c, sn, x + head * 128, dst, eps, lane);
      }
    }
  }
}

// Any head dim (even): norm_row, rope_head and the KV copy through memory, a head a warp.
__device__ __forceinline__ void head_general(bf16* qkv, const bf16* w, const int* positions,
                                             const float* table, const int* slot_mapping,
                                             uint8_t* kv, long long item, int nq, int nk, int hd,
                                             float eps, int lane) {
  const int heads = nq + 2 * nk;
  const long long row = item / heads;
  const int head = (int)(item % heads);
  bf16* x = qkv + row * (long long)heads * hd + (long long)head * hd;
  if (head < nq + nk) {
    norm_row(x, w + (head < nq ? 0 : hd), x, hd, eps, lane,
             width(hd, bits(qkv, w, w) | (uintptr_t)(hd * 2)));
    __syncwarp();  // the rope pairs cross lanes: every lane's normalized values first
    const int half = hd / 2;
    const uintptr_t bases = reinterpret_cast<uintptr_t>(qkv) |
                            reinterpret_cast<uintptr_t>(table);
    rope_head(x, table + (long long)positions[row] * hd, half, lane,
              half % 4 == 0 && bases % 16 == 0);
    if (head < nq) return;
    __syncwarp();
  }
  const long long slot = slot_mapping[row];
  if (slot < 0) return;  // a padding row owns no slot
  bf16* dst = reinterpret_cast<bf16*>(kv + slot * 4LL * nk * hd) + (long long)(head - nq) * hd;
  for (int i = 2 * lane; i < hd; i += 64)  // hd is even: 32-bit words, as kv_write_bf16
    *reinterpret_cast<uint32_t*>(dst + i) = *reinterpret_cast<const uint32_t*>(x + i);
}

// Packed qkv rows [q: nq*hd | k: nk*hd | v: nk*hd]; items are the (row, head) pairs over all
// nq + 2*nk heads. q and k heads: RMSNorm with w = [q_norm (hd) | k_norm (hd)], then neox rope
// at table row positions[row], in place; k and v heads: then copied into the KV slot
// slot_mapping[row] (layout as kv_write_bf16: [K: nk*hd | V: nk*hd] bf16; a row whose slot is
// negative writes none). Each step is the separate kernel's own code on the item's head, so
// the bits are those of the three launches (head dim 128, aligned: rows128, in registers).
// Any grid (x, y) and any block of up to 256 threads in whole warps is correct (at head dim
// 128 x strides over rows and the y blocks of a row share its heads; otherwise warps stride
// over the items). The example launches, per row, one block of 8 warps for a prefill chunk (4
// heads a warp) and ceil(heads / 4) blocks of 4 warps for a decode step (a head a warp: one
// row's heads spread over as many multiprocessors as the three kernels used).
extern "C" __global__ void __launch_bounds__(256, 4) qk_norm_rope_kv_bf16(bf16* __restrict__ qkv,
                                                const bf16* __restrict__ w,
                                                const int* __restrict__ positions,
                                                const float* __restrict__ table,
                                                const int* __restrict__ slot_mapping,
                                                uint8_t* __restrict__ kv, int rows, int nq,
                                                int nk, int hd, float eps) {
  pdl_begin();
  const int lane = threadIdx.x & 31;
  if (hd == 128 && (bits(qkv, w, table) | reinterpret_cast<uintptr_t>(kv)) % 16 == 0) {
    rows128(qkv, w, positions, table, slot_mapping, kv, rows, nq, nk, eps, lane);
    return;
  }
  const int warps = blockDim.x >> 5;
  const long long total = (long long)rows * (nq + 2 * nk);
  const long long stride = (long long)gridDim.x * gridDim.y * warps;
  for (long long item = ((long long)blockIdx.y * gridDim.x + blockIdx.x) * warps +
                        (threadIdx.x >> 5);
       item < total; item += stride)
    head_general(qkv, w, positions, table, slot_mapping, kv, item, nq, nk, hd, eps, lane);
}
