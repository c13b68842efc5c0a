"""The wgmma prefill attention (kernels/attention_sm90a.cu) against the numpy reference and
against the mma.sync kernel it replaces for head dim 128 (marked `gpu`; an sm_90a cubin loads
only on compute capability 9.0).

What must hold: the output matches the f32 reference within bf16 tolerance for every GQA group
the kernel takes (1, 2, 4, 8) and for chunks that start past 0 over a shuffled page table, end
anywhere in a block or a key tile, or hold one row; rows past the chunk are not written; a
second launch gives the same bits; a row's bits do not depend on the chunk it comes in (the
prompt fed whole, in two chunks, or packed with other sequences). `python
tests/test_attention_sm90a_cuda.py` prints each case's error and the two kernels' times and
TFLOP/s side by side on the small model's chunks.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import pytest
from test_attention_cuda import Gpu, bits_f32, make_case, reference

from kerncc.example.qwen import SM90A_PREFILL_BLOCK, SM90A_PREFILL_SMEM, attn_prefill_smem
from kerncc.kernels import library

pytestmark = pytest.mark.gpu

WG = "attn_prefill_varlen_sm90a_bf16"
MMA = "attn_prefill_varlen_bf16"

# (nq, nk, start, rows) at head dim 128: chunk rows [start, start + rows) of one sequence.
CASES = [
    (16, 8, 0, 1), (16, 8, 0, 64), (16, 8, 0, 65), (16, 8, 0, 512), (16, 8, 1536, 512),
    (16, 8, 513, 187), (16, 8, 999, 1), (16, 8, 130, 70), (16, 8, 127, 2), (16, 8, 0, 2048),
    (8, 8, 37, 100), (32, 8, 200, 45), (64, 8, 5, 300), (4, 1, 3000, 33),
]


class WgGpu(Gpu):
    """Gpu with the sm_90a module's entry and attention.cu's varlen entry loaded."""

    def __init__(self) -> None:
        super().__init__()
        cu = self.cu
        image = np.frombuffer(library.cubin_path("attention_sm90a").read_bytes(), np.uint8)
        self.wg_module = self.check(cu.cuModuleLoadData(image.ctypes.data))
        self.fns[WG] = self.check(cu.cuModuleGetFunction(self.wg_module, WG.encode()))
        self.fns[MMA] = self.check(cu.cuModuleGetFunction(self.module, MMA.encode()))
        attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self.check(cu.cuFuncSetAttribute(self.fns[WG], attr, SM90A_PREFILL_SMEM))
        self.check(cu.cuFuncSetAttribute(self.fns[MMA], attr, attn_prefill_smem(128)))


@pytest.fixture(scope="module")
def gpu() -> WgGpu:
    from cuda.bindings import driver as cu

    cu.cuInit(0)
    _, dev = cu.cuDeviceGet(0)
    major = cu.cuDeviceGetAttribute(
        cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)[1]
    minor = cu.cuDeviceGetAttribute(
        cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)[1]
    if (major, minor) != (9, 0):
        pytest.skip(f"sm_90a cubins need compute capability 9.0, this GPU is {major}.{minor}")
    return WgGpu()


def geometry(entry: str, rows: int, nq: int, nk: int, seqs: int) -> tuple[tuple, int, int]:
    """grid, dynamic shared memory, block threads."""
    if entry == WG:
        return (-(-rows // (128 // (nq // nk))), nk, seqs), SM90A_PREFILL_SMEM, SM90A_PREFILL_BLOCK
    return (-(-rows // (64 // (nq // nk))), nk, seqs), attn_prefill_smem(128), 256


def pack(parts: list) -> dict:
    """One packed chunk of several cases: one KV cache holding every sequence's pages."""
    bases = np.cumsum([0] + [len(p.kv) // 16 for p in parts])[:-1]
    width = max(p.width for p in parts)
    tables = np.full((len(parts), width), 1 << 29, np.int32)
    for i, p in enumerate(parts):
        used = p.table < (1 << 29)
        tables[i, :p.width][used] = p.table[used] + bases[i]
    rows = sum(p.rows for p in parts)
    cu_seqlens = np.concatenate([[0], np.cumsum([p.rows for p in parts])]).astype(np.int32)
    return dict(qkv=np.concatenate([p.qkv for p in parts]), kv=np.concatenate([p.kv for p in parts]),
                table=tables, positions=np.concatenate([p.positions for p in parts]),
                cu_seqlens=cu_seqlens, rows=rows, width=width, seqs=len(parts),
                nq=parts[0].nq, nk=parts[0].nk, scale=parts[0].scale)


def launch(gpu: WgGpu, entry: str, chunk: dict, repeats: int = 1, extra_rows: int = 3,
           timed: int = 0):
    """Output rows (bf16 bits) of `repeats` launches of `entry` on a packed chunk; rows past the
    chunk hold 0xFFFF first. With `timed`, also the ms per launch over that many launches."""
    nq, nk, rows = chunk["nq"], chunk["nk"], chunk["rows"]
    sentinel = np.full((rows + extra_rows, nq * 128), 0xFFFF, np.uint16)
    ptrs = [gpu.upload(chunk[k]) for k in ("qkv", "kv", "table", "positions", "cu_seqlens")]
    out = gpu.upload(sentinel)
    grid, shared, block = geometry(entry, rows, nq, nk, chunk["seqs"])
    args = ptrs + [out, ctypes.c_int32(rows), ctypes.c_int32(chunk["seqs"]), ctypes.c_int32(nq),
                   ctypes.c_int32(nk), ctypes.c_int32(128), ctypes.c_int32(chunk["width"]),
                   ctypes.c_float(chunk["scale"])]
    results = []
    for _ in range(repeats):
        gpu.launch(grid, shared, args, entry=entry, block=block)
        results.append(gpu.download(out, sentinel))
    ms = None
    if timed:
        cu = gpu.cu
        a, b = gpu.check(cu.cuEventCreate(0)), gpu.check(cu.cuEventCreate(0))
        gpu.check(cu.cuEventRecord(a, gpu.stream))
        for _ in range(timed):
            gpu.launch(grid, shared, args, entry=entry, block=block)
        gpu.check(cu.cuEventRecord(b, gpu.stream))
        gpu.check(cu.cuEventSynchronize(b))
        ms = gpu.check(cu.cuEventElapsedTime(a, b)) / timed
    gpu.free(*ptrs, out)
    return results, ms


def one(c) -> dict:
    return pack([c])


def error(got_bits: np.ndarray, want: np.ndarray) -> float:
    got = bits_f32(got_bits[: want.shape[0]])
    return float((np.abs(got - want) / (1 + np.abs(want))).max())


@pytest.mark.parametrize("case", CASES, ids=lambda c: "q{}-k{}-at{}-rows{}".format(*c))
def test_wgmma_prefill_matches_the_reference(gpu, case):
    c = make_case(128, *case)
    (first, second), _ = launch(gpu, WG, one(c), repeats=2)
    assert np.isfinite(bits_f32(first[: c.rows])).all()
    want = reference(c)
    assert error(first, want) <= 2e-2  # a few bf16 ulps (P in bf16, output in bf16)
    assert (first[c.rows:] == 0xFFFF).all(), "rows past the chunk were written"
    np.testing.assert_array_equal(first, second)
    # the mma.sync kernel computes the same function: the two within the same tolerance
    (mma,), _ = launch(gpu, MMA, one(c))
    assert error(first, bits_f32(mma[: c.rows])) <= 2e-2


def test_a_rows_bits_do_not_depend_on_its_chunk(gpu):
    """Prompt rows 0..999 whole, as chunks [0, 300) + [300, 1000), and row 999 alone."""
    whole = make_case(128, 16, 8, 0, 1000, seed=7)
    (bits,), _ = launch(gpu, WG, one(whole))
    for lo, hi in ((0, 300), (300, 1000), (999, 1000), (128, 129)):
        part = make_case(128, 16, 8, 0, 1000, seed=7)
        part.qkv, part.positions, part.rows = whole.qkv[lo:hi], whole.positions[lo:hi], hi - lo
        (got,), _ = launch(gpu, WG, one(part))
        np.testing.assert_array_equal(got[: hi - lo], bits[lo:hi])


@pytest.mark.parametrize("spans", [[(0, 200), (513, 187), (999, 1), (30, 64)],
                                   [(0, 5), (20, 3), (7, 64), (0, 1), (2000, 130)]])
def test_a_packed_chunk_gives_each_sequence_its_bits_alone(gpu, spans):
    parts = [make_case(128, 16, 8, start, rows, seed=i) for i, (start, rows) in enumerate(spans)]
    chunk = pack(parts)
    (packed,), _ = launch(gpu, WG, chunk)
    assert (packed[chunk["rows"]:] == 0xFFFF).all(), "rows past the chunk were written"
    cu = chunk["cu_seqlens"]
    for i, p in enumerate(parts):
        (alone,), _ = launch(gpu, WG, one(p))
        np.testing.assert_array_equal(packed[cu[i]:cu[i + 1]], alone[: p.rows])
        assert error(packed[cu[i]:cu[i + 1]], reference(p)) <= 2e-2


def main() -> int:
    gpu = WgGpu()
    for case in CASES:
        c = make_case(128, *case)
        (got,), _ = launch(gpu, WG, one(c))
        (mma,), _ = launch(gpu, MMA, one(c))
        want = reference(c) if c.rows * (case[2] + c.rows) <= 2 ** 21 else bits_f32(mma[: c.rows])
        print(f"q{case[0]} k{case[1]} at {case[2]} rows {case[3]}: error {error(got, want):.2e}")
    print("\nthe small model's chunks (16 q / 8 kv heads of 128): ms per launch, TFLOP/s")
    for start, rows in ((0, 2048), (2048, 2048), (0, 4096), (0, 512), (3584, 512)):
        c = make_case(128, 16, 8, start, rows)
        flop = 4 * 16 * 128 * sum(start + r + 1 for r in range(rows))
        times = {}
        for entry in (MMA, WG, MMA, WG):
            _, ms = launch(gpu, entry, one(c), timed=20)
            times.setdefault(entry, []).append(ms)
        mma, wg = min(times[MMA]), min(times[WG])
        print(f"  rows {rows} at {start}: mma.sync {mma:.3f} ms ({flop / mma / 1e9:.0f}), "
              f"wgmma {wg:.3f} ms ({flop / wg / 1e9:.0f}), wgmma / mma.sync {wg / mma:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
