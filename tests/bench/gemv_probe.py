"""The decode GEMV shapes: kerncc's GEMV kernels against probes that only stream W (the GEMV's
own access pattern with no math, coalesced rows, TMA bulk copies; tests/bench/gemv_probe.cu,
built here with nvcc), each inside a CUDA graph of 30 launches over rotating weight copies
(more bytes than the L2); us a launch and TB/s of W, side by side, and a check that the two
GEMV entries give bits independent of the run.

    python tests/bench/gemv_probe.py     # one GPU and nvcc (sm_90), ~10 s
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
from cuda.bindings import driver as cu

from kerncc.kernels import library
from kerncc.runtime.backends.cuda import CudaBackend, check

HERE = Path(__file__).resolve().parent
SHAPES = ((2048, 2048), (4096, 2048), (12288, 2048), (2048, 6144))  # o, qkv, gate_up, down
LAUNCHES = 30


def main() -> None:
    be = CudaBackend(0)
    be.activate()
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    cubin = Path(tempfile.mkdtemp()) / "gemv_probe.cubin"
    subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-O3", "-o", str(cubin),
                    str(HERE / "gemv_probe.cu")], check=True)
    images = [np.frombuffer(cubin.read_bytes(), np.uint8),
              np.frombuffer(library.cubin_path("gemv").read_bytes(), np.uint8)]
    probe = check(cu.cuModuleLoadData(images[0].ctypes.data), "cuModuleLoadData(probe)")
    gemv = check(cu.cuModuleLoadData(images[1].ctypes.data), "cuModuleLoadData(gemv)")

    def fn(module, name: str):
        return check(cu.cuModuleGetFunction(module, name.encode()), name)

    bulk = fn(probe, "probe_bulk")
    check(cu.cuFuncSetAttribute(
        bulk, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        200 * 1024), "cuFuncSetAttribute")
    keep = []  # parameter blocks stay alive while graphs hold them

    def launch(f, grid: int, block: int, args: list, smem: int = 0) -> None:
        slots = [a if isinstance(a, ctypes._SimpleCData) else ctypes.c_uint64(a) for a in args]
        table = (ctypes.c_void_p * len(slots))(*[ctypes.addressof(s) for s in slots])
        keep.append((slots, table))
        check(cu.cuLaunchKernel(f, grid, 1, 1, block, 1, 1, smem, be._launch_stream,
                                ctypes.addressof(table), 0), "cuLaunchKernel")

    def upload(array: np.ndarray) -> int:
        allocation = be.allocate(array.nbytes)
        be.upload(allocation, 0, array)
        return allocation.ptr

    for n, k in SHAPES:
        nbytes = n * k * 2
        copies = max(2, -(-160_000_000 // nbytes))
        rng = np.random.default_rng(n + k)

        def bf16(size: int, scale: float) -> np.ndarray:
            x = rng.standard_normal(size).astype(np.float32) * scale
            return (x.view(np.uint32) >> 16).astype(np.uint16)

        ws = [upload(bf16(n * k, 0.02)) for _ in range(copies)]
        a, c = upload(bf16(32 * k, 1.0)), upload(np.zeros(32 * n * 2, np.uint16))
        out = upload(np.zeros((n // 16) * 256, np.uint32))
        shape = [ctypes.c_int32(n), ctypes.c_int32(k)]

        def gemv_call(entry: str, threads: int):
            return lambda w: launch(fn(gemv, entry), n // 16, threads,
                                    [a, w, c, ctypes.c_int32(1), *shape, ctypes.c_int32(0)])

        variants = {
            "gemv, 8 warps": gemv_call("gemv_bf16_tn_mb1", 256),
            "gemv, 16 warps": gemv_call("gemv_bf16_tn_mb1_w16", 512),
            "its loads, no math": lambda w: launch(fn(probe, "probe_gemvlike"), n // 16, 256,
                                                   [w, *shape, out]),
            "coalesced rows": lambda w: launch(fn(probe, "probe_rows4"), n // 16, 256,
                                               [w, *shape, out]),
            "TMA bulk copies": lambda w: launch(bulk, n // 16, 128, [w, *shape, out],
                                                16 * (k * 2 + 64)),
        }
        graphs = {name: be.capture(lambda run=run: [run(ws[i % copies])
                                                    for i in range(LAUNCHES)])
                  for name, run in variants.items()}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(6):
            for name, graph in graphs.items():
                start = be.mark()
                be.replay(graph)
                end = be.mark()
                times[name].append(be.elapsed_ms(start, end) / LAUNCHES * 1e3)
        print(f"n {n} k {k} ({nbytes / 1e6:.1f} MB of W), us a launch / TB/s:")
        base = float(np.median(times["its loads, no math"][1:]))
        for name, t in times.items():
            us = float(np.median(t[1:]))
            print(f"  {name:20s} {us:7.2f} us  {nbytes / us / 1e6:5.2f} TB/s  "
                  f"{us / base:4.2f}x its loads")


if __name__ == "__main__":
    main()
