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
#include "activation.cuh"  // kernels/: silu_mul
#include "gemv.cuh"  // load_stream, mma_16816; common.cuh's counters and pdl_begin

struct Gemv {
  const bf16* w;  // [n, k]
  const bf16* x;  // [m, k], row stride x_stride
  bf16* y;        // [m, n]
  int n, k, x_stride, first_tile;  // first_tile: the chain's tiles before this GEMV's
  int pre;        // chain_ws: x_j as y_{j-1} (0), its rmsnorm (1), silu_mul of its halves (2)
  int pad;
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

// chain_ws's consumers' barrier (bar 1, 512 threads): its producer and signaller warps take no
// part in it.
__device__ __forceinline__ void ws_sync() { asm volatile("bar.sync 1, 512;" ::: "memory"); }

__device__ __forceinline__ void store_relaxed(unsigned* p, unsigned v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// The warps' sums in warp order, y = bf16; the barrier after orders the stores before the
// count a thread raises (with release) for them. NAMED: the barriers are chain_ws's consumers'
// (ws_sync) rather than the block's; tag != 0: y is tagged words, (tag << 16) | bf16, stored
// relaxed (chain_ws mode 3).
template <int WARPS, bool NAMED = false>
__device__ __forceinline__ void store_tile(const Gemv& g, int m, int row0, const float (&acc)[4],
                                          float (*partial)[32], unsigned tag = 0) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < 4; ++r) partial[warp * 4 + r][lane] = acc[r];
  if (NAMED) ws_sync(); else __syncthreads();
  if (threadIdx.x < 128) {
    const int s = threadIdx.x >> 5, l = threadIdx.x & 31;
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < WARPS; ++v) sum += partial[v * 4 + s][l];
    const int row = row0 + (l >> 2) + (s >= 2 ? 8 : 0);
    const int col = 2 * (l & 3) + (s & 1);
    if (col < m) {
      const bf16 y = __float2bfloat16(sum);
      if (tag)
        store_relaxed(reinterpret_cast<unsigned*>(g.y) + (size_t)col * g.n + row,
                      tag << 16 | *reinterpret_cast<const unsigned short*>(&y));
      else
        g.y[(size_t)col * g.n + row] = y;
    }
  }
  if (NAMED) ws_sync(); else __syncthreads();
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

// ---- "ws": the weights through a ring fed by a producer warp of its own -------------------
// chain_bulk_w16 issues its bulk copies from the thread that also waits for the inputs, so the
// ring stops filling while the block waits: the stream pauses at every dependency. Here the
// block is 16 consumer warps, a producer warp (warp 16) and a signaller warp (warp 17).
// * The producer walks the block's items (tile s, columns [ITEM q, ITEM (q + 1)) of its 16
//   rows, ITEM = 512 U) in deal order and copies each into the next stage of a ring of
//   `stages` (bulk copies, a row's segment each, completion on the stage's `full` mbarrier),
//   waiting only for a free stage (`empty`, one arrival per consumer warp). It never waits for
//   an input, so while the consumers wait for the GEMV before, the ring goes on filling.
// * The consumers must drain the ring much faster than HBM fills it, or a wait leaves a
//   backlog that stalls the producer: so when a block reaches a GEMV it copies that GEMV's
//   whole x (m x k) into shared memory once (rows WS_XPAD elements apart, no bank conflicts),
//   and its items then read only shared memory. A warp's columns come in the order of the
//   launches' whole-tile loop (32 w + 512 u + 8 t, u over the tile's k), and the warps' sums
//   are added in warp order, so the bits are the launches'. Their barriers are named (bar 1,
//   512 threads): the other two warps take no part.
// * Raising a counter with release stalls the raising warp until its stores are acknowledged
//   (about a microsecond), so the signaller does it: it waits at barrier 2 for the consumers to
//   end each run of tiles of one GEMV (they arrive without waiting), then raises the GEMV's
//   counter by the run's tiles.
// Modes: 1 waits for the inputs through the counters; 2 does not (the ring's stream alone, the
// results wrong); 3 has no counters: every y word carries its launch's tag, (tag << 16) | bf16,
// stored relaxed at GPU scope, so a consumer knows an element is this launch's by reading it
// (a 32-bit word is single-copy atomic: the flag rides with the data, as in NCCL's LL
// protocol). Its x staging loads spin until every tag matches; no fence, counter or poll of a
// counter stands between a tile's store and its readers. The tag is the launch's epoch + 1,
// the epoch a word the launch's last block raises (done[count + 1]; done[count + 2] counts the
// finished blocks), so graph replays get fresh tags without a memset; mode 3's y buffers are
// words, x_0 stays bf16.
// Dynamic shared memory: x (m rows of kmax + WS_XPAD) then the ring (stages x 16 x (1024 U +
// 64) bytes). done[count] is raised if a wait gave up (about a second).
#define WS_XPAD 32
#define WS_SPINS (1 << 24)

__device__ __forceinline__ void raise_release_by(unsigned* p, unsigned n) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(n) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

__device__ __forceinline__ uint4 load_relaxed4(const unsigned* p) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

template <int U>
__device__ __forceinline__ Cursor ws_next(const Gemv* chain, int count, int tiles, Cursor c) {
  if (++c.r < chain[c.j].k / (512 * U)) return c;
  c.s += gridDim.x;
  c.r = 0;
  if (c.s < tiles) c.j = gemv_of(chain, count, c.s, c.j);
  return c;
}

// Four elements of y_{j-1} from p: bf16 (tag == 0), or tagged words, the load repeated until
// all four carry the tag. As two bf16 pairs.
__device__ __forceinline__ uint2 ws_load4(const bf16* p, unsigned tag, unsigned* gave_up) {
  if (!tag) return __ldcg(reinterpret_cast<const uint2*>(p));
  const unsigned* w = reinterpret_cast<const unsigned*>(p);
  uint4 v = load_relaxed4(w);
  for (int spins = 0; (v.x >> 16) != tag || (v.y >> 16) != tag || (v.z >> 16) != tag ||
                      (v.w >> 16) != tag; ++spins) {
    if (spins == WS_SPINS) {  // a dependency bug, never a hang
      atomicExch(gave_up, 1u);
      break;
    }
    v = load_relaxed4(w);
  }
  return make_uint2((v.x & 0xFFFFu) | v.y << 16, (v.z & 0xFFFFu) | v.w << 16);
}

// x_j into shared memory (m rows of k, xrow apart) from y_{j-1} (row stride x_stride, in
// elements, words when tagged): pre 0 copies it; pre 1 its rmsnorm (f32 mean of squares + 1e-6,
// rsqrt, times gamma, one bf16 rounding; the probe's own, not norm.cu's order); pre 2
// silu_mul (activation.cuh) of its halves, gate = columns [0, k), up = [k, 2k). `red` holds
// 16 x 8 warp sums and 8 scales. Ends with the consumers' barrier.
__device__ __forceinline__ void ws_stage_x(const Gemv& gm, int m, bf16* xs, int xrow,
                                           unsigned tag, unsigned* gave_up, const bf16* gamma,
                                           float* red) {
  const bf16* x = gm.x;
  if (!tag && gm.pre == 0) {  // a plain copy, 16 bytes a load
    const int chunks = gm.k / 8;
    for (int q = threadIdx.x; q < m * chunks; q += 512) {
      const int row = q / chunks, col = 8 * (q % chunks);
      *reinterpret_cast<uint4*>(xs + row * xrow + col) =
          load_l2(x + (size_t)row * gm.x_stride + col);
    }
    ws_sync();
    return;
  }
  const int chunks = gm.k / 4;  // 4-element chunks of a row
  const size_t word = tag ? 2 : 1;  // a tagged element takes two bf16 slots of address
  for (int q = threadIdx.x; q < m * chunks; q += 512) {
    const int row = q / chunks, col = 4 * (q % chunks);
    const bf16* at = x + ((size_t)row * gm.x_stride + col) * word;
    uint2 v = ws_load4(at, tag, gave_up);
    if (gm.pre == 2) {
      const uint2 up = ws_load4(at + (size_t)gm.k * word, tag, gave_up);
      const float2 g0 = unpack_bf16x2(v.x), g1 = unpack_bf16x2(v.y);
      const float2 u0 = unpack_bf16x2(up.x), u1 = unpack_bf16x2(up.y);
      v = make_uint2(pack_bf16x2(silu_mul(g0.x, u0.x), silu_mul(g0.y, u0.y)),
                     pack_bf16x2(silu_mul(g1.x, u1.x), silu_mul(g1.y, u1.y)));
    }
    *reinterpret_cast<uint2*>(xs + row * xrow + col) = v;
  }
  ws_sync();
  if (gm.pre != 1) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int row = 0; row < m; ++row) {
    float ss = 0.f;
    for (int c = threadIdx.x; c < gm.k; c += 512) {
      const float v = __bfloat162float(xs[row * xrow + c]);
      ss = fmaf(v, v, ss);
    }
    ss = warp_sum(ss);
    if (lane == 0) red[warp * 8 + row] = ss;
  }
  ws_sync();
  if (threadIdx.x < m) {
    float total = 0.f;
    for (int w = 0; w < 16; ++w) total += red[w * 8 + threadIdx.x];
    red[128 + threadIdx.x] = rsqrtf(total / gm.k + 1e-6f);
  }
  ws_sync();
  for (int q = threadIdx.x; q < m * gm.k; q += 512) {
    const int row = q / gm.k, c = q % gm.k;
    bf16* e = xs + row * xrow + c;
    *e = __float2bfloat16(__bfloat162float(*e) * red[128 + row] * __bfloat162float(gamma[c]));
  }
  ws_sync();
}

template <int U>
__device__ __forceinline__ void run_ws(const Gemv* __restrict__ given, int count, int m,
                                       unsigned* __restrict__ done, unsigned epoch, int mode,
                                       int stages, int kmax, const bf16* __restrict__ gamma) {
  constexpr int ROW = 1024 * U;         // bytes of a row an item covers
  constexpr int PITCH = ROW + 64;       // rows 64 bytes off the bank period: no conflicts
  constexpr int STAGE = 16 * PITCH;
  constexpr int MAX_STAGES = 16;
  extern __shared__ __align__(128) unsigned char dyn[];
  __shared__ float partial[16 * 4][32];
  __shared__ float red[16 * 8 + 8];  // ws_stage_x's norm sums
  __shared__ Gemv chain[MAX_CHAIN];
  __shared__ __align__(8) uint64_t bars[2 * MAX_STAGES];  // full[stages], empty[stages]
  for (int i = threadIdx.x; i < count; i += blockDim.x) chain[i] = given[i];
  bf16* xs = reinterpret_cast<bf16*>(dyn);
  const int xrow = kmax + WS_XPAD;
  unsigned char* ring = dyn + ((m * xrow * 2 + 127) & ~127);
  const uint32_t ring0 = (uint32_t)__cvta_generic_to_shared(ring);
  const uint32_t full0 = (uint32_t)__cvta_generic_to_shared(bars), empty0 = full0 + 8 * stages;
  if (threadIdx.x == 0) {
    for (int i = 0; i < stages; ++i) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(full0 + 8 * i) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 16;" :: "r"(empty0 + 8 * i)
                   : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // mode 3's tag: this launch's epoch + 1, read before any block can raise it (at its end)
  const unsigned tag = mode == 3 ? (*(volatile unsigned*)(done + count + 1) + 1u) & 0xFFFFu : 0u;
  __syncthreads();  // the last barrier of all 576 threads
  const int tiles = chain[count - 1].first_tile + chain[count - 1].n / 16;
  if ((int)blockIdx.x >= tiles || stages > MAX_STAGES) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const Cursor start = {(int)blockIdx.x, gemv_of(chain, count, blockIdx.x, 0), 0};

  if (warp == 16) {  // the producer
    Cursor p = start;
    for (int i = 0; p.s < tiles; ++i) {
      const int stage = i % stages;
      if (i >= stages) bulk_wait(empty0 + 8 * stage, (i / stages - 1) & 1);
      if (lane == 0)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     :: "r"(full0 + 8 * stage), "r"(16 * ROW) : "memory");
      __syncwarp();
      if (lane < 16) {
        const Gemv& gm = chain[p.j];
        const int row = (p.s - gm.first_tile) * 16 + lane;
        const bf16* src = gm.w + (size_t)row * gm.k + (size_t)p.r * 512 * U;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                     "[%0], [%1], %2, [%3];"
                     :: "r"(ring0 + stage * STAGE + lane * PITCH), "l"(src), "r"(ROW),
                        "r"(full0 + 8 * stage) : "memory");
      }
      p = ws_next<U>(chain, count, tiles, p);
    }
    return;
  }
  if (warp == 17) {  // the signaller: a run's counter raised once its tiles are stored
    if (mode != 1) return;
    int j = start.j, run = 0;
    for (int s = blockIdx.x; s < tiles; s += gridDim.x) {
      const int js = gemv_of(chain, count, s, j);
      if (js != j) {
        asm volatile("bar.sync 2, 544;" ::: "memory");
        if (lane == 0) raise_release_by(done + j, run);
        j = js, run = 0;
      }
      ++run;
    }
    asm volatile("bar.sync 2, 544;" ::: "memory");
    if (lane == 0) raise_release_by(done + j, run);
    return;
  }

  Cursor c = start;
  int staged = -1;  // the GEMV whose x is in xs
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int i = 0; c.s < tiles; ++i) {
    const int stage = i % stages;
    const Gemv& gm = chain[c.j];
    if (c.j != staged) {  // block-uniform: a new GEMV (after a tile's barriers)
      if (mode == 1 && c.j > 0) {  // x_j = y_{j-1} complete: every tile of it raised
        if (threadIdx.x == 0) {
          const unsigned target = epoch * (unsigned)(chain[c.j - 1].n / 16);
          for (int spins = 0; (int)(load_acquire(done + c.j - 1) - target) < 0; ++spins) {
            if (spins == WS_SPINS) {  // a dependency bug, never a hang
              atomicExch(done + count, 1u);
              break;
            }
          }
        }
        ws_sync();
      }
      if (c.j == 0) {  // x_0: the chain's bf16 input, as it is
        Gemv first = gm;
        first.pre = 0;
        ws_stage_x(first, m, xs, xrow, 0u, done + count, gamma, red);
      } else {
        ws_stage_x(gm, m, xs, xrow, tag, done + count, gamma, red);
      }
      staged = c.j;
    }
    const Cursor n = ws_next<U>(chain, count, tiles, c);
    bulk_wait(full0 + 8 * stage, (i / stages) & 1);
    const unsigned char* base = ring + stage * STAGE;
    const bf16* xa = xs + g * xrow + 8 * t + 32 * warp + c.r * 512 * U;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int col = 2 * (32 * warp + 512 * u + 8 * t);  // bytes into the row segment
      const uint4 lo = *reinterpret_cast<const uint4*>(base + g * PITCH + col);
      const uint4 hi = *reinterpret_cast<const uint4*>(base + (g + 8) * PITCH + col);
      const uint4 x = g < m ? *reinterpret_cast<const uint4*>(xa + 512 * u)
                            : make_uint4(0, 0, 0, 0);
      mma_16816(acc, lo.x, hi.x, lo.y, hi.y, x.x, x.y);
      mma_16816(acc, lo.z, hi.z, lo.w, hi.w, x.z, x.w);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty0 + 8 * stage);  // the warp is done with the stage
    if (c.r + 1 == gm.k / (512 * U)) {
      store_tile<16, true>(gm, m, (c.s - gm.first_tile) * 16, acc, partial, tag);
      if (mode == 1 && (n.s >= tiles || n.j != c.j))  // the run's end: the signaller raises
        asm volatile("bar.arrive 2, 544;" ::: "memory");
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[q] = 0.f;
    }
    c = n;
  }
  if (mode == 3 && threadIdx.x == 0) {  // the last block to finish raises the epoch
    if (atomicAdd(done + count + 2, 1u) == gridDim.x - 1) {
      done[count + 2] = 0;
      atomicAdd(done + count + 1, 1u);
    }
  }
}

// U = 1, 2, 4: items of 16 rows x 1, 2, 4 KB; the launch picks the stages that fit.
extern "C" __global__ void __launch_bounds__(576, 1)
    chain_ws_u1(const Gemv* chain, int count, int m, unsigned* done, unsigned epoch, int mode,
                int stages, int kmax, const bf16* gamma) {
  pdl_begin();
  run_ws<1>(chain, count, m, done, epoch, mode, stages, kmax, gamma);
}

extern "C" __global__ void __launch_bounds__(576, 1)
    chain_ws_u2(const Gemv* chain, int count, int m, unsigned* done, unsigned epoch, int mode,
                int stages, int kmax, const bf16* gamma) {
  pdl_begin();
  run_ws<2>(chain, count, m, done, epoch, mode, stages, kmax, gamma);
}

extern "C" __global__ void __launch_bounds__(576, 1)
    chain_ws_u4(const Gemv* chain, int count, int m, unsigned* done, unsigned epoch, int mode,
                int stages, int kmax, const bf16* gamma) {
  pdl_begin();
  run_ws<4>(chain, count, m, done, epoch, mode, stages, kmax, gamma);
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
