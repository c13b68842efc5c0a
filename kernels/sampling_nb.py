"""Module `sampling_nb`: temperature, top-k and top-p sampling in Numba-CUDA.

`sample_f32(logits, params, tokens, n, stride, vocab)`: for b < n, tokens[b] = the token
sampled from logits row params[b*12] (`stride` floats apart, `vocab` of them) with that row's
parameters; the algorithm and the 12-word parameter layout are kernels/sampling_ref.py's (the
numpy reference, run by the cpu backend). One block per row: grid (n), block (1024; any
power of two up to 1024 is correct). The top-k and top-p thresholds are radix selects (8
passes of 4-bit digits over the row's keys); every reduction is over integers (keys, counts
and the uint64 weights), so the result does not depend on the order threads finish in: the
same inputs give the same token every time. Compiled ahead of time by kernels/build.py; never
imported at run time.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda
from numba.cuda import types
from numba.cuda.extending import register_jitable

from kerncc.kernels.nb import (I32, P_F32, P_I32, P_U32, Entries, address, bits_f32, f32_bits,
                               kernel, load16_nc, u32)

ENTRIES: Entries = {}
THREADS = 1024
WORDS = 12
U0, U1 = np.uint64(0), np.uint64(1)
S31, S32 = np.uint32(31), np.uint64(32)
SIGN = np.uint32(0x80000000)
MASK = np.uint64(0xFFFFFFFF)
SCALE = np.float32(2.0 ** 40)
P_SCALE = np.float32(2.0 ** 24)
P_MASK, P_SHIFT = np.uint64(2 ** 24 - 1), np.uint64(24)
M0, M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
W0, W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
ZERO_F = np.float32(0.0)
ONE_F = np.float32(1.0)
FULL = np.uint32(0xFFFFFFFF)
DIGIT = np.uint32(15)


@register_jitable
def key_of(x):
    """uint32 whose integer order is the float order of f32 x."""
    b = f32_bits(x)
    if u32(b >> S31) == np.uint32(0):
        return u32(b ^ SIGN)
    return u32(~b)


@register_jitable
def value_of(k):
    """The f32 of a key (key_of's inverse)."""
    if u32(k >> S31) != np.uint32(0):
        return bits_f32(u32(k ^ SIGN))
    return bits_f32(u32(~k))


@register_jitable
def weight(x, m, t):
    """uint64(expf((x - m) / t) * 2**40), every step in f32."""
    return np.uint64(math.exp((x - m) / t) * SCALE)


@register_jitable
def random64(seed, sequence, step):
    """Words 0 and 1 of Philox4x32-10 (key = seed, counter = (step, sequence)) as a uint64."""
    c0, c1, c2, c3 = step & MASK, step >> S32, sequence & MASK, sequence >> S32
    k0, k1 = seed & MASK, seed >> S32
    for _ in range(10):
        p0 = M0 * c0
        p1 = M1 * c2
        c0, c1, c2, c3 = (p1 >> S32) ^ c1 ^ k0, p1 & MASK, (p0 >> S32) ^ c3 ^ k1, p0 & MASK
        k0 = (k0 + W0) & MASK
        k1 = (k1 + W1) & MASK
    return c0 | (c1 << S32)


@register_jitable
def mulhi64(a, b):
    """floor(a * b / 2**64) of two uint64, exactly."""
    a_lo, a_hi, b_lo, b_hi = a & MASK, a >> S32, b & MASK, b >> S32
    p0, p1, p2, p3 = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi
    mid = (p0 >> S32) + (p1 & MASK) + (p2 & MASK)
    return p3 + (p1 >> S32) + (p2 >> S32) + (mid >> S32)


@register_jitable
def warp_sum(v):
    """The sum of a uint64 over the warp, in every lane (butterfly; integers: exact)."""
    for o in (16, 8, 4, 2, 1):
        v += np.uint64(cuda.shfl_xor_sync(FULL, np.int64(v), np.int32(o)))
    return v


@register_jitable
def unit(logits, base, u, wide):
    """Unit u of the row: 4 floats by one 16-byte load when `wide`, else logits[base + u]
    (in lane 0 only: the callers read `width` lanes)."""
    if wide:
        a, b, c, d = load16_nc(logits, base + np.int64(4) * u)
        return bits_f32(a), bits_f32(b), bits_f32(c), bits_f32(d)
    x = logits[base + u]
    return x, x, x, x


@register_jitable
def tally(bins, x, floor, mask, prefix, shift, counting, m, t):
    """Add x's count or weight to its digit's bin when its key is >= floor and its higher
    digits are the prefix found so far."""
    k = key_of(x)
    if k >= floor and u32(k & mask) == prefix:
        d = u32(k >> shift) & DIGIT
        bins[d] += U1 if counting else weight(x, m, t)


@register_jitable
def tally_unit(bins, xs, width, floor, mask, prefix, shift, counting, m, t):
    if width == 4:
        tally(bins, xs[0], floor, mask, prefix, shift, counting, m, t)
        tally(bins, xs[1], floor, mask, prefix, shift, counting, m, t)
        tally(bins, xs[2], floor, mask, prefix, shift, counting, m, t)
        tally(bins, xs[3], floor, mask, prefix, shift, counting, m, t)
    else:
        tally(bins, xs[0], floor, mask, prefix, shift, counting, m, t)


@register_jitable
def search(logits, base, units, wide, width, m, t, floor, counting, target, top_p, hist,
           shared, bins):
    """The largest key t >= floor such that the tokens with key >= t (and >= floor) weigh
    (counting: number) at least target, found a digit of 4 bits at a time from the top:
    8 passes, each a per-thread histogram of 16 bins, summed exactly over the block.

    With top_p > 0 the target is computed from the first pass's total instead (the mass of
    every token >= floor): floor(total * P / 2**24), P = uint32(top_p * 2**24), at least 1.
    """
    tid = cuda.threadIdx.x
    threads = np.int64(cuda.blockDim.x)
    prefix = np.uint32(0)
    for level in range(8):
        shift = np.uint32(28 - 4 * level)
        mask = u32(~((np.uint64(1) << np.uint64(32 - 4 * level)) - U1))  # the digits above
        for b in range(16):
            bins[b] = U0
        u = np.int64(tid)
        while u + 3 * threads < units:  # four 16-byte loads in flight: one SM reads the row
            xa = unit(logits, base, u, wide)
            xb = unit(logits, base, u + threads, wide)
            xc = unit(logits, base, u + 2 * threads, wide)
            xd = unit(logits, base, u + 3 * threads, wide)
            tally_unit(bins, xa, width, floor, mask, prefix, shift, counting, m, t)
            tally_unit(bins, xb, width, floor, mask, prefix, shift, counting, m, t)
            tally_unit(bins, xc, width, floor, mask, prefix, shift, counting, m, t)
            tally_unit(bins, xd, width, floor, mask, prefix, shift, counting, m, t)
            u += 4 * threads
        while u < units:
            tally_unit(bins, unit(logits, base, u, wide), width, floor, mask, prefix, shift,
                       counting, m, t)
            u += threads
        cuda.syncthreads()  # everyone has read the previous level's results
        if tid < 16:
            hist[tid] = U0
        cuda.syncthreads()
        for b in range(16):
            v = warp_sum(bins[b])
            if tid % 32 == 0 and v != U0:
                cuda.atomic.add(hist, b, v)
        cuda.syncthreads()
        if tid == 0:
            if level == 0 and top_p > ZERO_F:
                total = U0
                for b in range(16):
                    total += hist[b]
                p = np.uint64(top_p * P_SCALE)
                target = (total >> P_SHIFT) * p + (((total & P_MASK) * p) >> P_SHIFT)
                target = target if target > U0 else U1
                shared[1] = target
            else:
                target = shared[1] if top_p > ZERO_F else target
            above = shared[0] if level > 0 else U0
            d = 15
            while d > 0 and above + hist[d] < target:
                above += hist[d]
                d -= 1
            shared[0] = above
            shared[2] = np.uint64(prefix | u32(np.uint32(d) << shift))
        cuda.syncthreads()
        prefix = u32(shared[2])
    return prefix if prefix > floor else floor


@register_jitable
def better(v, idx, x, i):
    """(value, index) of the larger; on a tie the smaller index (np.argmax's first maximum)."""
    if x > v or (x == v and i < idx):
        return x, i
    return v, idx


@register_jitable
def argmax(logits, base, units, wide, width, tokens, b, best_v, best_i):
    """tokens[b] = the first index of the row's maximum (argmax_f32's rule)."""
    tid = cuda.threadIdx.x
    v = -np.float32(np.inf)
    idx = np.int32(0x7FFFFFFF)
    u = np.int64(tid)
    while u < units:
        xs = unit(logits, base, u, wide)
        first = np.int32(u * width)
        v, idx = better(v, idx, xs[0], first)
        if width == 4:
            v, idx = better(v, idx, xs[1], first + np.int32(1))
            v, idx = better(v, idx, xs[2], first + np.int32(2))
            v, idx = better(v, idx, xs[3], first + np.int32(3))
        u += cuda.blockDim.x
    best_v[tid] = v
    best_i[tid] = idx
    cuda.syncthreads()
    half = cuda.blockDim.x // 2
    while half > 0:
        if tid < half:
            nv, ni = better(best_v[tid], best_i[tid], best_v[tid + half], best_i[tid + half])
            best_v[tid] = nv
            best_i[tid] = ni
        cuda.syncthreads()
        half //= 2
    if tid == 0:
        tokens[b] = best_i[0] if best_i[0] != np.int32(0x7FFFFFFF) else np.int32(0)


@register_jitable
def top_key(xs, width, local):
    local = max(local, key_of(xs[0]))
    if width == 4:
        local = max(local, max(max(key_of(xs[1]), key_of(xs[2])), key_of(xs[3])))
    return local


@register_jitable
def kept_weight(xs, c, tau, m, t):
    """The weight of lane c of a unit when its key is >= tau, else 0."""
    x = xs[c]
    return weight(x, m, t) if key_of(x) >= tau else U0


@kernel(ENTRIES, "sample_f32", P_F32, P_U32, P_I32, I32, I32, I32)
def sample_f32(logits, params, tokens, n, stride, vocab):
    b = cuda.blockIdx.x
    if b >= n:
        return
    hist = cuda.shared.array(16, types.uint64)
    shared = cuda.shared.array(3, types.uint64)  # running mass above, top-p target, prefix
    top = cuda.shared.array(1, types.uint32)
    bins = cuda.local.array(16, types.uint64)
    sums = cuda.shared.array(THREADS, types.uint64)
    best_v = cuda.shared.array(THREADS, types.float32)
    best_i = cuda.shared.array(THREADS, types.int32)
    tid = cuda.threadIdx.x
    threads = np.int64(cuda.blockDim.x)
    w = np.int64(b) * WORDS
    base = np.int64(params[w]) * np.int64(stride)
    t = bits_f32(params[w + 1])
    top_k = params[w + 2]
    top_p = bits_f32(params[w + 3])
    seed = np.uint64(params[w + 4]) | (np.uint64(params[w + 5]) << S32)
    sequence = np.uint64(params[w + 6]) | (np.uint64(params[w + 7]) << S32)
    step = np.uint64(params[w + 8]) | (np.uint64(params[w + 9]) << S32)
    # 16-byte units when every row starts 16-byte aligned and holds whole units, else floats
    wide = vocab % 4 == 0 and stride % 4 == 0 and address(logits) % np.uint64(16) == U0
    width = 4 if wide else 1
    units = np.int64(vocab // width)
    if t == ZERO_F:
        argmax(logits, base, units, wide, width, tokens, b, best_v, best_i)
        return

    local = np.uint32(0)
    u = np.int64(tid)
    while u + 3 * threads < units:
        xa = unit(logits, base, u, wide)
        xb = unit(logits, base, u + threads, wide)
        xc = unit(logits, base, u + 2 * threads, wide)
        xd = unit(logits, base, u + 3 * threads, wide)
        local = top_key(xb, width, top_key(xa, width, local))
        local = top_key(xd, width, top_key(xc, width, local))
        u += 4 * threads
    while u < units:
        local = top_key(unit(logits, base, u, wide), width, local)
        u += threads
    if tid == 0:
        top[0] = np.uint32(0)
    cuda.syncthreads()
    cuda.atomic.max(top, 0, local)
    cuda.syncthreads()
    m = value_of(top[0])

    tau = np.uint32(0)
    if top_k > np.uint32(0) and np.int64(top_k) < np.int64(vocab):
        tau = search(logits, base, units, wide, width, m, t, tau, True, np.uint64(top_k),
                     ZERO_F, hist, shared, bins)
    if top_p < ONE_F:
        tau = search(logits, base, units, wide, width, m, t, tau, False, U1, top_p, hist,
                     shared, bins)

    # The chosen token: each thread owns a contiguous run of units; an inclusive scan of the
    # runs' weights says whose run holds the draw, and that thread walks it.
    chunk = (units + threads - 1) // threads
    lo = np.int64(tid) * chunk
    hi = min(lo + chunk, units)
    own = U0
    j = lo
    while j < hi:
        xs = unit(logits, base, j, wide)
        own += kept_weight(xs, 0, tau, m, t)
        if width == 4:
            own += kept_weight(xs, 1, tau, m, t) + kept_weight(xs, 2, tau, m, t) + \
                kept_weight(xs, 3, tau, m, t)
        j += 1
    sums[tid] = own
    cuda.syncthreads()
    off = 1
    while off < threads:
        v = sums[tid]
        if tid >= off:
            v += sums[tid - off]
        cuda.syncthreads()
        sums[tid] = v
        cuda.syncthreads()
        off *= 2
    inclusive = sums[tid]
    exclusive = inclusive - own
    r = mulhi64(random64(seed, sequence, step), sums[threads - 1])
    if own == U0 or r < exclusive or r >= inclusive:
        return
    running = exclusive
    j = lo
    while j < hi:
        xs = unit(logits, base, j, wide)
        for c in range(width):
            running += kept_weight(xs, c, tau, m, t)
            if running > r:
                tokens[b] = np.int32(j * width + c)
                return
        j += 1
