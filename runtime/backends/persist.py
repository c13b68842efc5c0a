"""Runs of decode-step launches as one persistent kernel (kernels/persist.cu) on the cuda backend.

Issue 20's structural lever: in a decode step the four GEMVs of a layer stream its weights and
the small kernels between them wait on each other, and as a chain of launches the two hardly
overlap (docs/benchmarks.md, session 9: the GEMVs alone make a 0.82 ms step, the small kernels
alone 0.36, together 1.14). One persistent launch for a stretch of them keeps the weight stream
going across the dependencies: a block loads its next GEMV task's weights before it waits for
that task's input. Opt-in (`KERNCC_PERSIST=1`, or `CudaBackend.persist = ENTRY` before a
Session loads; `ring` / RING_ENTRY: the weights several rounds ahead in shared memory): the
bits are the launches' own, but on an H200 the step is slower (1.52 against 1.13 ms at batch
1: each phase's wait and each small task cost more than a launch under PDL; docs/benchmarks.md,
session 10), so it stays off.

How a run forms. At load, `runs` finds each program's maximal stretches of consecutive sites the
persistent kernel can take (`candidate`): the GEMM externs `cublaslt_bf16_tn` and
`cublaslt_bf16_tn_acc`, and rmsnorm_bf16, add_rmsnorm_bf16 and silu_mul_bf16 of the library's
own norm and activation cubins, none gated by `when`; two or more make a run (at most
MAX_PHASES). Each site of a run gets a launcher that records its launch, and the run's last
site issues them (`Run.flush`): as one persistent launch when every recorded launch has a
`phase` at its values (a GEMM the GEMV kernels take, at m <= 8, whole 16-row tiles and whole
rounds of k; a norm or silu_mul launch of a one-dimensional grid of whole warps, at most
THREADS), else one by one through their own launchers, in order. Nothing else reaches the
stream between the sites of a run (they are consecutive launches of one program, issued
together), so issuing them at the last is issuing them in order.

The table travels as the kernel's parameter (PHASE.size bytes a phase), so a graph captures it
like any launch's arguments and nothing is allocated or copied per launch; the counters the
kernel orders its phases by are one small allocation per backend, zero between launches.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kerncc import config
from kerncc.kernels import library
from kerncc.runtime.backends import gemv
from kerncc.runtime.backends.base import BackendError
from kerncc.runtime.launch import Site

try:
    from cuda.bindings import driver as cu
except ImportError:  # pragma: no cover - exercised only without the `cuda` extra
    cu = None

MODULE = "persist"
ENTRY = "persist_run_bf16"  # the next GEMV round's weights in registers
RING_ENTRY = "persist_ring_bf16"  # RING_STAGES rounds ahead in shared memory
RING_SMEM = 3 * 32 * (2048 + 64)  # RING_SMEM: persist_ring_bf16's dynamic shared memory
THREADS = 512  # PERSIST_THREADS
WARPS = THREADS // 32
MAX_PHASES = 32  # PERSIST_MAX_PHASES
# KERNCC_PERSIST (kerncc/config.py): 0 (off, the default), 1 (persist_run_bf16), ring
MODES = {"0": None, "1": ENTRY, "ring": RING_ENTRY}
ENABLED = MODES[config.persist()]

# struct Phase (kernels/persist.cu): p[4]; kind, tasks, first, m; n, k, warps, threads; eps; pad.
PHASE = struct.Struct("<4Q4i4if3i")
GEMV, GEMV_ACC, RMSNORM, ADD_RMSNORM, SILU_MUL = range(5)
GEMM_KINDS = {"cublaslt_bf16_tn": GEMV, "cublaslt_bf16_tn_acc": GEMV_ACC}
KERNEL_KINDS = {"rmsnorm_bf16": ("norm", RMSNORM), "add_rmsnorm_bf16": ("norm", ADD_RMSNORM),
                "silu_mul_bf16": ("activation", SILU_MUL)}
GEMV_WARPS = {gemv.NARROW_ENTRY: 8, gemv.WIDE_ENTRY: 16}  # entry_for(m <= 8, n) -> warps a tile

Launcher = Callable[[tuple[int, int, int], int, Sequence[int]], None]


@attrs.frozen
class Phase:
    """One launch of a run, as the persistent kernel reads it."""

    kind: int
    tasks: int  # the launch's blocks (a GEMV's tiles, two a task for 8-warp tiles)
    m: int  # rows
    n: int  # GEMV: n; norm: cols; silu: inter
    k: int = 0  # GEMV: k; silu: the gate/up block
    warps: int = 0  # GEMV: warps a tile
    threads: int = 0  # norm, silu: the launch's block
    eps: float = 0.0
    pointers: tuple[int, int, int, int] = (0, 0, 0, 0)

    def pack(self, first: int) -> bytes:
        return PHASE.pack(*self.pointers, self.kind, self.tasks, first, self.m, self.n, self.k,
                          self.warps, self.threads, self.eps, 0, 0, 0)


def table(phases: Sequence[Phase]) -> bytes:
    """The kernel's `PersistTable` parameter: the phases, each with the tasks before it."""
    if not 0 < len(phases) <= MAX_PHASES:
        raise ValueError(f"a persistent run takes 1 to {MAX_PHASES} phases, not {len(phases)}")
    out, first = bytearray(PHASE.size * MAX_PHASES), 0
    for i, phase in enumerate(phases):
        out[i * PHASE.size:(i + 1) * PHASE.size] = phase.pack(first)
        first += phase.tasks
    return bytes(out)


# ---- which sites, and which launches --------------------------------------------------------


def library_modules() -> dict[str, str]:
    """{entry: the sha256 of the library module it must come from} for the kernel candidates."""
    index = library.index()
    return {entry: index[module]["sha256"] for entry, (module, _) in KERNEL_KINDS.items()}


def candidate(site: Site, modules: Mapping[str, str]) -> bool:
    """Whether the persistent kernel may take this site (its values are checked per launch)."""
    if site.when is not None:
        return False
    if site.kind == "extern":
        return site.extern_name in GEMM_KINDS
    return site.entry in KERNEL_KINDS and site.module == modules[site.entry]


def runs(sites: Sequence[Site], modules: Mapping[str, str]) -> list[list[Site]]:
    """A program's maximal stretches of consecutive candidates, two to MAX_PHASES long."""
    found: list[list[Site]] = []
    current: list[Site] = []
    for site in [*sites, None]:
        if site is not None and candidate(site, modules) and len(current) < MAX_PHASES:
            current.append(site)
            continue
        if len(current) >= 2:
            found.append(current)
        current = [site] if site is not None and candidate(site, modules) else []
    return found


def phase(site: Site, grid: tuple[int, int, int], scalars: Sequence[int]) -> Phase | None:
    """The launch as a phase, or None when the persistent kernel cannot take it at these
    values (the run then goes launch by launch). A launch with nothing to do is a phase of
    no tasks (`tasks == 0`), which the run leaves out."""
    args = site.bind(scalars)
    if site.kind == "extern":
        a, w, c, m, n, k = (int(x) for x in args)
        return gemm_phase(GEMM_KINDS[site.extern_name], a, w, c, m, n, k)
    return kernel_phase(KERNEL_KINDS[site.entry][1], args, grid, site.block)


def gemm_phase(kind: int, a: int, w: int, c: int, m: int, n: int, k: int) -> Phase | None:
    if not gemv.usable(m, n, k, a, w, c) or m > 8 or n % 16:
        return None
    warps = GEMV_WARPS.get(gemv.entry_for(m, n))
    if warps is None or k % (128 * warps):
        return None
    tiles = n // 16
    tasks = tiles if warps == WARPS else -(-tiles // (WARPS // warps))
    return Phase(kind, tasks, m, n, k, warps=warps, pointers=(a, w, c, 0))


def kernel_phase(kind: int, args: Sequence[Any], grid: tuple[int, int, int],
                 block: tuple[int, int, int]) -> Phase | None:
    threads = block[0]
    if grid[1] != 1 or grid[2] != 1 or block[1:] != (1, 1):
        return None
    if threads % 32 or not 0 < threads <= THREADS:
        return None
    if grid[0] <= 0:
        return Phase(kind, 0, 0, 0)
    if kind == SILU_MUL:
        gate_up, act, rows, inter, width = args
        return Phase(kind, grid[0], int(rows), int(inter), int(width), threads=threads,
                     pointers=(int(gate_up), int(act), 0, 0))
    if kind == RMSNORM:
        x, w, y, rows, cols, eps = args
        pointers = (int(x), int(w), int(y), 0)
    else:
        residual, x, w, y, rows, cols, eps = args
        pointers = (int(residual), int(x), int(w), int(y))
    return Phase(kind, grid[0], int(rows), int(cols), threads=threads, eps=float(eps),
                 pointers=pointers)


# ---- the launchers -----------------------------------------------------------------------------


class Run:
    """One run's sites: each records its launch, the last issues the run."""

    PLANS = 64  # the launch values a run keeps its plan for (a program has a handful)

    def __init__(self, kernel: PersistentKernel, sites: list[Site], launchers: list[Launcher]):
        self.kernel, self.sites, self.launchers = kernel, sites, launchers
        self.pending: list[tuple[tuple[int, int, int], int, tuple[int, ...]]] = []
        # (grid, scalars) of every launch -> (table, phases) or None: launch by launch
        self._plans: dict[tuple, tuple[bytes, int] | None] = {}

    def recorder(self, i: int) -> Launcher:
        def record(grid: tuple[int, int, int], shared: int, scalars: Sequence[int]) -> None:
            if i == 0:
                self.pending = []  # a run cut short before (an error) leaves nothing behind
            if len(self.pending) != i:
                raise RuntimeError(f"launch {i} of a persistent run came after "
                                   f"{len(self.pending)} of its launches")
            self.pending.append((grid, shared, tuple(scalars)))
            if i == len(self.sites) - 1:
                self.flush()

        return record

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        key = tuple((grid, scalars) for grid, _, scalars in pending)
        if key not in self._plans:
            if len(self._plans) >= self.PLANS:
                self._plans.clear()
            self._plans[key] = self.plan(pending)
        plan = self._plans[key]
        if plan is not None:
            self.kernel.launch(*plan)
            return
        for launcher, (grid, shared, scalars) in zip(self.launchers, pending):
            launcher(grid, shared, scalars)

    def plan(self, pending: Sequence[tuple]) -> tuple[bytes, int] | None:
        """The kernel's table and phase count for these launches, or None when one of them
        is no phase (or fewer than two have work)."""
        phases = [phase(site, grid, scalars)
                  for site, (grid, _, scalars) in zip(self.sites, pending)]
        if any(p is None for p in phases):
            return None
        kept = [p for p in phases if p.tasks > 0]
        return (table(kept), len(kept)) if len(kept) >= 2 else None


def join(kernel: PersistentKernel, programs: Mapping[str, Sequence[Site]],
         launchers: dict[int, Launcher]) -> dict[int, Launcher]:
    """The launchers with every run's sites recording into their run."""
    modules = library_modules()
    joined = dict(launchers)
    for sites in programs.values():
        for found in runs(sites, modules):
            run = Run(kernel, found, [launchers[s.number] for s in found])
            for i, site in enumerate(found):
                joined[site.number] = run.recorder(i)
    return joined


class PersistentKernel:
    """The persist module's kernel on one cuda backend: its function, grid and counters."""

    def __init__(self, backend: Any, check: Callable[[Any, str], Any], function: Any,
                 shared: int = 0) -> None:
        self.backend, self._check, self.function, self.shared = backend, check, function, shared
        if shared:
            check(cu.cuFuncSetAttribute(
                function, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared), f"cuFuncSetAttribute(persist, {shared} bytes of shared memory)")
        device = check(cu.cuCtxGetDevice(), "cuCtxGetDevice")
        sms = check(cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device),
            "cuDeviceGetAttribute(multiprocessors)")
        per_sm = check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.function, THREADS,
                                                                       shared),
                       "cuOccupancyMaxActiveBlocksPerMultiprocessor(persist)")
        if per_sm < 1:
            raise BackendError("the persistent kernel does not fit a multiprocessor")
        # every block resident at once, or a block could wait for one that never starts
        self.grid = int(sms) * int(per_sm)
        self.sync = backend.allocate(4 * (1 + MAX_PHASES))  # zeroed
        self._table = ctypes.create_string_buffer(PHASE.size * MAX_PHASES)
        self._count = ctypes.c_int32(0)
        self._sync_ptr = ctypes.c_uint64(self.sync.ptr)
        self._params = (ctypes.c_void_p * 3)(ctypes.addressof(self._table),
                                             ctypes.addressof(self._count),
                                             ctypes.addressof(self._sync_ptr))
        self.configs = {False: gemv.launch_config(False), True: gemv.launch_config(True)}

    def launch(self, packed: bytes, count: int) -> None:
        """One launch of the kernel over the `count` phases of table `packed` on the backend's
        stream (the driver copies the parameters at the launch, so rewriting them after it is
        safe, also while capturing)."""
        backend = self.backend
        ctypes.memmove(self._table, packed, PHASE.size * MAX_PHASES)
        self._count.value = count
        overlap = backend.pdl and backend.capturing and backend.after_kernel
        config = self.configs[overlap]
        config.gridDimX, config.blockDimX = self.grid, THREADS
        config.sharedMemBytes = self.shared
        config.hStream = backend._launch_stream
        self._check(cu.cuLaunchKernelEx(config, self.function, ctypes.addressof(self._params),
                                        0), "cuLaunchKernelEx(persist)")
        backend.overlapped += overlap
        backend.after_kernel = True
        backend.launches += 1
        backend.persisted += 1
