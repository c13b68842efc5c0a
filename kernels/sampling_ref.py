"""The sampling algorithm in numpy: the reference of `sample_f32` (kernels/sampling_nb.py).

One row of f32 logits, one token out, per block of the kernel (per row here). The row's
parameters arrive as 12 uint32 words (`PARAM_WORDS`), packed by `kerncc.runtime.sampling`:

  0 row (of the logits, `stride` floats apart)   1 temperature (f32 bits; 0 = greedy)
  2 top_k (0 = off)                              3 top_p (f32 bits; 1 = off)
  4, 5 seed (low, high word)                     6, 7 sequence (low, high)
  8, 9 step (low, high)                          10, 11 zero

The algorithm, exact in integers past one `expf` per logit, so the GPU and this reference
pick the same token whenever their `expf` round alike (they may differ by an ulp, rarely
moving a token at a boundary), and each is deterministic by (seed, sequence, step):

1. temperature 0: argmax, the first maximum (as `argmax_f32`); nothing else is read.
2. key(x): the f32 bits mapped to uint32 so that the integer order is the float order.
   m = the largest logit. w(x) = expf((x - m) / T) in f32, and the integer weight
   W(x) = uint64(w * 2**40) (truncated; a token whose probability is below ~2**-40 of the
   top one's never comes out). Every sum below is an exact uint64.
3. top-k (0 < k < vocab): tau = the k-th largest key; tokens with key >= tau stay (ties at
   the boundary all stay, as HF's TopKLogitsWarper keeps them).
4. top-p (p < 1): total = sum of W over the kept tokens; target = floor(total * P / 2**24)
   with P = uint32(p * 2**24) (at least 1); tau = the largest key such that the kept tokens
   with key >= tau weigh at least target: the fewest top tokens that hold p of the mass
   (ties all stay).
5. R = the first two words of Philox4x32-10 (key = seed, counter = (step, sequence)) as a
   uint64; r = floor(R * M / 2**64) with M the kept tokens' total weight; the token is the
   first index (ascending) whose inclusive running sum of kept weights exceeds r.
"""

from __future__ import annotations

import numpy as np

PARAM_WORDS = 12
WEIGHT_BITS = 40
P_BITS = 24
MASK32 = 0xFFFFFFFF
PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def philox4x32_10(counter: tuple[int, int, int, int], key: tuple[int, int]
                  ) -> tuple[int, int, int, int]:
    """Philox4x32 with 10 rounds (Salmon et al., SC'11; Random123's philox4x32_10)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = PHILOX_M[0] * c0, PHILOX_M[1] * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32)
        k0, k1 = (k0 + PHILOX_W[0]) & MASK32, (k1 + PHILOX_W[1]) & MASK32
    return c0, c1, c2, c3


def random64(seed: int, sequence: int, step: int) -> int:
    """The uint64 a (seed, sequence, step) draws: words 0 (low) and 1 (high) of Philox."""
    out = philox4x32_10((step & MASK32, step >> 32, sequence & MASK32, sequence >> 32),
                        (seed & MASK32, seed >> 32))
    return out[0] | (out[1] << 32)


def ordered_keys(x: np.ndarray) -> np.ndarray:
    """uint32 keys of f32 values whose integer order is the float order (-0 < +0)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return np.where(bits >> 31 == 0, bits ^ np.uint32(0x80000000), ~bits).astype(np.uint32)


def weights(x: np.ndarray, temperature: np.float32) -> np.ndarray:
    """W(x) = uint64(expf((x - max) / T) * 2**40), every step in f32 as the kernel does."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(under="ignore", over="ignore", invalid="ignore"):
        w = np.exp(((x - x.max()) / np.float32(temperature)).astype(np.float32))
        return (w * np.float32(2.0 ** WEIGHT_BITS)).astype(np.uint64)


def threshold(keys: np.ndarray, weight: np.ndarray, target: int) -> int:
    """The largest key value t such that the weights of keys >= t sum to at least target."""
    unique, inverse = np.unique(keys, return_inverse=True)
    per_key = np.zeros(unique.size, dtype=np.uint64)
    np.add.at(per_key, inverse, weight.astype(np.uint64))
    from_top = np.cumsum(per_key[::-1], dtype=np.uint64)
    at = int(np.searchsorted(from_top, np.uint64(target), side="left"))
    return int(unique[::-1][min(at, unique.size - 1)])


def top_p_target(total: int, top_p: np.float32) -> int:
    p = int(np.float32(top_p) * np.float32(2.0 ** P_BITS))
    return max(1, (total >> P_BITS) * p + (((total & (2 ** P_BITS - 1)) * p) >> P_BITS))


def sample_row(x: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int,
               sequence: int, step: int) -> int:
    """The token the algorithm of this module picks from one row of logits."""
    x = np.asarray(x, dtype=np.float32)
    if np.float32(temperature) == 0:
        return int(np.argmax(x))
    keys = ordered_keys(x)
    w = weights(x, np.float32(temperature))
    tau = 0
    if 0 < top_k < x.size:
        tau = threshold(keys, np.ones(x.size, dtype=np.uint64), top_k)
    if np.float32(top_p) < 1:
        kept = np.where(keys >= tau, w, np.uint64(0))
        tau = threshold(keys, kept, top_p_target(int(kept.sum(dtype=np.uint64)), top_p))
    kept = np.where(keys >= tau, w, np.uint64(0))
    running = np.cumsum(kept, dtype=np.uint64)
    r = (random64(seed, sequence, step) * int(running[-1])) >> 64
    return int(np.searchsorted(running, np.uint64(r), side="right"))


def unpack(words: np.ndarray) -> tuple[int, float, int, float, int, int, int]:
    """(row, temperature, top_k, top_p, seed, sequence, step) of one row's 12 words."""
    w = [int(v) for v in words]
    as_f32 = np.asarray([w[1], w[3]], dtype=np.uint32).view(np.float32)
    return (w[0], float(as_f32[0]), w[2], float(as_f32[1]), w[4] | w[5] << 32,
            w[6] | w[7] << 32, w[8] | w[9] << 32)
