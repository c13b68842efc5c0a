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

`KERNCC_PERSIST=ws` takes the same runs with a third entry, `persist_ws_bf16`: units of a GEMV and
the small launch before it, a producer warp's ring, tagged words between the units (the plan and
its hazards: "persist_ws_bf16" below). The same bits, and slower still as a launch a layer
(docs/benchmarks.md, session 14).

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
# KERNCC_PERSIST (kerncc/config.py): 0 (off, the default), 1 (persist_run_bf16), ring, ws
MODES = {"0": None, "1": ENTRY, "ring": RING_ENTRY, "ws": "persist_ws_bf16"}
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
        # (grid, scalars) of every launch -> the steps that issue them: the kernel's launches
        # (their arguments) and the launches that go as they are (their index in the run)
        self._plans: dict[tuple, list] = {}

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
            phases = [phase(site, grid, scalars)
                      for site, (grid, _, scalars) in zip(self.sites, pending)]
            self._plans[key] = self.kernel.steps(phases)
        for step in self._plans[key]:
            if isinstance(step, int):
                grid, shared, scalars = pending[step]
                self.launchers[step](grid, shared, scalars)
            else:
                self.kernel.launch(*step)


def one_launch(phases: Sequence[Phase | None]) -> list:
    """persist_run_bf16's and persist_ring_bf16's steps: the run as one launch ((table,
    count)) when each launch is a phase and two or more have work, else one by one (the
    launches' indices)."""
    if any(p is None for p in phases):
        return list(range(len(phases)))
    kept = [p for p in phases if p.tasks > 0]
    if len(kept) < 2:
        return list(range(len(phases)))
    return [(table(kept), len(kept))]


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

    def steps(self, phases: Sequence[Phase | None]) -> list:
        return one_launch(phases)

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



# ---- persist_ws_bf16: units, shadows and the hazards, planned at load ----------------------------
#
# kernels/persist.cu's third entry takes a run as *units*: a GEMV launch and, folded into its x,
# the norm or silu_mul launch before it that computes that x. Data moves between the units of a
# launch as tagged words in the backend's shadow region, and outputs are stored plain where
# they may be read after the launch. What `ws_plan` shows of a launch before it is issued:
# * RAW: every input a unit reads is either untouched by the units before it (read plain) or
#   exactly the whole output of one of them (read from that output's shadow);
# * WAW: no two stores overlap but exactly, and then the earlier is left out (its readers in
#   the launch read its shadow);
# * WAR: every plain store comes after every read of what it replaces: the reader is the
#   storing tile itself (a GEMV's C) or a unit every block of which the storing unit waited
#   for (it read a GEMV output of that unit, or of a unit that had, transitively);
# * nothing stores over a weight.
# Where one of them cannot be shown the launch ends before the unit, and a unit no launch can
# take goes launch by launch.

WS_ENTRY = "persist_ws_bf16"
WS_UNIT = struct.Struct("<11Q12ifi")  # struct Unit
WS_MAX_UNITS = 16
WS_THREADS = 544
WS_STAGE = 16 * (2048 + 64)
WS_MAX_STAGES = 8
WS_MIN_STAGES = 3  # fewer starve the stream (tests/bench/persistent_probe.py)
WS_XPAD = 32  # bf16 after each row of x in shared memory
WS_MAX_M = 1  # the rows it takes by default: at m = 8 the probe's design lost to the launches
WS_SHADOW_WORDS = 1 << 20  # the backend's shadow region, in tagged words (4 MiB)
PRE_NONE, PRE_RMSNORM, PRE_ADD_RMSNORM, PRE_SILU = range(4)
TAGGED_X, TAGGED_R, TAGGED_C = 1, 2, 4
SMALL_PRE = {RMSNORM: PRE_RMSNORM, ADD_RMSNORM: PRE_ADD_RMSNORM, SILU_MUL: PRE_SILU}


def block_width(cols: int, addresses: int) -> int:
    """kernels/norm.cuh's block_width: a norm launch's vector width."""
    if cols % 8 == 0 and addresses % 16 == 0:
        return 8
    if cols % 4 == 0 and addresses % 8 == 0:
        return 4
    return 2


@attrs.frozen
class Unit:
    """A GEMV phase and the small phase folded into its x (None: x as it is); `indices`: the
    run's launches it stands for."""

    gemv: Phase
    small: Phase | None
    indices: tuple[int, ...]

    @property
    def m(self) -> int:
        return self.gemv.m

    def reads(self) -> list[tuple[str, int, int]]:
        """(source, pointer, bytes): what the unit reads."""
        g, s, m = self.gemv, self.small, self.gemv.m
        a, w, c, _ = g.pointers
        out = [("w", w, 2 * g.n * g.k)]
        if s is None:
            out.append(("x", a, 2 * m * g.k))
        elif s.kind == SILU_MUL:
            out.append(("x", s.pointers[0], 4 * m * g.k))
        elif s.kind == RMSNORM:
            out += [("x", s.pointers[0], 2 * m * g.k), ("gamma", s.pointers[1], 2 * g.k)]
        else:
            out += [("r", s.pointers[0], 2 * m * g.k), ("x", s.pointers[1], 2 * m * g.k),
                    ("gamma", s.pointers[2], 2 * g.k)]
        if g.kind == GEMV_ACC:
            out.append(("c", c, 2 * m * g.n))
        return out

    def writes(self) -> list[tuple[str, int, int]]:
        """(output, pointer, bytes): what the unit stores."""
        g, s, m = self.gemv, self.small, self.gemv.m
        out = [("y", g.pointers[2], 2 * m * g.n)]
        if s is not None and s.kind == SILU_MUL:
            out.append(("side", s.pointers[1], 2 * m * g.k))
        elif s is not None and s.kind == RMSNORM:
            out.append(("side", s.pointers[2], 2 * m * g.k))
        elif s is not None:
            out += [("res", s.pointers[0], 2 * m * g.k), ("side", s.pointers[3], 2 * m * g.k)]
        return out

    def width(self) -> int:
        """The small launch's vector width (norm.cu's, activation.cuh's)."""
        s = self.small
        if s is None:
            return 0
        p = s.pointers
        if s.kind == SILU_MUL:
            return 8 if s.n % 8 == 0 and s.k % 8 == 0 and (p[0] | p[1]) % 16 == 0 else 1
        return block_width(s.n, p[0] | p[1] | p[2] | p[3] | 2 * s.n)

    def fits(self, max_m: int) -> bool:
        """The shapes the kernel's loops take (its items, staging and folds)."""
        g, s = self.gemv, self.small
        if not 0 < g.m <= max_m or g.tasks <= 0 or g.n % 16:
            return False
        if g.k % 1024:  # whole items of 1024 columns
            return False
        if s is None:
            return True
        if s.m != g.m or s.tasks <= 0:
            return False
        if s.kind == SILU_MUL:  # x = act, read 4 columns at a time inside one gate/up block
            return s.pointers[1] == g.pointers[0] and s.n == g.k and s.k > 0 and s.k % 4 == 0
        out = s.pointers[2] if s.kind == RMSNORM else s.pointers[3]
        return out == g.pointers[0] and s.n == g.k and s.threads <= WARPS * 32


def ws_units(phases: Sequence[Phase]) -> list[Unit | int]:
    """The run's launches (every one a phase) as units, in order; a launch no unit takes
    (a small launch not followed by the GEMV that reads its output), as its index."""
    out: list[Unit | int] = []
    i = 0
    while i < len(phases):
        p, nxt = phases[i], phases[i + 1] if i + 1 < len(phases) else None
        if p.kind in SMALL_PRE and nxt is not None and nxt.kind in (GEMV, GEMV_ACC):
            unit = Unit(nxt, p, (i, i + 1))
            if unit.fits(MAX_PHASES):  # its x is the small launch's output
                out.append(unit)
                i += 2
                continue
        if p.kind in (GEMV, GEMV_ACC):
            out.append(Unit(p, None, (i,)))
        else:
            out.append(i)
        i += 1
    return out


def _overlap(a: int, n: int, b: int, m: int) -> bool:
    return a < b + m and b < a + n


@attrs.frozen
class WsLaunch:
    """One launch of persist_ws_bf16: its table and the launch's other parameters."""

    table: bytes
    count: int
    words: int  # shadow words the units use
    xrow: int  # bf16 a row of x takes in shared memory
    m: int

    def shared(self, stages: int) -> int:
        return -(-2 * self.m * self.xrow // 128) * 128 + stages * WS_STAGE


def ws_plan(units: Sequence[Unit], shadow: int, words: int) -> WsLaunch | str:
    """`units` as one launch, with `words` tagged words at device address `shadow` for their
    shadows; or why not (the hazards above, the region's size)."""
    if not 0 < len(units) <= WS_MAX_UNITS or len({u.m for u in units}) != 1:
        return "the units differ in rows, or are too many"
    written: list[tuple[int, int, int, str]] = []  # (pointer, bytes, unit, output)
    needed: list[tuple[int, str]] = []  # (unit, output) that a later unit reads tagged
    sources: list[dict[str, tuple]] = []  # per unit: source -> (pointer,) or ((unit, output),)
    full: list[set[int]] = []
    for u, unit in enumerate(units):
        mine: dict[str, tuple] = {}
        waited: set[int] = set()
        for source, pointer, size in unit.reads():
            hits = [wr for wr in written if _overlap(pointer, size, wr[0], wr[1])]
            if not hits:
                mine[source] = (pointer,)
                continue
            p, n, v, output = hits[-1]
            if source in ("w", "gamma"):
                return f"unit {u} reads a weight unit {v} stores"
            if (p, n) != (pointer, size):
                return f"unit {u} reads part of what unit {v} stores"
            mine[source] = ((v, output),)
            if (v, output) not in needed:
                needed.append((v, output))
            if source != "c":  # staged whole: every block of v (if a GEMV output) is done
                waited |= full[v] | ({v} if output == "y" else set())
        outs = unit.writes()
        for i, (_, p, n) in enumerate(outs):
            if any(_overlap(p, n, q, k) for _, q, k in outs[:i]):
                return f"unit {u} stores two outputs that overlap"
        written += [(p, n, u, output) for output, p, n in outs]
        sources.append(mine)
        full.append(waited)
    live: list[tuple[int, int, int, str]] = []
    for i, (p, n, u, output) in enumerate(written):
        later = [wr for wr in written[i + 1:] if _overlap(p, n, wr[0], wr[1]) and wr[2] != u]
        if any((q, k) != (p, n) for q, k, _, _ in later):
            return f"unit {later[0][2]} stores over part of what unit {u} stores"
        if not later:
            live.append((p, n, u, output))
    for q, mine in enumerate(sources):
        for source, pointer, size in units[q].reads():
            if isinstance(mine[source][0], tuple):
                continue  # read tagged: no store touches a shadow
            for p, n, u, output in live:
                if not _overlap(pointer, size, p, n):
                    continue
                if u == q and source == "c" and output == "y" and (p, n) == (pointer, size):
                    continue  # the tile reads C and stores over it itself
                if u > q and q in full[u]:
                    continue
                return f"unit {u} stores over what unit {q} reads ({source}) before it is done"
    offsets: dict[tuple[int, str], int] = {}
    used = 0
    for key in needed:
        size = next(n for _, n, v, output in written if (v, output) == key)
        offsets[key] = used
        used += -(-(size // 2) // 4) * 4  # its elements' words, 16-byte aligned
    if used > words:
        return f"the shadows take {used} words of {words}"
    tables, first = bytearray(WS_UNIT.size * WS_MAX_UNITS), 0
    for u, unit in enumerate(units):
        def source(name: str) -> tuple[int, bool]:
            value = sources[u].get(name)
            if value is None:
                return 0, False
            if isinstance(value[0], tuple):
                return shadow + 4 * offsets[value[0]], True
            return value[0], False

        stores = {}
        for output, p, n in unit.writes():
            plain = p if (p, n, u, output) in live else 0
            tag = (u, output)
            stores[output] = (plain, shadow + 4 * offsets[tag] if tag in offsets else 0)
        x, r, c = source("x"), source("r"), source("c")
        g, s = unit.gemv, unit.small
        gamma = 0 if s is None or s.kind == SILU_MUL else source("gamma")[0]
        y, side, res = stores["y"], stores.get("side", (0, 0)), stores.get("res", (0, 0))
        tagged = TAGGED_X * x[1] | TAGGED_R * r[1] | TAGGED_C * c[1]
        pre = PRE_NONE if s is None else SMALL_PRE[s.kind]
        WS_UNIT.pack_into(
            tables, u * WS_UNIT.size, g.pointers[1], x[0], r[0], gamma, c[0], *y, *side, *res,
            int(g.kind == GEMV_ACC), pre, tagged, g.m, g.n, g.k, g.warps, g.tasks, first,
            s.threads if s else 0, unit.width(), s.k if s and s.kind == SILU_MUL else 0,
            s.eps if s else 0.0, 0)
        first += g.tasks
    xrow = max(u.gemv.k for u in units) + WS_XPAD
    return WsLaunch(bytes(tables), len(units), used, xrow, units[0].m)


def ws_steps(phases: Sequence[Phase | None], shadow: int, words: int, max_m: int,
             max_shared: int) -> list:
    """The run's launches as persist_ws_bf16 launches ((WsLaunch, stages)), each of as many
    consecutive units as `ws_plan` takes, and the launches no unit takes (their indices)."""
    items: list[Unit | int] = []
    start = 0
    for end in [*[i for i, p in enumerate(phases) if p is None], len(phases)]:
        for item in ws_units(phases[start:end]):  # a stretch of phases
            items.append(item + start if isinstance(item, int) else
                         attrs.evolve(item, indices=tuple(i + start for i in item.indices)))
        if end < len(phases):
            items.append(end)
        start = end + 1

    def stages(launch: WsLaunch) -> int:
        return min(WS_MAX_STAGES, (max_shared - launch.shared(0)) // WS_STAGE)

    def plan(units: Sequence[Unit]) -> tuple[WsLaunch, int] | None:
        launch = ws_plan(units, shadow, words)
        if isinstance(launch, str) or stages(launch) < WS_MIN_STAGES:
            return None
        return launch, stages(launch)

    steps: list = []
    i = 0
    while i < len(items):
        # the longest launch from here: a store a later unit overwrites is left out, so a
        # stretch may plan where a shorter one does not
        end = i
        while (end < len(items) and end - i < WS_MAX_UNITS and isinstance(items[end], Unit)
               and items[end].fits(max_m)):
            end += 1
        best = next(((planned, j) for j in range(end, i, -1)
                     if (planned := plan(items[i:j])) is not None), None)
        if best is None:
            item = items[i]
            steps += [item] if isinstance(item, int) else list(item.indices)
            i += 1
            continue
        steps.append(best[0])
        i = best[1]
    return steps


class WsKernel:
    """persist_ws_bf16 on one cuda backend: its function, grid, epoch and shadow region."""

    def __init__(self, backend: Any, check: Callable[[Any, str], Any], function: Any,
                 max_m: int = WS_MAX_M) -> None:
        self.backend, self._check, self.function, self.max_m = backend, check, function, max_m
        device = check(cu.cuCtxGetDevice(), "cuCtxGetDevice")
        attribute = cu.CUdevice_attribute
        sms = check(cu.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                            device), "cuDeviceGetAttribute(multiprocessors)")
        optin = check(cu.cuDeviceGetAttribute(
            attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device),
            "cuDeviceGetAttribute(shared memory)")
        static = check(cu.cuFuncGetAttribute(
            cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, function),
            "cuFuncGetAttribute(persist_ws, shared)")
        self.max_shared = int(optin) - int(static)
        check(cu.cuFuncSetAttribute(
            function, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            self.max_shared), "cuFuncSetAttribute(persist_ws, shared)")
        per_sm = check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            function, WS_THREADS, self.max_shared), "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        if per_sm < 1:
            raise BackendError("the persistent kernel does not fit a multiprocessor")
        self.grid = int(sms)  # one block a multiprocessor, all resident
        self.sync = backend.allocate(8)  # [epoch, finished blocks], zeroed
        self.shadow = backend.allocate(4 * WS_SHADOW_WORDS)  # zeroed: no word carries a tag
        self._table = ctypes.create_string_buffer(WS_UNIT.size * WS_MAX_UNITS)
        self._ints = [ctypes.c_int32(0) for _ in range(4)]  # count, words, xrow, stages
        self._pointers = [ctypes.c_uint64(self.sync.ptr), ctypes.c_uint64(self.shadow.ptr)]
        count, words, xrow, stages = self._ints
        self._params = (ctypes.c_void_p * 7)(*(ctypes.addressof(v) for v in (
            self._table, count, self._pointers[0], self._pointers[1], words, xrow, stages)))
        self.configs = {False: gemv.launch_config(False), True: gemv.launch_config(True)}

    def steps(self, phases: Sequence[Phase | None]) -> list:
        return ws_steps(phases, self.shadow.ptr, WS_SHADOW_WORDS, self.max_m, self.max_shared)

    def launch(self, launch: WsLaunch, stages: int) -> None:
        """One launch on the backend's stream (parameters copied at the launch, as above)."""
        backend = self.backend
        ctypes.memmove(self._table, launch.table, len(launch.table))
        for value, v in zip(self._ints, (launch.count, launch.words, launch.xrow, stages)):
            value.value = v
        overlap = backend.pdl and backend.capturing and backend.after_kernel
        config = self.configs[overlap]
        config.gridDimX, config.blockDimX = self.grid, WS_THREADS
        config.sharedMemBytes = launch.shared(stages)
        config.hStream = backend._launch_stream
        self._check(cu.cuLaunchKernelEx(config, self.function, ctypes.addressof(self._params),
                                        0), "cuLaunchKernelEx(persist_ws)")
        backend.overlapped += overlap
        backend.after_kernel = True
        backend.launches += 1
        backend.persisted += 1
