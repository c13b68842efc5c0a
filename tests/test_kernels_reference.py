"""The numpy reference kernels (kernels/reference.py) against direct formulas.

Each reference runs through its ABI (uint8 views running past the data, numpy scalars) on
random non-zero inputs and is compared with a plain, loop-level restatement of what the CUDA
kernel computes. Tolerances are bf16's (results round once or twice to 8 mantissa bits).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from kerncc.kernels import library
from kerncc.kernels.reference import DECODE_SPLIT, EXTERNS, KERNELS

BF16 = np.dtype(ml_dtypes.bfloat16)
LAUNCH = SimpleNamespace(grid=(1, 1, 1), block=(1, 1, 1), shared_mem=0)
TAIL = 64  # bytes past the data: pointer args run to the end of their allocation


def ptr(array: np.ndarray) -> np.ndarray:
    """A pointer arg: the array's bytes in a larger allocation (writes land in `array`'s copy)."""
    raw = np.zeros(array.nbytes + TAIL, np.uint8)
    raw[: array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return raw


def read(raw: np.ndarray, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    count = int(np.prod(shape))
    return raw[: count * np.dtype(dtype).itemsize].view(dtype).reshape(shape)


def randn(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale + 0.1).astype(np.float32).astype(BF16)


def f(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64)


def close(actual: np.ndarray, expected: np.ndarray, rtol: float = 2e-2, atol: float = 2e-2):
    np.testing.assert_allclose(f(actual), f(expected), rtol=rtol, atol=atol)


def i32(v: int) -> np.int32:
    return np.int32(v)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def test_every_cubin_entry_has_a_reference():
    entries = {e for info in library.index().values() for e in info["entries"]}
    assert entries == set(KERNELS)
    assert set(EXTERNS) == {"cublaslt_bf16_tn", "cublaslt_bf16_tn_acc", "cublas_bf16_tn_f32"}


def test_embedding_gather(rng):
    table = randn(rng, 50, 16)
    ids = rng.integers(0, 50, 7).astype(np.int32)
    out = ptr(np.zeros((7, 16), BF16))
    KERNELS["embedding_gather_bf16"](LAUNCH, ptr(ids), ptr(table), out, i32(7), i32(16))
    for r, t in enumerate(ids):
        assert read(out, BF16, (7, 16))[r].tobytes() == table[t].tobytes()


def norm_formula(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    rms = math.sqrt(sum(float(v) ** 2 for v in x) / len(x) + eps)
    return np.array([float(BF16.type(float(v) / rms)) * float(g) for v, g in zip(x, w)])


def test_rmsnorm(rng):
    x, w = randn(rng, 5, 32), randn(rng, 32)
    y = ptr(np.zeros((5, 32), BF16))
    KERNELS["rmsnorm_bf16"](LAUNCH, ptr(x), ptr(w), y, i32(5), i32(32), np.float32(1e-6))
    for r in range(5):
        close(read(y, BF16, (5, 32))[r], norm_formula(x[r], w, 1e-6))


def test_add_rmsnorm_updates_the_residual(rng):
    res, x, w = randn(rng, 3, 32), randn(rng, 3, 32), randn(rng, 32)
    res_raw, y = ptr(res), ptr(np.zeros((3, 32), BF16))
    KERNELS["add_rmsnorm_bf16"](LAUNCH, res_raw, ptr(x), ptr(w), y, i32(3), i32(32),
                                np.float32(1e-6))
    new_res = read(res_raw, BF16, (3, 32))
    close(new_res, f(res) + f(x), rtol=1e-2, atol=1e-2)
    for r in range(3):
        close(read(y, BF16, (3, 32))[r], norm_formula(new_res[r], w, 1e-6))


def test_head_rmsnorm_normalizes_q_and_k_heads_only(rng):
    nq, nk, hd, rows = 4, 2, 16, 3
    qkv, w = randn(rng, rows, (nq + 2 * nk) * hd), randn(rng, 2, hd)
    raw = ptr(qkv)
    KERNELS["head_rmsnorm_bf16"](LAUNCH, raw, ptr(w), i32(rows), i32(nq), i32(nk), i32(hd),
                                 np.float32(1e-6))
    out = read(raw, BF16, (rows, nq + 2 * nk, hd))
    heads = qkv.reshape(rows, nq + 2 * nk, hd)
    for r in range(rows):
        for h in range(nq + nk):
            close(out[r, h], norm_formula(heads[r, h], w[0 if h < nq else 1], 1e-6))
    assert out[:, nq + nk:].tobytes() == heads[:, nq + nk:].tobytes()  # v untouched


def test_rmsnorm_last_takes_each_sequences_last_row(rng):
    x, w = randn(rng, 6, 32), randn(rng, 32)
    y = ptr(np.zeros((2, 32), BF16))
    KERNELS["rmsnorm_last_bf16"](LAUNCH, ptr(x), ptr(w), y, i32(2), i32(3), i32(32),
                                 np.float32(1e-6))
    close(read(y, BF16, (2, 32))[0], norm_formula(x[2], w, 1e-6))
    close(read(y, BF16, (2, 32))[1], norm_formula(x[5], w, 1e-6))


def test_rope_table():
    raw = ptr(np.zeros((40, 8), np.float32))
    KERNELS["rope_table_f32"](LAUNCH, raw, i32(40), i32(8), np.float32(10000.0))
    table = read(raw, np.float32, (40, 8))
    for p in (0, 1, 17, 39):
        for i in range(4):
            angle = p * 10000.0 ** (-2 * i / 8)
            assert table[p, i] == pytest.approx(math.cos(angle), abs=1e-6)
            assert table[p, 4 + i] == pytest.approx(math.sin(angle), abs=1e-6)


def test_rope_neox_rotates_halves_as_complex_numbers(rng):
    nq, nk, hd, rows = 2, 1, 8, 3
    qkv = randn(rng, rows, (nq + 2 * nk) * hd)
    table = rng.uniform(-1, 1, (20, hd)).astype(np.float32)
    pos = np.array([3, 19, 0], np.int32)
    raw = ptr(qkv)
    KERNELS["rope_neox_bf16"](LAUNCH, raw, ptr(pos), ptr(table), i32(rows), i32(nq), i32(nk),
                              i32(hd))
    out = read(raw, BF16, (rows, nq + 2 * nk, hd))
    heads = qkv.reshape(rows, nq + 2 * nk, hd)
    half = hd // 2
    for r in range(rows):
        rot = table[pos[r], :half] + 1j * table[pos[r], half:]
        for h in range(nq + nk):
            z = (f(heads[r, h, :half]) + 1j * f(heads[r, h, half:])) * rot
            close(out[r, h], np.concatenate([z.real, z.imag]))
    assert out[:, nq + nk:].tobytes() == heads[:, nq + nk:].tobytes()


def test_kv_write_fills_slots_and_skips_padding(rng):
    nq, nk, hd, rows, slots = 2, 1, 8, 3, 10
    qkv = randn(rng, rows, (nq + 2 * nk) * hd)
    mapping = np.array([7, -1, 2], np.int32)
    cache = randn(rng, slots, 2 * nk * hd)
    raw = ptr(cache)
    KERNELS["kv_write_bf16"](LAUNCH, ptr(qkv), ptr(mapping), raw, i32(rows), i32(nq), i32(nk),
                             i32(hd))
    out = read(raw, BF16, (slots, 2 * nk * hd))
    assert out[7].tobytes() == qkv[0, nq * hd:].tobytes()
    assert out[2].tobytes() == qkv[2, nq * hd:].tobytes()
    untouched = [s for s in range(slots) if s not in (7, 2)]
    assert out[untouched].tobytes() == cache[untouched].tobytes()


def attention_formula(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float):
    """One query vector over keys/values [n, hd] (float64)."""
    s = [float(np.dot(f(q), f(k))) * scale for k in keys]
    m = max(s)
    p = [math.exp(v - m) for v in s]
    return sum(pi * f(v) for pi, v in zip(p, values)) / sum(p)


def paged_cache(rng, nk, hd, pages):
    """A random cache of `pages` pages and a shuffled page table over them."""
    cache = randn(rng, pages * 16, 2, nk, hd)
    return cache, rng.permutation(pages).astype(np.int32)


def key_values(cache, table_row, n, kvh):
    slots = [table_row[j // 16] * 16 + j % 16 for j in range(n)]
    return cache[slots, 0, kvh], cache[slots, 1, kvh]


def test_attn_prefill_over_cached_context(rng):
    nq, nk, hd, width, rows, start = 4, 2, 16, 4, 5, 19  # rows 19..23 of one sequence
    cache, table = paged_cache(rng, nk, hd, width)
    qkv = randn(rng, rows, (nq + 2 * nk) * hd)
    pos = np.arange(start, start + rows, dtype=np.int32)
    out = ptr(np.zeros((rows, nq * hd), BF16))
    scale = 1 / math.sqrt(hd)
    KERNELS["attn_prefill_bf16"](LAUNCH, ptr(qkv), ptr(cache), ptr(table), ptr(pos), out,
                                 i32(rows), i32(nq), i32(nk), i32(hd), i32(width),
                                 np.float32(scale))
    got = read(out, BF16, (rows, nq, hd))
    q = qkv.reshape(rows, -1, hd)
    for r in range(rows):
        for h in range(nq):
            k, v = key_values(cache, table, pos[r] + 1, h // (nq // nk))
            close(got[r, h], attention_formula(q[r, h], k, v, scale))


def decode(qkv, cache, tables, lens, nq, nk, hd, max_splits, scale):
    """attn_decode's two launches through their ABI: (partials [seqs, nq, splits, hd+2], out)."""
    seqs, width = tables.shape
    part = ptr(np.full((seqs, nq, max_splits, hd + 2), -7.0, np.float32))
    out = ptr(np.full((seqs, nq * hd), 5.0, BF16))
    KERNELS["attn_decode_split_bf16"](LAUNCH, ptr(qkv), ptr(cache), ptr(tables), ptr(lens), part,
                                      i32(seqs), i32(nq), i32(nk), i32(hd), i32(width),
                                      i32(max_splits), np.float32(scale))
    KERNELS["attn_decode_combine_bf16"](LAUNCH, part, ptr(lens), out, i32(seqs), i32(nq), i32(hd),
                                        i32(max_splits))
    return (read(part, np.float32, (seqs, nq, max_splits, hd + 2)),
            read(out, BF16, (seqs, nq, hd)))


def test_attn_decode_batch_of_sequences_over_several_splits(rng):
    nq, nk, hd, max_splits = 4, 2, 16, -(-700 // DECODE_SPLIT)  # covers the longest (700)
    width = max_splits * DECODE_SPLIT // 16
    lens = np.array([1, 33, 256, 300, 700, 0], np.int32)
    seqs = len(lens)
    cache, pages = paged_cache(rng, nk, hd, width * seqs)
    tables = pages.reshape(seqs, width)
    qkv = randn(rng, seqs, (nq + 2 * nk) * hd)
    scale = 1 / math.sqrt(hd)
    part, got = decode(qkv, cache, tables, lens, nq, nk, hd, max_splits, scale)
    q = qkv.reshape(seqs, -1, hd)
    for b, n in enumerate(lens):
        splits = -(-int(n) // DECODE_SPLIT)
        assert (part[b, :, splits:] == -7.0).all(), "a split past the sequence was written"
        if n == 0:
            assert (f(got[b]) == 0).all(), "an empty sequence writes zeros"
            continue
        for h in range(nq):
            k, v = key_values(cache, tables[b], n, h // (nq // nk))
            close(got[b, h], attention_formula(q[b, h], k, v, scale))
    # A partial is its split's own softmax: o / l is attention over the split's keys, m the
    # largest score in log2 units.
    k, v = key_values(cache, tables[4], 700, 0)
    keys = slice(DECODE_SPLIT, 2 * DECODE_SPLIT)
    m, l, o = part[4, 0, 1, 0], part[4, 0, 1, 1], part[4, 0, 1, 2:]
    close(o / l, attention_formula(q[4, 0], k[keys], v[keys], scale), rtol=1e-5, atol=1e-5)
    scores = [float(np.dot(f(q[4, 0]), f(key))) * scale / math.log(2) for key in k[keys]]
    assert m == pytest.approx(max(scores), rel=1e-5)


def test_attention_is_deterministic(rng):
    nq, nk, hd, width, rows = 4, 2, 16, 2, 20
    cache, table = paged_cache(rng, nk, hd, width)
    qkv, pos = randn(rng, rows, (nq + 2 * nk) * hd), np.arange(rows, dtype=np.int32)
    outs = []
    for _ in range(2):
        out = ptr(np.zeros((rows, nq * hd), BF16))
        KERNELS["attn_prefill_bf16"](LAUNCH, ptr(qkv), ptr(cache), ptr(table), ptr(pos), out,
                                     i32(rows), i32(nq), i32(nk), i32(hd), i32(width),
                                     np.float32(0.25))
        outs.append(out.tobytes())
    assert outs[0] == outs[1]


def test_silu_mul_reads_interleaved_blocks(rng):
    rows, inter, block = 2, 12, 4
    gate_up = randn(rng, rows, 2 * inter)
    act = ptr(np.zeros((rows, inter), BF16))
    KERNELS["silu_mul_bf16"](LAUNCH, ptr(gate_up), act, i32(rows), i32(inter), i32(block))
    got = read(act, BF16, (rows, inter))
    for r in range(rows):
        for i in range(inter):
            g = float(gate_up[r, (i // block) * 2 * block + i % block])
            u = float(gate_up[r, (i // block) * 2 * block + block + i % block])
            assert float(got[r, i]) == pytest.approx(g / (1 + math.exp(-g)) * u, rel=2e-2,
                                                     abs=1e-2)


def test_argmax_prefers_the_first_maximum(rng):
    logits = rng.standard_normal((3, 100)).astype(np.float32)
    logits[1, 10] = logits[1, 70] = 50.0
    tokens = ptr(np.zeros(3, np.int32))
    KERNELS["argmax_f32"](LAUNCH, ptr(logits), tokens, i32(3), i32(100))
    got = read(tokens, np.int32, (3,))
    assert got[1] == 10
    assert [int(t) for t in got] == [int(np.argmax(row)) for row in logits]


def test_cast_f32_bf16(rng):
    x = rng.standard_normal(37).astype(np.float32)
    y = ptr(np.zeros(37, BF16))
    KERNELS["cast_f32_bf16"](LAUNCH, ptr(x), y, i32(37))
    assert read(y, BF16, (37,)).tobytes() == x.astype(BF16).tobytes()


def gemm_formula(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    m, n = a.shape[0], w.shape[0]
    return np.array([[float(np.dot(f(a[i]), f(w[j]))) for j in range(n)] for i in range(m)])


@pytest.mark.parametrize("name", ["cublaslt_bf16_tn", "cublas_bf16_tn_f32"])
def test_gemm_tn(rng, name):
    m, n, k = 3, 5, 24
    a, w = randn(rng, m, k), randn(rng, n, k)
    dtype = np.float32 if name.endswith("f32") else BF16
    c = ptr(np.zeros((m, n), dtype))
    EXTERNS[name](LAUNCH, ptr(a), ptr(w), c, i32(m), i32(n), i32(k))
    tol = 1e-5 if dtype == np.float32 else 1e-2
    close(read(c, dtype, (m, n)), gemm_formula(a, w), rtol=tol, atol=tol)


def test_gemm_tn_accumulates(rng):
    m, n, k = 3, 5, 24
    a, w, c0 = randn(rng, m, k), randn(rng, n, k), randn(rng, m, n)
    c = ptr(c0)
    EXTERNS["cublaslt_bf16_tn_acc"](LAUNCH, ptr(a), ptr(w), c, i32(m), i32(n), i32(k))
    close(read(c, BF16, (m, n)), f(c0) + gemm_formula(a, w), rtol=1e-2, atol=2e-2)
