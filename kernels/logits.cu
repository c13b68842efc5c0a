// Module `logits`: logits processing before sampling, and the logprobs of the processed rows.
//
// The ABI is kernels/logits_ref.py's (the numpy reference the cpu backend runs): per processed
// row b of a call, LOGIT_WORDS uint32 words (0 logits row, 1 presence, 2 frequency,
// 3 repetition as f32 bits, 4 flags, 5 the sequence's state slot, 6 top logprobs wanted);
// per state slot s, rows of `counts` (i32 [vocab]), `seen` (u8 [vocab]), `bias` (f32 [vocab])
// and `allow` (u32 [ceil(vocab / 32)]); per processed row b, a row of `step_allow` (this
// step's grammar mask) and of `results` (RESULT_WORDS words).
//
// `logits_process_f32` changes each element by one correctly rounded f32 operation a rule
// (__f*_rn: no contraction into an fma), so it gives the reference's bits. The logprobs'
// sum of exponentials is a block reduction (its order is not numpy's): within an ulp or two
// of the reference, and the top tokens are the reference's where no two logprobs tie.
// Launched in this order on the stream: process, logprobs, the sampler, accept.
#include "common.cuh"

#define LOGIT_THREADS 1024
#define ACCEPT_THREADS 64
#define LOGIT_WORDS 8
#define TOP_MAX 20
#define RESULT_WORDS (4 + 2 * TOP_MAX)
#define HAS_BIAS 1u
#define HAS_MASK 2u
#define HAS_STEP_MASK 4u
#define HAS_LOGPROBS 8u

__device__ __forceinline__ bool bit_set(const uint32_t* __restrict__ row, int t) {
  return (row[t >> 5] >> (t & 31)) & 1u;
}

// Larger value wins; on a tie the smaller index (a stable sort of -logp picks it first).
__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
  if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
}

// The block's best (value, index) pair, in every thread. `sv`, `si`: 32 entries each.
__device__ __forceinline__ void block_best(float& v, int& i, float* sv, int* si) {
  for (int o = 16; o > 0; o >>= 1)
    better(v, i, __shfl_xor_sync(FULL_MASK, v, o), __shfl_xor_sync(FULL_MASK, i, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // the previous round's readers are done with sv, si
  if (lane == 0) { sv[warp] = v; si[warp] = i; }
  __syncthreads();
  v = -INFINITY; i = 0x7fffffff;
  if (lane < LOGIT_THREADS / 32) { v = sv[lane]; i = si[lane]; }
  for (int o = 16; o > 0; o >>= 1)
    better(v, i, __shfl_xor_sync(FULL_MASK, v, o), __shfl_xor_sync(FULL_MASK, i, o));
}

__device__ __forceinline__ float block_reduce(float v, float* s, bool is_max) {
  v = is_max ? warp_max(v) : warp_sum(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) s[warp] = v;
  __syncthreads();
  v = lane < LOGIT_THREADS / 32 ? s[lane] : (is_max ? -INFINITY : 0.0f);
  return is_max ? warp_max(v) : warp_sum(v);
}

// Penalties, bias and masks on each processed row, in place (logits_ref.process_logits).
// grid (n), block (1024).
extern "C" __global__ void __launch_bounds__(LOGIT_THREADS)
logits_process_f32(float* __restrict__ logits, const uint32_t* __restrict__ words,
                   const int* __restrict__ counts, const uint8_t* __restrict__ seen,
                   const float* __restrict__ bias, const uint32_t* __restrict__ allow,
                   const uint32_t* __restrict__ step_allow, int n, int vocab, int stride) {
  pdl_begin();
  const int b = blockIdx.x;
  if (b >= n) return;
  const uint32_t* w = words + (long long)b * LOGIT_WORDS;
  float* x = logits + (long long)w[0] * stride;
  const long long slot = w[5];
  const int mask_words = (vocab + 31) >> 5;
  const float presence = __uint_as_float(w[1]), frequency = __uint_as_float(w[2]);
  const float repetition = __uint_as_float(w[3]);
  const uint32_t flags = w[4];
  const int* c = counts + slot * vocab;
  const uint8_t* s = seen + slot * vocab;
  const float* add = bias + slot * vocab;
  const uint32_t* al = allow + slot * mask_words;
  const uint32_t* sa = step_allow + (long long)b * mask_words;
  const bool repeats = repetition != 1.0f, penalised = frequency != 0.0f || presence != 0.0f;
  for (int t = threadIdx.x; t < vocab; t += LOGIT_THREADS) {
    float v = x[t];
    if (repeats && s[t]) v = v > 0.0f ? __fdiv_rn(v, repetition) : __fmul_rn(v, repetition);
    if (penalised) {
      const float k = __int2float_rn(c[t]);
      v = __fsub_rn(v, __fadd_rn(__fmul_rn(frequency, k),
                                 __fmul_rn(presence, k > 0.0f ? 1.0f : 0.0f)));
    }
    if (flags & HAS_BIAS) v = __fadd_rn(v, add[t]);
    if ((flags & HAS_MASK) && !bit_set(al, t)) v = -INFINITY;
    if ((flags & HAS_STEP_MASK) && !bit_set(sa, t)) v = -INFINITY;
    x[t] = v;
  }
}

// The log-softmax's max and log-sum of each row asking for logprobs, and its top words[6]
// tokens by logprob (ties: the smaller id first) with their logprobs (logits_ref.logprobs).
// grid (n), block (1024).
extern "C" __global__ void __launch_bounds__(LOGIT_THREADS)
logits_logprobs_f32(const float* __restrict__ logits, const uint32_t* __restrict__ words,
                    float* __restrict__ results, int n, int vocab, int stride) {
  pdl_begin();
  __shared__ float sv[32];
  __shared__ int si[32];
  const int b = blockIdx.x;
  if (b >= n) return;
  const uint32_t* w = words + (long long)b * LOGIT_WORDS;
  if (!(w[4] & HAS_LOGPROBS)) return;
  const float* x = logits + (long long)w[0] * stride;
  float* out = results + (long long)b * RESULT_WORDS;
  float m = -INFINITY;
  for (int t = threadIdx.x; t < vocab; t += LOGIT_THREADS) m = fmaxf(m, x[t]);
  m = block_reduce(m, sv, true);
  float sum = 0.0f;
  for (int t = threadIdx.x; t < vocab; t += LOGIT_THREADS) sum += expf(__fsub_rn(x[t], m));
  const float log_sum = logf(block_reduce(sum, sv, false));
  if (threadIdx.x == 0) { out[1] = m; out[2] = log_sum; }
  const int k = min(min((int)w[6], TOP_MAX), vocab);
  float last_v = INFINITY;
  int last_i = -1;
  for (int r = 0; r < k; ++r) {
    float v = -INFINITY;
    int i = 0x7fffffff;
    for (int t = threadIdx.x; t < vocab; t += LOGIT_THREADS) {
      const float lp = __fsub_rn(__fsub_rn(x[t], m), log_sum);
      if (lp < last_v || (lp == last_v && t > last_i)) better(v, i, lp, t);
    }
    block_best(v, i, sv, si);
    if (threadIdx.x == 0) { out[4 + r] = __int_as_float(i); out[4 + TOP_MAX + r] = v; }
    last_v = v;
    last_i = i;
  }
}

// After the sampler: each processed row's token (from the call's token output) into its
// results, the token's logprob where asked for, and the sequence's counts and seen updated
// on the device (logits_ref.accept). grid (ceil(n / 64)), block (64).
extern "C" __global__ void __launch_bounds__(ACCEPT_THREADS)
logits_accept_f32(const float* __restrict__ logits, const uint32_t* __restrict__ words,
                  const int* __restrict__ tokens, int* __restrict__ counts,
                  uint8_t* __restrict__ seen, float* __restrict__ results, int n, int vocab,
                  int stride) {
  pdl_begin();
  const int b = blockIdx.x * ACCEPT_THREADS + threadIdx.x;
  if (b >= n) return;
  const uint32_t* w = words + (long long)b * LOGIT_WORDS;
  const int t = tokens[w[0]];
  float* out = results + (long long)b * RESULT_WORDS;
  out[3] = __int_as_float(t);
  if (t < 0 || t >= vocab) return;
  if (w[4] & HAS_LOGPROBS)
    out[0] = __fsub_rn(__fsub_rn(logits[(long long)w[0] * stride + t], out[1]), out[2]);
  const long long at = (long long)w[5] * vocab + t;
  counts[at] += 1;
  seen[at] = 1;
}
