"""The numpy references of kernels/fp8.cu, through the kernels' ABI, against loop-level
restatements of the CUDA comments (per 128 x 128 block: amax / 448 scales, e4m3 round to
nearest even with saturation; dequantize f32(q) * s rounded once to bf16; the GEMV as f32 sums
of scale times block products, in the three output modes)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kerncc.kernels.reference import KERNELS, fp8_dequantize, fp8_quantize

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
TAIL = 64


def ptr(array: np.ndarray) -> np.ndarray:
    raw = np.zeros(array.nbytes + TAIL, np.uint8)
    raw[: array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return raw


def read(raw: np.ndarray, dtype, shape) -> np.ndarray:
    return raw[: int(np.prod(shape)) * np.dtype(dtype).itemsize].view(dtype).reshape(shape)


def weight(n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)) * np.exp(rng.uniform(-3, 3, (n, 1)))  # rows of all sizes
    return w.astype(np.float32).astype(BF16)


def test_quantize_follows_the_block_rule_loop_by_loop():
    n, k = 200, 300  # partial blocks on both axes
    w = weight(n, k)
    w[128:, 256:] = 0  # an all-zero block gets scale 1
    q, s = fp8_quantize(w)
    assert q.dtype == FP8 and s.shape == (2, 3) and s.dtype == np.float32
    for bi in range(2):
        for bj in range(3):
            block = w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128].astype(np.float32)
            amax = np.abs(block).max()
            want = np.float32(amax) / np.float32(448) if amax > 0 else np.float32(1)
            assert s[bi, bj] == want
            got = q[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128].astype(np.float32)
            assert np.abs(got).max() == (448 if amax > 0 else 0)  # the amax maps to 448
            # each value is the nearest e4m3 of w / s: within half a step (2^-4 relative)
            ratio = block / want
            assert np.all(np.abs(got - ratio) <= np.abs(ratio) / 16 + 2.0 ** -10)


def test_quantize_rounds_to_nearest_even_and_saturates():
    w = np.zeros((1, 128), np.float32)
    w[0, :4] = [448.0, 1.0625, 1.1875, -448.0]  # amax 448: scale 1; two ties
    q, s = fp8_quantize(w.astype(BF16))
    assert s[0, 0] == 1
    assert q[0, :4].astype(np.float32).tolist() == [448.0, 1.0, 1.25, -448.0]


def test_the_quantize_kernel_abi_gives_the_function():
    n, k = 130, 272
    w = weight(n, k, 1)
    q_raw, s_raw = ptr(np.zeros((n, k), FP8)), ptr(np.zeros((2, 3), np.float32))
    KERNELS["fp8_quantize_bf16"](None, ptr(w), q_raw, s_raw, np.int32(n), np.int32(k))
    q, s = fp8_quantize(w)
    assert np.array_equal(read(q_raw, np.uint8, (n, k)), q.view(np.uint8))
    assert np.array_equal(read(s_raw, np.float32, (2, 3)), s)


def test_dequantize_is_one_bf16_rounding_of_fp8_times_scale():
    n, k = 130, 272
    q, s = fp8_quantize(weight(n, k, 2))
    out = ptr(np.zeros((n, k), BF16))
    KERNELS["fp8_dequantize_bf16"](None, ptr(q), ptr(s), out, np.int32(n), np.int32(k))
    got = read(out, BF16, (n, k))
    for i in (0, 127, 128, 129):
        for j in (0, 5, 127, 128, 271):
            want = np.float32(np.float32(q[i, j]) * s[i // 128, j // 128]).astype(BF16)
            assert got[i, j] == want
    assert np.abs(got.astype(np.float32) - weight(n, k, 2).astype(np.float32)).max() > 0


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("m", [1, 3, 5])
def test_gemv_sums_scaled_block_products(mode, m):
    n, k = 136, 400  # k: 3 whole blocks and a partial one
    q, s = fp8_quantize(weight(n, k, 3))
    rng = np.random.default_rng(4)
    a = rng.standard_normal((m, k)).astype(np.float32).astype(BF16)
    c0 = rng.standard_normal((m, n)).astype(np.float32)
    c0 = c0 if mode == 2 else c0.astype(BF16)
    c = ptr(c0)
    KERNELS["gemv_fp8_bf16"](None, ptr(a), ptr(q), ptr(s), c, np.int32(m), np.int32(n),
                             np.int32(k), np.int32(mode))
    got = read(c, np.float32 if mode == 2 else BF16, (m, n)).astype(np.float64)
    want = np.zeros((m, n))
    for r in range(m):
        for i in range(n):
            for b in range(0, k, 128):
                part = a[r, b:b + 128].astype(np.float64) @ q[i, b:b + 128].astype(np.float64)
                want[r, i] += s[i // 128, b // 128] * part
    if mode == 1:
        want += c0.astype(np.float64)
    bound = (2.0 ** -8 if mode != 2 else 1e-5) * np.abs(want).max()
    assert np.abs(got - want).max() <= bound
    assert np.abs(want).max() > 1


def test_gemv_rows_do_not_depend_on_the_batch():
    n, k = 64, 256
    q, s = fp8_quantize(weight(n, k, 5))
    a = np.random.default_rng(6).standard_normal((4, k)).astype(np.float32).astype(BF16)
    whole, one = ptr(np.zeros((4, n), np.float32)), ptr(np.zeros((1, n), np.float32))
    KERNELS["gemv_fp8_bf16"](None, ptr(a), ptr(q), ptr(s), whole, 4, n, k, 2)
    KERNELS["gemv_fp8_bf16"](None, ptr(a[2:3]), ptr(q), ptr(s), one, 1, n, k, 2)
    assert np.array_equal(read(whole, np.float32, (4, n))[2], read(one, np.float32, (1, n))[0])


def test_dequantize_inverts_quantize_within_e4m3_precision():
    w = weight(256, 256, 7)
    q, s = fp8_quantize(w)
    back = fp8_dequantize(q, s)
    x = w.astype(np.float32)
    scale = np.repeat(np.repeat(s, 128, 0), 128, 1)
    assert np.all(np.abs(back - x) <= np.abs(x) / 16 + scale * 2.0 ** -9)


def test_bf16_scales_widen_exactly():
    x = (np.random.default_rng(8).standard_normal(300) * 1e-3).astype(np.float32).astype(BF16)
    out = ptr(np.zeros(300, np.float32))
    KERNELS["cast_bf16_f32"](None, ptr(x), out, np.int32(300))
    assert np.array_equal(read(out, np.float32, (300,)), x.astype(np.float32))
