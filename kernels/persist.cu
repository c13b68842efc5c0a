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
// them add nothing but meet every barrier.
__device__ __forceinline__ float task_sum(float v, float* scratch, int threads) {
  v = warp_sum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0 && (int)threadIdx.x < threads) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
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
