// Shared helpers of the kern kernel library (included by every kernels/*.cu module).
//
// Conventions of every kernel here:
// * entries are extern "C" (unmangled) so manifests name them directly;
// * bf16 rounds to nearest even (__float2bfloat16), arithmetic accumulates in f32;
// * no atomics and fixed reduction orders, so a launch gives the same bits every time
//   (whole-vs-cut comparisons on the GPU are bitwise);
// * pointers are the buffer/state base plus the call's byte offset; row counts arrive as
//   i32 params and grids are sized by the manifest from the same vars;
// * every entry starts with `pdl_begin()` (the GEMVs with their own prologue): it waits for the
//   kernel before it in the stream to finish before touching memory, so the cuda backend may
//   launch it with programmatic stream serialization (its blocks start while that kernel
//   drains). kernels/build.py marks the modules `"waits": true`; tests/test_kernel_library.py
//   checks that every entry keeps this shape.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;
typedef __nv_bfloat162 bf162;

#define FULL_MASK 0xffffffffu
#define LOG2E 1.4426950408889634f

// Programmatic dependent launch (sm_90). `griddepcontrol.wait` returns once the kernels this
// one depends on have finished and their writes are visible; launched without the attribute
// it returns at once. `launch_dependents` lets the next kernel's blocks be scheduled: issued
// after the wait, at most two kernels are resident at a time (this one and the next, waiting).
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

__device__ __forceinline__ void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ void pdl_begin() {
  pdl_wait();
  pdl_launch_dependents();
}

__device__ __forceinline__ float warp_sum(float v) {
  // Butterfly: every lane ends with the same value, computed in the same order.
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}

__device__ __forceinline__ float round_bf16(float x) {
  return __bfloat162float(__float2bfloat16(x));
}

// Two bf16 packed in a 32-bit word (low half = lower address) as two floats; exact.
__device__ __forceinline__ float2 unpack_bf16x2(uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t l = __bfloat16_as_ushort(__float2bfloat16(lo));
  uint32_t h = __bfloat16_as_ushort(__float2bfloat16(hi));
  return l | (h << 16);
}
