// Module `embed`: token embedding gather.
#include "common.cuh"

// out[r, :] = table[ids[r], :] for r < rows. One block per row; hidden % 8 == 0 (16-byte copies).
// grid (rows), block (128).
extern "C" __global__ void embedding_gather_bf16(const int* __restrict__ ids,
                                                 const bf16* __restrict__ table,
                                                 bf16* __restrict__ out, int rows, int hidden) {
  pdl_begin();
  const int row = blockIdx.x;
  if (row >= rows) return;
  const long long id = ids[row];
  const uint4* src = reinterpret_cast<const uint4*>(table + id * hidden);
  uint4* dst = reinterpret_cast<uint4*>(out + (long long)row * hidden);
  for (int i = threadIdx.x; i < hidden / 8; i += blockDim.x) dst[i] = src[i];
}
