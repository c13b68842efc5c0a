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
from collections.abc import Callable

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
    return _load("cublas", _bind)


def _load(name: str, bind: Callable[[ctypes.CDLL], ctypes.CDLL]) -> ctypes.CDLL:
    """lib`name` through cuda-pathfinder, else the system's or a CUDA toolkit's, bound."""
    tried: list[str] = []
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
        path = load_nvidia_dynamic_lib(name).abs_path
        if path:
            return bind(ctypes.CDLL(path))
    except Exception as err:  # noqa: BLE001 - any failure here means: try the next place
        tried.append(f"cuda-pathfinder: {err}")
    candidates = [ctypes.util.find_library(name)]
    candidates += sorted(glob.glob(f"/usr/local/cuda*/lib64/lib{name}.so*"), reverse=True)
    for path in filter(None, candidates):
        try:
            return bind(ctypes.CDLL(path))
        except OSError as err:
            tried.append(f"{path}: {err}")
    raise CublasError(f"cannot load lib{name} (" + "; ".join(tried or ["not found"]) + ")")


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


# ---------------------------------------------------------------------------- cuBLASLt, pinned
# The batch-invariant prefill GEMMs (runtime/backends/cuda.py): each launch site's algorithms are
# chosen once at load, with their K walk pinned whole (no split-K: one block owns each output and
# sums K in the order the instruction fixes). cuBLAS's own choice is by m with split-K, so a row's
# bits would depend on how many rows share the call; split-free, they depend on the row alone
# (tests/test_determinism_cuda.py). cuBLASLt's split-free algorithms of one (n, k) differ in
# tiles, stages and swizzle but not in a row's bits: every candidate of the heuristic's lists at
# m = 64 to 2048 gave the same C, bit for bit, at each of 8 prefill shapes of the example and an
# 8B model (H100, cuBLASLt 13). So a site takes, per bucket of m, the heuristic's first for the
# bucket's largest m, and a small chunk is not run by tiles shaped for the largest (a 64-row
# down_proj: 60 us on the 2048-row algorithm, 14 on a 64-row one). The determinism tests launch
# every bucket against the largest's rows.
BUCKETS = (8, 32, 64, 128, 256, 512, 1024)  # below a site's largest m; the largest is the last
LT_DESC_TRANSA, LT_DESC_TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
LT_PREF_MAX_WORKSPACE_BYTES = 1  # cublasLtMatmulPreferenceAttributes_t
LT_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # ..._MIN_ALIGNMENT_{A,B,C,D}_BYTES
LT_CONFIG_SPLITK_NUM, LT_CONFIG_REDUCTION_SCHEME = 2, 3  # cublasLtMatmulAlgoConfigAttributes_t
LT_ALGO_BYTES = 64  # cublasLtMatmulAlgo_t: uint64_t data[8]
LT_RESULT_BYTES = 96  # cublasLtMatmulHeuristicResult_t: algo, size_t, status, float, int[4]
LT_CANDIDATES = 16


@functools.cache
def lt_library() -> ctypes.CDLL:
    """libcublasLt, loaded once per process (found as libcublas is)."""
    return _load("cublasLt", _bind_lt)


def lt_version() -> int:
    """cuBLASLt's version number (its algorithms, hence the pinned GEMMs' bits, may change)."""
    return int(lt_library().cublasLtGetVersion())


def _bind_lt(lib: ctypes.CDLL) -> ctypes.CDLL:
    vp, i, sz, u64, i64 = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint64,
                           ctypes.c_int64)
    signatures = {
        "cublasLtCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i, i],
        "cublasLtMatmulDescSetAttribute": [vp, i, vp, sz],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulPreferenceSetAttribute": [vp, i, vp, sz],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i, vp,
                                           ctypes.POINTER(i)],
        "cublasLtMatmulAlgoConfigSetAttribute": [vp, i, vp, sz],
        "cublasLtMatmulAlgoCheck": [vp, vp, vp, vp, vp, vp, vp, vp],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, i
    lib.cublasLtGetVersion.argtypes, lib.cublasLtGetVersion.restype = [], sz
    return lib


class Lt:
    """One cuBLASLt handle and the pinned algorithms of its device's prefill GEMM sites."""

    def __init__(self, workspace: int, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        self.lib = lt_library()
        self.handle = ctypes.c_void_p()
        _check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace, self.workspace_bytes = workspace, workspace_bytes
        self._plans: dict[tuple[str, int, int, int, int], PinnedGemm] = {}

    def pinned(self, name: str, n: int, k: int, max_m: int, align: int = 256) -> PinnedGemm:
        """extern `name` at (n, k) with one algorithm for every m up to max_m, for pointers
        aligned to `align` bytes (one per key)."""
        key = (name, n, k, max_m, align)
        if key not in self._plans:
            self._plans[key] = PinnedGemm(self, name, n, k, max_m, align)
        return self._plans[key]


class PinnedGemm:
    """C[m, n] (= or +=) A[m, k] · W[n, k]ᵀ by split-free cuBLASLt algorithms, one per bucket
    of m up to max_m (BUCKETS).

    A bucket's algorithm is cuBLASLt's first candidate for the bucket's largest m whose split-K
    is set to 1 (no reduction) and that cublasLtMatmulAlgoCheck accepts at the bucket's ends
    within the workspace; a bucket with none takes the next one's. None at max_m is a
    CublasError (the backend then keeps the site on kerncc's own row-invariant GEMV kernels)."""

    def __init__(self, lt: Lt, name: str, n: int, k: int, max_m: int, align: int = 256) -> None:
        self.lt, self.name, self.n, self.k, self.max_m = lt, name, n, k, max_m
        self.align = align
        lib = lt.lib
        self.ctype, beta = GEMMS[name]
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(beta)
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F,
                                            CUDA_R_32F), "cublasLtMatmulDescCreate")
        for attr, op in ((LT_DESC_TRANSA, CUBLAS_OP_T), (LT_DESC_TRANSB, CUBLAS_OP_N)):
            value = ctypes.c_int32(op)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), 4),
                   "cublasLtMatmulDescSetAttribute")
        self.w_layout = self._layout(CUDA_R_16BF, k, n, k)  # W[n, k] row-major = (k, n) col
        self._layouts: dict[int, tuple[ctypes.c_void_p, ctypes.c_void_p]] = {}
        self.algo = self._choose(1, max_m)  # the largest bucket's
        self.buckets = self._bucket_algorithms()

    def _layout(self, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        _check(self.lt.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols,
                                                      ld), "cublasLtMatrixLayoutCreate")
        return layout

    def layouts(self, m: int) -> tuple[ctypes.c_void_p, ctypes.c_void_p]:
        """(A's, C's) layouts at m rows, made once per m."""
        found = self._layouts.get(m)
        if found is None:
            found = (self._layout(CUDA_R_16BF, self.k, m, self.k),
                     self._layout(self.ctype, self.n, m, self.n))
            self._layouts[m] = found
        return found

    def _candidates(self, m: int) -> list[ctypes.Array]:
        lib, lt = self.lt.lib, self.lt
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)),
               "cublasLtMatmulPreferenceCreate")
        limit = ctypes.c_uint64(lt.workspace_bytes)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(
            pref, LT_PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit), 8),
            "cublasLtMatmulPreferenceSetAttribute")
        align = ctypes.c_uint32(self.align)
        for attr in LT_PREF_MIN_ALIGNMENT:
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(align), 4),
                   "cublasLtMatmulPreferenceSetAttribute")
        results = (ctypes.c_uint8 * (LT_RESULT_BYTES * LT_CANDIDATES))()
        found = ctypes.c_int(0)
        a_layout, c_layout = self.layouts(m)
        _check(lib.cublasLtMatmulAlgoGetHeuristic(
            lt.handle, self.desc, self.w_layout, a_layout, c_layout, c_layout, pref,
            LT_CANDIDATES, results, ctypes.byref(found)),
            f"cublasLtMatmulAlgoGetHeuristic (m={m}, n={self.n}, k={self.k})")
        raw = bytes(results)
        return [(ctypes.c_uint8 * LT_ALGO_BYTES).from_buffer_copy(
            raw[i * LT_RESULT_BYTES:i * LT_RESULT_BYTES + LT_ALGO_BYTES])
            for i in range(found.value)]

    def _split_free(self, algo: ctypes.Array) -> None:
        """K walked whole by one block: split-K 1, no reduction (a setter an algorithm refuses
        is a knob it does not have, and it then has no split either)."""
        for attr in (LT_CONFIG_SPLITK_NUM, LT_CONFIG_REDUCTION_SCHEME):
            value = ctypes.c_uint32(1 if attr == LT_CONFIG_SPLITK_NUM else 0)
            self.lt.lib.cublasLtMatmulAlgoConfigSetAttribute(algo, attr, ctypes.byref(value), 4)

    def _accepts(self, algo: ctypes.Array, m: int) -> bool:
        lib, lt = self.lt.lib, self.lt
        a_layout, c_layout = self.layouts(m)
        result = (ctypes.c_uint8 * LT_RESULT_BYTES)()
        status = lib.cublasLtMatmulAlgoCheck(lt.handle, self.desc, self.w_layout, a_layout,
                                             c_layout, c_layout, algo, result)
        workspace = int.from_bytes(bytes(result)[LT_ALGO_BYTES:LT_ALGO_BYTES + 8], "little")
        return status == 0 and workspace <= lt.workspace_bytes

    def _choose(self, low: int, high: int) -> ctypes.Array:
        """The heuristic's first split-free algorithm for m = high that takes m = low too."""
        for algo in self._candidates(high):
            self._split_free(algo)
            if all(self._accepts(algo, m) for m in sorted({low, high})):
                return algo
        raise CublasError(f"cuBLASLt offers no split-free algorithm for m <= {high}, "
                          f"n={self.n}, k={self.k}")

    def _bucket_algorithms(self) -> list[tuple[int, ctypes.Array]]:
        """(largest m, algorithm) of each bucket, ascending; the last is (max_m, self.algo)."""
        buckets: list[tuple[int, ctypes.Array]] = []
        low = 1
        for high in (b for b in BUCKETS if b < self.max_m):
            try:
                buckets.append((high, self._choose(low, high)))
            except CublasError:
                continue  # its rows go to the next bucket's algorithm, checked from `low`
            low = high + 1
        buckets.append((self.max_m, self.algo))
        return buckets

    def algorithm(self, m: int) -> ctypes.Array:
        """The algorithm that runs a launch of m rows."""
        for high, algo in self.buckets:
            if m <= high:
                return algo
        return self.algo

    def __call__(self, a: int, w: int, c: int, m: int, stream: int) -> None:
        """C (= or +=) A · Wᵀ over m rows, on `stream`."""
        if m <= 0:
            return
        lt = self.lt
        a_layout, c_layout = self.layouts(m)
        status = lt.lib.cublasLtMatmul(
            lt.handle, self.desc, ctypes.byref(self._alpha), w, self.w_layout, a, a_layout,
            ctypes.byref(self._beta), c, c_layout, c, c_layout, self.algorithm(m), lt.workspace,
            lt.workspace_bytes, stream)
        _check(status, f"cublasLtMatmul (m={m}, n={self.n}, k={self.k})")
