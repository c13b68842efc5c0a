"""The norm, rope, kv-cache and activation cubins against the numpy references (marked `gpu`).

Each of these kernels takes a wide path (8 or 4 elements a thread or lane, 16- or 8-byte
accesses) when the sizes and the pointers allow, and a narrow one otherwise, and all but
head_rmsnorm stride over the grid, so any grid is correct. Every case here runs on the wide
path, on the narrow one (sizes that do not divide, or buffers moved by 2 bytes), and on a
grid smaller than the work (the row norms also on the warp-per-row geometry earlier
manifests used); each must match the reference, and where both paths compute each element
alone (silu_mul, rope, kv_write) the two paths must give the same bits.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from gpu_driver import Gpu  # noqa: E402  (tests/ is on the path)
from kerncc.kernels.reference import KERNELS

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu():
    g = Gpu()
    yield g
    g.close()


def bf16_bits(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def as_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def u8(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8).reshape(-1)


def close_bf16(got: np.ndarray, want: np.ndarray, ulps: int = 1) -> None:
    """bf16 bit patterns within `ulps` units in the last place (f32 math may round apart)."""
    g, w = as_f32(got), as_f32(want)
    assert np.isfinite(g).all() and np.abs(w).max() > 0, "empty or non-finite output"
    tol = ulps * np.maximum(np.abs(w), 1e-30) * 2.0 ** -7
    bad = np.abs(g - w) > tol
    assert not bad.any(), f"{bad.sum()} of {bad.size} differ; first at {np.argwhere(bad)[0]}"


# Shifts of the written buffer: 0 keeps it 16-byte aligned (the widest path the sizes allow),
# 4 and 8 take it off 16 bytes (the row norms then read 2 and 4 bf16 at a time, the others
# one element). Buffers are at least 4-byte aligned: the narrow paths read 32-bit words.
SHIFTS = [0, 4, 8]


@pytest.mark.parametrize("rows, inter, block", [(37, 384, 128), (5, 120, 40), (9, 36, 12)])
@pytest.mark.parametrize("grid", ["full", "small"])
def test_silu_mul(gpu, rows, inter, block, grid):
    rng = np.random.default_rng(rows + inter)
    gate_up = bf16_bits(rng.standard_normal((rows, 2 * inter)).astype(np.float32) * 3)
    want = np.zeros(rows * inter, np.uint16)
    KERNELS["silu_mul_bf16"](None, u8(gate_up), u8(want), rows, inter, block)
    outs = []
    for shift in SHIFTS:
        src, out = gpu.upload(gate_up), gpu.upload(np.zeros_like(want), shift)
        blocks = -(-rows * inter // 8 // 256) if grid == "full" else 1
        gpu.launch("activation", "silu_mul_bf16", max(blocks, 1), 256,
                   [src, out, ctypes.c_int32(rows), ctypes.c_int32(inter), ctypes.c_int32(block)])
        outs.append(gpu.download(out, want))
        close_bf16(outs[-1], want)
    assert all(np.array_equal(outs[0], o) for o in outs), "the wide and narrow paths differ"


@pytest.mark.parametrize("rows, nq, nk, hd", [(33, 16, 8, 128), (7, 4, 2, 16), (6, 3, 1, 20)])
@pytest.mark.parametrize("grid", ["full", "small"])
def test_rope(gpu, rows, nq, nk, hd, grid):
    rng = np.random.default_rng(rows * hd)
    qkv = bf16_bits(rng.standard_normal((rows, (nq + 2 * nk) * hd)).astype(np.float32))
    positions = rng.integers(0, 500, rows).astype(np.int32)
    half = hd // 2
    angle = np.arange(512)[:, None] * 10000.0 ** (-2 * np.arange(half) / hd)[None, :]
    table = np.concatenate([np.cos(angle), np.sin(angle)], axis=1).astype(np.float32)
    want = qkv.copy()
    KERNELS["rope_neox_bf16"](None, u8(want), u8(positions), u8(table), rows, nq, nk, hd)
    outs = []
    for shift in SHIFTS:
        ptr = gpu.upload(qkv, shift)
        blocks = -(-rows * (nq + nk) * half // 4 // 256) if grid == "full" else 1
        gpu.launch("rope", "rope_neox_bf16", blocks, 256,
                   [ptr, gpu.upload(positions), gpu.upload(table), ctypes.c_int32(rows),
                    ctypes.c_int32(nq), ctypes.c_int32(nk), ctypes.c_int32(hd)])
        outs.append(gpu.download(ptr, qkv))
        close_bf16(outs[-1][:, :(nq + nk) * hd], want[:, :(nq + nk) * hd])
        assert np.array_equal(outs[-1][:, (nq + nk) * hd:], qkv[:, (nq + nk) * hd:]), "v moved"
    assert all(np.array_equal(outs[0], o) for o in outs), "the wide and narrow paths differ"


@pytest.mark.parametrize("rows, nq, nk, hd", [(40, 16, 8, 128), (9, 2, 1, 6)])
@pytest.mark.parametrize("grid", ["full", "small"])
def test_kv_write(gpu, rows, nq, nk, hd, grid):
    rng = np.random.default_rng(rows + hd)
    qkv = bf16_bits(rng.standard_normal((rows, (nq + 2 * nk) * hd)).astype(np.float32))
    slots = rng.permutation(3 * rows)[:rows].astype(np.int32)
    slots[::4] = -1  # padding rows own no slot
    kv = bf16_bits(rng.standard_normal(3 * rows * 2 * nk * hd).astype(np.float32))
    want = kv.copy()
    KERNELS["kv_write_bf16"](None, u8(qkv), u8(slots), u8(want), rows, nq, nk, hd)
    assert not np.array_equal(want, kv)
    for shift in SHIFTS:
        ptr = gpu.upload(kv, shift)
        blocks = -(-rows * nk * hd // 4 // 256) if grid == "full" else 1
        gpu.launch("kv_cache", "kv_write_bf16", blocks, 256,
                   [gpu.upload(qkv), gpu.upload(slots), ptr, ctypes.c_int32(rows),
                    ctypes.c_int32(nq), ctypes.c_int32(nk), ctypes.c_int32(hd)])
        assert np.array_equal(gpu.download(ptr, kv), want), f"shift {shift}"


NORM_COLS = [2048, 384, 100]  # 8, 4 and 2 bf16 a lane


def _norm_inputs(rows: int, cols: int, seed: int):
    rng = np.random.default_rng(seed)
    x = bf16_bits(rng.standard_normal((rows, cols)).astype(np.float32) * 2)
    w = bf16_bits(1 + 0.1 * rng.standard_normal(cols).astype(np.float32))
    return x, w


def norm_block(cols: int) -> int:
    """kerncc.example.qwen's: a thread per 8 columns, whole warps, at most 256."""
    threads = -(-cols // 8)
    return min(256, 32 * -(-threads // 32))


# (grid, block): the example's (a block of cols/8 threads per row), fewer blocks than rows
# (the blocks stride over the rows), and the warp-per-row geometry of earlier manifests.
NORM_GRIDS = ["per-row", "few", "old"]


def norm_geometry(kind: str, rows: int, cols: int) -> tuple[int, int]:
    if kind == "per-row":
        return rows, norm_block(cols)
    if kind == "few":
        return 3, 64
    return -(-rows // 4), 128


@pytest.mark.parametrize("cols", NORM_COLS)
@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("geometry", NORM_GRIDS)
def test_rmsnorm(gpu, cols, shift, geometry):
    rows, eps = 13, np.float32(1e-6)
    x, w = _norm_inputs(rows, cols, cols)
    want = np.zeros_like(x)
    KERNELS["rmsnorm_bf16"](None, u8(x), u8(w), u8(want), rows, cols, eps)
    y = gpu.upload(np.zeros_like(x), shift)
    gpu.launch("norm", "rmsnorm_bf16", *norm_geometry(geometry, rows, cols),
               [gpu.upload(x), gpu.upload(w), y, ctypes.c_int32(rows), ctypes.c_int32(cols),
                ctypes.c_float(eps)])
    close_bf16(gpu.download(y, x), want)


@pytest.mark.parametrize("cols", NORM_COLS)
@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("geometry", NORM_GRIDS)
def test_add_rmsnorm(gpu, cols, shift, geometry):
    rows, eps = 10, np.float32(1e-6)
    res, w = _norm_inputs(rows, cols, cols + 1)
    x, _ = _norm_inputs(rows, cols, cols + 2)
    want_res, want = res.copy(), np.zeros_like(res)
    KERNELS["add_rmsnorm_bf16"](None, u8(want_res), u8(x), u8(w), u8(want), rows, cols, eps)
    r, y = gpu.upload(res, shift), gpu.upload(np.zeros_like(res))
    gpu.launch("norm", "add_rmsnorm_bf16", *norm_geometry(geometry, rows, cols),
               [r, gpu.upload(x), gpu.upload(w), y, ctypes.c_int32(rows), ctypes.c_int32(cols),
                ctypes.c_float(eps)])
    assert np.array_equal(gpu.download(r, res), want_res), "the residual sum is exact"
    close_bf16(gpu.download(y, res), want)


@pytest.mark.parametrize("hd", [256, 128, 64])
@pytest.mark.parametrize("shift", SHIFTS)
def test_head_rmsnorm(gpu, hd, shift):
    rows, nq, nk, eps = 6, 4, 2, np.float32(1e-6)
    qkv, _ = _norm_inputs(rows, (nq + 2 * nk) * hd, hd)
    w = _norm_inputs(1, 2 * hd, hd + 1)[1]
    want = qkv.copy()
    KERNELS["head_rmsnorm_bf16"](None, u8(want), u8(w), rows, nq, nk, hd, eps)
    ptr = gpu.upload(qkv, shift)
    gpu.launch("norm", "head_rmsnorm_bf16", -(-rows * (nq + nk) // 4), 128,
               [ptr, gpu.upload(w), ctypes.c_int32(rows), ctypes.c_int32(nq), ctypes.c_int32(nk),
                ctypes.c_int32(hd), ctypes.c_float(eps)])
    got = gpu.download(ptr, qkv)
    close_bf16(got[:, :(nq + nk) * hd], want[:, :(nq + nk) * hd])
    assert np.array_equal(got[:, (nq + nk) * hd:], qkv[:, (nq + nk) * hd:]), "v moved"


@pytest.mark.parametrize("cols", NORM_COLS)
def test_rmsnorm_last(gpu, cols):
    seqs, per_seq, eps = 3, 5, np.float32(1e-6)
    x, w = _norm_inputs(seqs * per_seq, cols, cols + 3)
    want = np.zeros((seqs, cols), np.uint16)
    KERNELS["rmsnorm_last_bf16"](None, u8(x), u8(w), u8(want), seqs, per_seq, cols, eps)
    y = gpu.upload(np.zeros_like(want))
    gpu.launch("norm", "rmsnorm_last_bf16", seqs, norm_block(cols),
               [gpu.upload(x), gpu.upload(w), y, ctypes.c_int32(seqs), ctypes.c_int32(per_seq),
                ctypes.c_int32(cols), ctypes.c_float(eps)])
    close_bf16(gpu.download(y, want), want)


@pytest.mark.parametrize("rows, nq, nk, hd", [(21, 16, 8, 128), (300, 16, 8, 128), (1, 16, 8, 128),
                                              (7, 4, 2, 16), (5, 3, 1, 20),
                                              (4, 2, 2, 256)])
@pytest.mark.parametrize("shift", SHIFTS)
def test_qk_norm_rope_kv_is_the_three_kernels_in_one(gpu, rows, nq, nk, hd, shift):
    """The fused launch gives the bits of head_rmsnorm, rope_neox and kv_write in sequence."""
    rng = np.random.default_rng(rows * hd + nq)
    eps = np.float32(1e-6)
    qkv = bf16_bits(rng.standard_normal((rows, (nq + 2 * nk) * hd)).astype(np.float32) * 2)
    w = bf16_bits(1 + 0.1 * rng.standard_normal(2 * hd).astype(np.float32))
    positions = rng.integers(0, 300, rows).astype(np.int32)
    half = hd // 2
    angle = np.arange(300)[:, None] * 10000.0 ** (-2 * np.arange(half) / hd)[None, :]
    table = np.concatenate([np.cos(angle), np.sin(angle)], axis=1).astype(np.float32)
    slots = rng.permutation(2 * rows)[:rows].astype(np.int32)
    slots[1::3] = -1
    kv = bf16_bits(rng.standard_normal(2 * rows * 2 * nk * hd).astype(np.float32))
    want_qkv, want_kv = qkv.copy(), kv.copy()
    KERNELS["qk_norm_rope_kv_bf16"](None, u8(want_qkv), u8(w), u8(positions), u8(table),
                                    u8(slots), u8(want_kv), rows, nq, nk, hd, eps)
    ints = [ctypes.c_int32(rows), ctypes.c_int32(nq), ctypes.c_int32(nk), ctypes.c_int32(hd)]
    common = [gpu.upload(w), gpu.upload(positions), gpu.upload(table), gpu.upload(slots)]
    fused_qkv, fused_kv = gpu.upload(qkv, shift), gpu.upload(kv)
    gpu.launch("qk_rope_kv", "qk_norm_rope_kv_bf16", rows, 256,  # the example's geometry
               [fused_qkv, *common, fused_kv, *ints, ctypes.c_float(eps)])
    split_qkv, split_kv = gpu.upload(qkv, shift), gpu.upload(kv)
    w_ptr, pos_ptr, table_ptr, slot_ptr = common
    gpu.launch("norm", "head_rmsnorm_bf16", -(-rows * (nq + nk) // 4), 128,
               [split_qkv, w_ptr, *ints, ctypes.c_float(eps)])
    gpu.launch("rope", "rope_neox_bf16", -(-rows * (nq + nk) * half // 256), 256,
               [split_qkv, pos_ptr, table_ptr, *ints])
    gpu.launch("kv_cache", "kv_write_bf16", -(-rows * nk * hd // 256), 256,
               [split_qkv, slot_ptr, split_kv, *ints])
    got_qkv, got_kv = gpu.download(fused_qkv, qkv), gpu.download(fused_kv, kv)
    # other geometries: the decode step's (a head a warp, a row over several blocks), fewer
    # blocks than rows (blocks stride over rows, warps over items), 4-warp blocks (8 heads a
    # warp at head dim 128), one warp, an item a warp, a row's heads over 3 blocks of a warp
    for grid, block in (((rows, -(-(nq + 2 * nk) // 4)), 128), (-(-rows // 3), 256),
                        (rows, 128), (2, 32), (-(-rows * (nq + 2 * nk) // 4), 128),
                        ((-(-rows // 2), 3), 32)):
        other_qkv, other_kv = gpu.upload(qkv, shift), gpu.upload(kv)
        gpu.launch("qk_rope_kv", "qk_norm_rope_kv_bf16", grid, block,
                   [other_qkv, *common, other_kv, *ints, ctypes.c_float(eps)])
        assert np.array_equal(gpu.download(other_qkv, qkv), got_qkv), (grid, block)
        assert np.array_equal(gpu.download(other_kv, kv), got_kv), (grid, block, "kv")
    assert np.array_equal(got_qkv, gpu.download(split_qkv, qkv)), "qkv differs from the three"
    assert np.array_equal(got_kv, gpu.download(split_kv, kv)), "kv differs from the three"
    close_bf16(got_qkv, want_qkv, ulps=2)  # a norm's rounding, then rope's
    assert not np.array_equal(got_kv, kv)
    close_bf16(got_kv, want_kv, ulps=2)
