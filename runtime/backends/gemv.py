"""Decode-shaped GEMM externs on the GPU: kerncc's own GEMV kernels (kernels/gemv.cu) for m <= 8.

When A has a handful of rows (the decode step's GEMMs) a GEMM is a stream over W, and at the
example model's smaller shapes (n = 2048: 128 tiles for 132 multiprocessors) cuBLAS's kernels
reach 1.1-2.1 TB/s of the H200's 4.2 (docs/benchmarks.md). The cuda backend hands such
launches of the three GEMM externs to `gemv_bf16_tn_mb1[_w16]` instead: the same function
(kernels/reference.py's `cublaslt_bf16_tn`, `..._acc`, `cublas_bf16_tn_f32`: f32 accumulation,
one rounding), summed in a fixed order, so results are reproducible bit for bit and whole =
stages holds as it does with cuBLAS. Which path a launch
takes depends only on its shape (m, n, k) and its pointers' alignment, never on timing.

`MAX_M` (`KERNCC_GEMV_MAX_M`, default 8, the most they take; 0 turns the kernels off) is the
largest m the batch-shaped path gives them: measured on an H200 (docs/benchmarks.md), at m <= 8
they beat cuBLAS inside the decode graph (1.45 against 1.57 ms a step).
The backend says per launch whether it may overlap the kernel before (programmatic dependent
launch, runtime/backends/cuda.py); the GEMV waits (`griddepcontrol.wait`) before it loads W, A
or C either way.

Batch invariance (the default; `KERNCC_INVARIANT=0` restores the shape-picked path for the
benches' A/B): a GEMM site whose m can never exceed `DECODE_MAX_M` (the decode programs', and
the prefill's lm_head over one row a sequence) with n under `LT_MIN_N` and k under `LT_MIN_K`
takes these kernels at every m, cuBLAS never (a wider or deeper one takes the pinned
split-free cuBLASLt algorithms at every m, as prefill sites do: runtime/backends/cuda.py
`_invariant_extern`):
`invariant_entry` picks the warps from n alone (16 where W has at most WIDE_MAX_TILES tiles,
else 8), and for a given warp count every entry gives a row of C the same bits whatever
m, MB, T or the unroll (kernels/gemv.cu), so a sequence's logits do not depend on how many
others share its decode step. Past 8 rows an entry takes two or three W tiles a block (each
block then streams A once for more of W: `python -m bench.gemv`), and m above a block's rows
takes more blocks a tile (row groups), each computing its rows as a launch of its own would.
Past 32 rows on the eight-warp shapes (and past 16 from SMEM_N) the `_smem` entries stage A
and W through shared memory (dynamic, `SHARED`), reading A once for four W tiles with the
eight-warp bits.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any

import numpy as np

try:  # the launch policy below (usable, entry_for) needs no driver
    from cuda.bindings import driver as cu
except ImportError:  # pragma: no cover - exercised only without the `cuda` extra
    cu = None

from kerncc import config
from kerncc.kernels import library

MAX_M = config.gemv_max_m()
# Per shape, chosen at launch from (m, n) alone (measured on an H200 inside the decode graph,
# docs/benchmarks.md): launches with n >= CUBLAS_MIN_N go to cuBLAS (a 32000-row lm_head: cuBLAS
# streams it at 3.7 TB/s, these kernels at 3.2); m <= 8 takes WIDE_ENTRY (16 warps: twice the
# bytes in flight) when W has at most WIDE_MAX_TILES 16-row tiles (n <= 2048: 128 blocks, fewer
# than the multiprocessors), else NARROW_ENTRY (8 warps).
CUBLAS_MIN_N = 16384
WIDE_MAX_TILES = 128
WIDE_N = 6144  # from here three W tiles a block of 32 A rows fill the SMs well enough
WIDE_ENTRY = "gemv_bf16_tn_mb1_w16"
NARROW_ENTRY = "gemv_bf16_tn_mb1"
# entry: (threads, MB: 8-row blocks of A a block, T: 16-row tiles of W a block)
ENTRIES = {"gemv_bf16_tn_mb1": (256, 1, 1), "gemv_bf16_tn_mb2_t2": (256, 2, 2),
           "gemv_bf16_tn_mb4_t2": (256, 4, 2), "gemv_bf16_tn_mb4_t3": (256, 4, 3),
           "gemv_bf16_tn_mb1_w16": (512, 1, 1), "gemv_bf16_tn_mb2_w16_t2": (512, 2, 2),
           "gemv_bf16_tn_mb3_w16_t2": (512, 3, 2), "gemv_bf16_tn_mb4_w16_t2": (512, 4, 2),
           "gemv_bf16_tn_mb8_t4_smem": (256, 8, 4), "gemv_bf16_tn_mb4_t4_smem": (256, 4, 4),
           "gemv_bf16_tn_seq": (128, 1, 1)}
# The pinned cuBLASLt algorithms' bits (kernels/gemv.cu gemv_seq_tile: one chain of tensor-core
# products over k a row, as theirs): a site on the pinned algorithms runs its launches of at
# most SEQ_MAX_M rows here, where a launch overlaps its neighbours (programmatic dependent
# launch) and a cuBLASLt one does not. At one row the entry streams W about as fast as the
# pinned algorithms (the small gate_up 20.5 us against 20.9, lm_head 47.2 / 47.2; 8B lm_head
# 403 / 412); from 8 rows it reads A once a 16-row W tile and loses (`python -m bench.gemv`,
# an H100).
SEQ_ENTRY = "gemv_bf16_tn_seq"
SEQ_MAX_M = 1
SEQ_SLOT_BYTES = (16 + 8) * 272  # the tile's 16 rows of W and 8 of A, 128 k padded to 272 B
# Dynamic shared memory of the entries that stage A and W through it (kernels/gemv.cu
# gemv_smem_tile: warps * 3 slots * (8 MB + 16 T) rows * 64 bytes; a launch with less traps).
SHARED = {"gemv_bf16_tn_mb8_t4_smem": 8 * 3 * (64 + 64) * 64,
          "gemv_bf16_tn_mb4_t4_smem": 8 * 3 * (32 + 64) * 64,
          SEQ_ENTRY: 8 * SEQ_SLOT_BYTES}  # gemv_seq_tile: 8 slots
# From here (the 8B gate_up, every lm_head) the shared-memory entries win past 16 rows; below
# (qkv, o, down, the small gate_up), past 32 (`python -m bench.gemv --every`, an H100).
SMEM_N = 16384
# Past 64 rows (two row groups of the 64-row entry, n / 64 blocks each) the 64-row shared-memory
# entry takes the narrower 8-warp shapes up to here: 128 blocks, one wave of an H100's or
# H200's 132 multiprocessors, where the 32-row entry takes two; at 96 and 128 rows it took
# 0.83x the time (the small qkv 15.4 / 15.6 against 18.0 / 18.8 us, the 8B o 25.7 / 26.0
# against 30.0 / 31.2), and 1.04-1.1x at n = 6144 (`python -m bench.gemv --every`, an H100).
ONE_WAVE_N = 4096
INVARIANT = config.invariant()
# The most rows a site may launch with and still be served by these kernels when invariant:
# above it (prefill chunks) the pinned cuBLASLt algorithms of runtime/backends/cublas.py.
DECODE_MAX_M = 64
# From this many outputs a decode site takes the pinned split-free cuBLASLt algorithms too, at
# every m: on the wide shapes (a gate_up, an lm_head) they stream W about as fast as cuBLAS
# at any m, where these kernels fall to 1.2-1.8x cuBLAS past 32 rows (`python -m bench.gemv`,
# an H200), and their rows are the prefill chunks' bits (every split-free algorithm of a shape
# sums a row in one order: tests/test_determinism_cuda.py).
LT_MIN_N = 12288
# From this depth too (the 8B down_proj, 4096 x 12288): past 32 rows these kernels stream it at
# 1.0-1.15x cuBLAS, the pinned split-free algorithms at 0.93-0.94x at every m (`python -m
# bench.gemv`, an H100), and the 8B decode step's tax at 64 sequences falls from 10.3% to 4.3%
# (docs/design-notes.md).
LT_MIN_K = 12288
MODULE = "gemv"
ROWS_PER_BLOCK = 16
MODES = {"cublaslt_bf16_tn": 0, "cublaslt_bf16_tn_acc": 1, "cublas_bf16_tn_f32": 2}
_SLOTS = (0, 8, 16, 24, 32, 40, 48)  # a, w, c, m, n, k, mode: a 8-byte slot each


def takes_lt(n: int, k: int) -> bool:
    """Whether a decode site of n outputs over k takes the pinned split-free cuBLASLt
    algorithms at every m instead of these kernels (a property of the shape alone)."""
    return n >= LT_MIN_N or k >= LT_MIN_K


def usable(m: int, n: int, k: int, a: int, w: int, c: int) -> bool:
    """Whether the GEMV kernels take this launch (else cuBLAS does)."""
    return (0 < m <= min(MAX_M, 8) and 0 < n < CUBLAS_MIN_N and k > 0 and k % 8 == 0
            and not (a | w | c) & 15)


def invariant_usable(n: int, k: int, a: int, w: int, c: int) -> bool:
    """Whether the kernels take a batch-invariant site's launches (a property of the site:
    its shape and pointers, never of m)."""
    return n > 0 and k > 0 and k % 8 == 0 and not (a | w | c) & 15


def invariant_entry(m: int, n: int) -> str:
    """The kernel of a batch-invariant launch: the warp count from n alone (what fixes a row's
    bits), the blocks' shape from m and n (which does not): the fastest of each warp count's
    entries at the models' shapes, measured at m = 1 to 64 on an H100 (`python -m bench.gemv
    --every`; docs/design-notes.md)."""
    if -(-n // ROWS_PER_BLOCK) <= WIDE_MAX_TILES:  # 16 warps
        if m <= 8:
            return WIDE_ENTRY
        if m > 32:
            return "gemv_bf16_tn_mb4_w16_t2"
        return "gemv_bf16_tn_mb3_w16_t2" if m > 16 and m <= 24 else "gemv_bf16_tn_mb2_w16_t2"
    if m <= 8:
        return NARROW_ENTRY
    if m <= 16:
        return "gemv_bf16_tn_mb2_t2"
    if n >= SMEM_N:  # A staged in shared memory, read once a block for four W tiles
        return "gemv_bf16_tn_mb8_t4_smem" if m > 32 else "gemv_bf16_tn_mb4_t4_smem"
    if m > 32:  # past 64 rows, the 64-row entry where its two row groups fit one wave
        return ("gemv_bf16_tn_mb8_t4_smem" if m > 64 and n <= ONE_WAVE_N
                else "gemv_bf16_tn_mb4_t4_smem")
    return "gemv_bf16_tn_mb4_t3" if n >= WIDE_N else "gemv_bf16_tn_mb4_t2"


def grid_for(entry: str, m: int, n: int) -> int:
    """Blocks of a launch: W's tiles of T rows times A's groups of 8 * MB rows."""
    _, mb, t = ENTRIES[entry]
    return -(-n // (ROWS_PER_BLOCK * t)) * -(-m // (8 * mb))


def entry_for(m: int, n: int) -> str:
    """The kernel a launch of m rows over n outputs takes (it must be `usable`)."""
    tiles = -(-n // ROWS_PER_BLOCK)
    return WIDE_ENTRY if tiles <= WIDE_MAX_TILES else NARROW_ENTRY


class Gemv:
    """The GEMV module of one device: its functions, loaded once."""

    def __init__(self, check: Any) -> None:
        self._check = check
        image = np.frombuffer(library.cubin_path(MODULE).read_bytes(), dtype=np.uint8)
        self.module = check(cu.cuModuleLoadData(image.ctypes.data), "cuModuleLoadData(gemv)")
        self.functions = {name: check(cu.cuModuleGetFunction(self.module, name.encode()),
                                      f"cuModuleGetFunction({name})")
                          for name in ENTRIES}
        limit = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        for name, nbytes in SHARED.items():  # past the 48 KB a launch gets unasked
            check(cu.cuFuncSetAttribute(self.functions[name], limit, nbytes),
                  f"cuFuncSetAttribute({name})")

    def site(self, extern: str, invariant: bool = False) -> GemvSite:
        return GemvSite(self, MODES[extern], invariant)


class GemvSite:
    """One extern launch site's parameter block, rewritten per launch (m may change)."""

    def __init__(self, gemv: Gemv, mode: int, invariant: bool = False) -> None:
        self.gemv, self.mode, self.invariant = gemv, mode, invariant
        self.storage = ctypes.create_string_buffer(56)
        base = ctypes.addressof(self.storage)
        self.table = (ctypes.c_void_p * 7)(*[base + at for at in _SLOTS])
        self.configs = {False: launch_config(False), True: launch_config(True)}

    def __call__(self, a: int, w: int, c: int, m: int, n: int, k: int, stream: Any,
                 overlap: bool = False) -> None:
        """Launch on `stream`; `overlap`: with programmatic stream serialization."""
        entry = invariant_entry(m, n) if self.invariant else entry_for(m, n)
        self.launch(entry, a, w, c, m, n, k, stream, overlap)

    def launch(self, entry: str, a: int, w: int, c: int, m: int, n: int, k: int, stream: Any,
               overlap: bool = False) -> None:
        """Launch kernel `entry` (any of ENTRIES; tests and benches force one this way)."""
        base = self.storage
        for at, fmt, value in zip(_SLOTS, "QQQiiii", (a, w, c, m, n, k, self.mode)):
            struct.pack_into("<" + fmt, base, at, value)
        config = self.configs[overlap]
        config.gridDimX = grid_for(entry, m, n)
        config.blockDimX = ENTRIES[entry][0]
        config.sharedMemBytes = SHARED.get(entry, 0)
        config.hStream = stream
        fn = self.gemv.functions[entry]
        self.gemv._check(cu.cuLaunchKernelEx(config, fn, ctypes.addressof(self.table), 0),
                         "cuLaunchKernelEx(gemv)")


def launch_config(overlap: bool) -> Any:
    """A CUlaunchConfig for `cuLaunchKernelEx` (grid, block and stream set per launch);
    `overlap`: with programmatic stream serialization (the kernel may start while the one
    before it drains; it must wait for it with `griddepcontrol.wait`)."""
    config = cu.CUlaunchConfig()
    config.blockDimY = config.blockDimZ = 1
    config.gridDimY = config.gridDimZ = 1
    config.sharedMemBytes = 0
    if overlap:
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        config.attrs = [attr]
    config.numAttrs = 1 if overlap else 0
    return config
