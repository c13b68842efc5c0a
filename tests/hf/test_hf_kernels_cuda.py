"""The `hf` module's cubin (kernels/hf.cu) against its numpy references (marked `gpu`).

cast_f16_bf16 must give the reference's bits (one rounding of an exact f16 -> f32 value),
including the f16 extremes; rope_table_llama3_f32 must match the double-precision reference
to f32 rounding at every position, with scaling that changes low, blended and high bands.
"""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest
from test_elementwise_cuda import Gpu  # tests/ is on sys.path (the package root of tests/hf)

from kerncc.kernels.reference import KERNELS

pytestmark = pytest.mark.gpu
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def gpu():
    g = Gpu()
    yield g
    g.close()


def test_cast_f16_bf16_gives_the_reference_bits(gpu):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(5000) * 100, [65504, -65504, 6e-8, 0, -0.0]])
    x = x.astype(np.float16)
    n = x.size
    out = np.zeros(n, BF16)
    dx, dy = gpu.upload(x), gpu.upload(out)
    gpu.launch("hf", "cast_f16_bf16", -(-n // 256), 256, [dx, dy, ctypes.c_int32(n)])
    got = gpu.download(dy, out)
    want = np.zeros(n, BF16)
    KERNELS["cast_f16_bf16"](None, x.view(np.uint8), want.view(np.uint8), n)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_rope_table_llama3_matches_the_reference(gpu):
    max_pos, hd = 4096, 128
    table = np.zeros((max_pos, hd), np.float32)
    args = (500000.0, 32.0, 1.0, 4.0, 8192)
    d = gpu.upload(table)
    gpu.launch("hf", "rope_table_llama3_f32", -(-max_pos * hd // 2 // 256), 256,
               [d, ctypes.c_int32(max_pos), ctypes.c_int32(hd), ctypes.c_float(args[0]),
                ctypes.c_float(args[1]), ctypes.c_float(args[2]), ctypes.c_float(args[3]),
                ctypes.c_int32(args[4])])
    got = gpu.download(d, table)
    want = np.zeros_like(table)
    KERNELS["rope_table_llama3_f32"](None, want.view(np.uint8), max_pos, hd, *args)
    assert np.abs(got - want).max() < 1e-6
    plain = np.zeros_like(table)
    KERNELS["rope_table_f32"](None, plain.view(np.uint8), max_pos, hd, args[0])
    assert np.abs(got - plain).max() > 0.1  # the scaling is in use
