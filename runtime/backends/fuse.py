"""A decode GEMV and the small kernel before it as one launch (kernels/gemv.cu
`gemv_rmsnorm_bf16_tn_mb1[_w16]`, `gemv_silu_bf16_tn_mb1[_w16]`), on the cuda backend.

A decode layer launches `rmsnorm_bf16` right before the qkv GEMM and `silu_mul_bf16` right
before the down GEMM, each a few microseconds of latency for a few kilobytes of work, and each a
grid the GEMV then waits for. The fused kernels compute the small kernel's output themselves:
once its first weight loads are in flight, every block of the GEMV computes the whole m x k
activations into shared memory (`gemv.fused_shared` bytes), from the small kernel's inputs,
with the small kernel's operations in its order (for the norm: each row's sum of squares from
the shares the norm's launch gives its threads, added in its warp order), so they hold the same
bits and the products are the GEMV's. The blocks also write the small kernel's output between
them, so anything that reads it later reads the same bytes (tests/test_fuse_cuda.py compares
the fused launch with the two, bit for bit, and whole models with and without it).

How a pair forms. At load, `pairs` finds each program's consecutive sites that are a library
`rmsnorm_bf16` or `silu_mul_bf16` launch followed by a GEMM extern launch, neither gated by
`when`. The small kernel's site records its launch and the GEMM's issues the fused one when the
two agree at their values (`norm_values`, `silu_values`): the GEMM reads exactly the small
kernel's output as A, with its rows and width; the GEMV kernels take the shape (`gemv.usable`)
at m <= 8 and the activations fit `gemv.FUSED_SHARED_MAX`; rows are 16-byte aligned; the output
lies apart from every input, so no block reads what another writes. Otherwise both go out as
prepared, in order: the small kernel, then the GEMM through its own launcher (GEMV or cuBLAS).
No other launch reaches the stream between the two sites, since they are consecutive launches of
one program.

`KERNCC_FUSE_GEMV` picks the small kernels (0, the default: none; `norm`, `silu`, 1: both), or
`CudaBackend.fuse_gemv` (True, False or a set of entries) before a Session loads (the
benchmarks and GPU tests compare them).
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kerncc import config
from kerncc.kernels import library
from kerncc.runtime.backends import gemv
from kerncc.runtime.launch import Site

Launcher = Callable[[tuple[int, int, int], int, Sequence[int]], None]

NORM, SILU = "rmsnorm_bf16", "silu_mul_bf16"
MODULES = {NORM: "norm", SILU: "activation"}  # the small kernel: its library module
# (small kernel, the GEMV entry the shape takes) -> the fused entry
FUSED = {(NORM, gemv.NARROW_ENTRY): "gemv_rmsnorm_bf16_tn_mb1",
         (NORM, gemv.WIDE_ENTRY): "gemv_rmsnorm_bf16_tn_mb1_w16",
         (SILU, gemv.NARROW_ENTRY): "gemv_silu_bf16_tn_mb1",
         (SILU, gemv.WIDE_ENTRY): "gemv_silu_bf16_tn_mb1_w16"}
# the fused kernels' parameters: the norm's x, gn, y, eps, its threads a block; or silu's
# gate_up, act, block; then the GEMV's w, c, m, n, k, mode
FORMATS = {NORM: "QQQfiQQiiii", SILU: "QQiQQiiii"}
CHOICES = {"0": frozenset(), "norm": frozenset({NORM}), "silu": frozenset({SILU}),
           "1": frozenset({NORM, SILU})}
ENABLED = CHOICES[config.fuse_gemv()]  # KERNCC_FUSE_GEMV; a backend reads it as it is made
MAX_M = 8  # the fused tiles take 8 rows of A (MB = 1)


def pairs(sites: Sequence[Site], modules: Mapping[str, str]) -> list[tuple[Site, Site]]:
    """A program's (small kernel, GEMM) sites that may go out as one launch; `modules`: the
    sha256 of each library module in MODULES, by module name."""
    found = []
    for small, gemm in zip(sites, sites[1:]):
        if (small.kind == "kernel" and small.entry in MODULES
                and small.module == modules.get(MODULES[small.entry])
                and gemm.kind == "extern" and gemm.extern_name in gemv.MODES
                and small.when is None and gemm.when is None):
            found.append((small, gemm))
    return found


def _apart(ranges: Sequence[tuple[int, int]]) -> bool:
    """Whether the first [start, start + bytes) range overlaps none of the others."""
    (start, size), others = ranges[0], ranges[1:]
    return all(start + size <= s or s + n <= start for s, n in others if n > 0)


def _gemm(args: Sequence[Any], mode: int) -> tuple[int, int, int, int, int, int] | None:
    """The GEMM's (a, w, c, m, n, k) when the fused tiles take it, else None."""
    a, w, c, m, n, k = (int(v) for v in args)
    if (not (m <= MAX_M and gemv.usable(m, n, k, a, w, c)) or mode not in (0, 1, 2)
            or gemv.fused_shared(m, k) > gemv.FUSED_SHARED_MAX):
        return None
    return a, w, c, m, n, k


def norm_values(args: Sequence[Any], threads: int, gemm: Sequence[Any],
                mode: int) -> tuple | None:
    """The fused launch's values for rmsnorm_bf16 (x, gn, y, rows, cols, eps) launched with
    `threads` a block followed by the GEMM `gemm` (a, w, c, m, n, k), or None."""
    shape = _gemm(gemm, mode)
    if shape is None:
        return None
    a, w, c, m, n, k = shape
    x, gn, y, rows, cols, eps = args
    x, gn, y = int(x), int(gn), int(y)
    out = 4 if mode == 2 else 2
    if (y != a or (int(rows), int(cols)) != (m, k) or (x | gn | y) & 15
            or threads % 32 or not 32 <= threads <= 1024
            or not _apart([(y, 2 * m * k), (x, 2 * m * k), (gn, 2 * k), (w, 2 * n * k),
                           (c, out * m * n)])):
        return None
    return x, gn, y, float(eps), threads, w, c, m, n, k, mode


def silu_values(args: Sequence[Any], gemm: Sequence[Any], mode: int) -> tuple | None:
    """The fused launch's values for silu_mul_bf16 (gate_up, act, rows, inter, block) followed
    by the GEMM `gemm` (a, w, c, m, n, k), or None."""
    shape = _gemm(gemm, mode)
    if shape is None:
        return None
    a, w, c, m, n, k = shape
    gate_up, act, rows, inter, block = (int(v) for v in args)
    out = 4 if mode == 2 else 2
    if (act != a or (rows, inter) != (m, k) or (gate_up | act) & 15
            or block <= 0 or block % 8 or inter % block
            or not _apart([(act, 2 * m * k), (gate_up, 4 * m * k), (w, 2 * n * k),
                           (c, out * m * n)])):
        return None
    return gate_up, act, block, w, c, m, n, k, mode


class Pair:
    """One (small kernel, GEMM) pair's launchers: the small kernel's records, the GEMM's
    issues."""

    def __init__(self, backend: Any, functions: Mapping[str, Any], sites: tuple[Site, Site],
                 launchers: tuple[Launcher, Launcher]) -> None:
        self.backend, self.functions = backend, functions
        self.sites, self.launchers = sites, launchers
        self.small = sites[0].entry
        self.mode = gemv.MODES[sites[1].extern_name]
        self.formats = FORMATS[self.small]
        self.slots = tuple(8 * i for i in range(len(self.formats)))
        self.pending: tuple[tuple[int, int, int], int, tuple[int, ...]] | None = None
        self.storage = ctypes.create_string_buffer(8 * len(self.formats))
        base = ctypes.addressof(self.storage)
        self.table = (ctypes.c_void_p * len(self.formats))(*[base + at for at in self.slots])
        self.fused = 0  # launches that went out fused (the tests read it)

    def record(self, grid: tuple[int, int, int], shared: int, scalars: Sequence[int]) -> None:
        self.pending = (grid, shared, tuple(scalars))

    def issue(self, grid: tuple[int, int, int], shared: int, scalars: Sequence[int]) -> None:
        pending, self.pending = self.pending, None
        if pending is None:
            raise RuntimeError(f"the GEMM launch after `{self.small}` came without it")
        small_grid, small_shared, small_scalars = pending
        small_site, gemm_site = self.sites
        small_args = small_site.bind(small_scalars)
        gemm_args = gemm_site.bind(scalars)
        values = (norm_values(small_args, small_site.block[0], gemm_args, self.mode)
                  if self.small == NORM else silu_values(small_args, gemm_args, self.mode))
        if values is None or min(small_grid) <= 0:
            self.launchers[0](small_grid, small_shared, small_scalars)
            self.launchers[1](grid, shared, scalars)
            return
        m, n, k = values[-4:-1]
        entry = FUSED[(self.small, gemv.entry_for(m, n))]
        for at, fmt, value in zip(self.slots, self.formats, values):
            struct.pack_into("<" + fmt, self.storage, at,
                             float(value) if fmt == "f" else int(value))
        self.backend.launch_fused(self.functions[entry], (-(-n // gemv.ROWS_PER_BLOCK), 1, 1),
                                  (gemv.FUSED_ENTRIES[entry], 1, 1), gemv.fused_shared(m, k),
                                  ctypes.addressof(self.table))
        self.fused += 1


def kinds(choice: bool | frozenset[str]) -> frozenset[str]:
    """The small kernels to fuse for a backend's `fuse_gemv`: True for both, False for none,
    or a set of NORM and SILU."""
    if isinstance(choice, bool):
        return CHOICES["1" if choice else "0"]
    return frozenset(choice) & CHOICES["1"]


def join(backend: Any, functions: Mapping[str, Any], programs: Mapping[str, Sequence[Site]],
         launchers: dict[int, Launcher],
         small: frozenset[str] = frozenset({NORM, SILU})) -> dict[int, Launcher]:
    """The launchers with every pair's small kernel (of `small`) recording and its GEMM issuing
    the fused launch; `functions`: the gemv module's kernels by entry."""
    modules = {name: library.index()[name]["sha256"] for name in set(MODULES.values())}
    fused = dict(launchers)
    for sites in programs.values():
        for first, gemm in pairs(sites, modules):
            if first.entry not in small:
                continue
            small_site = first
            pair = Pair(backend, functions, (small_site, gemm),
                        (launchers[small_site.number], launchers[gemm.number]))
            fused[small_site.number], fused[gemm.number] = pair.record, pair.issue
    return fused
