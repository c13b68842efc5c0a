// The decode GEMVs' primitives, for kernels/gemv.cu (and the probes in tests/bench): a 16-byte
// weight load streamed past L1, the bf16 tensor-core product m16n8k16 accumulating in f32, and
// one k chunk of a tile as two such products.
#pragma once
#include "common.cuh"

__device__ __forceinline__ uint4 load_stream(const bf16* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void mma_16816(float* d, uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 32-wide k chunk of a 16-row tile of W (lane t's 16-byte loads `lo` and `hi`: rows g and
// g + 8) against MB blocks of 8 activation rows (`act`, the same lane's 16 bytes of each).
template <int MB>
__device__ __forceinline__ void chunk_mma(float (&acc)[MB][4], const uint4& lo, const uint4& hi,
                                          const uint4 (&act)[MB]) {
#pragma unroll
  for (int j = 0; j < MB; ++j) {
    mma_16816(acc[j], lo.x, hi.x, lo.y, hi.y, act[j].x, act[j].y);
    mma_16816(acc[j], lo.z, hi.z, lo.w, hi.w, act[j].z, act[j].w);
  }
}
