"""The numpy references a packed prefill runs on: attn_prefill_varlen_bf16 and
rmsnorm_last_varlen_bf16 give each sequence of a packed chunk the bits it gets alone, and a
GEMM row's bits do not depend on the other rows of the call (batch invariance, which is what
lets the engine promise that a prompt served with others gives the tokens it gives alone)."""

from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np

from kerncc.kernels.reference import EXTERNS, KERNELS

BF16 = np.dtype(ml_dtypes.bfloat16)
LAUNCH = SimpleNamespace(grid=(1, 1, 1), block=(1, 1, 1), shared_mem=0)
NQ, NK, HD, WIDTH, PAGE = 4, 2, 16, 4, 16
SCALE = np.float32(0.25)


def ptr(array: np.ndarray) -> np.ndarray:
    raw = np.zeros(array.nbytes + 64, np.uint8)
    raw[:array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return raw


def read(raw: np.ndarray, dtype, shape) -> np.ndarray:
    return raw[:int(np.prod(shape)) * np.dtype(dtype).itemsize].view(dtype).reshape(shape)


def bf16(rng, *shape) -> np.ndarray:
    return (rng.standard_normal(shape) + 0.1).astype(np.float32).astype(BF16)


def test_packed_attention_gives_each_sequence_its_bits_alone():
    rng = np.random.default_rng(7)
    # three sequences: (first position of the chunk, rows), pages shuffled over 12 pages
    seqs = [(0, 5), (20, 3), (7, 9)]
    tables = rng.permutation(12).reshape(3, WIDTH).astype(np.int32)
    kv = ptr(bf16(rng, 12 * PAGE, 4 * NK * HD))
    rows = sum(n for _, n in seqs)
    qkv = bf16(rng, rows, (NQ + 2 * NK) * HD)
    positions = np.concatenate([np.arange(s, s + n) for s, n in seqs]).astype(np.int32)
    cu = np.array([0, 5, 8, 17, 17], np.int32)  # padded past the last sequence
    out = ptr(np.zeros((rows, NQ * HD), BF16))
    KERNELS["attn_prefill_varlen_bf16"](LAUNCH, ptr(qkv), kv, ptr(tables), ptr(positions),
                                        ptr(cu), out, np.int32(rows), np.int32(3),
                                        *map(np.int32, (NQ, NK, HD, WIDTH)), SCALE)
    packed = read(out, BF16, (rows, NQ * HD))
    for s, (start, n) in enumerate(seqs):
        lo = int(cu[s])
        alone = ptr(np.zeros((n, NQ * HD), BF16))
        KERNELS["attn_prefill_bf16"](LAUNCH, ptr(qkv[lo:lo + n]), kv, ptr(tables[s]),
                                     ptr(positions[lo:lo + n]), alone, np.int32(n),
                                     *map(np.int32, (NQ, NK, HD, WIDTH)), SCALE)
        want = read(alone, BF16, (n, NQ * HD))
        assert np.array_equal(packed[lo:lo + n].view(np.uint16), want.view(np.uint16))
        assert np.abs(want.astype(np.float32)).sum() > 0


def test_a_rows_attention_does_not_depend_on_the_rows_fed_with_it():
    rng = np.random.default_rng(8)
    table = np.arange(WIDTH, dtype=np.int32)
    kv = ptr(bf16(rng, WIDTH * PAGE, 4 * NK * HD))
    qkv = bf16(rng, 30, (NQ + 2 * NK) * HD)

    def run(lo: int, hi: int) -> np.ndarray:
        out = ptr(np.zeros((hi - lo, NQ * HD), BF16))
        KERNELS["attn_prefill_bf16"](LAUNCH, ptr(qkv[lo:hi]), kv, ptr(table),
                                     ptr(np.arange(lo, hi, dtype=np.int32)), out,
                                     np.int32(hi - lo), *map(np.int32, (NQ, NK, HD, WIDTH)),
                                     SCALE)
        return read(out, BF16, (hi - lo, NQ * HD)).view(np.uint16)

    whole = run(0, 30)
    assert np.array_equal(np.concatenate([run(0, 7), run(7, 8), run(8, 30)]), whole)


def test_the_last_row_of_each_packed_sequence_is_normed():
    rng = np.random.default_rng(9)
    x, w = bf16(rng, 10, 64), bf16(rng, 64)
    cu = np.array([0, 3, 4, 10], np.int32)
    out = ptr(np.zeros((3, 64), BF16))
    KERNELS["rmsnorm_last_varlen_bf16"](LAUNCH, ptr(x), ptr(w), out, ptr(cu), np.int32(3),
                                        np.int32(64), np.float32(1e-6))
    for s, last in enumerate((2, 3, 9)):
        one = ptr(np.zeros((1, 64), BF16))
        KERNELS["rmsnorm_last_bf16"](LAUNCH, ptr(x[last]), ptr(w), one, np.int32(1),
                                     np.int32(1), np.int32(64), np.float32(1e-6))
        assert np.array_equal(read(out, BF16, (3, 64))[s].view(np.uint16),
                              read(one, BF16, (1, 64))[0].view(np.uint16))


def test_a_gemm_rows_bits_do_not_depend_on_the_batch():
    rng = np.random.default_rng(10)
    a, w = bf16(rng, 40, 64), bf16(rng, 256, 64)

    def run(rows: np.ndarray) -> np.ndarray:
        c = ptr(np.zeros((len(rows), 256), np.float32))
        EXTERNS["cublas_bf16_tn_f32"](LAUNCH, ptr(a[rows]), ptr(w), c, np.int32(len(rows)),
                                      np.int32(256), np.int32(64))
        return read(c, np.float32, (len(rows), 256))

    whole = run(np.arange(40))
    for rows in (np.array([5]), np.array([3, 17, 5, 9]), rng.permutation(40)[:13]):
        assert np.array_equal(run(rows).view(np.uint32), whole[rows].view(np.uint32))
