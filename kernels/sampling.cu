// Module `sampling`: greedy sampling.
#include "common.cuh"

#define ARGMAX_THREADS 256

// Larger value wins; on a tie the smaller index (np.argmax picks the first maximum).
__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
  if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
}

// tokens[r] = argmax(logits[r, :vocab]). One block of 256 threads per row.
// grid (rows), block (256).
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_f32(const float* __restrict__ logits, int* __restrict__ tokens, int rows, int vocab) {
  pdl_begin();
  __shared__ float sv[ARGMAX_THREADS / 32];
  __shared__ int si[ARGMAX_THREADS / 32];
  const int row = blockIdx.x;
  if (row >= rows) return;
  const float* x = logits + (long long)row * vocab;
  float v = -INFINITY;
  int idx = 0x7fffffff;
  for (int c = threadIdx.x; c < vocab; c += ARGMAX_THREADS) better(v, idx, x[c], c);
  for (int o = 16; o > 0; o >>= 1)
    better(v, idx, __shfl_xor_sync(FULL_MASK, v, o), __shfl_xor_sync(FULL_MASK, idx, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) { sv[warp] = v; si[warp] = idx; }
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int k = 1; k < ARGMAX_THREADS / 32; ++k) better(v, idx, sv[k], si[k]);
  tokens[row] = idx == 0x7fffffff ? 0 : idx;
}
