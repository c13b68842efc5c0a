// Module `kv_cache`: writes this call's keys and values into a layer's paged KV state.
//
// KV state layout (one state per layer): token slot s occupies 4*nk*hd bytes at s*4*nk*hd:
// [K: nk heads x hd bf16 | V: nk heads x hd bf16]. A slot is page*16 + index within the page.
#include "common.cuh"

// For each row r with slot_mapping[r] >= 0, copy qkv[r, nq*hd : (nq+2nk)*hd] (k then v,
// exactly the slot's layout) into the slot. One thread per 32-bit word (rows * nk*hd words).
// grid (ceil(rows*nk*hd/256)), block (256).
extern "C" __global__ void kv_write_bf16(const bf16* __restrict__ qkv,
                                         const int* __restrict__ slot_mapping,
                                         uint8_t* __restrict__ kv, int rows, int nq, int nk,
                                         int hd) {
  const int words = nk * hd;  // (k + v) bf16 per row / 2
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)rows * words) return;
  const long long row = idx / words;
  const int w = (int)(idx % words);
  const long long slot = slot_mapping[row];
  if (slot < 0) return;  // a padding row owns no slot
  const uint32_t* src =
      reinterpret_cast<const uint32_t*>(qkv + row * (long long)(nq + 2 * nk) * hd + nq * hd);
  uint32_t* dst = reinterpret_cast<uint32_t*>(kv + slot * 4LL * words);
  dst[w] = src[w];
}
