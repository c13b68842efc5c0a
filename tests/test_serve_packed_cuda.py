"""Packed prefill on the GPU (marked `gpu`): attn_prefill_varlen_bf16 gives every sequence of
a packed chunk the bits attn_prefill_bf16 gives it alone, and matches the numpy reference;
rmsnorm_last_varlen_bf16 normalises each sequence's last row as rmsnorm_last_bf16 does."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from test_attention_cuda import Gpu, bits_f32, make_case, reference, run_gpu

from kerncc.example.qwen import attn_prefill_smem
from kerncc.kernels import library

pytestmark = pytest.mark.gpu

VARLEN = "attn_prefill_varlen_bf16"
# (hd, nq, nk, [(start, rows) per sequence])
PACKED = [
    (16, 4, 2, [(0, 5), (20, 3), (7, 64), (0, 1)]),
    (128, 16, 8, [(0, 200), (513, 187), (999, 1), (30, 64)]),
    (64, 8, 8, [(37, 100), (0, 7)]),
]


@pytest.fixture(scope="module")
def gpu() -> Gpu:
    g = Gpu()
    cu = g.cu
    g.fns[VARLEN] = g.check(cu.cuModuleGetFunction(g.module, VARLEN.encode()))
    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    g.check(cu.cuFuncSetAttribute(g.fns[VARLEN], attr, attn_prefill_smem(128)))
    image = np.frombuffer(library.cubin_path("norm").read_bytes(), dtype=np.uint8)
    g.norm = g.check(cu.cuModuleLoadData(image.ctypes.data))
    for name in ("rmsnorm_last_bf16", "rmsnorm_last_varlen_bf16"):
        g.fns[name] = g.check(cu.cuModuleGetFunction(g.norm, name.encode()))
    return g


@pytest.mark.parametrize("case", PACKED, ids=lambda c: f"hd{c[0]}-q{c[1]}-k{c[2]}-{len(c[3])}")
def test_a_packed_chunk_gives_each_sequence_its_bits_alone(gpu, case):
    hd, nq, nk, seqs = case
    parts = [make_case(hd, nq, nk, start, rows, seed=i) for i, (start, rows) in enumerate(seqs)]
    # one KV cache holding every sequence's pages: sequence i's pages offset by its base
    bases = np.cumsum([0] + [len(p.kv) // 16 for p in parts])[:-1]
    kv = np.concatenate([p.kv for p in parts])
    width = max(p.width for p in parts)
    tables = np.full((len(parts), width), 1 << 29, np.int32)
    for i, p in enumerate(parts):
        used = p.table < (1 << 29)
        tables[i, :p.width][used] = p.table[used] + bases[i]
    qkv = np.concatenate([p.qkv for p in parts])
    positions = np.concatenate([p.positions for p in parts])
    rows = len(positions)
    cu_seqlens = np.concatenate([[0], np.cumsum([p.rows for p in parts])]).astype(np.int32)
    cu_seqlens = np.concatenate([cu_seqlens, [rows, rows]]).astype(np.int32)  # padded
    sentinel = np.full((rows + 3, nq * hd), 0xFFFF, np.uint16)
    ptrs = [gpu.upload(a) for a in (qkv, kv, tables, positions, cu_seqlens)]
    out = gpu.upload(sentinel)
    G = nq // nk
    grid = (-(-rows // (64 // G)), nk, len(parts))
    args = ptrs + [out, ctypes.c_int32(rows), ctypes.c_int32(len(parts)), ctypes.c_int32(nq),
                   ctypes.c_int32(nk), ctypes.c_int32(hd), ctypes.c_int32(width),
                   ctypes.c_float(parts[0].scale)]
    gpu.launch(grid, attn_prefill_smem(hd), args, entry=VARLEN)
    packed = gpu.download(out, sentinel)
    gpu.free(*ptrs, out)
    assert (packed[rows:] == 0xFFFF).all(), "rows past the chunk were written"
    for i, p in enumerate(parts):
        alone = run_gpu(gpu, p)[0][:p.rows]
        got = packed[cu_seqlens[i]:cu_seqlens[i + 1]]
        np.testing.assert_array_equal(got, alone)
        want = reference(p)
        assert float((np.abs(bits_f32(got) - want) / (1 + np.abs(want))).max()) <= 2e-2


def test_the_packed_final_norm_reads_each_sequences_last_row(gpu):
    rng = np.random.default_rng(3)
    cols, cu = 2048, np.array([0, 3, 4, 10, 10], np.int32)
    x = (rng.standard_normal((10, cols)) + 0.1).astype(np.float32)
    w = (rng.standard_normal(cols) + 1).astype(np.float32)
    from test_attention_cuda import bf16_bits

    xb, wb = bf16_bits(x), bf16_bits(w)
    px, pw, pc = gpu.upload(xb), gpu.upload(wb), gpu.upload(cu)
    out = gpu.upload(np.zeros((3, cols), np.uint16))
    gpu.launch((3, 1, 1), 0, [px, pw, out, pc, ctypes.c_int32(3), ctypes.c_int32(cols),
                              ctypes.c_float(1e-6)], entry="rmsnorm_last_varlen_bf16")
    packed = gpu.download(out, np.zeros((3, cols), np.uint16))
    for s, last in enumerate((2, 3, 9)):
        one_x = gpu.upload(xb[last:last + 1])
        one = gpu.upload(np.zeros((1, cols), np.uint16))
        gpu.launch((1, 1, 1), 0, [one_x, pw, one, ctypes.c_int32(1), ctypes.c_int32(1),
                                  ctypes.c_int32(cols), ctypes.c_float(1e-6)],
                   entry="rmsnorm_last_bf16")
        np.testing.assert_array_equal(packed[s], gpu.download(one, np.zeros((1, cols),
                                                                          np.uint16))[0])
        gpu.free(one_x, one)
    gpu.free(px, pw, pc, out)
