"""Variant cubins of the wgmma prefill attention, checked and timed side by side (GPU).

    python tests/bench/attention_variants.py NAME=CUBIN[:SMEM[:BLOCK]] ...

For working on kernels/attention_sm90a.cu: build a variant with
`nvcc -cubin -gencode=arch=compute_90a,code=sm_90a -O3 -Ikernels -o v.cubin v.cu` (its entry
keeps the name attn_prefill_varlen_sm90a_bf16), pass it here with its dynamic shared memory and
block size (default: the library kernel's), and every variant gets, in one run:
* the error against the numpy reference and whether rows past the chunk stayed untouched, on
  chunks that start at 0 or past it, end inside a block, hold one row, and GQA groups 1, 2, 8;
* ms and TFLOP/s (the causal FLOPs) on the small model's chunks, variants and the mma.sync
  kernel alternating, best of three rounds of 20 launches.
`cur=kernels/cubins/attention_sm90a.cubin` is the library's kernel. The machine lends 30 device
minutes a session: a variant costs about 5 s here.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the GPU harness

import test_attention_sm90a_cuda as T  # noqa: E402
from test_attention_cuda import make_case  # noqa: E402

from kerncc.example.qwen import SM90A_PREFILL_BLOCK, SM90A_PREFILL_SMEM  # noqa: E402

CHECKS = [(16, 8, 0, 1), (16, 8, 0, 65), (16, 8, 1536, 512), (16, 8, 127, 2), (64, 8, 5, 300),
          (8, 8, 37, 100), (4, 1, 3000, 33)]
TIMED = [(2048, 2048), (0, 2048), (0, 4096), (3584, 512)]  # (start, rows), 16 q / 8 kv heads


def parse(arg: str) -> tuple[str, Path, int, int]:
    name, _, rest = arg.partition("=")
    path, *geometry = rest.split(":")
    if not name or not path:
        raise SystemExit(f"expected NAME=CUBIN[:SMEM[:BLOCK]], got {arg!r}")
    smem = int(geometry[0]) if geometry else SM90A_PREFILL_SMEM
    block = int(geometry[1]) if len(geometry) > 1 else SM90A_PREFILL_BLOCK
    return name, Path(path), smem, block


class Variant:
    def __init__(self, gpu: T.WgGpu, name: str, path: Path, smem: int, block: int) -> None:
        cu = gpu.cu
        self.gpu, self.name, self.smem, self.block = gpu, name, smem, block
        self.image = np.frombuffer(path.read_bytes(), np.uint8)  # kept alive with the module
        self.module = gpu.check(cu.cuModuleLoadData(self.image.ctypes.data))
        self.fn = gpu.check(cu.cuModuleGetFunction(self.module, T.WG.encode()))
        attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        gpu.check(cu.cuFuncSetAttribute(self.fn, attr, smem))

    def run(self, chunk: dict, timed: int = 0):
        gpu, cu = self.gpu, self.gpu.cu
        gpu.fns["_variant"] = self.fn
        nq, nk, rows = chunk["nq"], chunk["nk"], chunk["rows"]
        sentinel = np.full((rows + 3, nq * 128), 0xFFFF, np.uint16)
        ptrs = [gpu.upload(chunk[k]) for k in ("qkv", "kv", "table", "positions", "cu_seqlens")]
        out = gpu.upload(sentinel)
        grid = (-(-rows // (128 // (nq // nk))), nk, chunk["seqs"])
        args = ptrs + [out, ctypes.c_int32(rows), ctypes.c_int32(chunk["seqs"]),
                       ctypes.c_int32(nq), ctypes.c_int32(nk), ctypes.c_int32(128),
                       ctypes.c_int32(chunk["width"]), ctypes.c_float(chunk["scale"])]
        gpu.launch(grid, self.smem, args, entry="_variant", block=self.block)
        got = gpu.download(out, sentinel)
        ms = None
        if timed:
            a, b = gpu.check(cu.cuEventCreate(0)), gpu.check(cu.cuEventCreate(0))
            gpu.check(cu.cuEventRecord(a, gpu.stream))
            for _ in range(timed):
                gpu.launch(grid, self.smem, args, entry="_variant", block=self.block)
            gpu.check(cu.cuEventRecord(b, gpu.stream))
            gpu.check(cu.cuEventSynchronize(b))
            ms = gpu.check(cu.cuEventElapsedTime(a, b)) / timed
        gpu.free(*ptrs, out)
        return got, ms


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    gpu = T.WgGpu()
    variants = [Variant(gpu, *parse(a)) for a in argv]
    for case in CHECKS:
        c = make_case(128, *case)
        want = T.reference(c)
        for v in variants:
            got, _ = v.run(T.one(c))
            untouched = bool((got[c.rows:] == 0xFFFF).all())
            print(f"{v.name} q{case[0]} k{case[1]} at {case[2]} rows {case[3]}: error "
                  f"{T.error(got, want):.2e}, rows past the chunk untouched: {untouched}")
    for start, rows in TIMED:
        c = make_case(128, 16, 8, start, rows)
        flop = 4 * 16 * 128 * sum(start + r + 1 for r in range(rows))
        times: dict[str, list[float]] = {}
        for _ in range(3):
            for v in variants:
                times.setdefault(v.name, []).append(v.run(T.one(c), timed=20)[1])
            times.setdefault("mma.sync", []).append(T.launch(gpu, T.MMA, T.one(c), timed=20)[1])
        print(f"rows {rows} at {start}: " + ", ".join(
            f"{n} {min(t):.3f} ms {flop / min(t) / 1e9:.0f} TFLOP/s" for n, t in times.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
