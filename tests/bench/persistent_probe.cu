// Issue 20's structural question, as a probe (tests/bench/persistent_probe.py): how fast can one
// persistent kernel stream a decode step's chain of GEMVs, each needing the one before it,
// against the same GEMVs as a CUDA graph of launches?
//
// A chain is `count` GEMVs y_j[m, n_j] = x_j[m, k_j] . W_j[n_j, k_j]^T (bf16 in, f32 accumulate,
// bf16 out) where x_{j+1} is y_j read with row stride n_j (its first k_{j+1} columns), so each
// GEMV depends on the whole of the one before, as qkv -> o_proj -> gate_up -> down -> qkv do in
// the model (the norms, rope, attention and activation between them left out).
//
// The arithmetic is kernels/gemv.cu's whole-tile loop (a 16-row tile, WARPS warps over k, lane
// (g, t) loads 16 bytes of rows g and g + 8, UNROLL chunks of a warp in flight, mma.m16n8k16,
// the warps' sums added in warp order), so every mode gives the same bits.
//
// Modes (param `mode`):
//   0 launch      one GEMV a launch (grid = its tiles); the stream orders the chain (PDL in the
//                 graph: a block waits before it loads, then lets the next launch start)
//   1 persistent  one launch for the whole chain, a block a multiprocessor (all resident at
//                 once); the chain's tiles dealt round-robin to the blocks in chain order; a
//                 block loads the next tile's W before it waits for that tile's x (a counter
//                 per GEMV, raised by every finished tile), so weights stream across the waits
//   2 unordered   as 1 without the waits: the weight stream's own rate (the results are wrong)
//   (chain_bulk_w16: as 1 with the weights through shared memory, deeper ahead: below)
// done[count] is raised if a wait gave up (about a second): the probe reports it, never hangs.
// Needs k_j % (32 * WARPS * UNROLL) == 0, n_j % 16 == 0, m <= 8, every n_j >= k_{j+1}.
#include "gemv.cuh"  // kernels/: load_stream, mma_16816; common.cuh's counters and pdl_begin

struct Gemv {
  const bf16* w;  // [n, k]
  const bf16* x;  // [m, k], row stride x_stride
  bf16* y;        // [m, n]
  int n, k, x_stride, first_tile;  // first_tile: the chain's tiles before this GEMV's
};

// x is written inside the persistent launch by other blocks: read it at L2, never through
// the non-coherent path.
__device__ __forceinline__ uint4 load_l2(const bf16* p) {
  return __ldcg(reinterpret_cast<const uint4*>(p));
}

#define MAX_CHAIN 128

// The GEMV of chain tile s: the chain is in order, so a block's cursor only moves forward.
__device__ __forceinline__ int gemv_of(const Gemv* chain, int count, int s, int j) {
  while (j + 1 < count && chain[j + 1].first_tile <= s) ++j;
  return j;
}

template <int WARPS, int UNROLL>
struct Tile {
  static constexpr int STEP = 32 * WARPS;       // elements between a warp's chunks
  static constexpr int ROUND = STEP * UNROLL;   // elements of k a round covers

  uint4 lo[UNROLL], hi[UNROLL];

  // Round r's W loads of the 16-row tile at row0 (no bounds: whole tiles, whole rounds).
  __device__ __forceinline__ void load(const Gemv& g, int row0, int r) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bf16* p = g.w + (size_t)(row0 + (lane >> 2)) * g.k + 8 * (lane & 3) + 32 * warp
                    + (size_t)r * ROUND;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      lo[u] = load_stream(p + STEP * u);
      hi[u] = load_stream(p + (size_t)8 * g.k + STEP * u);
    }
  }

  __device__ __forceinline__ void multiply(const Gemv& g, int m, int r, float (&acc)[4]) const {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, row = lane >> 2;
    const bf16* a = g.x + (size_t)row * g.x_stride + 8 * (lane & 3) + 32 * warp
                    + (size_t)r * ROUND;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    uint4 act[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) act[u] = row < m ? load_l2(a + STEP * u) : zero;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      mma_16816(acc, lo[u].x, hi[u].x, lo[u].y, hi[u].y, act[u].x, act[u].y);
      mma_16816(acc, lo[u].z, hi[u].z, lo[u].w, hi[u].w, act[u].z, act[u].w);
    }
  }
};

// The warps' sums in warp order, y = bf16; the barrier after orders the stores before the
// count thread 0 raises (with release) for them.
template <int WARPS>
__device__ __forceinline__ void store_tile(const Gemv& g, int m, int row0, const float (&acc)[4],
                                          float (*partial)[32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < 4; ++r) partial[warp * 4 + r][lane] = acc[r];
  __syncthreads();
  if (threadIdx.x < 128) {
    const int s = threadIdx.x >> 5, l = threadIdx.x & 31;
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < WARPS; ++v) sum += partial[v * 4 + s][l];
    const int row = row0 + (l >> 2) + (s >= 2 ? 8 : 0);
    const int col = 2 * (l & 3) + (s & 1);
    if (col < m) g.y[(size_t)col * g.n + row] = __float2bfloat16(sum);
  }
  __syncthreads();
}

template <int WARPS, int UNROLL>
__device__ __forceinline__ void run_chain(const Gemv* __restrict__ given, int count, int m,
                                          unsigned* __restrict__ done, unsigned epoch, int mode) {
  using T = Tile<WARPS, UNROLL>;
  __shared__ float partial[WARPS * 4][32];
  __shared__ Gemv chain[MAX_CHAIN];
  for (int i = threadIdx.x; i < count; i += blockDim.x) chain[i] = given[i];
  __syncthreads();
  const int tiles = chain[count - 1].first_tile + chain[count - 1].n / 16;
  // the GEMVs whose x this block knows complete: every thread keeps the same count (the
  // branch below must be block-uniform, it holds a barrier); GEMV 0's x is an input
  int ready = mode == 1 ? 1 : count;

  int s = blockIdx.x;
  if (s >= tiles) return;
  int j = gemv_of(chain, count, s, 0);
  int row0 = (s - chain[j].first_tile) * 16, r = 0;
  T cur;
  cur.load(chain[j], row0, 0);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  while (true) {
    const Gemv& g = chain[j];
    const int rounds = g.k / T::ROUND;
    // the item after this one: the tile's next round, else the block's next tile
    int nj = j, ns = s, nrow0 = row0, nr = r + 1;
    if (nr == rounds) {
      ns = s + gridDim.x;
      nr = 0;
      if (ns < tiles) {
        nj = gemv_of(chain, count, ns, j);
        nrow0 = (ns - chain[nj].first_tile) * 16;
      }
    }
    T next;
    if (ns < tiles) next.load(chain[nj], nrow0, nr);  // in flight across the wait below
    if (j >= ready) {  // x_j is y_{j-1}: complete once every tile of it has been raised
      if (threadIdx.x == 0) {
        const unsigned target = epoch * (unsigned)(chain[j - 1].n / 16);
        // bounded (about a second): a dependency bug raises done[count] instead of hanging
        for (int spins = 0; (int)(load_acquire(done + j - 1) - target) < 0; ++spins) {
          if (spins == (1 << 24)) {
            atomicExch(done + count, 1u);
            break;
          }
        }
      }
      __syncthreads();
      ready = j + 1;
    }
    cur.multiply(g, m, r, acc);
    if (r + 1 == rounds) {
      store_tile<WARPS>(g, m, row0, acc, partial);
      if (threadIdx.x == 0 && mode != 0) raise_release(done + j);
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[q] = 0.f;
    }
    if (ns >= tiles) break;
    j = nj, s = ns, row0 = nrow0, r = nr;
    cur = next;
  }
}

// chain_w16: 16 warps, 4 chunks a warp in flight (kernels/gemv.cu's _w16 loop).
extern "C" __global__ void __launch_bounds__(512, 1)
    chain_w16(const Gemv* chain, int count, int m, unsigned* done, unsigned epoch, int mode) {
  pdl_begin();
  run_chain<16, 4>(chain, count, m, done, epoch, mode);
}

// chain_w8: 8 warps (the mb1 loop), two blocks a multiprocessor in the persistent modes.
extern "C" __global__ void __launch_bounds__(256, 2)
    chain_w8(const Gemv* chain, int count, int m, unsigned* done, unsigned epoch, int mode) {
  pdl_begin();
  run_chain<8, 4>(chain, count, m, done, epoch, mode);
}

// ---- mode 3, "bulk": the weights through a ring of shared memory ------------------------------
// As `persistent`, but a block's weights come into a ring of BULK_STAGES rounds of shared
// memory by bulk copies (the TMA engine: a 4 KB row segment each, completion on the stage's
// mbarrier), issued BULK_STAGES - 1 rounds ahead of the one being multiplied, so 130 KB a
// multiprocessor (17 MB over 132) stay in flight across the waits instead of one round in
// registers (64 KB). Rows sit BULK_PITCH bytes apart (4096 + 64) so the lanes of a 16-byte
// shared load fall in distinct banks. 16 warps, whole rounds of 2048 (k % 2048 == 0).
#define BULK_STAGES 3
#define BULK_ROW 4096
#define BULK_PITCH (BULK_ROW + 64)
#define BULK_STAGE_BYTES (16 * BULK_PITCH)

struct Cursor {  // a block's items (tile s, round r), in its deal order
  int s, j, r;
};

__device__ __forceinline__ Cursor bulk_next(const Gemv* chain, int count, int tiles, Cursor c) {
  if (++c.r < chain[c.j].k / 2048) return c;
  c.s += gridDim.x;
  c.r = 0;
  if (c.s < tiles) c.j = gemv_of(chain, count, c.s, c.j);
  return c;
}

__device__ __forceinline__ void bulk_issue(const Gemv& g, int s, int r, uint32_t dst,
                                           uint32_t bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :: "r"(bar), "r"(16 * BULK_ROW) : "memory");
  const int row0 = (s - g.first_tile) * 16;
  for (int row = 0; row < 16; ++row) {
    const bf16* src = g.w + (size_t)(row0 + row) * g.k + (size_t)r * 2048;
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1], %2, [%3];"
                 :: "r"(dst + row * BULK_PITCH), "l"(src), "r"(BULK_ROW), "r"(bar) : "memory");
  }
}

__device__ __forceinline__ void bulk_wait(uint32_t bar, int parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}

extern "C" __global__ void __launch_bounds__(512, 1)
    chain_bulk_w16(const Gemv* given, int count, int m, unsigned* done, unsigned epoch) {
  pdl_begin();
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ float partial[16 * 4][32];
  __shared__ Gemv chain[MAX_CHAIN];
  __shared__ __align__(8) uint64_t bars[BULK_STAGES];
  for (int i = threadIdx.x; i < count; i += blockDim.x) chain[i] = given[i];
  const uint32_t ring0 = (uint32_t)__cvta_generic_to_shared(ring);
  const uint32_t bar0 = (uint32_t)__cvta_generic_to_shared(bars);
  if (threadIdx.x == 0) {
    for (int i = 0; i < BULK_STAGES; ++i)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar0 + 8 * i) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int tiles = chain[count - 1].first_tile + chain[count - 1].n / 16;
  if ((int)blockIdx.x >= tiles) return;
  Cursor c = {(int)blockIdx.x, gemv_of(chain, count, blockIdx.x, 0), 0};
  Cursor p = c;  // the producer's: BULK_STAGES - 1 items ahead
  if (threadIdx.x == 0) {
    for (int i = 0; i < BULK_STAGES - 1 && p.s < tiles; ++i) {
      bulk_issue(chain[p.j], p.s, p.r, ring0 + i * BULK_STAGE_BYTES, bar0 + 8 * i);
      p = bulk_next(chain, count, tiles, p);
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  int ready = 1;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int i = 0; c.s < tiles; ++i) {
    const int stage = i % BULK_STAGES;
    if (threadIdx.x == 0 && p.s < tiles) {  // into the stage item i - 1 left (barrier below)
      const int into = (i + BULK_STAGES - 1) % BULK_STAGES;
      bulk_issue(chain[p.j], p.s, p.r, ring0 + into * BULK_STAGE_BYTES, bar0 + 8 * into);
      p = bulk_next(chain, count, tiles, p);
    }
    const Gemv& gm = chain[c.j];
    if (c.j >= ready) {
      if (threadIdx.x == 0) {
        const unsigned target = epoch * (unsigned)(chain[c.j - 1].n / 16);
        for (int spins = 0; (int)(load_acquire(done + c.j - 1) - target) < 0; ++spins) {
          if (spins == (1 << 24)) {
            atomicExch(done + count, 1u);
            break;
          }
        }
        __threadfence();
      }
      __syncthreads();
      ready = c.j + 1;
    }
    bulk_wait(bar0 + 8 * stage, (i / BULK_STAGES) & 1);
    const unsigned char* base = ring + stage * BULK_STAGE_BYTES;
    const bf16* a = gm.x + (size_t)g * gm.x_stride + 8 * t + 32 * warp + (size_t)c.r * 2048;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int col = 2 * (32 * warp + 512 * u + 8 * t);  // bytes into the row segment
      const uint4 lo = *reinterpret_cast<const uint4*>(base + g * BULK_PITCH + col);
      const uint4 hi = *reinterpret_cast<const uint4*>(base + (g + 8) * BULK_PITCH + col);
      const uint4 x = g < m ? load_l2(a + 512 * u) : make_uint4(0, 0, 0, 0);
      mma_16816(acc, lo.x, hi.x, lo.y, hi.y, x.x, x.y);
      mma_16816(acc, lo.z, hi.z, lo.w, hi.w, x.z, x.w);
    }
    if (c.r + 1 == gm.k / 2048) {
      store_tile<16>(gm, m, (c.s - gm.first_tile) * 16, acc, partial);
      if (threadIdx.x == 0) raise_release(done + c.j);
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[q] = 0.f;
    } else {
      __syncthreads();  // every warp is done with the stage before it is refilled
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // reads before the copy
    c = bulk_next(chain, count, tiles, c);
  }
}

// Weights and inputs without a host copy: bf16 of a hash, uniform in [-scale, scale).
extern "C" __global__ void fill_bf16(bf16* p, long long count, unsigned seed, float scale) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count;
       i += (long long)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 0x9E3779B1u ^ seed;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    p[i] = __float2bfloat16(((h >> 8) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * scale);
  }
}
