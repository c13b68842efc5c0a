// Module `persist`: a run of decode-step launches as one persistent kernel (issue 20; the cuda
// backend forms the runs: runtime/backends/persist.py, opt-in with KERNCC_PERSIST=1). Measured
// on an H200 it gives the launches' bits but a slower step (docs/benchmarks.md, session 10).
//
// A run is consecutive launches of the decode GEMVs at m <= 8 (kernels/gemv.cu's entries),
// rmsnorm_bf16, add_rmsnorm_bf16 and silu_mul_bf16: in a decode layer o_proj, post_norm,
// gate_up, act, down and the next layer's input_norm and qkv. Each launch is a *phase* of the
// table; its blocks are the phase's *tasks* (a GEMV's: its 16-row tiles, two a task for the
// 8-warp entry). The run's tasks, in phase order, are dealt round-robin to as many blocks as
// the multiprocessors hold at once (all resident); a block takes its tasks in order and, before
// a task of phase p, waits until every task of phase p - 1 has finished (a counter a phase).
// So every phase starts after the one before it has finished, as on the stream, and no
// deadlock is possible: the first unfinished task in the deal order never waits for a later
// one. What the launches could not do: a block loads its next GEMV task's weights (which no
// launch writes) before it waits, so the weight stream goes on across the dependencies, and
// there is no launch between the phases.
//
// The bits are the launches' own: a GEMV task is gemv_tile<1, WARPS, 4>'s whole-tile loop (the
// same loads, products and warp-order sums), the norms are norm.cu's block_norm with the
// launch's block size, silu_mul is activation.cuh's. Data other blocks write in this launch is
// read with plain (L1-coherent after the acquire below) or .cg loads, never the .nc path.
//
// The counters (param `sync`: [finished blocks, done[phase]...]) are zero between launches: the
// last block to finish resets them. A wait that lasts past about a second traps (the launch
// fails and the backend reports it) rather than hang or compute on stale data.
#include "activation.cuh"
#include "gemv.cuh"
#include "norm.cuh"
#include "qk_rope_kv.cuh"
#include "attention_split.cuh"

#define PERSIST_THREADS 512
#define PERSIST_WARPS 16
#define PERSIST_MAX_PHASES 32
#define PERSIST_SPINS (1 << 26)  // a poll is an L2 round trip: seconds in all

// Phase kinds.
#define PHASE_GEMV 0         // C bf16 = bf16(acc)                 p: x, w, c
#define PHASE_GEMV_ACC 1     // C bf16 = bf16(f32(C) + acc)        p: x, w, c
#define PHASE_RMSNORM 2      // y = rmsnorm(x) * w                 p: x, w, y
#define PHASE_ADD_RMSNORM 3  // r = bf16(r + x); y = rmsnorm(r) * w  p: r, x, w, y
#define PHASE_SILU_MUL 4     // act = silu_mul(gate_up)            p: gate_up, act

// One launch of the run (80 bytes; runtime/backends/persist.py packs it).
struct Phase {
  const void* p[4];
  int kind, tasks, first, m;  // first: the run's tasks before this phase's; m: rows
  int n, k, warps, threads;   // GEMV: n, k, warps a tile (8 or 16); norm: cols in n;
                              // silu: inter in n, gate/up block in k; threads: the launch's block
  float eps;
  int pad[3];
};

__device__ __forceinline__ bool is_gemv(const Phase& ph) { return ph.kind <= PHASE_GEMV_ACC; }

// Rounds of k a GEMV task takes: 4 chunks of 32 a warp, `warps` warps a tile.
__device__ __forceinline__ int rounds_of(const Phase& ph) {
  return is_gemv(ph) ? ph.k / (128 * ph.warps) : 1;
}

// ---- where a block is in its deal of the run ---------------------------------------------

struct Item {
  int task, phase, round;  // task: the run's index (blockIdx.x, + gridDim.x, ...)
};

__device__ __forceinline__ int phase_of(const Phase* table, int count, int task, int from) {
  while (from + 1 < count && table[from + 1].first <= task) ++from;
  return from;
}

__device__ __forceinline__ Item advance(const Phase* table, int count, int total, Item it) {
  if (it.round + 1 < rounds_of(table[it.phase])) return {it.task, it.phase, it.round + 1};
  const int task = it.task + gridDim.x;
  if (task >= total) return {total, count, 0};
  return {task, phase_of(table, count, task, it.phase), 0};
}

// The first GEMV item at or after `it` (its weights are what a block loads ahead).
__device__ __forceinline__ Item next_gemv(const Phase* table, int count, int total, Item it) {
  while (it.task < total && !is_gemv(table[it.phase])) it = advance(table, count, total, it);
  return it;
}

// ---- GEMV tasks ------------------------------------------------------------------------------

// A task's W for one round in registers: warp w takes tile `half` of the task (w / warps) and
// chunks w % warps, + warps, ... of the round (gemv_tile's whole-tile loop).
struct Weights {
  uint4 lo[4], hi[4];

  __device__ __forceinline__ void load(const Phase& ph, const Item& it) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int half = warp / ph.warps, wl = warp % ph.warps, step = 32 * ph.warps;
    const int tile = ph.warps == 16 ? it.task - ph.first : 2 * (it.task - ph.first) + half;
    if (16 * tile >= ph.n) return;  // the second tile of an odd count's last task
    const bf16* w = static_cast<const bf16*>(ph.p[1]);
    const bf16* p = w + (size_t)(16 * tile + (lane >> 2)) * ph.k + 8 * (lane & 3) + 32 * wl
                    + (size_t)it.round * 4 * step;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      lo[u] = load_stream(p + step * u);
      hi[u] = load_stream(p + (size_t)8 * ph.k + step * u);
    }
  }
};

__device__ __forceinline__ void gemv_round(const Phase& ph, const Item& it, const Weights& w,
                                           float (&acc)[4]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, row = lane >> 2;
  const int half = warp / ph.warps, wl = warp % ph.warps, step = 32 * ph.warps;
  const int tile = ph.warps == 16 ? it.task - ph.first : 2 * (it.task - ph.first) + half;
  if (16 * tile >= ph.n) return;
  const bf16* a = static_cast<const bf16*>(ph.p[0]) + (size_t)row * ph.k + 8 * (lane & 3)
                  + 32 * wl + (size_t)it.round * 4 * step;
  uint4 act[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    act[u] = row < ph.m ? __ldcg(reinterpret_cast<const uint4*>(a + step * u))
                        : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    mma_16816(acc, w.lo[u].x, w.hi[u].x, w.lo[u].y, w.hi[u].y, act[u].x, act[u].y);
    mma_16816(acc, w.lo[u].z, w.hi[u].z, w.lo[u].w, w.hi[u].w, act[u].z, act[u].w);
  }
}

// The warps' sums of each tile in warp order (threads 128 * half .. of tile `half`), stored
// as gemv.cu stores them.
__device__ __forceinline__ void gemv_store(const Phase& ph, const Item& it,
                                           const float (&acc)[4], float (*partial)[32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < 4; ++r) partial[warp * 4 + r][lane] = acc[r];
  __syncthreads();
  const int half = threadIdx.x >> 7;
  const int tile = ph.warps == 16 ? it.task - ph.first : 2 * (it.task - ph.first) + half;
  if (half < PERSIST_WARPS / ph.warps && 16 * tile < ph.n) {
    const int s = (threadIdx.x >> 5) & 3, l = lane;
    float sum = 0.f;
    for (int v = 0; v < ph.warps; ++v) sum += partial[(half * ph.warps + v) * 4 + s][l];
    const int row = 16 * tile + (l >> 2) + (s >= 2 ? 8 : 0);
    const int col = 2 * (l & 3) + (s & 1);
    if (col < ph.m) {
      bf16* out = static_cast<bf16*>(const_cast<void*>(ph.p[2]));
      const size_t at = (size_t)col * ph.n + row;
      if (ph.kind == PHASE_GEMV_ACC) sum += __bfloat162float(out[at]);
      out[at] = __float2bfloat16(sum);
    }
  }
  __syncthreads();
}

// ---- the small phases: one task is one block of the launch, `threads` of this block's ------

// norm.cu's block_sum over the launch's `threads` (a whole number of warps); the threads past
// them add nothing but meet every barrier (`sync`: the block's, or persist_ws_bf16's
// consumers' named one).
struct BlockSync {
  __device__ __forceinline__ void operator()() const { __syncthreads(); }
};

template <class Sync = BlockSync>
__device__ __forceinline__ float task_sum(float v, float* scratch, int threads,
                                          Sync sync = Sync()) {
  v = warp_sum(v);
  sync();
  if ((threadIdx.x & 31) == 0 && (int)threadIdx.x < threads) scratch[threadIdx.x >> 5] = v;
  sync();
  float total = 0.f;
  for (int i = 0; i < threads >> 5; ++i) total += scratch[i];
  return total;
}

template <int V>
__device__ __forceinline__ void task_norm(const bf16* x, const bf16* w, bf16* y, int cols,
                                          float eps, float* scratch, int threads) {
  const bool in = (int)threadIdx.x < threads;
  const int first = V * threadIdx.x, step = V * threads;
  const float ss = task_sum(in ? squares<V>(x, cols, first, step) : 0.f, scratch, threads);
  if (in) scale<V>(x, w, y, cols, rsqrtf(ss / (float)cols + eps), first, step);
}

struct TaskThreads {  // the first `n` threads: the launch's block inside this one
  unsigned n;
  __device__ __forceinline__ unsigned thread() const { return threadIdx.x; }
  __device__ __forceinline__ unsigned count() const { return n; }
};

template <int V>
__device__ __forceinline__ void norm_rows(const Phase& ph, int block, float* scratch) {
  const bool add = ph.kind == PHASE_ADD_RMSNORM;
  bf16* res = static_cast<bf16*>(const_cast<void*>(ph.p[0]));
  const bf16* x = static_cast<const bf16*>(ph.p[add ? 1 : 0]);
  const bf16* w = static_cast<const bf16*>(ph.p[add ? 2 : 1]);
  bf16* y = static_cast<bf16*>(const_cast<void*>(ph.p[add ? 3 : 2]));
  for (int row = block; row < ph.m; row += ph.tasks) {
    const long long off = (long long)row * ph.n;
    if (add) {
      if ((int)threadIdx.x < ph.threads)
        row_add<V>(res + off, x + off, ph.n, TaskThreads{(unsigned)ph.threads});
      task_norm<V>(res + off, w, y + off, ph.n, ph.eps, scratch, ph.threads);
    } else {
      task_norm<V>(x + off, w, y + off, ph.n, ph.eps, scratch, ph.threads);
    }
  }
}

// rmsnorm_bf16 / add_rmsnorm_bf16's block `block` (rows block, + tasks, ...).
__device__ __forceinline__ void norm_task(const Phase& ph, int block, float* scratch) {
  uintptr_t bases = reinterpret_cast<uintptr_t>(ph.p[0]) | reinterpret_cast<uintptr_t>(ph.p[1])
                    | reinterpret_cast<uintptr_t>(ph.p[2]) | (uintptr_t)(ph.n * 2);
  if (ph.kind == PHASE_ADD_RMSNORM) bases |= reinterpret_cast<uintptr_t>(ph.p[3]);
  const int v = block_width(ph.n, bases);
  if (v == 8) norm_rows<8>(ph, block, scratch);
  else if (v == 4) norm_rows<4>(ph, block, scratch);
  else norm_rows<2>(ph, block, scratch);
}

// silu_mul_bf16's block `block` of `tasks` (its grid-stride loops, `threads` a block).
__device__ __forceinline__ void silu_task(const Phase& ph, int block) {
  if ((int)threadIdx.x >= ph.threads) return;
  silu_mul_span<true>(static_cast<const bf16*>(ph.p[0]),
                      static_cast<bf16*>(const_cast<void*>(ph.p[1])), ph.m, ph.n, ph.k,
                      ph.tasks, block, ph.threads, threadIdx.x);
}

// ---- ordering ------------------------------------------------------------------------------

// Every task of phase p - 1 finished (block-uniform: every thread passes the same p).
__device__ __forceinline__ void wait_phase(const Phase* table, unsigned* done, int p) {
  if (threadIdx.x == 0) {
    const unsigned target = (unsigned)table[p - 1].tasks;
    for (int spins = 0; load_acquire(done + p - 1) < target; ++spins) {
      if (spins == PERSIST_SPINS) asm volatile("trap;");
    }
    __threadfence();
  }
  __syncthreads();
}

__device__ __forceinline__ void task_done(unsigned* done, int p) {
  // every thread's stores before the count: the barrier orders them before thread 0's
  // release, which (cumulative) makes them visible with it
  __syncthreads();
  if (threadIdx.x == 0) raise_release(done + p);
}

// The last block out resets the counters for the next launch (every other block is past its
// last wait by then).
__device__ __forceinline__ void finish(unsigned* sync, int count) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  if (atomicAdd(sync, 1u) != gridDim.x - 1) return;
  for (int p = 0; p < count; ++p) sync[1 + p] = 0;
  sync[0] = 0;
  __threadfence();
}

// ---- what both entries do ---------------------------------------------------------------------

// The table into shared memory; the run's task count.
__device__ __forceinline__ int take_table(const Phase* given, int count, Phase* table) {
  for (int i = threadIdx.x; i < count; i += blockDim.x) table[i] = given[i];
  __syncthreads();
  return table[count - 1].first + table[count - 1].tasks;
}

// The block's first item of the run (or its end).
__device__ __forceinline__ Item first_item(const Phase* table, int count, int total) {
  if ((int)blockIdx.x >= total) return {total, count, 0};
  return {(int)blockIdx.x, phase_of(table, count, blockIdx.x, 0), 0};
}

// A GEMV round done: the task's last stores its tiles and counts it; acc starts again.
__device__ __forceinline__ bool gemv_finish(const Phase& ph, const Item& it, float (&acc)[4],
                                            float (*partial)[32], unsigned* done) {
  if (it.round + 1 != rounds_of(ph)) return false;
  gemv_store(ph, it, acc, partial);
  task_done(done, it.phase);
#pragma unroll
  for (int q = 0; q < 4; ++q) acc[q] = 0.f;
  return true;
}

// A small task: the launch's block `it.task - first` of its norm or silu_mul, counted.
__device__ __forceinline__ void small_task(const Phase& ph, const Item& it, float* scratch,
                                           unsigned* done) {
  const int block = it.task - ph.first;
  if (ph.kind == PHASE_SILU_MUL) silu_task(ph, block);
  else norm_task(ph, block, scratch);
  task_done(done, it.phase);
}

// The run's phases, passed by value: a graph captures them with the launch, and nothing is
// allocated or copied per launch.
struct PersistTable {
  Phase phase[PERSIST_MAX_PHASES];
};

// grid (the multiprocessors x the blocks a multiprocessor holds: all resident), block
// (PERSIST_THREADS); `count` phases of `phases`, 2 to PERSIST_MAX_PHASES.
extern "C" __global__ void __launch_bounds__(PERSIST_THREADS, 1)
    persist_run_bf16(const PersistTable phases, int count, unsigned* __restrict__ sync) {
  pdl_begin();
  __shared__ Phase table[PERSIST_MAX_PHASES];
  __shared__ float partial[PERSIST_WARPS * 4][32];
  __shared__ float scratch[32];
  const int total = take_table(phases.phase, count, table);
  unsigned* done = sync + 1;
  int ready = 1;  // phases this block knows it may start (phase 0's inputs precede the launch)
  Item it = first_item(table, count, total);
  Item wi = next_gemv(table, count, total, it);
  Weights cur;
  if (wi.task < total) cur.load(table[wi.phase], wi);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  while (it.task < total) {
    const Phase& ph = table[it.phase];
    Weights next;
    Item ni = wi;
    if (is_gemv(ph)) {  // it == wi: load the next GEMV round's weights before any wait
      ni = next_gemv(table, count, total, advance(table, count, total, it));
      if (ni.task < total) next.load(table[ni.phase], ni);
    }
    if (it.phase >= ready) {
      wait_phase(table, done, it.phase);
      ready = it.phase + 1;
    }
    if (is_gemv(ph)) {
      gemv_round(ph, it, cur, acc);
      gemv_finish(ph, it, acc, partial, done);
      cur = next;
      wi = ni;
    } else {
      small_task(ph, it, scratch, done);
    }
    it = advance(table, count, total, it);
  }
  finish(sync, count);
}

// ---- persist_ring_bf16: the weights through a ring of shared memory ---------------------------
// The same run, its GEMV rounds' weights brought into RING_STAGES stages of shared memory by
// bulk copies (the TMA engine, a row segment each, completion counted on the stage's mbarrier)
// by thread 0 as soon as a stage is free, so RING_STAGES rounds (about 200 KB a multiprocessor,
// 26 MB over 132) are in flight across the waits and the small tasks instead of the one round
// persist_run_bf16 holds in registers. A round is 16 rows of 2048 (16 warps) or 32 rows of 1024
// (two 8-warp tiles); rows sit a segment + 64 bytes apart, so the lanes of a 16-byte shared
// load fall in distinct banks. The products and sums are persist_run_bf16's: the same bits.
#define RING_STAGES 3
#define RING_STAGE_BYTES (32 * (2048 + 64))  // the larger of 16 x (4096 + 64), 32 x (2048 + 64)
#define RING_SMEM (RING_STAGES * RING_STAGE_BYTES)

__device__ __forceinline__ int ring_pitch(const Phase& ph) { return 256 * ph.warps + 64; }

// Thread 0: the bulk copies of GEMV round `it` into the stage at `dst` (rows past n skipped).
__device__ __forceinline__ void ring_issue(const Phase& ph, const Item& it, uint32_t dst,
                                           uint32_t bar) {
  const int rows = ph.warps == 16 ? 16 : 32, bytes = 256 * ph.warps, pitch = ring_pitch(ph);
  const int row0 = rows * (it.task - ph.first);
  const int valid = min(rows, ph.n - row0);
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :: "r"(bar), "r"(valid * bytes) : "memory");
  const bf16* w = static_cast<const bf16*>(ph.p[1]) + (size_t)row0 * ph.k
                  + (size_t)it.round * 128 * ph.warps;
  for (int r = 0; r < valid; ++r) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1], %2, [%3];"
                 :: "r"(dst + r * pitch), "l"(w + (size_t)r * ph.k), "r"(bytes), "r"(bar)
                 : "memory");
  }
}

__device__ __forceinline__ void ring_wait(uint32_t bar, int parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}

// gemv_round with the round's weights from its stage: row half * 16 + g (+ 8) of the stage,
// the lane's 16 bytes of chunk u at 2 * (32 * wl + step * u + 8 * t).
__device__ __forceinline__ void gemv_round_ring(const Phase& ph, const Item& it,
                                                const unsigned char* stage, float (&acc)[4]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, row = lane >> 2;
  const int half = warp / ph.warps, wl = warp % ph.warps, step = 32 * ph.warps;
  const int tile = ph.warps == 16 ? it.task - ph.first : 2 * (it.task - ph.first) + half;
  if (16 * tile >= ph.n) return;
  const int pitch = ring_pitch(ph);
  const unsigned char* lo_row = stage + (size_t)(16 * half + row) * pitch;
  const unsigned char* hi_row = lo_row + (size_t)8 * pitch;
  const bf16* a = static_cast<const bf16*>(ph.p[0]) + (size_t)row * ph.k + 8 * (lane & 3)
                  + 32 * wl + (size_t)it.round * 4 * step;
  uint4 act[4], lo[4], hi[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    act[u] = row < ph.m ? __ldcg(reinterpret_cast<const uint4*>(a + step * u))
                        : make_uint4(0, 0, 0, 0);
    const int col = 2 * (32 * wl + step * u + 8 * (lane & 3));
    lo[u] = *reinterpret_cast<const uint4*>(lo_row + col);
    hi[u] = *reinterpret_cast<const uint4*>(hi_row + col);
  }
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    mma_16816(acc, lo[u].x, hi[u].x, lo[u].y, hi[u].y, act[u].x, act[u].y);
    mma_16816(acc, lo[u].z, hi[u].z, lo[u].w, hi[u].w, act[u].z, act[u].w);
  }
}

// grid and block as persist_run_bf16, dynamic shared memory RING_SMEM.
extern "C" __global__ void __launch_bounds__(PERSIST_THREADS, 1)
    persist_ring_bf16(const PersistTable phases, int count, unsigned* __restrict__ sync) {
  pdl_begin();
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ Phase table[PERSIST_MAX_PHASES];
  __shared__ float partial[PERSIST_WARPS * 4][32];
  __shared__ float scratch[32];
  __shared__ __align__(8) uint64_t bars[RING_STAGES];
  const uint32_t ring0 = (uint32_t)__cvta_generic_to_shared(ring);
  const uint32_t bar0 = (uint32_t)__cvta_generic_to_shared(bars);
  if (threadIdx.x == 0) {
    for (int i = 0; i < RING_STAGES; ++i)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar0 + 8 * i) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  const int total = take_table(phases.phase, count, table);  // its barrier: the mbarriers too
  unsigned* done = sync + 1;
  int ready = 1;
  Item it = first_item(table, count, total);
  Item pi = next_gemv(table, count, total, it);  // thread 0's: the next round to bring in
  int issued = 0, consumed = 0;                  // GEMV rounds (issued: thread 0's count)
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  while (it.task < total) {
    if (threadIdx.x == 0) {  // every free stage gets the next round, before any wait
      for (; issued < consumed + RING_STAGES && pi.task < total; ++issued) {
        const int stage = issued % RING_STAGES;
        ring_issue(table[pi.phase], pi, ring0 + stage * RING_STAGE_BYTES, bar0 + 8 * stage);
        pi = next_gemv(table, count, total, advance(table, count, total, pi));
      }
    }
    const Phase& ph = table[it.phase];
    if (it.phase >= ready) {
      wait_phase(table, done, it.phase);
      ready = it.phase + 1;
    }
    if (is_gemv(ph)) {
      const int stage = consumed % RING_STAGES;
      ring_wait(bar0 + 8 * stage, (consumed / RING_STAGES) & 1);
      gemv_round_ring(ph, it, ring + stage * RING_STAGE_BYTES, acc);
      if (!gemv_finish(ph, it, acc, partial, done))
        __syncthreads();  // every warp is done with the stage before it is refilled
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // reads before the copy
      ++consumed;
    } else {
      small_task(ph, it, scratch, done);
    }
    it = advance(table, count, total, it);
  }
  finish(sync, count);
}

// ---- persist_ws_bf16: a producer warp's ring, tagged words, the small kernels folded ------
// The same runs as persist_run_bf16 (runtime/backends/persist.py plans them as *units*), built
// the way tests/bench/persistent_probe.py's chain_ws measured fastest (docs/benchmarks.md,
// session 13: the small model's 96 GEMVs chained in 0.62 ms against the graph's 0.77):
// * A unit is one GEMV launch and, folded into it, the rmsnorm, add_rmsnorm, silu_mul or decode
//   attention combine launch that computes its x; or a rope launch (qk_norm_rope_kv_bf16) or a
//   split attention launch (attn_decode_split_tc_bf16), whose tasks are the launch's rows and
//   blocks: they store plain and count themselves (sync[2 + unit]), and the units after them
//   wait for the count. A block is 16 consumer warps and a producer warp.
// * The producer walks the block's weight items (16 rows x 1024 columns of a tile; a narrow
//   task's two tiles take turns, round by round) in deal order and copies each into the next
//   stage of a ring of shared memory (a 2 KB bulk copy a row: 1 KB rows halve the stream,
//   session 13; completion on the stage's `full` mbarrier), waiting only for a free stage
//   (`empty`: an arrival from every consumer warp). It never waits for an input, so the
//   weight stream goes on while the consumers wait.
// * When a block reaches a unit it stages the unit's whole x (m x k) in shared memory once,
//   computing the folded small kernel there with the launch's own arithmetic (norm.cuh's
//   squares and scale over the launch's `threads`, its warps' sums in warp order;
//   activation.cuh's silu_mul8 / silu_mul), so the bits are the launches'. The block holding
//   the unit's first task also writes the small kernel's outputs (unless a later unit
//   overwrites them whole: the plan says which by leaving a pointer null).
// * Between the units of a launch data moves as *tagged words*: an element is stored as
//   (tag << 16) | bf16 in one 32-bit word, relaxed at GPU scope, into the shadow the plan gave
//   the output, and its readers load it until the tag is this launch's (a 32-bit word is
//   single-copy atomic: the flag rides with the data, as in NCCL's LL protocol), so no
//   counter, fence or barrier across blocks stands between a store and its readers. Outputs
//   that outlive the launch are also stored plain.
// * A consumer warp's chunks are the launch's (wide: 32 w + 512 i of its tile's k, 16 warps;
//   narrow: 32 (w % 8) + 256 i, 8 warps a tile, warps 8-15 the task's second tile) and the
//   warps' sums are added in warp order: the GEMV bits are the launches'.
// * The tag is the launch's epoch (sync[0], raised by the last block to finish: graph replays
//   need no memset) mod 65535, plus 1, so never 0; when it comes round again the last block
//   clears the shadows, so a word left from 65535 launches before can never pass for this
//   one's. The plan shows at load that every plain write comes after every read of the old
//   value (runtime/backends/persist.py: `ws_units`); a wait that lasts past about a second
//   traps rather than hang.
#define WS_CONSUMERS 512
#define WS_THREADS (WS_CONSUMERS + 32)
#define WS_MAX_UNITS 160  // 23 KB of parameters (CUDA 12.1+ takes up to 32 KB)
#define WS_PITCH (2048 + 64)  // a row's 2 KB segment, rows 64 bytes off the bank period
#define WS_STAGE (16 * WS_PITCH)
#define WS_SPINS (1 << 24)

#define PRE_NONE 0
#define PRE_RMSNORM 1
#define PRE_ADD_RMSNORM 2
#define PRE_SILU 3
#define PRE_COMBINE 4  // the decode attention's combine (attn_decode_combine_bf16) folded
#define OP_GEMV 0
#define OP_GEMV_ACC 1
#define OP_ROPE 2      // qk_norm_rope_kv_bf16's rows (head dim 128)
#define OP_SPLIT 3     // attn_decode_split_tc_bf16's splits (head dim 128)
#define TAGGED_X 1  // Unit::tagged bits: the source is a shadow of tagged words
#define TAGGED_R 2
#define TAGGED_C 4

// One unit (144 bytes; runtime/backends/persist.py packs it as WS_UNIT). The fields of a GEMV
// unit are as named; a rope unit's: x qkv (its source), y qkv (stored whole), gamma the q/k norm
// weights, r positions, c the rope table, side slot_mapping, res the KV cache, m rows, n nq, k
// nk; a split unit's: x qkv, r the KV cache, c block_table, gamma seq_lens, y the partials, m
// seqs, n nq, k nk, block the table's width, pad max_splits, eps the scale; a combine folded
// into a GEMV: x the partials, r seq_lens, side its output, block max_splits. `threads` and
// `width` of a rope, split or combine: the unit whose counter it waits for, and the count.
struct Unit {
  const bf16* w;          // [n, k]
  const void* x;          // the GEMV's x (pre none), the norm's x, add_rmsnorm's x, gate_up
  const void* r;          // add_rmsnorm: the residual before
  const bf16* gamma;      // the norm's weight
  const void* c;          // GEMV_ACC: C before
  bf16* y;                // the GEMV's output, plain (null: a later unit writes it whole)
  unsigned* y_tag;        // ... tagged (null: no later unit reads it)
  bf16* side;             // the small kernel's output (normed, act), plain
  unsigned* side_tag;
  bf16* res;              // add_rmsnorm: the residual after, plain
  unsigned* res_tag;
  int op, pre, tagged;    // op: OP_*; OP_GEMV_ACC: C = bf16(C + x.W^T)
  int m, n, k, warps;     // warps a tile: 16 (wide) or 8 (narrow, two tiles a task)
  int tasks, first;       // first: the run's tasks before this unit's
  int threads, width;     // the small kernel's block and vector width (norm V; silu 8 or 1)
  int block;              // silu: the gate/up block
  float eps;
  int pad;
};
static_assert(sizeof(Unit) == 144, "runtime/backends/persist.py's WS_UNIT");

struct WsTable {
  Unit unit[WS_MAX_UNITS];
};

__device__ __forceinline__ void ws_sync() {
  asm volatile("bar.sync 1, %0;" :: "n"(WS_CONSUMERS) : "memory");
}

__device__ __forceinline__ void ws_store_tag(unsigned* p, unsigned tag, bf16 v) {
  const unsigned word = tag << 16 | *reinterpret_cast<const unsigned short*>(&v);
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(word) : "memory");
}

__device__ __forceinline__ uint4 ws_relaxed4(const unsigned* p) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned ws_relaxed1(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Four elements from element `at` of a source (bf16, or tagged words loaded until all four
// carry `tag`), as two bf16 pairs; `at` a multiple of 4.
__device__ __forceinline__ uint2 ws_load4(const void* src, bool tagged, size_t at, unsigned tag) {
  if (!tagged) return __ldcg(reinterpret_cast<const uint2*>(static_cast<const bf16*>(src) + at));
  const unsigned* p = static_cast<const unsigned*>(src) + at;
  uint4 v = ws_relaxed4(p);
  for (int spins = 0; (v.x >> 16) != tag || (v.y >> 16) != tag || (v.z >> 16) != tag ||
                      (v.w >> 16) != tag; ++spins) {
    if (spins == WS_SPINS) asm volatile("trap;");  // a dependency bug: fail, never hang
    v = ws_relaxed4(p);
  }
  return make_uint2((v.x & 0xFFFFu) | v.y << 16, (v.z & 0xFFFFu) | v.w << 16);
}

__device__ __forceinline__ float ws_load1(const void* src, bool tagged, size_t at, unsigned tag) {
  if (!tagged) return __bfloat162float(__ldcg(static_cast<const bf16*>(src) + at));
  const unsigned* p = static_cast<const unsigned*>(src) + at;
  unsigned v = ws_relaxed1(p);
  for (int spins = 0; (v >> 16) != tag; ++spins) {
    if (spins == WS_SPINS) asm volatile("trap;");
    v = ws_relaxed1(p);
  }
  return __uint_as_float((v & 0xFFFFu) << 16);
}

// count bf16 of xs (a multiple of 2, from a 4-byte boundary) out to the plain and tagged
// copies (either may be null), the consumers' threads each a pair.
__device__ __forceinline__ void ws_write_out(const bf16* xs, int count, bf16* plain,
                                             unsigned* tagged, unsigned tag) {
  for (int q = threadIdx.x; 2 * q < count; q += WS_CONSUMERS) {
    const __nv_bfloat162 v = reinterpret_cast<const __nv_bfloat162*>(xs)[q];
    if (plain) reinterpret_cast<__nv_bfloat162*>(plain)[q] = v;
    if (tagged) {
      ws_store_tag(tagged + 2 * q, tag, v.x);
      ws_store_tag(tagged + 2 * q + 1, tag, v.y);
    }
  }
}

struct WsSync {  // the consumers' barrier
  __device__ __forceinline__ void operator()() const { ws_sync(); }
};

// A row of xs normalized in place as norm.cu's block_norm over `threads` threads.
template <int V>
__device__ __forceinline__ void ws_norm_row(bf16* row, const Unit& u, float* scratch) {
  const bool in = (int)threadIdx.x < u.threads;
  const int first = V * threadIdx.x, step = V * u.threads;
  const float ss = task_sum(in ? squares<V>(row, u.k, first, step) : 0.f, scratch, u.threads,
                            WsSync());
  if (in) scale<V>(row, u.gamma, row, u.k, rsqrtf(ss / (float)u.k + u.eps), first, step);
}

__device__ __forceinline__ void ws_norm_rows(bf16* xs, int xrow, const Unit& u, float* scratch) {
  for (int row = 0; row < u.m; ++row) {
    bf16* p = xs + (size_t)row * xrow;
    if (u.width == 8) ws_norm_row<8>(p, u, scratch);
    else if (u.width == 4) ws_norm_row<4>(p, u, scratch);
    else ws_norm_row<2>(p, u, scratch);
  }
}

// ---- the decode attention as tasks: counters between them ----------------------------------
// A rope task stores plain (qkv whole, the KV slots) and a split task plain partials, then
// counts itself (the barrier orders every consumer thread's stores before thread 0's release,
// which makes them visible with it); the tasks after wait for the count (acquire) and read at
// L2. sync[2 + j] is unit j's count, zeroed again by the launch's last block.
__device__ __forceinline__ void ws_wait_count(const unsigned* counter, unsigned target) {
  if (threadIdx.x == 0) {
    for (int spins = 0; (int)(load_acquire(counter) - target) < 0; ++spins)
      if (spins == WS_SPINS) asm volatile("trap;");  // a dependency bug: fail, never hang
    __threadfence();
  }
  ws_sync();
}

__device__ __forceinline__ void ws_count(unsigned* counter) {
  ws_sync();
  if (threadIdx.x == 0) {
    __threadfence();
    raise_release(counter);
  }
}

// Row `row` of qk_norm_rope_kv_bf16 (rows128: head dim 128, aligned), its heads dealt to the
// 16 consumer warps (the bits do not depend on which warp takes a head); q and k heads normed
// and roped, v heads as they are, all stored into qkv plain, k and v copied into the slot.
__device__ __forceinline__ void ws_rope(const Unit& u, int row, unsigned tag) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nq = u.n, nk = u.k, heads = nq + 2 * nk;
  float gq[4], gk[4];  // [q_norm | k_norm]
  load_bf16<4>(u.gamma + 4 * lane, gq);
  load_bf16<4>(u.gamma + 128 + 4 * lane, gk);
  const int position = static_cast<const int*>(u.r)[row];
  const float* t = static_cast<const float*>(u.c) + (long long)position * 128 + 4 * (lane & 15);
  const long long slot = reinterpret_cast<const int*>(u.side)[row];
  bf16* x = u.y + (long long)row * heads * 128 + 4 * lane;
  bf16* kv_row = slot < 0 ? nullptr  // a padding row owns no slot
                          : reinterpret_cast<bf16*>(reinterpret_cast<uint8_t*>(u.res) +
                                                    slot * 4LL * nk * 128) + 4 * lane;
  const float4 c = *reinterpret_cast<const float4*>(t);
  const float4 sn = *reinterpret_cast<const float4*>(t + 64);
  for (int head = warp; head < heads; head += WS_CONSUMERS / 32) {
    const uint2 v = ws_load4(u.x, u.tagged & TAGGED_X,
                             (size_t)row * heads * 128 + head * 128 + 4 * lane, tag);
    const float2 a = unpack_bf16x2(v.x), b = unpack_bf16x2(v.y);
    float f[4] = {a.x, a.y, b.x, b.y};
    float g[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) g[i] = head < nq ? gq[i] : gk[i];
    bf16* dst = head >= nq && kv_row ? kv_row + (head - nq) * 128 : nullptr;
    head128_apply(f, head < nq + nk, g, c, sn, x + head * 128, dst, u.eps, lane);
    if (head >= nq + nk) store_bf16<4>(x + head * 128, f);  // v: qkv is stored whole
  }
}

// Consumer warps 0 .. DC_WARPS - 1 as one block of attn_decode_split_tc_bf16 (barrier 2).
struct WsSplit {
  int b_, kvh_;
  __device__ __forceinline__ int b() const { return b_; }
  __device__ __forceinline__ int kvh() const { return kvh_; }
  __device__ __forceinline__ int tid() const { return threadIdx.x; }
  __device__ __forceinline__ void sync() const {
    asm volatile("bar.sync 2, %0;" :: "n"(DC_WARPS * 32) : "memory");
  }
  __device__ __forceinline__ uint4 load(const uint4* p) const { return __ldcg(p); }
  __device__ __forceinline__ uint4 load_q(const uint4* p) const { return __ldcg(p); }
};

// The split's shared staging at the front of `smem` (x's region: the block stages x again
// after the task): s_acc, s_q, s_stats, s_pages as attn_decode_split_entry declares them.
template <int G>
__device__ __forceinline__ void ws_split_g(const Unit& u, int b, int kvh, int split, int len,
                                           unsigned char* smem) {
  // s_acc also holds the warps' V tiles (16 rows of 128 bf16 each) before their partials
  constexpr int ACC = 4 * DC_WARPS * G * 128 > 2 * DC_WARPS * 16 * 128 ? 4 * DC_WARPS * G * 128
                                                                      : 2 * DC_WARPS * 16 * 128;
  float* s_acc = reinterpret_cast<float*>(smem);
  uint4* s_q = reinterpret_cast<uint4*>(smem + ACC);
  float* s_stats = reinterpret_cast<float*>(s_q + G * 128 / 8);
  int* s_pages = reinterpret_cast<int*>(s_stats + DC_WARPS * G * 2);
  const int* table_row = static_cast<const int*>(u.c) + (long long)b * u.block;
  attn_decode_split_tc<128, G, WsSplit>(static_cast<const bf16*>(u.x),
                                        static_cast<const uint8_t*>(u.r), table_row, len, split,
                                        reinterpret_cast<float*>(u.y), u.n, u.k, u.pad, u.eps,
                                        s_pages, s_q, s_stats, s_acc, WsSplit{b, kvh});
}

// Task `task` of a split unit: (sequence, kv head, split) of the launch's grid (seqs, nk,
// max_splits); a split past the sequence does nothing, as in the launch.
__device__ __forceinline__ void ws_split(const Unit& u, int task, unsigned char* smem,
                                         const unsigned* counters) {
  const int ms = u.pad, b = task / (u.k * ms), kvh = (task / ms) % u.k, split = task % ms;
  const int len = reinterpret_cast<const int*>(u.gamma)[b];  // block-uniform
  if (split * DC_SPLIT >= len) return;  // nothing to wait for: it only counts
  if (u.threads >= 0) ws_wait_count(counters + u.threads, (unsigned)u.width);  // the rope
  if ((threadIdx.x >> 5) >= DC_WARPS) return;
  switch (u.n / u.k) {
    case 1: ws_split_g<1>(u, b, kvh, split, len, smem); break;
    case 2: ws_split_g<2>(u, b, kvh, split, len, smem); break;
    case 4: ws_split_g<4>(u, b, kvh, split, len, smem); break;
    default: ws_split_g<8>(u, b, kvh, split, len, smem); break;
  }
}

// attn_decode_combine_bf16's rows (head dim 128) into xs, a (sequence, q head) a warp and 4 dims
// a lane, with the launch's arithmetic: M by the same lane-strided max and butterfly; each
// split's weight f = 2^(m_s - M) computed by one lane and shuffled to all (every thread of the
// launch computes the same value), L and O summed in split order. The loads of 8 splits go out
// before their sums, so a pair costs a few L2 round trips, not one a split.
__device__ __forceinline__ void ws_combine(const Unit& u, bf16* xs, int xrow) {
  const int nq = u.k / 128, ms = u.block, lane = threadIdx.x & 31;
  const float* part = static_cast<const float*>(u.x);
  const int* lens = static_cast<const int*>(u.r);
  const long long stride = 128 + 2;
  for (int pair = threadIdx.x >> 5; pair < u.m * nq; pair += WS_CONSUMERS / 32) {
    const int b = pair / nq, h = pair % nq;
    const int len = lens[b];
    const int n = len <= 0 ? 0 : min((len + DC_SPLIT - 1) / DC_SPLIT, ms);
    const float* e = part + ((long long)b * nq + h) * ms * stride;
    float mx = -INFINITY;
    for (int s = lane; s < n; s += 32) mx = fmaxf(mx, __ldcg(e + s * stride));
    mx = warp_max(mx);
    float lsum = 0.f, o[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s0 = 0; s0 < n; s0 += 8) {
      const int mine = s0 + (lane & 7);
      float f_mine = 0.f, l_mine = 0.f;
      if (mine < n) {
        f_mine = fast_exp2(__ldcg(e + mine * stride) - mx);
        l_mine = __ldcg(e + mine * stride + 1);
      }
      float2 v[8][2];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float* row = e + (s0 + j) * stride + 2 + 4 * lane;
        v[j][0] = s0 + j < n ? __ldcg(reinterpret_cast<const float2*>(row)) : make_float2(0.f, 0.f);
        v[j][1] = s0 + j < n ? __ldcg(reinterpret_cast<const float2*>(row + 2))
                             : make_float2(0.f, 0.f);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float f = __shfl_sync(FULL_MASK, f_mine, j);
        const float l = __shfl_sync(FULL_MASK, l_mine, j);
        if (s0 + j < n) {  // warp-uniform
          lsum += l * f;
          o[0] += v[j][0].x * f;
          o[1] += v[j][0].y * f;
          o[2] += v[j][1].x * f;
          o[3] += v[j][1].y * f;
        }
      }
    }
    const float inv = lsum > 0.f ? 1.f / lsum : 0.f;  // len == 0 gives zeros, not NaN
    bf16* out = xs + (size_t)b * xrow + h * 128 + 4 * lane;
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = __float2bfloat16(o[i] * inv);
  }
}

// The unit's x (m x k, rows xrow apart) into xs, its folded small kernel computed; `owner`:
// this block also writes the small kernel's outputs. Ends with the consumers' barrier.
__device__ __forceinline__ void ws_stage(const Unit& u, bf16* xs, int xrow, bool owner,
                                         unsigned tag, float* scratch, const unsigned* counters) {
  const int m = u.m, k = u.k, chunks = k / 4;
  if (u.pre == PRE_COMBINE) {
    if (u.threads >= 0) ws_wait_count(counters + u.threads, (unsigned)u.width);  // the splits
    ws_combine(u, xs, xrow);
    ws_sync();
    if (owner && (u.side || u.side_tag)) {
      for (int row = 0; row < m; ++row)
        ws_write_out(xs + (size_t)row * xrow, k, u.side ? u.side + (size_t)row * k : nullptr,
                     u.side_tag ? u.side_tag + (size_t)row * k : nullptr, tag);
      ws_sync();
    }
    return;
  }
  if (u.pre == PRE_SILU) {
    const bool tagged = u.tagged & TAGGED_X;
    const int inter = k, block = u.block;
    for (int q = threadIdx.x; q < m * (inter / 4); q += WS_CONSUMERS) {
      const int row = q / (inter / 4), i = 4 * (q % (inter / 4));
      const size_t at = (size_t)row * 2 * inter + (size_t)(i / block) * 2 * block + i % block;
      const uint2 g = ws_load4(u.x, tagged, at, tag), up = ws_load4(u.x, tagged, at + block, tag);
      uint2 out;
      if (u.width == 8) {  // silu_mul8's arithmetic on these four (it is elementwise)
        const uint4 o = silu_mul8(make_uint4(g.x, g.y, 0, 0), make_uint4(up.x, up.y, 0, 0));
        out = make_uint2(o.x, o.y);
      } else {
        const float2 g0 = unpack_bf16x2(g.x), g1 = unpack_bf16x2(g.y);
        const float2 u0 = unpack_bf16x2(up.x), u1 = unpack_bf16x2(up.y);
        out = make_uint2(pack_bf16x2(silu_mul(g0.x, u0.x), silu_mul(g0.y, u0.y)),
                         pack_bf16x2(silu_mul(g1.x, u1.x), silu_mul(g1.y, u1.y)));
      }
      *reinterpret_cast<uint2*>(xs + (size_t)row * xrow + i) = out;
    }
    ws_sync();
    if (owner && (u.side || u.side_tag)) {
      for (int row = 0; row < m; ++row)
        ws_write_out(xs + (size_t)row * xrow, k, u.side ? u.side + (size_t)row * k : nullptr,
                     u.side_tag ? u.side_tag + (size_t)row * k : nullptr, tag);
      ws_sync();
    }
    return;
  }
  // x as it is (pre none, rmsnorm), or bf16(r + x) (add_rmsnorm: row_add's one rounding)
  for (int q = threadIdx.x; q < m * chunks; q += WS_CONSUMERS) {
    const int row = q / chunks, col = 4 * (q % chunks);
    const size_t at = (size_t)row * k + col;
    uint2 v = ws_load4(u.x, u.tagged & TAGGED_X, at, tag);
    if (u.pre == PRE_ADD_RMSNORM) {
      const uint2 r = ws_load4(u.r, u.tagged & TAGGED_R, at, tag);
      const float2 a0 = unpack_bf16x2(r.x), a1 = unpack_bf16x2(r.y);
      const float2 b0 = unpack_bf16x2(v.x), b1 = unpack_bf16x2(v.y);
      v = make_uint2(pack_bf16x2(a0.x + b0.x, a0.y + b0.y), pack_bf16x2(a1.x + b1.x, a1.y + b1.y));
    }
    *reinterpret_cast<uint2*>(xs + (size_t)row * xrow + col) = v;
  }
  ws_sync();
  if (u.pre == PRE_NONE) return;
  if (owner && u.pre == PRE_ADD_RMSNORM && (u.res || u.res_tag)) {
    // the residual after, read before the norms' first barrier (ws_block_sum) rewrites xs
    for (int row = 0; row < m; ++row)
      ws_write_out(xs + (size_t)row * xrow, k, u.res ? u.res + (size_t)row * k : nullptr,
                   u.res_tag ? u.res_tag + (size_t)row * k : nullptr, tag);
  }
  ws_norm_rows(xs, xrow, u, scratch);
  ws_sync();
  if (owner && (u.side || u.side_tag)) {
    for (int row = 0; row < m; ++row)
      ws_write_out(xs + (size_t)row * xrow, k, u.side ? u.side + (size_t)row * k : nullptr,
                   u.side_tag ? u.side_tag + (size_t)row * k : nullptr, tag);
    ws_sync();
  }
}

struct WsCursor {  // a block's items: task s of unit j, item r of the task
  int s, j, r;
};

// A task's items: a round of 1024 columns of its tile, or of each of its two (narrow: item
// 2 r + h is round r of tile h).
__device__ __forceinline__ int ws_items(const Unit& u) {
  if (u.op >= OP_ROPE) return 1;  // a rope or split task: one step, no weights
  return (u.warps == 16 ? 1 : 2) * u.k / 1024;
}

__device__ __forceinline__ int ws_unit_of(const Unit* units, int count, int s, int j) {
  while (j + 1 < count && units[j + 1].first <= s) ++j;
  return j;
}

__device__ __forceinline__ WsCursor ws_next(const Unit* units, int count, int total, WsCursor c) {
  if (++c.r < ws_items(units[c.j])) return c;
  c.s += gridDim.x;
  c.r = 0;
  if (c.s < total) c.j = ws_unit_of(units, count, c.s, c.j);
  return c;
}

__device__ __forceinline__ void ws_wait(uint32_t bar, int parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}

// The task's tiles stored: each tile's warps' sums in warp order (persist_run_bf16's
// gemv_store), plain and tagged as the plan asks.
__device__ __forceinline__ void ws_store(const Unit& u, int task, const float (&acc)[4],
                                         float (*partial)[32], unsigned tag) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < 4; ++r) partial[warp * 4 + r][lane] = acc[r];
  ws_sync();
  const int half = threadIdx.x >> 7;
  const int tile = u.warps == 16 ? task : 2 * task + half;
  if (half < 16 / u.warps && 16 * tile < u.n) {
    const int s = (threadIdx.x >> 5) & 3;
    float sum = 0.f;
    for (int v = 0; v < u.warps; ++v) sum += partial[(half * u.warps + v) * 4 + s][lane];
    const int row = 16 * tile + (lane >> 2) + (s >= 2 ? 8 : 0);
    const int col = 2 * (lane & 3) + (s & 1);
    if (col < u.m) {
      const size_t at = (size_t)col * u.n + row;
      if (u.op == OP_GEMV_ACC) sum += ws_load1(u.c, u.tagged & TAGGED_C, at, tag);
      const bf16 y = __float2bfloat16(sum);
      if (u.y) u.y[at] = y;
      if (u.y_tag) ws_store_tag(u.y_tag + at, tag, y);
    }
  }
  ws_sync();
}

// grid (the multiprocessors: every block resident), block WS_THREADS; `count` units; dynamic
// shared memory: x (m rows of xrow bf16, 128-byte rounded) then `stages` ring stages of
// WS_STAGE; sync: [epoch, finished blocks, a count per unit]; shadow: the `words` tagged words the plan uses.
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
    persist_ws_bf16(const WsTable given, int count, unsigned* __restrict__ sync,
                    unsigned* __restrict__ shadow, int words, int xrow, int stages) {
  pdl_begin();  // the epoch and every input after the kernels before have finished
  extern __shared__ __align__(128) unsigned char dyn[];
  __shared__ float partial[16 * 4][32];
  __shared__ float scratch[32];
  __shared__ __align__(8) uint64_t bars[2 * 8];  // full[stages], empty[stages]; stages <= 8
  __shared__ int last;
  const Unit* units = given.unit;  // read in place: the constant bank, warp-uniform
  const int m = given.unit[0].m;
  bf16* xs = reinterpret_cast<bf16*>(dyn);
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
  const unsigned epoch = *(volatile unsigned*)sync;
  const unsigned tag = epoch % 65535u + 1u;
  __syncthreads();  // the table, the mbarriers; the last barrier of all WS_THREADS threads
  const int total = units[count - 1].first + units[count - 1].tasks;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const WsCursor start = {(int)blockIdx.x,
                          ws_unit_of(units, count, min((int)blockIdx.x, total - 1), 0), 0};

  if (warp == 16) {  // the producer
    WsCursor p = start;
    for (int i = 0; p.s < total; ++i) {
      while (p.s < total && units[p.j].op >= OP_ROPE) p = ws_next(units, count, total, p);
      if (p.s >= total) break;
      const int stage = i % stages;
      if (i >= stages) ws_wait(empty0 + 8 * stage, (i / stages - 1) & 1);
      const Unit& u = units[p.j];
      const bool wide = u.warps == 16;
      const int row0 = wide ? 16 * (p.s - u.first) : 32 * (p.s - u.first) + 16 * (p.r & 1);
      const int round = wide ? p.r : p.r >> 1;
      const int valid = max(0, min(16, u.n - row0));  // a missing second tile: none
      if (lane == 0)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     :: "r"(full0 + 8 * stage), "r"(valid * 2048) : "memory");
      __syncwarp();
      if (lane < valid) {
        const bf16* src = u.w + (size_t)(row0 + lane) * u.k + (size_t)round * 1024;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                     "[%0], [%1], %2, [%3];"
                     :: "r"(ring0 + stage * WS_STAGE + lane * WS_PITCH), "l"(src), "r"(2048),
                        "r"(full0 + 8 * stage) : "memory");
      }
      p = ws_next(units, count, total, p);
    }
    return;
  }

  WsCursor c = start;
  int staged = -1;  // the unit whose x is in xs
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  unsigned* counters = sync + 2;
  for (int i = 0; c.s < total; ++i) {
    const Unit& u = units[c.j];
    if (u.op >= OP_ROPE) {  // block-uniform: a rope or split task, then its count
      if (u.op == OP_ROPE) {
        ws_rope(u, c.s - u.first, tag);
      } else {
        ws_split(u, c.s - u.first, dyn, counters);
        staged = -1;  // its staging took x's place
      }
      ws_count(counters + c.j);
      c = ws_next(units, count, total, c);
      --i;  // no ring stage
      continue;
    }
    const int stage = i % stages;
    if (c.j != staged) {  // block-uniform
      ws_stage(u, xs, xrow, c.s == u.first, tag, scratch, counters);
      staged = c.j;
    }
    const WsCursor n = ws_next(units, count, total, c);
    ws_wait(full0 + 8 * stage, (i / stages) & 1);
    const unsigned char* base = ring + stage * WS_STAGE;
    const int task = c.s - u.first;
    if (u.warps == 16) {
      const bf16* xa = xs + g * xrow + 8 * t + 32 * warp + c.r * 1024;
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int col = 2 * (32 * warp + 512 * q + 8 * t);  // bytes into the row segment
        const uint4 lo = *reinterpret_cast<const uint4*>(base + g * WS_PITCH + col);
        const uint4 hi = *reinterpret_cast<const uint4*>(base + (g + 8) * WS_PITCH + col);
        const uint4 x = g < m ? *reinterpret_cast<const uint4*>(xa + 512 * q)
                              : make_uint4(0, 0, 0, 0);
        mma_16816(acc, lo.x, hi.x, lo.y, hi.y, x.x, x.y);
        mma_16816(acc, lo.z, hi.z, lo.w, hi.w, x.z, x.w);
      }
    } else if ((c.r & 1) == (warp >> 3) && 16 * (2 * task + (warp >> 3)) < u.n) {
      // the item is this warp's tile (and the tile exists): 4 chunks of its round
      const int wl = warp & 7;
      const bf16* xa = xs + g * xrow + 8 * t + 32 * wl + (c.r >> 1) * 1024;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int col = 2 * (32 * wl + 256 * q + 8 * t);
        const uint4 lo = *reinterpret_cast<const uint4*>(base + g * WS_PITCH + col);
        const uint4 hi = *reinterpret_cast<const uint4*>(base + (g + 8) * WS_PITCH + col);
        const uint4 x = g < m ? *reinterpret_cast<const uint4*>(xa + 256 * q)
                              : make_uint4(0, 0, 0, 0);
        mma_16816(acc, lo.x, hi.x, lo.y, hi.y, x.x, x.y);
        mma_16816(acc, lo.z, hi.z, lo.w, hi.w, x.z, x.w);
      }
    }
    __syncwarp();
    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(empty0 + 8 * stage)
                                : "memory");  // the warp is done with the stage
    if (c.r + 1 == ws_items(u)) {
      ws_store(u, task, acc, partial, tag);
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[q] = 0.f;
    }
    c = n;
  }
  // the last block out raises the epoch (and, when the tags come round, clears the shadows)
  ws_sync();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(sync + 1, 1u) == gridDim.x - 1;
  }
  ws_sync();
  if (!last) return;
  const bool wrap = (epoch + 1u) % 65535u == 0u;
  if (wrap)
    for (int q = threadIdx.x; q < words; q += WS_CONSUMERS) shadow[q] = 0u;
  ws_sync();
  if (threadIdx.x == 0) {
    for (int j = 0; j < count; ++j) sync[2 + j] = 0;
    sync[1] = 0;
    sync[0] = epoch + 1u;
    __threadfence();
  }
}
