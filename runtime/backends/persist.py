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

`KERNCC_PERSIST=ws` takes longer runs with a third entry, `persist_ws_bf16`: they reach across the
decode attention (its rope, split and combine launches are candidates too), so a decode step goes
out as one launch of units (a GEMV and the small launch before it; the rope; the split), with a
producer warp's ring and tagged words or counts between the units (the plan and its hazards:
"persist_ws_bf16" below). The same bits, and slower (1.75 against 1.15 ms a step of the example:
docs/benchmarks.md, session 14).

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
ROPE, SPLIT, COMBINE = 5, 6, 7  # the decode attention's launches: persist_ws_bf16 only
GEMM_KINDS = {"cublaslt_bf16_tn": GEMV, "cublaslt_bf16_tn_acc": GEMV_ACC}
KERNEL_KINDS = {"rmsnorm_bf16": ("norm", RMSNORM), "add_rmsnorm_bf16": ("norm", ADD_RMSNORM),
                "silu_mul_bf16": ("activation", SILU_MUL)}
# what persist_ws_bf16 takes besides: qk_rope_kv.cu's and attention.cu's decode launches
WS_KERNEL_KINDS = {**KERNEL_KINDS, "qk_norm_rope_kv_bf16": ("qk_rope_kv", ROPE),
                   "attn_decode_split_tc_bf16": ("attention", SPLIT),
                   "attn_decode_combine_bf16": ("attention", COMBINE)}
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
    pointers: tuple[int, ...] = (0, 0, 0, 0)  # the attention phases': their pointer args
    extra: tuple[int, ...] = ()  # split: (table width, max_splits); combine: (max_splits,)

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


def library_modules(kinds: Mapping[str, tuple[str, int]] = KERNEL_KINDS) -> dict[str, str]:
    """{entry: the sha256 of the library module it must come from} for the kernel candidates."""
    index = library.index()
    return {entry: index[module]["sha256"] for entry, (module, _) in kinds.items()}


def candidate(site: Site, modules: Mapping[str, str]) -> bool:
    """Whether the persistent kernel may take this site (its values are checked per launch)."""
    if site.when is not None:
        return False
    if site.kind == "extern":
        return site.extern_name in GEMM_KINDS
    return site.entry in modules and site.module == modules[site.entry]


def runs(sites: Sequence[Site], modules: Mapping[str, str],
         limit: int = MAX_PHASES) -> list[list[Site]]:
    """A program's maximal stretches of consecutive candidates, two to `limit` long."""
    found: list[list[Site]] = []
    current: list[Site] = []
    for site in [*sites, None]:
        if site is not None and candidate(site, modules) and len(current) < limit:
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
    kind = WS_KERNEL_KINDS[site.entry][1]
    if kind >= ROPE:
        return attention_phase(kind, args, grid)
    return kernel_phase(kind, args, grid, site.block)


def attention_phase(kind: int, args: Sequence[Any], grid: tuple[int, int, int]) -> Phase | None:
    """A decode attention launch as persist_ws_bf16 takes it: head dim 128, and the launch's
    grid covering its sequences and heads (the rope's rows128 path: aligned)."""
    if kind == ROPE:
        qkv, w, positions, table_, slots, kv, rows, nq, nk, hd, eps = args
        qkv, w, table_, kv, rows, nq, nk = (int(v) for v in (qkv, w, table_, kv, rows, nq, nk))
        if int(hd) != 128 or (qkv | w | table_ | kv) % 16 or rows <= 0 or nq <= 0 or nk <= 0:
            return None
        return Phase(ROPE, rows, rows, nq, nk, eps=float(eps),
                     pointers=(qkv, w, int(positions), table_, int(slots), kv))
    if kind == SPLIT:
        qkv, kv, block_table, seq_lens, part, seqs, nq, nk, hd, width, max_splits, scale = args
        seqs, nq, nk, max_splits = int(seqs), int(nq), int(nk), int(max_splits)
        if int(hd) != 128 or nk <= 0 or nq % nk or nq // nk not in (1, 2, 4, 8) or seqs <= 0:
            return None
        if grid[0] != seqs or grid[1] != nk or grid[2] < 1 or max_splits <= 0:
            return None
        return Phase(SPLIT, seqs * nk * max_splits, seqs, nq, nk, eps=float(scale),
                     pointers=(int(qkv), int(kv), int(block_table), int(seq_lens), int(part)),
                     extra=(int(width), max_splits))
    part, seq_lens, out, seqs, nq, hd, max_splits = args
    seqs, nq = int(seqs), int(nq)
    if int(hd) != 128 or grid != (seqs, nq, 1) or seqs <= 0 or int(max_splits) <= 0:
        return None
    return Phase(COMBINE, seqs * nq, seqs, nq, pointers=(int(part), int(seq_lens), int(out)),
                 extra=(int(max_splits),))


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
    modules = library_modules(kernel.kinds)
    joined = dict(launchers)
    for sites in programs.values():
        for found in runs(sites, modules, kernel.limit):
            run = Run(kernel, found, [launchers[s.number] for s in found])
            for i, site in enumerate(found):
                joined[site.number] = run.recorder(i)
    return joined


class PersistentKernel:
    """The persist module's kernel on one cuda backend: its function, grid and counters."""

    kinds, limit = KERNEL_KINDS, MAX_PHASES  # the launches its runs take, and how many

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
        ctypes.memmove(self._table, packed, PHASE.size * MAX_PHASES)
        self._count.value = count
        issue(self, THREADS, self.shared, "persist")



# ---- persist_ws_bf16: units, shadows and the hazards, planned at load ----------------------------
#
# kernels/persist.cu's third entry takes a run as *units*: a GEMV launch and, folded into its x,
# the norm, silu_mul or decode attention combine launch before it that computes that x; and the
# decode attention's rope and split launches, each a unit of its own. GEMV outputs and folded
# outputs pass to later units as tagged words in the backend's shadow region; a rope or split
# unit stores plain and counts its tasks, and the units after it wait for the count. Outputs
# are stored plain where they may be read after the launch. What `ws_plan` shows of a launch
# before it is issued:
# * RAW: every input a unit reads is untouched by the units before it (read plain), or exactly
#   the whole output of one of them, read from that output's shadow or, for a rope or split
#   unit's output, after that unit's count;
# * WAW: no two stores overlap but exactly; the earlier is then left out when its readers read
#   its shadow, else kept and the later unit waited for every block of the earlier;
# * WAR: every plain store comes after every plain read of what it replaces: the reader is the
#   storing tile itself (a GEMV's C) or a unit every block of which the storing unit waited for
#   (it read a GEMV output or a count of that unit, or of a unit that had, transitively);
# * nothing stores over a weight or a table.
# Where one of them cannot be shown the launch ends before the unit, and a unit no launch can
# take goes launch by launch.

WS_ENTRY = "persist_ws_bf16"
WS_UNIT = struct.Struct("<11Q12ifi")  # struct Unit
WS_MAX_UNITS = 160
WS_THREADS = 544
WS_STAGE = 16 * (2048 + 64)
WS_MAX_STAGES = 8
WS_MIN_STAGES = 3  # fewer starve the stream (tests/bench/persistent_probe.py)
WS_XPAD = 32  # bf16 after each row of x in shared memory
WS_MAX_M = 1  # the rows it takes by default: at m = 8 the probe's design lost to the launches
WS_SHADOW_WORDS = 1 << 20  # the backend's shadow region, in tagged words (4 MiB)
WS_DC_WARPS, WS_DC_SPLIT = 8, 128  # attention_split.cuh's DC_WARPS, DC_SPLIT
PRE_NONE, PRE_RMSNORM, PRE_ADD_RMSNORM, PRE_SILU, PRE_COMBINE = range(5)
OP_GEMV, OP_GEMV_ACC, OP_ROPE, OP_SPLIT = range(4)
TAGGED_X, TAGGED_R, TAGGED_C = 1, 2, 4
SMALL_PRE = {RMSNORM: PRE_RMSNORM, ADD_RMSNORM: PRE_ADD_RMSNORM, SILU_MUL: PRE_SILU,
             COMBINE: PRE_COMBINE}
TAGGABLE = ("x", "r", "c")  # the sources a unit may read as tagged words
COUNTED = ("q", "kv", "part")  # the sources it reads after a rope or split unit's count
MUST_STORE = ("qkv", "kv", "part")  # outputs read after a count: never left out


def block_width(cols: int, addresses: int) -> int:
    """kernels/norm.cuh's block_width: a norm launch's vector width."""
    if cols % 8 == 0 and addresses % 16 == 0:
        return 8
    if cols % 4 == 0 and addresses % 8 == 0:
        return 4
    return 2


Extent = Callable[[int], tuple[int, int] | None]  # a pointer's allocation (start, bytes)


@attrs.frozen
class Unit:
    """A GEMV phase and the small phase folded into its x (None: x as it is), or a rope or
    split phase alone (`gemv` is then that phase); `indices`: the run's launches it stands
    for."""

    gemv: Phase
    small: Phase | None
    indices: tuple[int, ...]

    @property
    def m(self) -> int:
        return self.gemv.m

    @property
    def op(self) -> int:
        kind = self.gemv.kind
        return {GEMV: OP_GEMV, GEMV_ACC: OP_GEMV_ACC, ROPE: OP_ROPE, SPLIT: OP_SPLIT}[kind]

    def reads(self, extent: Extent) -> list[tuple[str, int, int]]:
        """(source, pointer, bytes): what the unit reads."""
        g, s, m = self.gemv, self.small, self.gemv.m
        if g.kind == ROPE:
            qkv, w, positions, table_, slots, kv = g.pointers
            heads = g.n + 2 * g.k
            return [("x", qkv, 2 * m * heads * 128), ("gamma", w, 2 * 256),
                    ("const", positions, 4 * m), ("const", slots, 4 * m),
                    ("const", *whole(extent, table_, 4 * 128))]
        if g.kind == SPLIT:
            qkv, kv, block_table, seq_lens, part = g.pointers
            heads = g.n + 2 * g.k
            return [("q", qkv, 2 * m * heads * 128), ("kv", *whole(extent, kv, 1)),
                    ("const", block_table, 4 * m * g.extra[0]), ("const", seq_lens, 4 * m)]
        a, w, c, _ = g.pointers
        out = [("w", w, 2 * g.n * g.k)]
        if s is None:
            out.append(("x", a, 2 * m * g.k))
        elif s.kind == SILU_MUL:
            out.append(("x", s.pointers[0], 4 * m * g.k))
        elif s.kind == RMSNORM:
            out += [("x", s.pointers[0], 2 * m * g.k), ("gamma", s.pointers[1], 2 * g.k)]
        elif s.kind == ADD_RMSNORM:
            out += [("r", s.pointers[0], 2 * m * g.k), ("x", s.pointers[1], 2 * m * g.k),
                    ("gamma", s.pointers[2], 2 * g.k)]
        else:  # the combine: the splits' partials
            out += [("part", s.pointers[0], partials(m, s.n, s.extra[0])),
                    ("const", s.pointers[1], 4 * m)]
        if g.kind == GEMV_ACC:
            out.append(("c", c, 2 * m * g.n))
        return out

    def writes(self, extent: Extent) -> list[tuple[str, int, int]]:
        """(output, pointer, bytes): what the unit stores."""
        g, s, m = self.gemv, self.small, self.gemv.m
        if g.kind == ROPE:
            qkv, kv = g.pointers[0], g.pointers[5]
            return [("qkv", qkv, 2 * m * (g.n + 2 * g.k) * 128), ("kv", *whole(extent, kv, 1))]
        if g.kind == SPLIT:
            return [("part", g.pointers[4], partials(m, g.n, g.extra[1]))]
        out = [("y", g.pointers[2], 2 * m * g.n)]
        if s is not None and s.kind == SILU_MUL:
            out.append(("side", s.pointers[1], 2 * m * g.k))
        elif s is not None and s.kind in (RMSNORM, COMBINE):
            out.append(("side", s.pointers[2], 2 * m * g.k))
        elif s is not None:
            out += [("res", s.pointers[0], 2 * m * g.k), ("side", s.pointers[3], 2 * m * g.k)]
        return out

    def width(self) -> int:
        """The small launch's vector width (norm.cu's, activation.cuh's)."""
        s = self.small
        if s is None or s.kind == COMBINE:
            return 0
        p = s.pointers
        if s.kind == SILU_MUL:
            return 8 if s.n % 8 == 0 and s.k % 8 == 0 and (p[0] | p[1]) % 16 == 0 else 1
        return block_width(s.n, p[0] | p[1] | p[2] | p[3] | 2 * s.n)

    def fits(self, max_m: int) -> bool:
        """The shapes the kernel's loops take (its items, staging and folds)."""
        g, s = self.gemv, self.small
        if not 0 < g.m <= max_m or g.tasks <= 0:
            return False
        if g.kind in (ROPE, SPLIT):
            return True  # attention_phase took only what the tasks compute
        if g.n % 16 or g.k % 1024:  # whole items of 1024 columns
            return False
        if s is None:
            return True
        if s.m != g.m or s.tasks <= 0:
            return False
        if s.kind == SILU_MUL:  # x = act, read 4 columns at a time inside one gate/up block
            return s.pointers[1] == g.pointers[0] and s.n == g.k and s.k > 0 and s.k % 4 == 0
        if s.kind == COMBINE:
            return s.pointers[2] == g.pointers[0] and s.n * 128 == g.k
        out = s.pointers[2] if s.kind == RMSNORM else s.pointers[3]
        return out == g.pointers[0] and s.n == g.k and s.threads <= WARPS * 32

    def scratch(self) -> int:
        """Shared bytes a split task stages (attention_split.cuh's arrays for its G)."""
        if self.gemv.kind != SPLIT:
            return 0
        group = self.gemv.n // self.gemv.k
        acc = max(4 * WS_DC_WARPS * group * 128, 2 * WS_DC_WARPS * 16 * 128)  # or the V tiles
        return acc + 16 * group * 16 + 4 * WS_DC_WARPS * group * 2 + 4 * (WS_DC_SPLIT // 16)


def partials(seqs: int, nq: int, max_splits: int) -> int:
    """The bytes of the split launch's f32 partials: seqs x nq x max_splits x (hd + 2)."""
    return 4 * seqs * nq * max_splits * (128 + 2)


def whole(extent: Extent, pointer: int, size: int) -> tuple[int, int]:
    """The allocation `pointer` lies in (its start and bytes), or `size` bytes from it when
    the allocation is not known."""
    found = extent(pointer) if extent is not None else None
    return (pointer, size) if found is None else found


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
        if p.kind in (GEMV, GEMV_ACC, ROPE, SPLIT):
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


def ws_plan(units: Sequence[Unit], shadow: int, words: int,
            extent: Extent = None) -> WsLaunch | str:
    """`units` as one launch, with `words` tagged words at device address `shadow` for their
    shadows; or why not (the hazards above, the region's size)."""
    if not 0 < len(units) <= WS_MAX_UNITS or len({u.m for u in units}) != 1:
        return "the units differ in rows, or are too many"
    written: list[tuple[int, int, int, str]] = []  # (pointer, bytes, unit, output)
    needed: list[tuple[int, str]] = []  # (unit, output) that a later unit reads tagged
    sources: list[dict[str, tuple]] = []  # per unit: source -> (pointer,) or ((unit, output),)
    waits: list[int] = []  # per unit: the unit whose count it waits for, or -1
    full: list[set[int]] = []
    for u, unit in enumerate(units):
        mine: dict[str, tuple] = {}
        waited: set[int] = set()
        wait = -1
        for source, pointer, size in unit.reads(extent):
            hits = [wr for wr in written if _overlap(pointer, size, wr[0], wr[1])]
            if not hits:
                mine[source] = (pointer,)
                continue
            p, n, v, output = hits[-1]
            if source in ("w", "gamma", "const"):
                return f"unit {u} reads a weight or table unit {v} stores"
            if (p, n) != (pointer, size):
                return f"unit {u} reads part of what unit {v} stores"
            if source in COUNTED:  # after a rope or split unit's count
                if output not in MUST_STORE or wait not in (-1, v):
                    return f"unit {u} reads {source} of unit {v}, which does not count"
                wait = v
                mine[source] = (pointer,)
                waited |= full[v] | {v}
                continue
            if output in MUST_STORE:
                return f"unit {u} reads {source} of unit {v} as tagged words it has not"
            mine[source] = ((v, output),)
            if (v, output) not in needed:
                needed.append((v, output))
            if source != "c":  # staged whole: every block of v (if a GEMV output) is done
                waited |= full[v] | ({v} if output == "y" else set())
        outs = unit.writes(extent)
        for i, (_, p, n) in enumerate(outs):
            if any(_overlap(p, n, q, k) for _, q, k in outs[:i]):
                return f"unit {u} stores two outputs that overlap"
        written += [(p, n, u, output) for output, p, n in outs]
        sources.append(mine)
        waits.append(wait)
        full.append(waited)
    live: list[tuple[int, int, int, str]] = []
    for i, (p, n, u, output) in enumerate(written):
        later = [wr for wr in written[i + 1:] if _overlap(p, n, wr[0], wr[1]) and wr[2] != u]
        if any((q, k) != (p, n) for q, k, _, _ in later):
            return f"unit {later[0][2]} stores over part of what unit {u} stores"
        if later and output in MUST_STORE:  # kept: the next store must come after it
            if any(u not in full[v] for _, _, v, _ in later):
                return f"unit {later[0][2]} stores over unit {u}'s {output} unordered"
        if not later or output in MUST_STORE:
            live.append((p, n, u, output))
    for q, mine in enumerate(sources):
        for source, pointer, size in units[q].reads(extent):
            if isinstance(mine[source][0], tuple):
                continue  # read tagged: no store touches a shadow
            for p, n, u, output in live:
                if not _overlap(pointer, size, p, n) or u < q:
                    continue  # an earlier store: the read is of the latest (RAW, WAW above)
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
    tables, first = bytearray(WS_UNIT.size * len(units)), 0
    for u, unit in enumerate(units):
        def source(name: str) -> tuple[int, bool]:
            value = sources[u].get(name)
            if value is None:
                return 0, False
            if isinstance(value[0], tuple):
                return shadow + 4 * offsets[value[0]], True
            return value[0], False

        def store(output: str) -> tuple[int, int]:
            for name, p, n in unit.writes(extent):
                if name == output:
                    tag = (u, output)
                    return ((p if (p, n, u, output) in live else 0),
                            shadow + 4 * offsets[tag] if tag in offsets else 0)
            return 0, 0

        g, s = unit.gemv, unit.small
        wait, target = waits[u], units[waits[u]].gemv.tasks if waits[u] >= 0 else 0
        if g.kind == ROPE:
            qkv, w, positions, table_, slots, kv = g.pointers
            x = source("x")
            fields = (0, x[0], positions, w, table_, store("qkv")[0] and qkv, 0, slots, 0, kv,
                      0, OP_ROPE, PRE_NONE, TAGGED_X * x[1], g.m, g.n, g.k, 128, g.tasks, first,
                      -1, 0, 0, g.eps, 0)
        elif g.kind == SPLIT:
            qkv, kv, block_table, seq_lens, part = g.pointers
            fields = (0, qkv, kv, seq_lens, block_table, part, 0, 0, 0, 0, 0, OP_SPLIT,
                      PRE_NONE, 0, g.m, g.n, g.k, 128, g.tasks, first, wait, target,
                      g.extra[0], g.eps, g.extra[1])
        else:
            x, r, c = source("x"), source("r"), source("c")
            pre = PRE_NONE if s is None else SMALL_PRE[s.kind]
            gamma = 0 if s is None or s.kind in (SILU_MUL, COMBINE) else source("gamma")[0]
            if pre == PRE_COMBINE:
                x, r = source("part"), (s.pointers[1], False)
            threads = s.threads if s is not None and pre != PRE_COMBINE else wait
            width = unit.width() if pre != PRE_COMBINE else target
            block = s.k if pre == PRE_SILU else s.extra[0] if pre == PRE_COMBINE else 0
            tagged = TAGGED_X * x[1] | TAGGED_R * r[1] | TAGGED_C * c[1]
            fields = (g.pointers[1], x[0], r[0], gamma, c[0], *store("y"), *store("side"),
                      *store("res"), int(g.kind == GEMV_ACC), pre, tagged, g.m, g.n, g.k,
                      g.warps, g.tasks, first, threads, width, block,
                      s.eps if s is not None else 0.0, 0)
        WS_UNIT.pack_into(tables, u * WS_UNIT.size, *fields)
        first += g.tasks
    m = units[0].m
    need = max(u.scratch() for u in units)  # a split's staging takes x's place
    widest = max([u.gemv.k for u in units if u.gemv.kind in (GEMV, GEMV_ACC)]
                 + [-(-need // (2 * m))])
    # rows 16-byte aligned and WS_XPAD (64 bytes) off the 128-byte bank period
    xrow = -(-widest // (2 * WS_XPAD)) * 2 * WS_XPAD + WS_XPAD
    return WsLaunch(bytes(tables), len(units), used, xrow, m)


def ws_steps(phases: Sequence[Phase | None], shadow: int, words: int, max_m: int,
             max_shared: int, extent: Extent = None) -> list:
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
        launch = ws_plan(units, shadow, words, extent)
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
        best = None
        for j in range(end, i, -1):
            planned = plan(items[i:j])
            if planned is not None:
                best = (planned, j)
                break
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

    kinds, limit = WS_KERNEL_KINDS, 2 * WS_MAX_UNITS

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
        # [epoch, finished blocks, a count per unit], zeroed
        self.sync = backend.allocate(4 * (2 + WS_MAX_UNITS))
        self.shadow = backend.allocate(4 * WS_SHADOW_WORDS)  # zeroed: no word carries a tag
        self._table = ctypes.create_string_buffer(WS_UNIT.size * WS_MAX_UNITS)
        self._ints = [ctypes.c_int32(0) for _ in range(4)]  # count, words, xrow, stages
        self._pointers = [ctypes.c_uint64(self.sync.ptr), ctypes.c_uint64(self.shadow.ptr)]
        count, words, xrow, stages = self._ints
        self._params = (ctypes.c_void_p * 7)(*(ctypes.addressof(v) for v in (
            self._table, count, self._pointers[0], self._pointers[1], words, xrow, stages)))
        self.configs = {False: gemv.launch_config(False), True: gemv.launch_config(True)}

    def steps(self, phases: Sequence[Phase | None]) -> list:
        return ws_steps(phases, self.shadow.ptr, WS_SHADOW_WORDS, self.max_m, self.max_shared,
                        self.extent)

    def extent(self, pointer: int) -> tuple[int, int] | None:
        """The backend allocation `pointer` lies in: (start, bytes)."""
        for a in self.backend._allocations:
            if a.ptr <= pointer < a.ptr + max(a.nbytes, 1):
                return a.ptr, max(a.nbytes, 1)
        return None

    def launch(self, launch: WsLaunch, stages: int) -> None:
        """One launch on the backend's stream (parameters copied at the launch, as above)."""
        ctypes.memmove(self._table, launch.table, len(launch.table))
        for value, v in zip(self._ints, (launch.count, launch.words, launch.xrow, stages)):
            value.value = v
        issue(self, WS_THREADS, launch.shared(stages), "persist_ws")


def issue(kernel: PersistentKernel | WsKernel, threads: int, shared: int, what: str) -> None:
    """A launch of a persistent kernel's function over its parameters (set by the caller) on
    its backend's stream, overlapping the kernel before it inside a capture (PDL)."""
    backend = kernel.backend
    overlap = backend.pdl and backend.capturing and backend.after_kernel
    config = kernel.configs[overlap]
    config.gridDimX, config.blockDimX = kernel.grid, threads
    config.sharedMemBytes = shared
    config.hStream = backend._launch_stream
    kernel._check(cu.cuLaunchKernelEx(config, kernel.function, ctypes.addressof(kernel._params),
                                      0), f"cuLaunchKernelEx({what})")
    backend.overlapped += overlap
    backend.after_kernel = True
    backend.launches += 1
    backend.persisted += 1
