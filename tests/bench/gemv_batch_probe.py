"""The batched decode GEMMs (m = 16 and 32): cuBLAS and kernels/gemv.cu's mb kernels against the
probes of tests/bench/gemv_batch_probe.cu (R tiles a warp, U chunks a round, A a round ahead, k
split over S blocks), each in a CUDA graph of 30 launches over rotating weight copies (more
bytes than the L2), the GEMVs with programmatic dependent launch as in the decode graph; us a
launch and TB/s of W, side by side, and each probe's bits against the library kernel's.

    python tests/bench/gemv_batch_probe.py     # one GPU and nvcc (sm_90), ~20 s
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
from cuda.bindings import driver as cu

from kerncc.runtime.backends import gemv
from kerncc.runtime.backends.cuda import CudaBackend, check

HERE = Path(__file__).resolve().parent
SHAPES = (("o_proj", 2048, 2048, 0), ("qkv", 4096, 2048, 0), ("gate_up", 12288, 2048, 0),
          ("down", 2048, 6144, 1))  # name, n, k, accumulate into C
LAUNCHES = 30
NAME = re.compile(r"b(\d)_w(\d+)_u(\d)_r(\d)_s(\d)(p?)$")


def main() -> None:
    gemv.MAX_M = 32
    be = CudaBackend(0)
    be.activate()
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    source = HERE / "gemv_batch_probe.cu"
    cubin = Path(tempfile.mkdtemp()) / "probe.cubin"
    subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-O3", "-o", str(cubin), str(source)],
                   check=True)
    image = np.frombuffer(cubin.read_bytes(), np.uint8)
    module = check(cu.cuModuleLoadData(image.ctypes.data), "cuModuleLoadData(probe)")
    names = re.findall(r"^PROBE\((\w+),", source.read_text(), re.M)
    probes = {}
    for name in names:
        mb, warps, u, r, s, _ = NAME.match(name).groups()
        probes[name] = (check(cu.cuModuleGetFunction(module, name.encode()), name),
                        int(mb), int(warps), int(u), int(r), int(s))
    keep = []
    pdl = gemv.launch_config(True)

    def launch(f, grid: tuple[int, int], block: int, args: list) -> None:
        slots = [a if isinstance(a, ctypes._SimpleCData) else ctypes.c_uint64(a) for a in args]
        table = (ctypes.c_void_p * len(slots))(*[ctypes.addressof(s) for s in slots])
        keep.append((slots, table))
        pdl.gridDimX, pdl.gridDimY, pdl.blockDimX = grid[0], grid[1], block
        pdl.hStream = be._launch_stream
        check(cu.cuLaunchKernelEx(pdl, f, ctypes.addressof(table), 0), "cuLaunchKernelEx")

    def upload(array: np.ndarray):
        allocation = be.allocate(array.nbytes)
        be.upload(allocation, 0, array.view(np.uint8))
        return allocation

    def download(allocation, nbytes: int) -> np.ndarray:
        return np.asarray(be.download(allocation, 0, nbytes)).copy()

    rng = np.random.default_rng(7)

    def bf16(size: int, scale: float) -> np.ndarray:
        x = rng.standard_normal(size).astype(np.float32) * scale
        return (x.view(np.uint32) >> 16).astype(np.uint16)

    for op, n, k, acc in SHAPES:
        nbytes = n * k * 2
        copies = max(2, -(-200_000_000 // nbytes))
        ws = [upload(bf16(n * k, 0.02)) for _ in range(copies)]
        a = upload(bf16(32 * k, 1.0))
        c0 = bf16(32 * n, 1.0)
        c = upload(c0)
        work = upload(np.zeros(4 * 32 * n, np.float32))
        counts = upload(np.zeros(n // 16, np.uint32))
        extern = "cublaslt_bf16_tn_acc" if acc else "cublaslt_bf16_tn"
        site = be._gemv_site(extern)
        for m in (16, 32):
            mb = m // 8
            runs = {
                "cublas": lambda w, m=m: be.blas.gemm(extern, a.ptr, w.ptr, c.ptr, m, n, k),
                f"library mb{mb}": lambda w, m=m: site(a.ptr, w.ptr, c.ptr, m, n, k,
                                                       be._launch_stream, True),
            }
            for name, (f, pmb, warps, u, r, s) in probes.items():
                if pmb != mb or n % (16 * r) or (k // s) % (32 * warps * u) or k % s:
                    continue
                runs[name] = (lambda w, f=f, warps=warps, r=r, s=s, m=m: launch(
                    f, (n // (16 * r), s), 32 * warps,
                    [a.ptr, w.ptr, c.ptr, work.ptr, counts.ptr, ctypes.c_int32(m),
                     ctypes.c_int32(n), ctypes.c_int32(k), ctypes.c_int32(acc)]))
            # bits: one launch on copy 0 from the same C, against the library kernel's
            results = {}
            for name, run in runs.items():
                be.upload(c, 0, c0.view(np.uint8))
                be.sync()
                run(ws[0])
                be.sync()
                results[name] = download(c, 32 * n * 2).view(np.uint16)[: m * n]
            ref = results[f"library mb{mb}"]

            def error(bits: np.ndarray) -> float:
                f32 = lambda x: (x.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
                return float(np.max(np.abs(f32(bits) - f32(ref))))

            times = graph_us(be, runs, ws)
            print(f"{op} n {n} k {k} m {m} ({nbytes / 1e6:.1f} MB of W): us a launch, TB/s, "
                  f"bits against the library's")
            base = float(np.median(times["cublas"][1:]))
            for name, t in sorted(times.items(), key=lambda kv: np.median(kv[1][1:])):
                us = float(np.median(t[1:]))
                same = np.array_equal(results[name], ref)
                print(f"  {name:18s} {us:7.2f} us  {nbytes / us / 1e6:5.2f} TB/s  "
                      f"{us / base:4.2f}x cuBLAS  "
                      f"{'same bits' if same else f'max diff {error(results[name]):.3g}'}")
        for x in (*ws, a, c, work, counts):
            be.free(x)


def graph_us(be, runs: dict, weights: list, launches: int = LAUNCHES,
             rounds: int = 7) -> dict[str, list[float]]:
    """Each run captured in a CUDA graph of `launches` calls over the rotating `weights`, the
    graphs replayed in turn `rounds` times: us a launch of each round, by run."""
    graphs = {name: be.capture(lambda run=run: [run(weights[i % len(weights)])
                                                for i in range(launches)])
              for name, run in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            start = be.mark()
            be.replay(graph)
            end = be.mark()
            times[name].append(be.elapsed_ms(start, end) / launches * 1e3)
    return times


if __name__ == "__main__":
    main()
