"""The decode GEMMs that cuBLAS takes (m > 8, and the lm_head) under every algorithm cuBLASLt's
heuristic offers, against `cublasGemmEx`'s default choice (what runtime/backends/cublas.py
calls): each in a CUDA graph of 30 launches over rotating weight copies (more bytes than the
L2), us a launch and TB/s of W, side by side, with each algorithm's configuration (id, tile,
stages, split-k, reduction scheme), whether two launches from the same C give the same bits,
and whether its bits are the default's. It answers whether a per-shape choice of algorithm is
worth building for issue 20's batched decode (the 32-sequence step's GEMMs take about 40 us a
layer on cuBLAS against 25 us for their bytes at 4 TB/s).

    python tests/bench/cublaslt_probe.py     # one GPU, ~30 s
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np

from gemv_batch_probe import graph_us  # noqa: E402  (tests/bench is the script's directory)
from kerncc.runtime.backends.cuda import CudaBackend

SHAPES = (("o_proj", 2048, 2048, 0), ("qkv", 4096, 2048, 0), ("gate_up", 12288, 2048, 0),
          ("down", 2048, 6144, 1), ("lm_head", 32000, 2048, 2))  # name, n, k, C: bf16 / += / f32
MS = (16, 32)
LAUNCHES = 30
REQUESTED = 32
CUDA_R_32F, CUDA_R_16BF, COMPUTE_32F = 0, 14, 68
DESC_TRANSA, DESC_TRANSB, PREF_MAX_WORKSPACE = 3, 4, 1
CONFIG = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5,
          "stages": 6}
REDUCTIONS = {0: "none", 1: "in place", 2: "compute type", 4: "output type"}
WORKSPACE = 32 << 20


class Result(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t),
                ("state", ctypes.c_int), ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def lt_library() -> ctypes.CDLL:
    from cuda.pathfinder import load_nvidia_dynamic_lib

    lib = ctypes.CDLL(load_nvidia_dynamic_lib("cublasLt").abs_path)
    vp = ctypes.c_void_p
    for name in ("cublasLtCreate", "cublasLtMatmulDescCreate", "cublasLtMatmulDescSetAttribute",
                 "cublasLtMatrixLayoutCreate", "cublasLtMatmulPreferenceCreate",
                 "cublasLtMatmulPreferenceSetAttribute", "cublasLtMatmulAlgoGetHeuristic",
                 "cublasLtMatmul", "cublasLtMatmulAlgoConfigGetAttribute"):
        getattr(lib, name).restype = ctypes.c_int
    lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_uint64,
                                               ctypes.c_uint64, ctypes.c_int64]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, ctypes.c_int, vp, ctypes.c_size_t]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, ctypes.c_int, vp, ctypes.c_size_t]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int, vp,
                                                   ctypes.POINTER(ctypes.c_int)]
    lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp,
                                   ctypes.c_size_t, vp]
    lib.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [vp, ctypes.c_int, vp, ctypes.c_size_t,
                                                         ctypes.POINTER(ctypes.c_size_t)]
    return lib


def ok(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: cublas status {status}")


def main() -> int:
    be = CudaBackend(0)
    be.activate()
    lt = lt_library()
    handle = ctypes.c_void_p()
    ok(lt.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    workspace = be.allocate(WORKSPACE)
    rng = np.random.default_rng(7)

    def bf16(size: int, scale: float) -> np.ndarray:
        x = rng.standard_normal(size).astype(np.float32) * scale
        x[x == 0] = scale
        return (x.view(np.uint32) >> 16).astype(np.uint16)

    def upload(array: np.ndarray):
        allocation = be.allocate(array.nbytes)
        be.upload(allocation, 0, array.view(np.uint8))
        return allocation

    def layout(dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        out = ctypes.c_void_p()
        ok(lt.cublasLtMatrixLayoutCreate(ctypes.byref(out), dtype, rows, cols, ld), "layout")
        return out

    def config(algo) -> dict:
        got = {}
        for key, attr in CONFIG.items():
            value, size = ctypes.c_uint32(), ctypes.c_size_t()
            ok(lt.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr,
                                                       ctypes.byref(value), 4,
                                                       ctypes.byref(size)), "config")
            got[key] = value.value
        return got

    alpha = ctypes.c_float(1.0)
    for op, n, k, mode in SHAPES:
        nbytes = n * k * 2
        copies = max(2, -(-200_000_000 // nbytes))
        ws = [upload(bf16(n * k, 0.02)) for _ in range(copies)]
        width = 4 if mode == 2 else 2
        a = upload(bf16(32 * k, 1.0))
        c0 = bf16(32 * n * width // 2, 1.0) if mode != 2 else np.zeros(64 * n, np.uint16)
        c = upload(c0)
        extern = ("cublaslt_bf16_tn", "cublaslt_bf16_tn_acc", "cublas_bf16_tn_f32")[mode]
        beta = ctypes.c_float(1.0 if mode == 1 else 0.0)
        ctype = CUDA_R_32F if mode == 2 else CUDA_R_16BF
        desc = ctypes.c_void_p()
        ok(lt.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, CUDA_R_32F), "desc")
        for attr, value in ((DESC_TRANSA, 1), (DESC_TRANSB, 0)):
            v = ctypes.c_int32(value)
            ok(lt.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v), 4), "trans")
        pref = ctypes.c_void_p()
        ok(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        size = ctypes.c_uint64(WORKSPACE)
        ok(lt.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(size),
                                                   8), "workspace")
        for m in (1, 8, 32) if op == "lm_head" else MS:
            wl, al, cl = layout(CUDA_R_16BF, k, n, k), layout(CUDA_R_16BF, k, m, k), \
                layout(ctype, n, m, n)
            results = (Result * REQUESTED)()
            count = ctypes.c_int()
            ok(lt.cublasLtMatmulAlgoGetHeuristic(handle, desc, wl, al, cl, cl, pref, REQUESTED,
                                                 results, ctypes.byref(count)), "heuristic")
            runs = {"gemmex default": lambda w, m=m: be.blas.gemm(extern, a.ptr, w.ptr, c.ptr,
                                                                  m, n, k)}
            configs = {}
            for i in range(count.value):
                if results[i].state != 0:
                    continue
                name = f"lt #{i}"
                configs[name] = config(results[i].algo)
                runs[name] = (lambda w, i=i, m=m, wl=wl, al=al, cl=cl: ok(lt.cublasLtMatmul(
                    handle, desc, ctypes.byref(alpha), ctypes.c_void_p(w.ptr), wl,
                    ctypes.c_void_p(a.ptr), al, ctypes.byref(beta), ctypes.c_void_p(c.ptr), cl,
                    ctypes.c_void_p(c.ptr), cl, ctypes.byref(results[i].algo),
                    ctypes.c_void_p(workspace.ptr), WORKSPACE,
                    ctypes.c_void_p(int(be._launch_stream))), "matmul"))
            bits, same_twice = {}, {}
            for name, run in runs.items():
                got = []
                for _ in range(2):
                    be.upload(c, 0, c0.view(np.uint8))
                    be.sync()
                    run(ws[0])
                    be.sync()
                    got.append(np.asarray(be.download(c, 0, m * n * width)).copy())
                bits[name], same_twice[name] = got[0], np.array_equal(got[0], got[1])
            times = graph_us(be, runs, ws)
            base = float(np.median(times["gemmex default"][1:]))
            print(f"{op} n {n} k {k} m {m} ({nbytes / 1e6:.1f} MB of W), {count.value} "
                  f"algorithms: us a launch, TB/s, x the default")
            ranked = sorted(times, key=lambda name: np.median(times[name][1:]))
            default_bits = bits["gemmex default"]
            for name in ranked[:6] + [r for r in ranked[6:] if r == "lt #0"]:
                us = float(np.median(times[name][1:]))
                cfg = configs.get(name)
                what = ("" if cfg is None else
                        f"id {cfg['id']} tile {cfg['tile']} stages {cfg['stages']} split-k "
                        f"{cfg['splitk']} ({REDUCTIONS.get(cfg['reduction'], cfg['reduction'])})"
                        f" swizzle {cfg['swizzle']}")
                print(f"  {name:15s} {us:7.2f} us  {nbytes / us / 1e6:5.2f} TB/s  "
                      f"{us / base:4.2f}x  {'repeatable' if same_twice[name] else 'NOT repeatable'}"
                      f"  {'default' if np.array_equal(bits[name], default_bits) else 'other'} bits"
                      f"  {what}")
            sys.stdout.flush()
        for x in (*ws, a, c):
            be.free(x)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
