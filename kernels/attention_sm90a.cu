// Module `attention_sm90a`: the packed prefill attention of attention.cu (the same contract
// as attn_prefill_varlen_bf16) on Hopper's warpgroup matrix instructions, for head dim 128.
// Built for sm_90a (kernels/build.py: `*_sm90a.cu` sources), which only Hopper runs.
//
// Layout facts as in attention.cu: packed qkv rows [q: nq*hd | k: nk*hd | v: nk*hd]; KV slot s
// holds [K: nk*hd | V: nk*hd] bf16 at byte s*4*nk*hd; key j of sequence z lives in slot
// block_table[z*width + j/16]*16 + j%16. Row r of a chunk attends to keys 0..positions[r].
//
// A block serves 128 (row, q head) pairs of one kv head of sequence blockIdx.z: 128/G
// consecutive rows times the G q heads of that kv head (pair p = row_in_block * G +
// head_in_group). It has three warpgroups. Warpgroup 0 copies key tiles of 128 keys (K and V,
// from key 0 up to the block's last position) into a ring of three shared-memory stages with
// cp.async, each stage's arrival and release tracked by an mbarrier pair. Warpgroups 1 and 2
// compute, 64 pairs each (the block's slabs of 16 pairs alternate between them), walking every
// tile in order:
//   S = Q K^T   8 x wgmma m64n128k16 (Q and K from shared memory)
//   online softmax on S in f32 (scale folded into log2, ex2.approx), P rounded to bf16
//   O += P V    8 x wgmma m64n128k16 (P from registers, V from shared memory, N-major)
// software-pipelined by a tile (a step issues S of tile it and P V of tile it-1, and runs the
// softmax while P V runs), and taking turns to issue (named barriers 1, 2), so one warpgroup's
// softmax overlaps the other's matrix work. setmaxnreg moves registers from the copier (40)
// to the two computing warpgroups (232). Tiles sit in the 128-byte swizzled layout the tensor
// cores read: two halves of 64 dims, each [128 keys][128 bytes], 16-byte chunk c of key j at
// chunk c ^ (j % 8). Keys past the block's last position are zero-filled and every key past a
// row's position is masked, so a row's sums run over the same tiles in the same order whatever
// chunk it comes in (batch invariance), and launches repeat bit for bit (no atomics). Blocks
// start longest first: under the causal mask the last rows have the most keys.
// Limits: hd == 128, 64 % G == 0.
// grid (ceil(rows / (128/G)), nk, seqs), block (384), dynamic shared memory WG_SMEM bytes.
#include <type_traits>

#include "tc.cuh"

#define PAGE 16
#define WG_HD 128
#define WG_BM 128  // pairs per block, 64 per warpgroup
#define WG_BN 128  // keys per tile
#define WG_THREADS 384  // warpgroup 0 copies the tiles, 1 and 2 compute
#define WG_CONSUMERS 256
#define WG_STAGES 3  // K and V of tiles it-1 (P V in flight), it, it+1
#define WG_HALF_Q (64 * 128)           // bytes of one warpgroup's Q, half of the dims
#define WG_Q_BYTES (WG_BM * WG_HD * 2)  // 32768
#define WG_TILE_BYTES (WG_BN * WG_HD * 2)  // K or V of one tile: 32768
// 1024 bytes of slack to align the swizzle atoms, Q, the stages (K then V), the stages' full
// and empty barriers, the block's last position
#define WG_SMEM (1024 + WG_Q_BYTES + WG_STAGES * 2 * WG_TILE_BYTES + 64)

// Byte offset of 16-byte chunk `ch` (0..15, dims 8ch..8ch+7) of row `row` in a swizzled
// [rows][128 dims] bf16 tile of `rows` rows.
__device__ __forceinline__ uint32_t sw128(int row, int ch, int rows) {
  return (ch >> 3) * rows * 128 + row * 128 + (((ch & 7) ^ (row & 7)) << 4);
}

// A shared-memory matrix descriptor, 128-byte swizzle (PTX ISA, "Matrix Descriptor Format").
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
         ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_wait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
__device__ __forceinline__ void wg_wait1() {
  asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
}
// Pins a register's value in program order (the tensor cores write or read it asynchronously).
__device__ __forceinline__ void pin(float& r) { asm volatile("" : "+f"(r) :: "memory"); }
__device__ __forceinline__ void pin(uint32_t& r) { asm volatile("" : "+r"(r) :: "memory"); }
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
// Named barriers 1 and 2 order the two compute warpgroups' wgmma issue; 3 is theirs alone.
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

// The 64 f32 accumulator registers of an m64n128 wgmma: the operand list and its PTX names.
#define WG_ACC(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
  "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
  "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), \
  "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
  "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
  "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
  "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), \
  "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), \
  "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define WG_ACC_REGS \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
  " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
  " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
  " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63},"

// d (64 x 128 f32, the m64n128 accumulator fragments) = [d +] A B^T; A [64 x 16] and B
// [128 x 16] K-major in shared memory.
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      WG_ACC_REGS
      " %64, %65, p, 1, 1, 0, 0;\n}\n"
      : WG_ACC(d)
      : "l"(a), "l"(b), "r"(accumulate));
}

// d += A B; A [64 x 16] bf16 from registers (the m64k16 A fragments), B [16 x 128] N-major
// in shared memory.
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      WG_ACC_REGS
      " {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : WG_ACC(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// Max and sum of a row's 32 scores in one thread (fragments s[4j + E], s[4j + E + 1], j < 16)
// as pairwise trees: a chain of 32 dependent steps would stall the warp on each one. The sum's
// order is fixed, so its bits repeat.
template <int E>
__device__ __forceinline__ float tree_max(const float (&s)[64]) {
  float v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j)
    v[j] = fmaxf(fmaxf(s[4 * j + E], s[4 * j + E + 1]),
                 fmaxf(s[4 * j + 32 + E], s[4 * j + 33 + E]));
  const float a = fmaxf(fmaxf(v[0], v[4]), fmaxf(v[2], v[6]));
  const float b = fmaxf(fmaxf(v[1], v[5]), fmaxf(v[3], v[7]));
  return fmaxf(a, b);
}

template <int E>
__device__ __forceinline__ float tree_sum(const float (&s)[64]) {
  float v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j)
    v[j] = (s[4 * j + E] + s[4 * j + E + 1]) + (s[4 * j + 32 + E] + s[4 * j + 33 + E]);
  const float a = (v[0] + v[4]) + (v[2] + v[6]);
  const float b = (v[1] + v[5]) + (v[3] + v[7]);
  return a + b;
}

__device__ __forceinline__ void attn_prefill_wg(const bf16* __restrict__ qkv,
                                                const uint8_t* __restrict__ kv,
                                                const int* __restrict__ table,
                                                const int* __restrict__ positions,
                                                bf16* __restrict__ out, int len, int row0,
                                                int nq, int nk, float scale, int kvh,
                                                uint8_t* base) {
  const int G = nq / nk;
  const int tid = threadIdx.x, role = tid >> 7, lane = tid & 31;
  const long long qkv_stride = (long long)(nq + 2 * nk) * WG_HD;
  const long long slot_bytes = 4LL * nk * WG_HD;
  uint8_t* sq = base;
  uint8_t* stages = base + WG_Q_BYTES;  // stage s: K at s * 2 tiles, V after it
  const uint32_t bars = smem_u32(stages + WG_STAGES * 2 * WG_TILE_BYTES);
  const uint32_t full = bars, empty = bars + 8 * WG_STAGES;  // 8-byte mbarriers
  int* s_state = reinterpret_cast<int*>(stages + WG_STAGES * 2 * WG_TILE_BYTES + 48);
  if (tid < 32) {  // warp 0: the barriers, the block's last position
    if (lane < WG_STAGES) {
      mbar_init(full + 8 * lane, 128);            // every copying thread, once a tile
      mbar_init(empty + 8 * lane, WG_CONSUMERS);  // every computing thread, once a tile
    }
    int mx = -1;
    for (int r = row0 + lane; r < min(len, row0 + WG_BM / G); r += 32) mx = max(mx, positions[r]);
    mx = __reduce_max_sync(FULL_MASK, mx);
    if (lane == 0) s_state[0] = mx;
  }
  __syncthreads();
  const int kend = s_state[0] + 1;  // keys the block needs: 0 .. its last position
  const int ntiles = (kend + WG_BN - 1) / WG_BN;

  if (role == 0) {
    // The copying warpgroup. Thread p copies 16-byte chunk p % 16 of the K and V rows of keys
    // p/16 + 8i (i < 16) of a tile: one page-table entry per two keys of its, and one swizzled
    // offset (the key's row % 8 is p/16 for every i) + i rows of 8. A tile's copies complete
    // on its stage's full barrier one tile later (cp.async groups retire in order); a stage is
    // refilled once both compute warpgroups have released it (its empty barrier).
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    const int l_key = (tid >> 4) & 7, l_ch = tid & 15;
    const uint32_t l_off = sw128(l_key, l_ch, WG_BN);
    const uint8_t* l_src = kv + l_key * slot_bytes + (long long)kvh * WG_HD * 2 + l_ch * 16;
    const long long page_bytes = PAGE * slot_bytes, v_delta = (long long)nk * WG_HD * 2;
    for (int tile = 0; tile < ntiles; ++tile) {
      const int st = tile % WG_STAGES;
      if (tile >= WG_STAGES) mbar_wait(empty + 8 * st, (tile / WG_STAGES - 1) & 1);
      const uint32_t dk = smem_u32(stages + st * 2 * WG_TILE_BYTES) + l_off;
      const int* pages = table + tile * (WG_BN / PAGE);
#pragma unroll 4
      for (int i = 0; i < 16; ++i) {
        const int key = tile * WG_BN + 8 * i + l_key;
        const bool on = key < kend;  // pages past it need not exist
        const uint8_t* src =
            on ? l_src + pages[i >> 1] * page_bytes + (i & 1) * 8 * slot_bytes : kv;
        cp_async16(dk + i * 8 * 128, src, on);
        cp_async16(dk + WG_TILE_BYTES + i * 8 * 128, on ? src + v_delta : kv, on);
      }
      cp_async_commit();
      if (tile > 0) {
        cp_async_wait<1>();
        fence_proxy_async();
        mbar_arrive(full + 8 * ((tile - 1) % WG_STAGES));
      }
    }
    cp_async_wait<0>();
    fence_proxy_async();
    mbar_arrive(full + 8 * ((ntiles - 1) % WG_STAGES));
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int ctid = tid - 128, wg = ctid >> 7, warp = (ctid >> 5) & 3;
  const int g = lane >> 2, t = lane & 3;  // fragment row (and row + 8), column pair

  // The block's 8 slabs of 16 pairs alternate between the warpgroups: warp q of warpgroup w
  // owns slab 2q + w, so both warpgroups reach the block's last position and walk the same
  // tiles (no warpgroup has a tile to skip, so no wgmma sits behind a branch).
  // Q: pair p's 16 chunks into row 16q + p % 16 of its warpgroup's swizzled [64][128] tile
  // (zeros past the chunk).
  const uint32_t q_smem = smem_u32(sq);
#pragma unroll
  for (int i = 0; i < WG_BM * 16 / WG_CONSUMERS; ++i) {
    const int c = ctid + i * WG_CONSUMERS, p = c >> 4, ch = c & 15, r = row0 + p / G;
    const int slab = p >> 4, wg_row = 16 * (slab >> 1) + (p & 15);
    const bool on = r < len;
    const bf16* src = on ? qkv + r * qkv_stride + (kvh * G + p % G) * WG_HD + ch * 8 : qkv;
    cp_async16(q_smem + (slab & 1) * (WG_Q_BYTES / 2) + sw128(wg_row, ch, 64), src, on);
  }
  cp_async_commit();
  const int pair0 = 16 * (2 * warp + wg);  // this warp's first pair
  int pos[2];  // positions of this thread's fragment rows g and g+8; -1 past the chunk
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + (pair0 + g + 8 * h) / G;
    pos[h] = r < len ? positions[r] : -1;
  }
  const int wmin = __reduce_min_sync(FULL_MASK, min(pos[0], pos[1]));
  cp_async_wait<0>();
  fence_proxy_async();
  bar_sync(3, WG_CONSUMERS);  // Q is in
  if (wg == 1) bar_arrive(1, WG_CONSUMERS);  // warpgroup 0 issues first

  const float scale2 = scale * LOG2E;
  float o[64], s[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = s[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // l: this thread's columns only
  uint32_t pa[WG_BN / 16][4];  // P of the previous tile, the A fragments of P V
#pragma unroll
  for (int kk = 0; kk < WG_BN / 16; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) pa[kk][e] = 0u;
  // Descriptor bases; an offset inside shared memory adds offset / 16 to the address field.
  const uint64_t q_desc = wg_desc(q_smem + wg * (WG_Q_BYTES / 2), 16, 1024);
  const uint64_t k_desc = wg_desc(smem_u32(stages), 16, 1024);
  const uint64_t v_desc = wg_desc(smem_u32(stages) + WG_TILE_BYTES, WG_BN * 128, 1024);

  // Software-pipelined by one tile: step `it` waits for tile it's stage to fill, issues (in its
  // turn) S = Q K_it^T and then O += P V_{it-1} (the P of the step before), and runs the
  // softmax of S while the tensor cores still work on P V; only the rescale of O waits for
  // them, and then tile it-1's stage is released to the copier. The first step has no P V,
  // the last (it = ntiles) only P V: the flags are compile-time, so no wgmma or wait is behind
  // a branch (ptxas would serialize every wgmma).
  auto step = [&](auto with_scores, auto with_pv, int it) {
    constexpr bool SCORES = decltype(with_scores)::value, PV = decltype(with_pv)::value;
    const int k0 = it * WG_BN;
    if constexpr (SCORES) mbar_wait(full + 8 * (it % WG_STAGES), (it / WG_STAGES) & 1);
    bar_sync(1 + wg, WG_CONSUMERS);  // this warpgroup's turn to issue
    wg_fence();
    if constexpr (SCORES) {
      const uint64_t k_at = k_desc + (it % WG_STAGES) * (2 * WG_TILE_BYTES / 16);
#pragma unroll
      for (int kk = 0; kk < WG_HD / 16; ++kk)
        wgmma_ss(s, q_desc + ((kk >> 2) * WG_HALF_Q + (kk & 3) * 32) / 16,
                 k_at + ((kk >> 2) * (WG_BN * 128) + (kk & 3) * 32) / 16, kk > 0);
      wg_commit();
    }
    if constexpr (PV) {
      const uint64_t v_at =
          v_desc + ((it + WG_STAGES - 1) % WG_STAGES) * (2 * WG_TILE_BYTES / 16);
#pragma unroll
      for (int kk = 0; kk < WG_BN / 16; ++kk) wgmma_rs(o, pa[kk], v_at + kk * 16 * 128 / 16);
      wg_commit();
    }
    // the other's turn (warpgroup 1 gives none after its last step: nobody waits for it)
    if (SCORES || wg == 0) bar_arrive(2 - wg, WG_CONSUMERS);
    if constexpr (SCORES) {
      if constexpr (PV) wg_wait1(); else wg_wait0();  // S has landed (P V may still run)
#pragma unroll
      for (int i = 0; i < 64; ++i) pin(s[i]);
      if (k0 + WG_BN - 1 > wmin) {  // some key of the tile is past some row of this warp
#pragma unroll
        for (int j = 0; j < WG_BN / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (k0 + 8 * j + 2 * t + (e & 1) > pos[e >> 1]) s[4 * j + e] = -INFINITY;
      }
      float corr[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = h ? tree_max<2>(s) : tree_max<0>(s);
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
        const float mnew = fmaxf(m[h], mx);
        const float ms = mnew == -INFINITY ? 0.f : __fmul_rn(mnew, scale2);  // no key yet
        corr[h] = fast_exp2(__fmul_rn(m[h], scale2) - ms);                   // 0 from -inf
        m[h] = mnew;
#pragma unroll
        for (int j = 0; j < WG_BN / 8; ++j)
#pragma unroll
          for (int e = 2 * h; e < 2 * h + 2; ++e)
            s[4 * j + e] = fast_exp2(fmaf(s[4 * j + e], scale2, -ms));
        l[h] = l[h] * corr[h] + (h ? tree_sum<2>(s) : tree_sum<0>(s));
      }
      if constexpr (PV) {
        wg_wait0();  // P V of the tile before has landed: O and the old P are free
        mbar_arrive(empty + 8 * ((it + WG_STAGES - 1) % WG_STAGES));  // and tile it-1's stage
      }
#pragma unroll
      for (int i = 0; i < 64; ++i) pin(o[i]);
#pragma unroll
      for (int kk = 0; kk < WG_BN / 16; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) pin(pa[kk][e]);
#pragma unroll
      for (int j = 0; j < WG_HD / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[4 * j + e] *= corr[e >> 1];
      // The S fragments of key tiles 2kk, 2kk+1 are the A fragment of keys 16kk..16kk+15.
#pragma unroll
      for (int kk = 0; kk < WG_BN / 16; ++kk) {
        pa[kk][0] = pack_bf16x2_rn(s[8 * kk + 0], s[8 * kk + 1]);
        pa[kk][1] = pack_bf16x2_rn(s[8 * kk + 2], s[8 * kk + 3]);
        pa[kk][2] = pack_bf16x2_rn(s[8 * kk + 4], s[8 * kk + 5]);
        pa[kk][3] = pack_bf16x2_rn(s[8 * kk + 6], s[8 * kk + 7]);
      }
    } else {
      wg_wait0();
#pragma unroll
      for (int i = 0; i < 64; ++i) pin(o[i]);
    }
  };
  using yes = std::true_type;
  using no = std::false_type;
  step(yes{}, no{}, 0);
  for (int it = 1; it < ntiles; ++it) step(yes{}, yes{}, it);
  step(no{}, yes{}, ntiles);
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // whole-row sums, the same order on the quad's 4 lanes
    l[h] += __shfl_xor_sync(FULL_MASK, l[h], 1);
    l[h] += __shfl_xor_sync(FULL_MASK, l[h], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int p = pair0 + g + 8 * h, r = row0 + p / G;
    if (r >= len || !(l[h] > 0.f)) continue;  // past the chunk
    const float inv = 1.f / l[h];
    uint32_t* dst = reinterpret_cast<uint32_t*>(out + (long long)r * nq * WG_HD +
                                                (long long)(kvh * G + p % G) * WG_HD);
#pragma unroll
    for (int j = 0; j < WG_HD / 8; ++j)
      dst[(8 * j + 2 * t) / 2] = pack_bf16x2(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
  }
}

// The contract of attn_prefill_varlen_bf16 (attention.cu) for hd 128: a packed chunk of `seqs`
// sequences, sequence z's rows [cu_seqlens[z], cu_seqlens[z+1]) with page-table row z. Block z
// serves sequence z; blocks past a sequence's rows return at once.
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)
attn_prefill_varlen_sm90a_bf16(const bf16* __restrict__ qkv, const uint8_t* __restrict__ kv,
                               const int* __restrict__ block_table,
                               const int* __restrict__ positions,
                               const int* __restrict__ cu_seqlens, bf16* __restrict__ out,
                               int rows, int seqs, int nq, int nk, int hd, int width,
                               float scale) {
  pdl_begin();
  extern __shared__ __align__(1024) uint8_t wg_smem[];
  if (hd != WG_HD || (64 % (nq / nk)) != 0 || gridDim.y != (unsigned)nk ||
      blockDim.x != WG_THREADS || dynamic_smem_bytes() < (uint32_t)WG_SMEM)
    __trap();  // a launch it was not written for (a wrong block would wait forever)
  const int seq = blockIdx.z;
  if (seq >= seqs) return;
  const int start = cu_seqlens[seq], len = min(cu_seqlens[seq + 1], rows) - start;
  // Blocks start in order of their linear index; under the causal mask the last rows have the
  // most keys, so the linear index runs over (row block from the last, kv head), the longest
  // blocks first (the grid's x, y are only its size: x row blocks, y == nk kv heads).
  const int linear = blockIdx.x + gridDim.x * blockIdx.y;
  const int kvh = linear % nk;
  const int row0 = (gridDim.x - 1 - linear / nk) * (WG_BM / (nq / nk));
  if (row0 >= len) return;  // the whole block: no barrier hit
  const long long row_elems = (long long)(nq + 2 * nk) * WG_HD;
  uint8_t* base = wg_smem + ((1024 - (smem_u32(wg_smem) & 1023)) & 1023);
  attn_prefill_wg(qkv + start * row_elems, kv, block_table + (long long)seq * width,
                  positions + start, out + (long long)start * nq * WG_HD, len, row0, nq, nk,
                  scale, kvh, base);
}
