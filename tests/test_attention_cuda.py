"""The attention cubin's kernels against the numpy references, launched alone (marked `gpu`).

The model tests reach only the tiny shape (hd 16, G 2, one decode split); here the kernels run
every shape class they serve: head dims 16..128, GQA groups 1..8, prefill chunks that start
past 0 over a shuffled page table, row counts that leave a block part-filled, long contexts,
and decode batches whose sequences end anywhere in a split (1, 17, 256, 300, 4100 keys) or
hold no key. What must hold: the output matches the f32 reference within bf16 tolerance,
rows past the chunk (decode: partials past a sequence's splits) are not written, and a second
launch gives the same bits. `python tests/test_attention_cuda.py` prints each case's error
and, for the `small` model's shape, the kernels' times.
"""

from __future__ import annotations

import ctypes
import math
from types import SimpleNamespace

import numpy as np
import pytest

from kerncc.example.qwen import attn_prefill_smem
from kerncc.kernels import library
from kerncc.kernels.reference import DECODE_SPLIT, KERNELS

pytestmark = pytest.mark.gpu

ENTRY = "attn_prefill_bf16"
SPLIT, COMBINE = "attn_decode_split_bf16", "attn_decode_combine_bf16"
SPLIT_TC = "attn_decode_split_tc_bf16"  # hd % 32 == 0, on tensor cores
PAGE = 16

# (hd, nq, nk, start, rows): chunk rows [start, start + rows) of one sequence.
CASES = [
    (16, 4, 2, 0, 1), (16, 4, 2, 0, 64), (16, 4, 2, 59, 5), (16, 4, 2, 130, 70),
    (128, 16, 8, 0, 512), (128, 16, 8, 1536, 512), (128, 16, 8, 513, 187), (128, 16, 8, 999, 1),
    (64, 8, 8, 37, 100), (128, 32, 4, 200, 45), (80, 8, 2, 70, 33), (32, 16, 2, 5, 20),
]


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """f32 -> bf16 bit patterns (uint16), round to nearest even."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bits_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


class Gpu:
    """The driver API, just enough to launch one cubin entry."""

    def __init__(self) -> None:
        from cuda.bindings import driver as cu

        self.cu = cu
        self.check(cu.cuInit(0))
        dev = self.check(cu.cuDeviceGet(0))
        self.ctx = self.check(cu.cuDevicePrimaryCtxRetain(dev))
        self.check(cu.cuCtxSetCurrent(self.ctx))
        image = np.frombuffer(library.cubin_path("attention").read_bytes(), dtype=np.uint8)
        self.module = self.check(cu.cuModuleLoadData(image.ctypes.data))
        self.fns = {name: self.check(cu.cuModuleGetFunction(self.module, name.encode()))
                    for name in (ENTRY, SPLIT, SPLIT_TC, COMBINE)}
        attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self.check(cu.cuFuncSetAttribute(self.fns[ENTRY], attr, attn_prefill_smem(128)))
        self.stream = self.check(cu.cuStreamCreate(0))

    def check(self, result):
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA error {err}")
        return values[0] if len(values) == 1 else (tuple(values) or None)

    def upload(self, data: np.ndarray) -> int:
        data = np.ascontiguousarray(data)
        ptr = int(self.check(self.cu.cuMemAlloc(max(data.nbytes, 1))))
        self.check(self.cu.cuMemcpyHtoD(self.cu.CUdeviceptr(ptr), data.ctypes.data, data.nbytes))
        return ptr

    def download(self, ptr: int, like: np.ndarray) -> np.ndarray:
        out = np.empty_like(like)
        self.check(self.cu.cuCtxSynchronize())
        self.check(self.cu.cuMemcpyDtoH(out.ctypes.data, self.cu.CUdeviceptr(ptr), out.nbytes))
        return out

    def free(self, *ptrs: int) -> None:
        for p in ptrs:
            self.check(self.cu.cuMemFree(self.cu.CUdeviceptr(p)))

    def launch(self, grid, shared: int, args: list, entry: str = ENTRY, block: int = 256) -> None:
        slots = [a if isinstance(a, ctypes._SimpleCData) else ctypes.c_uint64(a) for a in args]
        table = (ctypes.c_void_p * len(slots))(*[ctypes.addressof(s) for s in slots])
        self.check(self.cu.cuLaunchKernel(self.fns[entry], *grid, block, 1, 1, shared,
                                          self.stream, ctypes.addressof(table), 0))


@pytest.fixture(scope="module")
def gpu() -> Gpu:
    return Gpu()


def make_case(hd: int, nq: int, nk: int, start: int, rows: int, seed: int = 0):
    rng = np.random.default_rng(seed + 1000 * hd + rows + start)
    keys = start + rows
    width = -(-keys // PAGE) + 2
    pages = int(width * 1.5) + 3
    qkv = rng.standard_normal((rows, (nq + 2 * nk) * hd)).astype(np.float32)
    qkv[:, : nq * hd] *= 2.0  # peakier softmax than unit logits
    kv = rng.standard_normal((pages * PAGE, 2 * nk * hd)).astype(np.float32)
    table = np.full(width, 1 << 29, np.int32)  # entries past the context: never read
    table[: -(-keys // PAGE)] = rng.permutation(pages)[: -(-keys // PAGE)]
    positions = np.arange(start, start + rows, dtype=np.int32)
    return SimpleNamespace(hd=hd, nq=nq, nk=nk, rows=rows, width=width,
                           qkv=bf16_bits(qkv), kv=bf16_bits(kv), table=table,
                           positions=positions, scale=np.float32(1 / math.sqrt(hd)))


def reference(c) -> np.ndarray:
    out = np.zeros(c.rows * c.nq * c.hd, np.uint16)
    u8 = lambda a: a.view(np.uint8).reshape(-1)
    KERNELS[ENTRY](None, u8(c.qkv), u8(c.kv), u8(c.table), u8(c.positions), u8(out),
                   np.int32(c.rows), np.int32(c.nq), np.int32(c.nk), np.int32(c.hd),
                   np.int32(c.width), c.scale)
    return bits_f32(out).reshape(c.rows, c.nq * c.hd)


def run_gpu(gpu: Gpu, c, repeats: int = 1, extra_rows: int = 3):
    """Output rows (bf16 bits) of `repeats` launches; rows past the chunk hold 0xFFFF first."""
    sentinel = np.full(((c.rows + extra_rows), c.nq * c.hd), 0xFFFF, np.uint16)
    ptrs = [gpu.upload(a) for a in (c.qkv, c.kv, c.table, c.positions)]
    out = gpu.upload(sentinel)
    G = c.nq // c.nk
    grid = (-(-c.rows // (64 // G)), c.nk, 1)
    args = ptrs + [out, ctypes.c_int32(c.rows), ctypes.c_int32(c.nq), ctypes.c_int32(c.nk),
                   ctypes.c_int32(c.hd), ctypes.c_int32(c.width), ctypes.c_float(c.scale)]
    results = []
    for _ in range(repeats):
        gpu.launch(grid, attn_prefill_smem(c.hd), args)
        results.append(gpu.download(out, sentinel))
    gpu.free(*ptrs, out)
    return results


def error(got_bits: np.ndarray, want: np.ndarray) -> float:
    """The worst |got - want| / (1 + |want|) (bf16 outputs: a relative error past 1)."""
    got = bits_f32(got_bits[: want.shape[0]])
    return float((np.abs(got - want) / (1 + np.abs(want))).max())


def diagnose(c, got_bits: np.ndarray, want: np.ndarray) -> None:
    """Where the errors sit: by q head, by dim % 16, by row within a block."""
    err = np.abs(bits_f32(got_bits[: c.rows]) - want).reshape(c.rows, c.nq, c.hd)
    err = np.nan_to_num(err, nan=1e9)
    r, h, d = np.unravel_index(np.argmax(err), err.shape)
    print(f"    worst at row {r} head {h} dim {d}; by head {err.max(axis=(0, 2)).round(3)}")
    print(f"    by dim % 16 {err.max(axis=(0, 1)).reshape(-1, 16).max(axis=0).round(3)}")
    per_block = 64 // (c.nq // c.nk)
    print(f"    by row % {per_block} {err.max(axis=(1, 2))[: per_block].round(3)}")
    got = bits_f32(got_bits[: c.rows]).reshape(c.rows, c.nq, c.hd)
    print(f"    got  {got[r, h, :8]}\n    want {want.reshape(c.rows, c.nq, c.hd)[r, h, :8]}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: "hd{}-q{}-k{}-at{}-rows{}".format(*c))
def test_prefill_matches_the_reference(gpu, case):
    c = make_case(*case)
    first, second = run_gpu(gpu, c, repeats=2)
    assert np.isfinite(bits_f32(first[: c.rows])).all()
    assert error(first, reference(c)) <= 2e-2  # a few bf16 ulps (P in bf16, output in bf16)
    assert (first[c.rows:] == 0xFFFF).all(), "rows past the chunk were written"
    np.testing.assert_array_equal(first, second)


def timing(gpu: Gpu, hd=128, nq=16, nk=8, start=7680, rows=512, repeats=20) -> float:
    """Seconds per launch of the small model's last 512-row chunk of an 8192-token prompt."""
    c = make_case(hd, nq, nk, start, rows)
    cu = gpu.cu
    ptrs = [gpu.upload(a) for a in (c.qkv, c.kv, c.table, c.positions)]
    out = gpu.upload(np.zeros((rows, nq * hd), np.uint16))
    G = nq // nk
    args = ptrs + [out, ctypes.c_int32(rows), ctypes.c_int32(nq), ctypes.c_int32(nk),
                   ctypes.c_int32(hd), ctypes.c_int32(c.width), ctypes.c_float(c.scale)]
    grid = (-(-rows // (64 // G)), nk, 1)
    gpu.launch(grid, attn_prefill_smem(hd), args)
    a, b = gpu.check(cu.cuEventCreate(0)), gpu.check(cu.cuEventCreate(0))
    gpu.check(cu.cuEventRecord(a, gpu.stream))
    for _ in range(repeats):
        gpu.launch(grid, attn_prefill_smem(hd), args)
    gpu.check(cu.cuEventRecord(b, gpu.stream))
    gpu.check(cu.cuEventSynchronize(b))
    ms = gpu.check(cu.cuEventElapsedTime(a, b))
    gpu.free(*ptrs, out)
    return ms / 1e3 / repeats


# ---- decode: attn_decode_split_bf16 (or _tc_bf16) then attn_decode_combine_bf16 ----------

# (hd, nq, nk, seq_lens): one decode batch, a row per sequence.
DECODE_CASES = [
    (128, 16, 8, [1, 17, 256, 300, 4100]), (128, 16, 8, [8448]), (16, 4, 2, [1, 17, 256, 300]),
    (64, 8, 8, [0, 17, 300, 4100]), (128, 32, 4, [256, 4100, 1]), (80, 8, 2, [300, 4100, 17]),
    (32, 16, 2, [17, 4100]), (128, 8, 8, [4100, 255]), (112, 4, 1, [257]),
    (128, 16, 4, [17, 300, 2049]), (96, 8, 4, [130, 1]),  # head groups of 4 and 2 on mma
]
SENTINEL = -12345.0  # partials past a sequence's splits keep it


def make_decode_case(hd: int, nq: int, nk: int, lens: list[int], seed: int = 0):
    """Sequences over disjoint shuffled pages; one split more than the longest needs."""
    rng = np.random.default_rng(seed + 7 * hd + nq + sum(lens))
    seqs = len(lens)
    max_splits = -(-max(lens) // DECODE_SPLIT) + 1
    width = max_splits * DECODE_SPLIT // PAGE
    used = [-(-n // PAGE) for n in lens]
    pages = sum(used) + 3
    qkv = rng.standard_normal((seqs, (nq + 2 * nk) * hd)).astype(np.float32)
    qkv[:, : nq * hd] *= 2.0
    kv = rng.standard_normal((pages * PAGE, 2 * nk * hd)).astype(np.float32)
    table = np.full((seqs, width), 1 << 29, np.int32)  # entries past a sequence: never read
    perm = rng.permutation(pages)
    for b, n in enumerate(used):
        table[b, :n] = perm[sum(used[:b]): sum(used[:b]) + n]
    return SimpleNamespace(hd=hd, nq=nq, nk=nk, seqs=seqs, width=width, max_splits=max_splits,
                           qkv=bf16_bits(qkv), kv=bf16_bits(kv), table=table,
                           lens=np.array(lens, np.int32), scale=np.float32(1 / math.sqrt(hd)))


def decode_scalars(c) -> tuple[list, list]:
    i = ctypes.c_int32
    split = [i(c.seqs), i(c.nq), i(c.nk), i(c.hd), i(c.width), i(c.max_splits),
             ctypes.c_float(c.scale)]
    return split, [i(c.seqs), i(c.nq), i(c.hd), i(c.max_splits)]


def decode_reference(c) -> tuple[np.ndarray, np.ndarray]:
    """(partials [seqs, nq, max_splits, hd+2] f32, rows [seqs, nq*hd] f32) of the references."""
    u8 = lambda a: a.view(np.uint8).reshape(-1)
    part = np.full((c.seqs, c.nq, c.max_splits, c.hd + 2), SENTINEL, np.float32)
    out = np.zeros(c.seqs * c.nq * c.hd, np.uint16)
    split, combine = ([np.int32(v.value) if isinstance(v, ctypes.c_int32) else np.float32(v.value)
                       for v in args] for args in decode_scalars(c))
    KERNELS[SPLIT](None, u8(c.qkv), u8(c.kv), u8(c.table), u8(c.lens), u8(part), *split)
    KERNELS[COMBINE](None, u8(part), u8(c.lens), u8(out), *combine)
    return part, bits_f32(out).reshape(c.seqs, c.nq * c.hd)


def run_decode(gpu: Gpu, c, repeats: int = 1, blocks: int | None = None,
               split_entry: str = SPLIT) -> list[tuple[np.ndarray, np.ndarray]]:
    """(partials, rows as bf16 bits) after each of `repeats` split + combine launches; the split
    launch (of `split_entry`) has `blocks` blocks per (sequence, kv head) (default: one per
    split)."""
    part0 = np.full((c.seqs, c.nq, c.max_splits, c.hd + 2), SENTINEL, np.float32)
    out0 = np.full((c.seqs, c.nq * c.hd), 0xFFFF, np.uint16)
    ptrs = [gpu.upload(a) for a in (c.qkv, c.kv, c.table, c.lens)]
    part, out = gpu.upload(part0), gpu.upload(out0)
    split, combine = decode_scalars(c)
    results = []
    for _ in range(repeats):
        gpu.launch((c.seqs, c.nk, blocks or c.max_splits), 0, ptrs + [part] + split,
                   split_entry, 256)
        gpu.launch((c.seqs, c.nq, 1), 0, [part, ptrs[3], out] + combine, COMBINE, 128)
        results.append((gpu.download(part, part0), gpu.download(out, out0)))
    gpu.free(*ptrs, part, out)
    return results


def decode_errors(c, part: np.ndarray, rows: np.ndarray) -> tuple[float, float, bool]:
    """(worst row error, worst partial error, partials past every sequence untouched)."""
    want_part, want_rows = decode_reference(c)
    live = want_part != SENTINEL
    part_err = float((np.abs(part[live] - want_part[live]) / (1 + np.abs(want_part[live]))).max())
    return error(rows, want_rows), part_err, bool((part[~live] == SENTINEL).all())


SPLIT_ENTRIES = [(SPLIT, case) for case in DECODE_CASES] + [
    (SPLIT_TC, case) for case in DECODE_CASES if case[0] % 32 == 0]


@pytest.mark.parametrize("entry,case", SPLIT_ENTRIES, ids=lambda x: x.removeprefix(
    "attn_decode_split_").removesuffix("_bf16") or "cuda-cores" if isinstance(x, str) else
    "hd{}-q{}-k{}-lens{}".format(*x[:3], "-".join(map(str, x[3]))))
def test_decode_matches_the_reference(gpu, entry, case):
    """Both split kernels against the one reference (the tensor-core one where hd % 32 == 0)."""
    c = make_decode_case(*case)
    (part, rows), (part2, rows2) = run_decode(gpu, c, repeats=2, split_entry=entry)
    row_err, part_err, untouched = decode_errors(c, part, rows)
    assert np.isfinite(bits_f32(rows)).all()
    assert row_err <= 1e-2  # the rows round once to bf16
    assert part_err <= 1e-4  # f32 partials: summation order and ex2.approx only
    assert untouched, "a partial past a sequence's splits was written"
    assert (rows[c.lens == 0] == 0).all(), "an empty sequence writes zeros"
    np.testing.assert_array_equal(part.view(np.uint32), part2.view(np.uint32))
    np.testing.assert_array_equal(rows, rows2)


@pytest.mark.parametrize("entry,case", [(SPLIT, DECODE_CASES[0]), (SPLIT, DECODE_CASES[4]),
                                        (SPLIT, DECODE_CASES[5]), (SPLIT_TC, DECODE_CASES[0]),
                                        (SPLIT_TC, DECODE_CASES[4]), (SPLIT_TC, DECODE_CASES[3])],
                         ids=lambda x: x.removeprefix("attn_decode_split_") if isinstance(x, str)
                         else "hd{}-q{}-k{}".format(*x[:3]))
def test_fewer_split_blocks_loop_over_the_splits_with_the_same_bits(gpu, entry, case):
    """A split block takes splits z, z + Z, ... (the batched decode launches Z < max_splits):
    with Z = 1, 3 and 8 every partial and row has the bits of a block per split."""
    c = make_decode_case(*case)
    (part, rows), = run_decode(gpu, c, split_entry=entry)
    assert decode_errors(c, part, rows)[2], "a partial past a sequence's splits was written"
    assert c.max_splits > 8  # 4100 keys: 33 splits, so every Z below loops
    for blocks in (1, 3, 8):
        (part_z, rows_z), = run_decode(gpu, c, blocks=blocks, split_entry=entry)
        np.testing.assert_array_equal(part_z.view(np.uint32), part.view(np.uint32))
        np.testing.assert_array_equal(rows_z, rows)


def decode_timing(gpu: Gpu, keys: int, hd=128, nq=16, nk=8, seqs=1, repeats=50) -> float:
    """Seconds per split + combine pair for `seqs` sequences of `keys` keys (small's shape)."""
    c = make_decode_case(hd, nq, nk, [keys] * seqs)
    c.max_splits = -(-8448 // DECODE_SPLIT)  # the benchmark's small model: max_context 8448
    cu = gpu.cu
    ptrs = [gpu.upload(a) for a in (c.qkv, c.kv, c.table, c.lens)]
    part = gpu.upload(np.zeros((seqs, nq, c.max_splits, hd + 2), np.float32))
    out = gpu.upload(np.zeros((seqs, nq * hd), np.uint16))
    split, combine = decode_scalars(c)

    def pair() -> None:
        gpu.launch((seqs, nk, c.max_splits), 0, ptrs + [part] + split, SPLIT, 256)
        gpu.launch((seqs, nq, 1), 0, [part, ptrs[3], out] + combine, COMBINE, 128)

    pair()
    a, b = gpu.check(cu.cuEventCreate(0)), gpu.check(cu.cuEventCreate(0))
    gpu.check(cu.cuEventRecord(a, gpu.stream))
    for _ in range(repeats):
        pair()
    gpu.check(cu.cuEventRecord(b, gpu.stream))
    gpu.check(cu.cuEventSynchronize(b))
    ms = gpu.check(cu.cuEventElapsedTime(a, b))
    gpu.free(*ptrs, part, out)
    return ms / 1e3 / repeats


if __name__ == "__main__":
    g = Gpu()
    for case in CASES:
        c = make_case(*case)
        first, second = run_gpu(g, c, repeats=2)
        want = reference(c)
        e = error(first, want)
        print(case, f"max |diff|/(1+|ref|) {e:.3e}",
              "untouched past rows" if (first[c.rows:] == 0xFFFF).all() else "WROTE PAST",
              "deterministic" if (first == second).all() else "NOT DETERMINISTIC", flush=True)
        if not e <= 2e-2:
            diagnose(c, first, want)
    for case in DECODE_CASES:
        c = make_decode_case(*case)
        (part, rows), (part2, rows2) = run_decode(g, c, repeats=2)
        row_err, part_err, untouched = decode_errors(c, part, rows)
        same = (part.view(np.uint32) == part2.view(np.uint32)).all() and (rows == rows2).all()
        print("decode", case, f"rows {row_err:.3e} partials {part_err:.3e}",
              "untouched past splits" if untouched else "WROTE PAST",
              "deterministic" if same else "NOT DETERMINISTIC", flush=True)
    for keys, seqs in ((100, 1), (1024, 1), (8192, 1), (8192, 8)):
        s = decode_timing(g, keys, seqs=seqs)
        gb = seqs * keys * 2 * 8 * 128 * 2 / 1e9  # K and V of 8 kv heads
        print(f"small decode, {seqs} x {keys} keys: {s * 1e6:.1f} us, {gb / s:.0f} GB/s")
    for start in (0, 3584, 7680):
        s = timing(g, start=start)
        keys = start + 256  # mean keys per row
        flops = 4 * 512 * 16 * 128 * keys
        print(f"small chunk at {start}: {s * 1e6:.1f} us, {flops / s / 1e12:.1f} TFLOP/s")
