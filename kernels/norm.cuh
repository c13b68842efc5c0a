// Warp-level RMSNorm pieces shared by kernels/norm.cu and kernels/qk_rope_kv.cu: a warp
// normalizes one row (or head) of `cols` bf16, each lane V at a time (HF Qwen3RMSNorm rounding:
// the normalized value is rounded to bf16 before the bf16 weight multiplies it).
#pragma once
#include "common.cuh"

// V consecutive bf16 at p (V * 2 bytes, aligned to that) as floats, and back.
template <int V>
__device__ __forceinline__ void load_bf16(const bf16* p, float (&f)[V]) {
  uint32_t w[V / 2];
  if constexpr (V == 8) {
    const uint4 q = *reinterpret_cast<const uint4*>(p);
    w[0] = q.x; w[1] = q.y; w[2] = q.z; w[3] = q.w;
  } else if constexpr (V == 4) {
    const uint2 q = *reinterpret_cast<const uint2*>(p);
    w[0] = q.x; w[1] = q.y;
  } else {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  }
#pragma unroll
  for (int k = 0; k < V / 2; ++k) {
    const float2 v = unpack_bf16x2(w[k]);
    f[2 * k] = v.x;
    f[2 * k + 1] = v.y;
  }
}

template <int V>
__device__ __forceinline__ void store_bf16(bf16* p, const float (&f)[V]) {
  uint32_t w[V / 2];
#pragma unroll
  for (int k = 0; k < V / 2; ++k) w[k] = pack_bf16x2(f[2 * k], f[2 * k + 1]);
  if constexpr (V == 8) {
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  } else if constexpr (V == 4) {
    *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  } else {
    *reinterpret_cast<uint32_t*>(p) = w[0];
  }
}

// The elements a thread handles: from `first`, every `step` (a warp's lanes or a block's
// threads, V apiece); the sum of their squares, and y = bf16(bf16(x * r) * w) on them. x may
// alias y (each thread rewrites what it read).
template <int V>
__device__ __forceinline__ float squares(const bf16* x, int cols, int first, int step) {
  float ss = 0.f;
#pragma unroll 4
  for (int c = first; c < cols; c += step) {
    float f[V];
    load_bf16<V>(x + c, f);
#pragma unroll
    for (int k = 0; k < V; ++k) ss += f[k] * f[k];
  }
  return ss;
}

template <int V>
__device__ __forceinline__ void scale(const bf16* x, const bf16* w, bf16* y, int cols, float r,
                                      int first, int step) {
#pragma unroll 4
  for (int c = first; c < cols; c += step) {
    float v[V], g[V];
    load_bf16<V>(x + c, v);
    load_bf16<V>(w + c, g);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = round_bf16(v[k] * r) * g[k];
    store_bf16<V>(y + c, v);
  }
}

// residual += x over one row, V elements at a time a thread of the block (each thread's own,
// read back by squares and scale at the same width, so no barrier is needed between them).
template <int V>
__device__ __forceinline__ void row_add(bf16* res, const bf16* x, int cols) {
  for (int c = V * threadIdx.x; c < cols; c += V * blockDim.x) {
    float a[V], b[V];
    load_bf16<V>(res + c, a);
    load_bf16<V>(x + c, b);
#pragma unroll
    for (int k = 0; k < V; ++k) a[k] += b[k];
    store_bf16<V>(res + c, a);
  }
}

// ---- a warp per row --------------------------------------------------------------------

template <int V>
__device__ __forceinline__ void norm_row_v(const bf16* x, const bf16* w, bf16* y, int cols,
                                           float eps, int lane) {
  const float ss = warp_sum(squares<V>(x, cols, V * lane, 32 * V));
  scale<V>(x, w, y, cols, rsqrtf(ss / (float)cols + eps), V * lane, 32 * V);
}

// The widest loads the row allows: 8 (cols % 256 == 0, 16-byte aligned), 4, else 2. The same
// for every warp of a launch (cols is a launch param; the bases are the launch's pointers).
__device__ __forceinline__ int width(int cols, uintptr_t addresses) {
  if (cols % 256 == 0 && addresses % 16 == 0) return 8;
  if (cols % 128 == 0 && addresses % 8 == 0) return 4;
  return 2;
}

// The widest loads a row allows, for a block stepping V * (its threads) elements at a time
// (norm.cu's block kernels).
__device__ __forceinline__ int block_width(int cols, uintptr_t addresses) {
  if (cols % 8 == 0 && addresses % 16 == 0) return 8;
  if (cols % 4 == 0 && addresses % 8 == 0) return 4;
  return 2;
}

__device__ __forceinline__ uintptr_t bits(const void* a, const void* b, const void* c) {
  return reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) |
         reinterpret_cast<uintptr_t>(c);
}

__device__ __forceinline__ void norm_row(const bf16* x, const bf16* w, bf16* y, int cols,
                                         float eps, int lane, int v) {
  if (v == 8) norm_row_v<8>(x, w, y, cols, eps, lane);
  else if (v == 4) norm_row_v<4>(x, w, y, cols, eps, lane);
  else norm_row_v<2>(x, w, y, cols, eps, lane);
}
