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

from kerncc.kernels.nb import I32, P_F32, P_I32, P_U32, Entries, bits_f32, f32_bits, kernel, u32

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
def tally(bins, x, floor, mask, prefix, shift, counting, m, t):
    """Add x's count or weight to its digit's bin when its key is >= floor and its higher
    digits are the prefix found so far."""
    k = key_of(x)
    if k >= floor and u32(k & mask) == prefix:
        d = u32(k >> shift) & DIGIT
        bins[d] += U1 if counting else weight(x, m, t)


@register_jitable
def search(logits, base, vocab, m, t, floor, counting, target, top_p, hist, shared, bins):
    """The largest key t >= floor such that the tokens with key >= t (and >= floor) weigh
    (counting: number) at least target, found a digit of 4 bits at a time from the top:
    8 passes, each a per-thread histogram of 16 bins, summed exactly over the block.

    With top_p > 0 the target is computed from the first pass's total instead (the mass of
    every token >= floor): floor(total * P / 2**24), P = uint32(top_p * 2**24), at least 1.
    """
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    prefix = np.uint32(0)
    for level in range(8):
        shift = np.uint32(28 - 4 * level)
        mask = u32(~((np.uint64(1) << np.uint64(32 - 4 * level)) - U1))  # the digits above
        for b in range(16):
            bins[b] = U0
        i = tid
        while i + 3 * threads < vocab:  # four loads in flight: the passes are latency-bound
            x0 = logits[base + i]
            x1 = logits[base + i + threads]
            x2 = logits[base + i + 2 * threads]
            x3 = logits[base + i + 3 * threads]
            tally(bins, x0, floor, mask, prefix, shift, counting, m, t)
            tally(bins, x1, floor, mask, prefix, shift, counting, m, t)
            tally(bins, x2, floor, mask, prefix, shift, counting, m, t)
            tally(bins, x3, floor, mask, prefix, shift, counting, m, t)
            i += 4 * threads
        while i < vocab:
            tally(bins, logits[base + i], floor, mask, prefix, shift, counting, m, t)
            i += threads
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
def argmax(logits, base, vocab, tokens, b, best_v, best_i):
    """tokens[b] = the first index of the row's maximum (argmax_f32's rule)."""
    tid = cuda.threadIdx.x
    v = -np.float32(np.inf)
    idx = np.int32(0x7FFFFFFF)
    i = tid
    while i < vocab:
        x = logits[base + i]
        if x > v:  # ascending i: the first maximum of this thread's share wins ties
            v = x
            idx = np.int32(i)
        i += cuda.blockDim.x
    best_v[tid] = v
    best_i[tid] = idx
    cuda.syncthreads()
    half = cuda.blockDim.x // 2
    while half > 0:
        if tid < half:
            ov, oi = best_v[tid + half], best_i[tid + half]
            if ov > best_v[tid] or (ov == best_v[tid] and oi < best_i[tid]):
                best_v[tid] = ov
                best_i[tid] = oi
        cuda.syncthreads()
        half //= 2
    if tid == 0:
        tokens[b] = best_i[0] if best_i[0] != np.int32(0x7FFFFFFF) else np.int32(0)


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
    threads = cuda.blockDim.x
    w = np.int64(b) * WORDS
    base = np.int64(params[w]) * np.int64(stride)
    t = bits_f32(params[w + 1])
    top_k = params[w + 2]
    top_p = bits_f32(params[w + 3])
    seed = np.uint64(params[w + 4]) | (np.uint64(params[w + 5]) << S32)
    sequence = np.uint64(params[w + 6]) | (np.uint64(params[w + 7]) << S32)
    step = np.uint64(params[w + 8]) | (np.uint64(params[w + 9]) << S32)
    if t == ZERO_F:
        argmax(logits, base, vocab, tokens, b, best_v, best_i)
        return

    local = np.uint32(0)
    i = tid
    while i + 3 * threads < vocab:
        k0 = max(key_of(logits[base + i]), key_of(logits[base + i + threads]))
        k1 = max(key_of(logits[base + i + 2 * threads]), key_of(logits[base + i + 3 * threads]))
        local = max(local, max(k0, k1))
        i += 4 * threads
    while i < vocab:
        local = max(local, key_of(logits[base + i]))
        i += threads
    if tid == 0:
        top[0] = np.uint32(0)
    cuda.syncthreads()
    cuda.atomic.max(top, 0, local)
    cuda.syncthreads()
    m = value_of(top[0])

    tau = np.uint32(0)
    if top_k > np.uint32(0) and np.int64(top_k) < np.int64(vocab):
        tau = search(logits, base, vocab, m, t, tau, True, np.uint64(top_k), ZERO_F, hist,
                     shared, bins)
    if top_p < ONE_F:
        tau = search(logits, base, vocab, m, t, tau, False, U1, top_p, hist, shared, bins)

    # The chosen token: each thread owns a contiguous chunk; an inclusive scan of the chunks'
    # weights says whose chunk holds the draw, and that thread walks it.
    chunk = (np.int64(vocab) + threads - 1) // threads
    lo = np.int64(tid) * chunk
    hi = min(lo + chunk, np.int64(vocab))
    own = U0
    j = lo
    while j < hi:
        x = logits[base + j]
        if key_of(x) >= tau:
            own += weight(x, m, t)
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
        x = logits[base + j]
        if key_of(x) >= tau:
            running += weight(x, m, t)
            if running > r:
                tokens[b] = np.int32(j)
                return
        j += 1
