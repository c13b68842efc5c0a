// Module `qk_rope_kv`: what happens to a layer's packed qkv rows between the projection and
// attention, in one launch: head_rmsnorm_bf16, rope_neox_bf16 and kv_write_bf16 in sequence.
#include "norm.cuh"
#include "rope.cuh"

#define ROWS_PER_BLOCK 4

// HEADS_PER_WARP heads of 128 held in registers, 4 elements a lane, for the whole of norm ->
// rope -> KV write: each head's x, norm weight and table row are read once, all heads' loads
// before any use (so a warp waits about one memory latency for all of them), and x and the KV
// slot are written once, where the general path below goes through memory between its steps.
// The same expressions as norm_row_v<4>, rope_quad and the KV copy, so the same bits. The
// rope's pairs (i, 64 + i) sit in lanes l and l + 16: a shuffle brings each lane its partner.
// One: 4 a warp over a quarter of the grid measured slower (0.85 against 0.59 ms for a 2048-row
// chunk's 24 launches): fewer warps resident (110 registers) outweighed the shared latency.
#define HEADS_PER_WARP 1

struct Head128 {
  bf16* x;
  bf16* dst;  // the KV slot's row for a k or v head; null for q heads and padding rows
  float f[4], g[4];
  float4 c, sn;
  bool norm_rope;  // q and k heads
};

__device__ __forceinline__ void head128_load(Head128& h, bf16* qkv, const bf16* w,
                                             const int* positions, const float* table,
                                             const int* slot_mapping, uint8_t* kv, long long item,
                                             int nq, int nk, int lane) {
  const int heads = nq + 2 * nk;
  const long long row = item / heads;
  const int head = (int)(item % heads);
  h.x = qkv + (row * heads + head) * 128;
  h.norm_rope = head < nq + nk;
  const long long slot = head < nq ? -1 : slot_mapping[row];
  h.dst = slot < 0 ? nullptr
                   : reinterpret_cast<bf16*>(kv + slot * 4LL * nk * 128) + (head - nq) * 128LL;
  load_bf16<4>(h.x + 4 * lane, h.f);
  if (h.norm_rope) {
    load_bf16<4>(w + (head < nq ? 0 : 128) + 4 * lane, h.g);
    const float* t = table + (long long)positions[row] * 128 + 4 * (lane & 15);
    h.c = *reinterpret_cast<const float4*>(t);
    h.sn = *reinterpret_cast<const float4*>(t + 64);
  }
}

__device__ __forceinline__ void head128_finish(Head128& h, float eps, int lane) {
  float* f = h.f;
  if (h.norm_rope) {  // warp-uniform: one head per warp
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) ss += f[k] * f[k];
    const float r = rsqrtf(warp_sum(ss) / 128.f + eps);
#pragma unroll
    for (int k = 0; k < 4; ++k) f[k] = round_bf16(round_bf16(f[k] * r) * h.g[k]);  // as stored
    const float cs[4] = {h.c.x, h.c.y, h.c.z, h.c.w}, sn[4] = {h.sn.x, h.sn.y, h.sn.z, h.sn.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float other = __shfl_xor_sync(FULL_MASK, f[k], 16);
      float x1 = lane < 16 ? f[k] : other, x2 = lane < 16 ? other : f[k];
      rotate(x1, x2, cs[k], sn[k]);
      f[k] = lane < 16 ? x1 : x2;
    }
    store_bf16<4>(h.x + 4 * lane, h.f);
  }
  if (h.dst) store_bf16<4>(h.dst + 4 * lane, h.f);
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
// the bits are those of the three launches (head dim 128, aligned: head128_*, in registers).
// Warps stride over the items, so any grid is correct; block (128). The example launches
// ceil(items / 4) blocks: an item a warp.
extern "C" __global__ void qk_norm_rope_kv_bf16(bf16* __restrict__ qkv,
                                                const bf16* __restrict__ w,
                                                const int* __restrict__ positions,
                                                const float* __restrict__ table,
                                                const int* __restrict__ slot_mapping,
                                                uint8_t* __restrict__ kv, int rows, int nq,
                                                int nk, int hd, float eps) {
  pdl_begin();
  const int heads = nq + 2 * nk, lane = threadIdx.x & 31;
  const long long total = (long long)rows * heads, stride = (long long)gridDim.x * ROWS_PER_BLOCK;
  long long item = (long long)blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
  if (hd == 128 && (bits(qkv, w, table) | reinterpret_cast<uintptr_t>(kv)) % 16 == 0) {
    for (; item < total; item += HEADS_PER_WARP * stride) {  // warp-uniform
      Head128 h[HEADS_PER_WARP];
#pragma unroll
      for (int k = 0; k < HEADS_PER_WARP; ++k)
        if (item + k * stride < total)
          head128_load(h[k], qkv, w, positions, table, slot_mapping, kv, item + k * stride, nq,
                       nk, lane);
#pragma unroll
      for (int k = 0; k < HEADS_PER_WARP; ++k)
        if (item + k * stride < total) head128_finish(h[k], eps, lane);
    }
    return;
  }
  for (; item < total; item += stride)
    head_general(qkv, w, positions, table, slot_mapping, kv, item, nq, nk, hd, eps, lane);
}
