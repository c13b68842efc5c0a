"""The batched decode's split attention pipelined across each block's splits (kernels/attention.cu
`attn_decode_split_pipe_tc_bf16`), on the cuda backend: the same ABI, grid meaning and partials
bit for bit as `attn_decode_split_tc_bf16`, but each warp brings the K and V tiles of its
block's next splits into shared memory while it computes the current one (docs/runtime.md,
"The batched decode attention pipelined", says why and what it measured).

Which launches. At load, `sites` finds every launch of `attn_decode_split_tc_bf16` from the
library's attention cubin with a block of 256 (gated or not: each goes out alone). At each
launch it goes out pipelined when `fits`: its grid z is smaller than max_splits (a block loops
over splits: the batched `decode_batch`; the `decode` program's block per split keeps the split
kernel, which has nothing to overlap there), the head dim is one the kernel takes (32, 64, 96,
128) and nq / nk is 1, 2, 4 or 8; else as prepared. The pipelined launch keeps the split's
arguments and grid x, y, takes `blocks` (the Z rule) for grid z and `shared_bytes(hd, G)` of
dynamic shared memory, whose limit the backend raises once at load. Below `columns` (sequences
x kv heads under the multiprocessor count) it keeps the split kernel, measured faster there;
`CudaBackend.pipe_columns` lowers that threshold (the GPU tests do, for their small models).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kerncc import config
from kerncc.kernels import library
from kerncc.runtime.launch import Site, VarScalar

Launcher = Callable[[tuple[int, int, int], int, Sequence[int]], None]

ENTRY = "attn_decode_split_pipe_tc_bf16"
SPLIT = "attn_decode_split_tc_bf16"
MODULE = "attention"
BLOCK = (256, 1, 1)  # DC_WARPS * 32
HEAD_DIMS = (32, 64, 96, 128)  # the tensor-core kernels': hd % 32 == 0, hd <= 128
GROUPS = (1, 2, 4, 8)  # q heads a kv head
ENABLED = config.pipe_attention()  # KERNCC_PIPE_ATTENTION; a backend reads it as it is made
# the split's arguments the launch decision reads: nq, nk, hd, max_splits
NQ, NK, HD, SPLITS = 6, 7, 8, 10

# kernels/attention.cu's layout constants (DC_WARPS, DP_*): a test reads them from the source
WARPS = 8
MAX_SLOTS = 6  # DP_MAX_SLOTS: three splits of K and V tiles
SM_SHARED = 233472  # DP_SM_SHARED: an sm_90 multiprocessor's shared memory (228 KiB)
BLOCK_RESERVED = 1024  # DP_BLOCK_RESERVED: the driver's reserve per block
BLOCK_SHARED_MAX = 232448  # DP_BLOCK_SHARED_MAX: the most one block may take (227 KiB)


def fixed_bytes(hd: int, g: int) -> int:
    """dp_fixed_bytes: the partials of the 8 warps (f32), the G q rows (bf16), their stats."""
    return WARPS * g * hd * 4 + g * hd * 2 + WARPS * g * 2 * 4


def slot_bytes(hd: int) -> int:
    """dp_slot_bytes: one slot of every warp's ring, a 16-key K or V tile of hd bf16 each."""
    return WARPS * 16 * hd * 2


def slots(hd: int, g: int) -> int:
    """dp_slots: the ring's slots a warp, the most (up to MAX_SLOTS) with which two blocks fit a
    multiprocessor, or where that leaves fewer than 3 the most one block may take."""
    two = (SM_SHARED // 2 - BLOCK_RESERVED - fixed_bytes(hd, g)) // slot_bytes(hd)
    one = (BLOCK_SHARED_MAX - fixed_bytes(hd, g)) // slot_bytes(hd)
    return min(two if two >= 3 else one, MAX_SLOTS)


@functools.cache
def shared_bytes(hd: int, g: int) -> int:
    """dp_smem_bytes: the dynamic shared memory a launch at head dim `hd` and G = nq / nk needs
    (the kernel traps with less)."""
    return slots(hd, g) * slot_bytes(hd) + fixed_bytes(hd, g)


MAX_SHARED = max(shared_bytes(hd, g) for hd in HEAD_DIMS for g in GROUPS)


def resident(hd: int, g: int) -> int:
    """Blocks of the pipelined kernel a multiprocessor holds at once at head dim `hd` and G:
    two where two launches' shared memory and the driver's reserve fit it, else one (its
    256-thread block at 128 registers allows two)."""
    return 2 if 2 * (shared_bytes(hd, g) + BLOCK_RESERVED) <= SM_SHARED else 1


def blocks(grid: tuple[int, int, int], sms: int, per_sm: int = 2) -> int:
    """The pipelined launch's grid z (Z: blocks a (sequence, kv head)) for a split launch of
    `grid` on a GPU of `sms` multiprocessors holding `per_sm` blocks each: as many blocks a
    (sequence, kv head) as one wave of the machine has room for, floor(sms * per_sm / (x *
    y)), at least 1 and never more than the launch's own z. Measured on an H200 at 8 kv heads
    of 128 (commit 2e4b997: kernel alone, us): 32 x 512 keys Z = 1 22.3
    against the split kernel's 25.8; 8 x 512 Z = 4 15.7, Z = 8 15.4 against 17.3, while Z = 3
    (uneven: a block of two splits, the rest one) took 17.5; 8 x 2048 Z = 4 22.1 against 24.8.
    The partials do not depend on Z, so this decides only speed."""
    x, y, z = grid
    return max(1, min(z, sms * per_sm // (x * y)))


def sites(program: Sequence[Site], module: str) -> list[Site]:
    """A program's launches that may go out pipelined: `attn_decode_split_tc_bf16` of the
    library's attention cubin (sha256 `module`) with a block of 256."""
    return [site for site in program
            if site.kind == "kernel" and site.entry == SPLIT and site.module == module
            and site.block == BLOCK]


def fixed_values(site: Site) -> tuple[int, int, int, int] | None:
    """The site's nq, nk, hd and max_splits when the plan fixes them (the example's), else None
    (then read at each launch)."""
    needed = [site.args[i] for i in (NQ, NK, HD, SPLITS)]
    if any(isinstance(a, VarScalar) for a in needed):
        return None
    nq, nk, hd, max_splits = (int(a) for a in needed)
    return nq, nk, hd, max_splits


def head_shape_fits(nq: int, nk: int, hd: int) -> bool:
    return hd in HEAD_DIMS and nk > 0 and nq % nk == 0 and nq // nk in GROUPS


def fits(grid: tuple[int, int, int], nq: int, nk: int, hd: int, max_splits: int,
         columns: int) -> bool:
    """Whether a split launch at these values goes out pipelined: blocks that loop over splits
    (grid z below max_splits) at a head dim and head group the kernel takes, with at least
    `columns` (sequence, kv head) columns (the backend's `pipe_columns`, by default the GPU's
    multiprocessor count). Below that the pipelined
    kernel alone is still faster (8 x 512 keys: 10.2 against 12.2 us) but the decode step is
    slower (8 sequences: 1.359 against 1.333 ms, twice: commit 2e4b997); at 32
    sequences (256 columns) the step gains 3.0 us a layer."""
    return (0 < grid[2] < max_splits and grid[0] * grid[1] >= columns
            and head_shape_fits(nq, nk, hd))


class Piped:
    """One split site's launcher: the pipelined launch where it fits, else the one prepared."""

    def __init__(self, backend: Any, site: Site, plain: Launcher, piped: Launcher, sms: int,
                 columns: int, fixed: tuple[int, int, int, int] | None) -> None:
        self.backend, self.site, self.plain, self.piped = backend, site, plain, piped
        self.sms, self.columns, self.fixed = sms, columns, fixed

    def values(self, scalars: Sequence[int]) -> tuple[int, int, int, int]:
        if self.fixed is not None:
            return self.fixed
        args = self.site.bind(scalars)
        nq, nk, hd, max_splits = (int(args[i]) for i in (NQ, NK, HD, SPLITS))
        return nq, nk, hd, max_splits

    def __call__(self, grid: tuple[int, int, int], shared: int, scalars: Sequence[int]) -> None:
        nq, nk, hd, max_splits = self.values(scalars)
        if not fits(grid, nq, nk, hd, max_splits, self.columns):
            self.plain(grid, shared, scalars)
            return
        self.piped((grid[0], grid[1], blocks(grid, self.sms, resident(hd, nq // nk))),
                   shared_bytes(hd, nq // nk),
                   scalars)
        self.backend.piped += 1


def pipe(backend: Any, prepare: Callable[[Site, int], Launcher], sms: int,
         programs: Mapping[str, Sequence[Site]],
         launchers: dict[int, Launcher], columns: int | None = None) -> dict[int, Launcher]:
    """The launchers with every split site's going out pipelined where it fits (`fits`, with
    `columns` or else `sms` as the fewest columns);
    `prepare(site, shared)` gives a launcher of the pipelined kernel over the site's arguments
    whose dynamic shared memory limit is raised to `shared` bytes; `backend.piped` counts the
    pipelined launches. A site whose fixed head shape the kernel does not take stays as it was."""
    module = library.index()[MODULE]["sha256"]
    piped = dict(launchers)
    for program in programs.values():
        for site in sites(program, module):
            fixed = fixed_values(site)
            if fixed is None:
                shared = MAX_SHARED
            elif head_shape_fits(*fixed[:3]):
                nq, nk, hd, _ = fixed
                shared = shared_bytes(hd, nq // nk)
            else:
                continue
            piped[site.number] = Piped(backend, site, launchers[site.number],
                                       prepare(site, shared), sms,
                                       sms if columns is None else columns, fixed)
    return piped
