// Module `kv_cache`: writes this call's keys and values into a layer's paged KV state.
//
// KV state layout (one state per layer): token slot s occupies 4*nk*hd bytes at s*4*nk*hd:
// [K: nk heads x hd bf16 | V: nk heads x hd bf16]. A slot is page*16 + index within the page.
#include "common.cuh"

// For each row r with slot_mapping[r] >= 0, copy qkv[r, nq*hd : (nq+2nk)*hd] (k then v,
// exactly the slot's layout) into the slot. Grid-stride over the row's 32-bit words, 4 at a
// time (16-byte copies) when nk*hd is a multiple of 8 and the buffers 16-byte aligned, else
// one, so any grid is correct; the example sizes it grid (ceil(rows*nk*hd/4/256)), block
// (256), when it can.
extern "C" __global__ void kv_write_bf16(const bf16* __restrict__ qkv,
                                         const int* __restrict__ slot_mapping,
                                         uint8_t* __restrict__ kv, int rows, int nq, int nk,
                                         int hd) {
  pdl_begin();
  const int words = nk * hd;  // (k + v) bf16 per row / 2
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const uintptr_t bases = reinterpret_cast<uintptr_t>(qkv) | reinterpret_cast<uintptr_t>(kv) |
                          (uintptr_t)(nq * hd * 2);
  if (words % 4 == 0 && bases % 16 == 0) {
    const int quads = words / 4;
    for (long long v = first; v < (long long)rows * quads; v += stride) {
      const long long row = v / quads;
      const int q = (int)(v % quads);
      const long long slot = slot_mapping[row];
      if (slot < 0) continue;  // a padding row owns no slot
      const uint4* src = reinterpret_cast<const uint4*>(
          qkv + row * (long long)(nq + 2 * nk) * hd + nq * hd);
      reinterpret_cast<uint4*>(kv + slot * 4LL * words)[q] = src[q];
    }
    return;
  }
  for (long long idx = first; idx < (long long)rows * words; idx += stride) {
    const long long row = idx / words;
    const int w = (int)(idx % words);
    const long long slot = slot_mapping[row];
    if (slot < 0) continue;
    const uint32_t* src =
        reinterpret_cast<const uint32_t*>(qkv + row * (long long)(nq + 2 * nk) * hd + nq * hd);
    reinterpret_cast<uint32_t*>(kv + slot * 4LL * words)[w] = src[w];
  }
}
