// Module `rope`: rotary position embedding (neox style: rotate the two halves of a head).
#include "common.cuh"

// table[p, i] = cos(p * theta^(-2i/hd)), table[p, hd/2 + i] = sin(...), for p < max_pos,
// i < hd/2. Computed in double (run once at load) so the f32 table is correctly rounded.
// grid (ceil(max_pos*hd/2/256)), block (256).
extern "C" __global__ void rope_table_f32(float* __restrict__ table, int max_pos, int hd,
                                          float theta) {
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

// In place on the q and k heads of packed qkv rows [q: nq*hd | k: nk*hd | v: nk*hd]:
// x1' = x1*cos - x2*sin, x2' = x2*cos + x1*sin (x1, x2 = first and second half of a head),
// cos/sin from table row positions[r]. One thread per (row, head, i < hd/2).
// grid (ceil(rows*(nq+nk)*hd/2/256)), block (256).
extern "C" __global__ void rope_neox_bf16(bf16* __restrict__ qkv,
                                          const int* __restrict__ positions,
                                          const float* __restrict__ table, int rows, int nq,
                                          int nk, int hd) {
  const int half = hd / 2;
  const int heads = nq + nk;
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)rows * heads * half) return;
  const int i = (int)(idx % half);
  const long long rh = idx / half;
  const int head = (int)(rh % heads);
  const long long row = rh / heads;
  bf16* x = qkv + row * (long long)(nq + 2 * nk) * hd + (long long)head * hd;
  const float* t = table + (long long)positions[row] * hd;
  const float c = t[i], s = t[half + i];
  const float x1 = __bfloat162float(x[i]), x2 = __bfloat162float(x[half + i]);
  x[i] = __float2bfloat16(x1 * c - x2 * s);
  x[half + i] = __float2bfloat16(x2 * c + x1 * s);
}
