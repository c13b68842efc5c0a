// Module `rope`: rotary position embedding (neox style: rotate the two halves of a head).
#include "rope.cuh"

// table[p, i] = cos(p * theta^(-2i/hd)), table[p, hd/2 + i] = sin(...), for p < max_pos,
// i < hd/2. Computed in double (run once at load) so the f32 table is correctly rounded.
// grid (ceil(max_pos*hd/2/256)), block (256).
extern "C" __global__ void rope_table_f32(float* __restrict__ table, int max_pos, int hd,
                                          float theta) {
  pdl_begin();
  const int half = hd / 2;
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)max_pos * half) return;
  const long long pos = idx / half;
  const int i = (int)(idx % half);
  const double inv_freq = pow((double)theta, -2.0 * (double)i / (double)hd);
  const double angle = (double)pos * inv_freq;
  table[pos * hd + i] = (float)cos(angle);
  table[pos * hd + half + i] = (float)sin(angle);
}

// In place on the q and k heads of packed qkv rows [q: nq*hd | k: nk*hd | v: nk*hd]: each
// head's halves rotated, cos/sin from table row positions[r].
// Grid-stride over (row, head, i < hd/2): 4 consecutive i at a time (8-byte bf16 and 16-byte
// table loads) when hd/2 is a multiple of 4 and the buffers aligned, else one, so any grid is
// correct; the example sizes it grid (ceil(rows*(nq+nk)*hd/8/256)), block (256), when it can.
extern "C" __global__ void rope_neox_bf16(bf16* __restrict__ qkv,
                                          const int* __restrict__ positions,
                                          const float* __restrict__ table, int rows, int nq,
                                          int nk, int hd) {
  pdl_begin();
  const int half = hd / 2;
  const int heads = nq + nk;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const uintptr_t bases = reinterpret_cast<uintptr_t>(qkv) | reinterpret_cast<uintptr_t>(table);
  if (half % 4 == 0 && bases % 16 == 0) {
    const int quads = half / 4;
    for (long long v = first; v < (long long)rows * heads * quads; v += stride) {
      const int i = (int)(v % quads) * 4;
      const long long rh = v / quads;
      const int head = (int)(rh % heads);
      const long long row = rh / heads;
      rope_quad(qkv + row * (long long)(nq + 2 * nk) * hd + (long long)head * hd,
                table + (long long)positions[row] * hd, half, i);
    }
    return;
  }
  for (long long idx = first; idx < (long long)rows * heads * half; idx += stride) {
    const int i = (int)(idx % half);
    const long long rh = idx / half;
    const int head = (int)(rh % heads);
    const long long row = rh / heads;
    bf16* x = qkv + row * (long long)(nq + 2 * nk) * hd + (long long)head * hd;
    rope_pair(x, table + (long long)positions[row] * hd, half, i);
  }
}
