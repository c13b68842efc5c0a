"""The GEMV kernels (kernels/gemv.cu) against the GEMM externs' numpy references (marked `gpu`).

Every case draws fresh random non-zero inputs, poisons C (NaN) where the kernel only writes
and fills it with random values where it accumulates, and leaves a poisoned guard after C that
must stay untouched. Shapes cover m from 1 to 8 (the most the kernels take), n that is
not a multiple of the 16-row tile, k that is not a multiple of the 32-wide chunk, and the
model's own sizes; each result must match the reference within bf16 rounding, equal itself
bit for bit on a second launch, and agree with cuBLAS on the same launch within the same
tolerance. Launches that the kernels must not take (m > 8, k % 8 != 0, a misaligned pointer)
go to cuBLAS.
"""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

from kerncc.kernels.reference import EXTERNS

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
GUARD = 64  # bytes of poison after C
EXTERN_NAMES = ("cublaslt_bf16_tn", "cublaslt_bf16_tn_acc", "cublas_bf16_tn_f32")
SHAPES = [  # (m, n, k)
    (1, 16, 32), (1, 40, 8), (1, 2048, 2048), (3, 100, 72), (8, 64, 2048), (7, 48, 40),
    (6, 4096, 2048), (4, 33, 6144), (2, 80, 264), (7, 2048, 6144), (8, 12288, 2048),
    (8, 17, 16), (5, 32000, 2048),
]


@pytest.fixture(scope="module")
def backend():
    from kerncc.runtime.backends import gemv
    from kerncc.runtime.backends.cuda import CudaBackend

    saved = gemv.MAX_M, gemv.CUBLAS_MIN_N
    gemv.MAX_M, gemv.CUBLAS_MIN_N = 8, 1 << 30  # every size the kernels can take
    yield CudaBackend(0)
    gemv.MAX_M, gemv.CUBLAS_MIN_N = saved


def random_bf16(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32) * scale
    x[x == 0] = scale  # never zeros
    return x.astype(BF16)


def poison(nbytes: int) -> np.ndarray:
    return np.full(nbytes, 0xFF, np.uint8)  # NaN as bf16 and as f32


def reference(name: str, a: np.ndarray, w: np.ndarray, c0: np.ndarray, m: int, n: int,
              k: int) -> np.ndarray:
    c = c0.copy()
    EXTERNS[name](None, a.view(np.uint8).reshape(-1), w.view(np.uint8).reshape(-1), c,
                  np.int32(m), np.int32(n), np.int32(k))
    return c


def as_values(name: str, raw: np.ndarray, count: int) -> np.ndarray:
    dtype = np.dtype(np.float32) if name.endswith("f32") else BF16
    return raw[:count * dtype.itemsize].view(dtype).astype(np.float64)


class Case:
    """A, W and C on the device for one extern launch."""

    def __init__(self, backend, name: str, m: int, n: int, k: int, seed: int,
                 shift: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.backend, self.name, self.m, self.n, self.k = backend, name, m, n, k
        self.a_host = random_bf16(rng, (m, k), 1.0)
        self.w_host = random_bf16(rng, (n, k), 1.0 / np.sqrt(k))
        width = 4 if name.endswith("f32") else 2
        self.c_bytes = m * n * width
        c0 = poison(self.c_bytes + GUARD)
        if name.endswith("_acc"):
            c0[:self.c_bytes] = random_bf16(rng, (m * n,), 1.0).view(np.uint8)
        self.c0 = c0
        self.a = backend.allocate(self.a_host.nbytes + 16)
        self.w = backend.allocate(self.w_host.nbytes + 16)
        self.c = backend.allocate(c0.nbytes + 16)
        self.shift = shift
        backend.upload(self.a, shift, self.a_host.view(np.uint8).reshape(-1))
        backend.upload(self.w, 0, self.w_host.view(np.uint8).reshape(-1))

    def pointers(self) -> tuple[int, int, int]:
        return self.a.ptr + self.shift, self.w.ptr, self.c.ptr

    def run(self, launch) -> np.ndarray:
        self.backend.upload(self.c, 0, self.c0)
        launch(*self.pointers(), self.m, self.n, self.k)
        self.backend.sync()
        return self.backend.download(self.c, 0, self.c0.nbytes)

    def expected(self) -> np.ndarray:
        return reference(self.name, self.a_host, self.w_host, self.c0[:self.c_bytes],
                         self.m, self.n, self.k)

    def free(self) -> None:
        for allocation in (self.a, self.w, self.c):
            self.backend.free(allocation)


def gemv_launcher(backend, name: str):
    site = backend._gemv_site(name)
    assert site is not None, "the GEMV kernels did not load"

    def launch(a, w, c, m, n, k):
        site(a, w, c, m, n, k, backend.stream_handle)
    return launch


def blas_launcher(backend, name: str):
    def launch(a, w, c, m, n, k):
        backend.blas.gemm(name, a, w, c, m, n, k)
    return launch


def close(name: str, got: np.ndarray, want: np.ndarray, m: int, n: int,
          cublas: bool = False) -> None:
    g, r = as_values(name, got, m * n), as_values(name, want, m * n)
    assert np.isfinite(g).all(), "an output was not written (NaN poison left)"
    scale = np.abs(r).max()
    assert scale > 0
    # two f32 sums of the same products in other orders, then one bf16 rounding each: at most
    # one bf16 step apart (2^-8 relative), plus the f32 order error near zero
    tol = np.abs(r) * 2.0 ** -7 + scale * 1e-5
    if cublas and name.endswith("_acc"):
        # cuBLAS with beta = 1 and a bf16 C does not round once: where C and A.W^T cancel it
        # is several bf16 steps of the product's size off (seen on an H200, cuBLAS 13)
        tol = tol + scale * 2.0 ** -7
    bad = np.abs(g - r) > tol
    assert not bad.any(), (f"{bad.sum()} of {m * n} differ; worst {np.abs(g - r).max():.3e} "
                           f"at scale {scale:.3e}")


@pytest.mark.parametrize("name", EXTERN_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "m{}n{}k{}".format(*s))
def test_gemv_matches_the_reference_and_cublas(backend, name, shape):
    from kerncc.runtime.backends import gemv

    m, n, k = shape
    case = Case(backend, name, m, n, k, seed=zlib.crc32(f"{name} {shape}".encode()))
    try:
        assert gemv.usable(m, n, k, *case.pointers())
        got = case.run(gemv_launcher(backend, name))
        assert (got[case.c_bytes:] == 0xFF).all(), "wrote past C"
        close(name, got, case.expected(), m, n)
        again = case.run(gemv_launcher(backend, name))
        assert got.tobytes() == again.tobytes(), "two launches gave different bits"
        close(name, got, case.run(blas_launcher(backend, name)), m, n, cublas=True)
    finally:
        case.free()


@pytest.mark.parametrize("entry", ["gemv_bf16_tn_mb1", "gemv_bf16_tn_mb1_w16"])
@pytest.mark.parametrize("name", EXTERN_NAMES)
@pytest.mark.parametrize("shape", [(1, 2048, 6144), (8, 100, 72), (5, 4096, 2048), (2, 40, 8)],
                         ids=lambda s: "m{}n{}k{}".format(*s))
def test_each_variant_for_m_up_to_8_matches_the_reference(backend, entry, name, shape):
    """The m <= 8 kernels that differ in warps (chosen per shape) compute the same function:
    each against the reference (the 16-warp one sums in another order)."""
    from kerncc.runtime.backends import gemv

    m, n, k = shape
    case = Case(backend, name, m, n, k, seed=zlib.crc32(f"{entry} {name} {shape}".encode()))
    saved = gemv.NARROW_ENTRY, gemv.WIDE_MAX_TILES
    try:
        gemv.WIDE_MAX_TILES = 0
        gemv.NARROW_ENTRY = entry
        assert gemv.entry_for(m, n) == entry
        got = case.run(gemv_launcher(backend, name))
        assert (got[case.c_bytes:] == 0xFF).all(), "wrote past C"
        close(name, got, case.expected(), m, n)
        assert got.tobytes() == case.run(gemv_launcher(backend, name)).tobytes()
    finally:
        gemv.NARROW_ENTRY, gemv.WIDE_MAX_TILES = saved
        case.free()


def test_shapes_the_kernels_refuse_go_to_cublas(backend):
    from kerncc.runtime.backends import gemv

    assert gemv.usable(8, 64, 64, 0, 0, 0)
    assert not gemv.usable(9, 64, 64, 0, 0, 0)  # m > 8
    assert not gemv.usable(4, 64, 60, 0, 0, 0)  # k % 8 != 0
    assert not gemv.usable(4, 64, 64, 2, 0, 0)  # A not 16-byte aligned
    assert not gemv.usable(4, 64, 64, 0, 0, 8)
    saved = gemv.CUBLAS_MIN_N
    try:
        gemv.CUBLAS_MIN_N = 16384  # the default: a tall W (an lm_head) streams best in cuBLAS
        assert gemv.usable(4, 16383, 64, 0, 0, 0) and not gemv.usable(4, 16384, 64, 0, 0, 0)
    finally:
        gemv.CUBLAS_MIN_N = saved


@pytest.mark.parametrize("name", EXTERN_NAMES)
@pytest.mark.parametrize("shape", [(1, 40, 64), (8, 48, 64), (9, 48, 64), (4, 40, 60),
                                   (4, 40, 64, 2)], ids=str)
def test_the_extern_site_takes_the_right_path_and_stays_right(backend, name, shape):
    """Through the backend's own extern launch site (m a var, as in a manifest): the kernels
    take m <= 8; m > 8, k % 8 != 0 and a misaligned A go to cuBLAS; the result matches the
    reference either way."""
    from kerncc.runtime.backends import gemv
    from kerncc.runtime.launch import Site, VarScalar

    m, n, k = shape[:3]
    shift = shape[3] if len(shape) > 3 else 0
    case = Case(backend, name, m, n, k, seed=11 + m, shift=shift)
    try:
        a, w, c = case.pointers()
        site = Site(number=0, program="decode", call=0, label=None, op="gemm", launch=0,
                    kind="extern", entry=f"extern:{name}", module=None, block=(1, 1, 1),
                    grid=(1, 1, 1), shared_mem=0, when=None,
                    args=(a, w, c, VarScalar("i32", {"var": "tokens"}), n, k))
        launcher = backend.prepare(site)
        calls = []
        original = gemv.GemvSite.__call__
        gemv.GemvSite.__call__ = lambda self, *args: (calls.append(args), original(self, *args))
        try:
            got = case.run(lambda *_: launcher((1, 1, 1), 0, (m,)))
        finally:
            gemv.GemvSite.__call__ = original
        assert bool(calls) == gemv.usable(m, n, k, a, w, c) == (m <= 8 and k % 8 == 0
                                                                and shift == 0)
        close(name, got, case.expected(), m, n, cublas=not calls)
    finally:
        case.free()


SMEM_ROWS = (17, 24, 32, 33, 48, 63, 64, 65, 96, 128)  # past 64: more row groups
# (n, k): n not a multiple of a block's 32 or 64 W rows (n % 8 == 0 keeps a lone row's C
# 16-byte aligned), k not a multiple of the 32-wide chunk, k under one round of the warps'
# chunks (warps with none), and a full-tile shape (the m = 1 entry's unchecked fast path)
SMEM_SHAPES = [(200, 1000), (4104, 2056), (24, 8), (1000, 2048)]


def smem_entries() -> list[str]:
    from kerncc.runtime.backends import gemv

    return sorted(set(gemv.SHARED) - {gemv.SEQ_ENTRY})


@pytest.mark.parametrize("entry", smem_entries())
@pytest.mark.parametrize("name", EXTERN_NAMES)
@pytest.mark.parametrize("shape", SMEM_SHAPES, ids=lambda s: "n{}k{}".format(*s))
def test_shared_memory_entries_give_each_row_its_alone_bits(backend, entry, name, shape):
    """The entries that stage A through shared memory (17 rows and more) give every row of C the
    bits of that row launched alone at m = 1 by the entry of the same warp count, and match
    the reference, at every m of SMEM_ROWS."""
    from kerncc.runtime.backends import gemv

    n, k = shape
    alone_entry = gemv.NARROW_ENTRY
    assert gemv.ENTRIES[entry][0] == gemv.ENTRIES[alone_entry][0], "another warp count"
    rows = max(SMEM_ROWS)
    case = Case(backend, name, rows, n, k, seed=zlib.crc32(f"smem {entry} {name} {shape}".encode()))
    site = backend._gemv_site(name, invariant=True)
    assert site is not None, "the GEMV kernels did not load"
    try:
        a, w, c = case.pointers()
        width = case.c_bytes // (rows * n)
        alone = np.empty(case.c_bytes, np.uint8)
        backend.upload(case.c, 0, case.c0)
        for r in range(rows):  # each row alone, into its own row of C
            site.launch(alone_entry, a + r * k * 2, w, c + r * n * width, 1, n, k,
                        backend.stream_handle)
        backend.sync()
        alone[:] = backend.download(case.c, 0, case.c0.nbytes)[:case.c_bytes]
        for m in SMEM_ROWS:
            case.m = m
            got = case.run(lambda a, w, c, m, n, k: site.launch(entry, a, w, c, m, n, k,
                                                                backend.stream_handle))
            used = m * n * width
            assert (got[used:] == case.c0[used:]).all(), f"m={m}: wrote past its rows"
            assert got[:used].tobytes() == alone[:used].tobytes(), \
                f"m={m}: rows differ from the same rows alone"
            want = reference(name, case.a_host[:m], case.w_host, case.c0[:used], m, n, k)
            close(name, got[:used], want, m, n)
    finally:
        case.free()


# (n, k): the model's shapes, and n and k off the 16-row tile, the 128-wide slot and the 16-wide
# slice (the chain's last slice half zeros), and one slice in all
SEQ_SHAPES = [(12288, 2048), (4096, 2048), (2048, 6144), (2056, 1000), (24, 16)]


@pytest.mark.parametrize("name", EXTERN_NAMES)
@pytest.mark.parametrize("shape", SEQ_SHAPES, ids=lambda s: "n{}k{}".format(*s))
def test_the_chain_entry_gives_the_pinned_algorithms_bits(backend, name, shape):
    """gemv_bf16_tn_seq (one tensor-core chain over k a row, the pinned algorithms' beta = 1
    epilogue) writes the C of the pinned split-free cuBLASLt algorithms bit for bit, at one row
    (the launches the policy gives it) and at more (row groups), and only its rows; and it
    matches the reference."""
    from kerncc.runtime.backends import gemv
    from kerncc.runtime.backends.cuda import _alignment

    n, k = shape
    rows = 13
    case = Case(backend, name, rows, n, k, seed=zlib.crc32(f"seq {name} {shape}".encode()))
    site = backend._gemv_site(name, invariant=True)
    try:
        pinned = backend._pinned_gemm(name, n, k, 64, _alignment(*case.pointers()))
        assert site is not None and pinned is not None
        width = case.c_bytes // (rows * n)
        for m in (1, 2, 8, 13):
            case.m = m
            want = case.run(lambda a, w, c, m, n, k: pinned(a, w, c, m, int(backend.stream_handle)))
            got = case.run(lambda a, w, c, m, n, k: site.launch(gemv.SEQ_ENTRY, a, w, c, m, n, k,
                                                                backend.stream_handle))
            used = m * n * width
            assert (got[used:] == case.c0[used:]).all(), f"m={m}: wrote past its rows"
            assert got[:used].tobytes() == want[:used].tobytes(), f"m={m}: not cuBLASLt's bits"
            close(name, got[:used], reference(name, case.a_host[:m], case.w_host,
                                              case.c0[:used], m, n, k), m, n, cublas=True)
    finally:
        case.free()
