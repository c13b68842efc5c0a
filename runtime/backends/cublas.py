"""The GEMM externs on the GPU: cuBLAS's `cublasGemmEx` through ctypes, one handle per device.

kerncc's extern ABI (kernels/reference.py) is row-major: C[m, n] = A[m, k] · W[n, k]ᵀ. In cuBLAS's
column-major terms that is Cᵀ[n, m] = op(W)=T · Aᵀ with lda = ldb = k and ldc = n ("TN"), f32
compute. The three externs differ only in C's type and beta:

    cublaslt_bf16_tn      C bf16, beta 0
    cublaslt_bf16_tn_acc  C bf16, beta 1 (C = bf16(C + A·Wᵀ), one rounding)
    cublas_bf16_tn_f32    C f32,  beta 0

The library is found by cuda-pathfinder (NVIDIA wheels, conda, the CUDA toolkit) and, failing
that, by the system loader. Each handle gets a fixed workspace so that no GEMM allocates while a
CUDA graph is being captured; `cublasSetStream` resets the workspace, so `set_stream` sets it
again. Every call's status is checked. No torch or cupy is involved.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20

# extern name -> (C's cudaDataType, beta)
GEMMS: dict[str, tuple[int, float]] = {
    "cublaslt_bf16_tn": (CUDA_R_16BF, 0.0),
    "cublaslt_bf16_tn_acc": (CUDA_R_16BF, 1.0),
    "cublas_bf16_tn_f32": (CUDA_R_32F, 0.0),
}

STATUS = {0: "SUCCESS", 1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE",
          8: "ARCH_MISMATCH", 11: "MAPPING_ERROR", 13: "EXECUTION_FAILED",
          14: "INTERNAL_ERROR", 15: "NOT_SUPPORTED", 16: "LICENSE_ERROR"}


class CublasError(Exception):
    pass


@functools.cache
def library() -> ctypes.CDLL:
    """libcublas, loaded once per process."""
    tried: list[str] = []
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
        path = load_nvidia_dynamic_lib("cublas").abs_path
        if path:
            return _bind(ctypes.CDLL(path))
    except Exception as err:  # noqa: BLE001 - any failure here means: try the next place
        tried.append(f"cuda-pathfinder: {err}")
    candidates = [ctypes.util.find_library("cublas")]
    candidates += sorted(glob.glob("/usr/local/cuda*/lib64/libcublas.so*"), reverse=True)
    for path in filter(None, candidates):
        try:
            return _bind(ctypes.CDLL(path))
        except OSError as err:
            tried.append(f"{path}: {err}")
    raise CublasError("cannot load libcublas (" + "; ".join(tried or ["not found"]) + ")")


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    vp, i = ctypes.c_void_p, ctypes.c_int
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
    lib.cublasSetStream_v2.argtypes = [vp, vp]
    lib.cublasDestroy_v2.argtypes = [vp]
    lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
    lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
    for name in ("cublasCreate_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2",
                 "cublasGemmEx"):
        getattr(lib, name).restype = i
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasError(f"{what} failed: CUBLAS_STATUS_{STATUS.get(status, status)}")


class Blas:
    """One cuBLAS handle, bound to the device that is current when it is made."""

    def __init__(self, stream: int, workspace: int, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        self.lib = library()
        self.handle = ctypes.c_void_p()
        _check(self.lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self.workspace = workspace
        self.workspace_bytes = workspace_bytes
        self._alpha = ctypes.c_float(1.0)
        self._betas = {0.0: ctypes.c_float(0.0), 1.0: ctypes.c_float(1.0)}
        self.stream = -1
        self.set_stream(stream)

    def close(self) -> None:
        """Destroy the handle (its device memory goes back); the Blas is unusable after."""
        if self.handle:
            self.lib.cublasDestroy_v2(self.handle)
            self.handle = ctypes.c_void_p()

    def set_stream(self, stream: int) -> None:
        if stream == self.stream:
            return
        _check(self.lib.cublasSetStream_v2(self.handle, stream), "cublasSetStream")
        _check(self.lib.cublasSetWorkspace_v2(self.handle, self.workspace, self.workspace_bytes),
               "cublasSetWorkspace")
        self.stream = stream

    def gemm(self, name: str, a: int, w: int, c: int, m: int, n: int, k: int) -> None:
        """C[m, n] (= or +=) A[m, k] · W[n, k]ᵀ on the handle's stream."""
        ctype, beta = GEMMS[name]
        status = self.lib.cublasGemmEx(
            self.handle, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, ctypes.byref(self._alpha),
            w, CUDA_R_16BF, k, a, CUDA_R_16BF, k, ctypes.byref(self._betas[beta]),
            c, ctype, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        _check(status, f"cublasGemmEx (m={m}, n={n}, k={k})")
