// Bandwidth probes for decode-shaped weight streams (tests/bench/gemv_probe.py): W [n, k] bf16,
// read once, no math: the GEMV's own access pattern, coalesced rows, TMA bulk copies.
#include <stdint.h>
#include <cuda_bf16.h>

__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// The GEMV's pattern: block of 16 rows, 8 warps over 32-wide k chunks, lane (g, t) 16 B of rows
// g and g + 8, 4 chunks in flight, next 4 loaded while the current are "used".
extern "C" __global__ void __launch_bounds__(256) probe_gemvlike(const __nv_bfloat16* w, int n, int k, uint32_t* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16, chunks = k >> 5;
  const __nv_bfloat16* lo_p = w + (size_t)(row0 + g) * k + 8 * t;
  const __nv_bfloat16* hi_p = lo_p + (size_t)8 * k;
  uint32_t acc = 0;
  uint4 lo[4], hi[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) { int ch = warp + 8 * u; lo[u] = ch < chunks ? ld_stream(lo_p + 32 * ch) : make_uint4(0,0,0,0); hi[u] = ch < chunks ? ld_stream(hi_p + 32 * ch) : make_uint4(0,0,0,0); }
  for (int base = warp; base < chunks; base += 32) {
    uint4 l2[4], h2[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) { l2[u] = lo[u]; h2[u] = hi[u]; }
    const int next = base + 32;
    if (next < chunks) {
#pragma unroll
      for (int u = 0; u < 4; ++u) { int ch = next + 8 * u; lo[u] = ch < chunks ? ld_stream(lo_p + 32 * ch) : make_uint4(0,0,0,0); hi[u] = ch < chunks ? ld_stream(hi_p + 32 * ch) : make_uint4(0,0,0,0); }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= l2[u].x ^ l2[u].y ^ l2[u].z ^ l2[u].w ^ h2[u].x ^ h2[u].y ^ h2[u].z ^ h2[u].w;
  }
  out[blockIdx.x * 256 + threadIdx.x] = acc;
}

// Coalesced rows: warp w of 8 takes rows 2w, 2w+1 of the block's 16; a lane 16 B at a time,
// 512 B contiguous per warp instruction, every load of both rows in flight (k <= 2048 x U).
template <int PER>
__device__ __forceinline__ void rows_body(const __nv_bfloat16* w, int n, int k, uint32_t* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row0 = blockIdx.x * 16 + 2 * warp;
  uint32_t acc = 0;
  for (int c0 = 0; c0 < k; c0 += 256 * PER) {
    uint4 v[2][PER];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int c = c0 + 256 * i + 8 * lane;
        v[r][i] = c < k ? ld_stream(w + (size_t)(row0 + r) * k + c) : make_uint4(0,0,0,0);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int i = 0; i < PER; ++i)  // every load issued before the first use
        asm volatile("" : "+r"(v[r][i].x), "+r"(v[r][i].y), "+r"(v[r][i].z), "+r"(v[r][i].w));
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int i = 0; i < PER; ++i) acc ^= v[r][i].x ^ v[r][i].y ^ v[r][i].z ^ v[r][i].w;
  }
  out[blockIdx.x * 256 + threadIdx.x] = acc;
}
extern "C" __global__ void __launch_bounds__(256) probe_rows4(const __nv_bfloat16* w, int n, int k, uint32_t* out) { rows_body<4>(w, n, k, out); }
extern "C" __global__ void __launch_bounds__(256) probe_rows8(const __nv_bfloat16* w, int n, int k, uint32_t* out) { rows_body<8>(w, n, k, out); }

// Bulk copies (the TMA engine, no tensor map): a block's 16 rows, each row's k * 2 bytes in one
// cp.async.bulk into shared memory, completion on one mbarrier; then a word each is read.
extern "C" __global__ void __launch_bounds__(128) probe_bulk(const __nv_bfloat16* w, int n, int k, uint32_t* out) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t bar;
  const uint32_t b = (uint32_t)__cvta_generic_to_shared(&bar);
  const uint32_t bytes = (uint32_t)k * 2;
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(b) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(b), "r"(bytes * 16) : "memory");
    for (int r = 0; r < 16; ++r) {
      const uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem + r * (bytes + 64));
      const __nv_bfloat16* src = w + (size_t)(blockIdx.x * 16 + r) * k;
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(dst), "l"(src), "r"(bytes), "r"(b) : "memory");
    }
  }
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\nselp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(b) : "memory");
  uint32_t acc = 0;
  for (int i = threadIdx.x; i < 16 * (int)bytes / 4; i += 128 * 16) acc ^= reinterpret_cast<uint32_t*>(smem)[i];
  out[blockIdx.x * 256 + threadIdx.x] = acc;
}
