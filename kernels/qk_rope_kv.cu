// Module `qk_rope_kv`: what happens to a layer's packed qkv rows between the projection and
// attention, in one launch: head_rmsnorm_bf16, rope_neox_bf16 and kv_write_bf16 in sequence.
#include "norm.cuh"
#include "rope.cuh"

#define ROWS_PER_BLOCK 4

// Packed qkv rows [q: nq*hd | k: nk*hd | v: nk*hd]; one warp per (row, head) over all
// nq + 2*nk heads. q and k heads: RMSNorm with w = [q_norm (hd) | k_norm (hd)], then neox rope
// at table row positions[row], in place; k and v heads: then copied into the KV slot
// slot_mapping[row] (layout as kv_write_bf16: [K: nk*hd | V: nk*hd] bf16; a row whose slot is
// negative writes none). Each step is the separate kernel's own code on the warp's head, so
// the bits are those of the three launches. grid (ceil(rows*(nq+2nk)/4)), block (128).
extern "C" __global__ void qk_norm_rope_kv_bf16(bf16* __restrict__ qkv,
                                                const bf16* __restrict__ w,
                                                const int* __restrict__ positions,
                                                const float* __restrict__ table,
                                                const int* __restrict__ slot_mapping,
                                                uint8_t* __restrict__ kv, int rows, int nq,
                                                int nk, int hd, float eps) {
  pdl_begin();
  const int heads = nq + 2 * nk;
  const long long item = (long long)blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
  if (item >= (long long)rows * heads) return;
  const int lane = threadIdx.x & 31;
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
