"""The decode attention's split and combine launches as one (kernels/attention.cu
`attn_decode_joined[_tc]_bf16`), on the cuda backend.

Flash-decoding takes two launches a layer: the split kernel writes each split's softmax
partials, and the combine kernel, once every split block has finished, merges them into the
attention's rows. The joined kernel runs the split kernel's blocks unchanged; the last block of
each (sequence, kv head) to finish, counted in `counts`, merges that kv head's q heads as the
combine kernel does, with the same operations in the same order, so the rows carry the same
bits (tests/test_attention_cuda.py compares them). That takes away one launch from each layer of
a decode step, and with it one wait for a grid to drain.

How a pair forms. At load, `pairs` finds each program's consecutive sites that are a split
launch (`attn_decode_split_bf16` or `attn_decode_split_tc_bf16`) followed by
`attn_decode_combine_bf16`, both from the library's attention cubin and neither gated by `when`.
The split's site records its launch and the combine's issues the joined one, provided the two
launches agree at their values (`Pair.fits`): the same partials buffer, lengths, sequence count,
head counts, head dim and split count, grids that cover the sequences and heads exactly, and at
most COUNTS counters. Where they do not, both go out as prepared, in order. No other launch
reaches the stream between the two sites, since they are consecutive launches of one program.
With the pipelined split on too (runtime/backends/attention_pipe.py, KERNCC_PIPE_ATTENTION),
the pairs are formed over its launchers: a pair that goes out joined runs the joined kernel, and
a split that does not goes out as the pipe prepared it (pipelined where it fits).

The counters are one small allocation per backend, zero between launches (the kernel's last
block sets its counter back); every launch that uses them goes on that backend's one stream,
so no two joined launches run at once over them. On with `KERNCC_JOIN_ATTENTION=1`, or
`CudaBackend.join_attention = True` before a Session loads (the GPU tests compare the two);
off by default: on an H200 it measured 0.8-3.9 us a layer slower than the two launches, the
merge behind the last block's counter costing more than the combine launch whose start PDL
already overlaps (docs/benchmarks.md, session 12).
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kerncc import config
from kerncc.kernels import library
from kerncc.runtime.launch import Site

Launcher = Callable[[tuple[int, int, int], int, Sequence[int]], None]

JOINED = {"attn_decode_split_bf16": "attn_decode_joined_bf16",
          "attn_decode_split_tc_bf16": "attn_decode_joined_tc_bf16"}
COMBINE = "attn_decode_combine_bf16"
MODULE = "attention"
SPLIT_BLOCK = (256, 1, 1)  # DC_WARPS * 32
COMBINE_BLOCK = (128, 1, 1)  # DC_MAX_HD
GROUPS = (1, 2, 4, 8)  # q heads a kv head, as the kernels take them
ENABLED = config.join_attention()  # KERNCC_JOIN_ATTENTION; a backend reads it as it is made
COUNTS = 1 << 14  # counters a backend holds: sequences * kv heads of one launch
# the joined kernel's parameters: the split's 12 (5 pointers, 6 i32, the f32 scale), out, counts
_FORMATS = "QQQQQiiiiiifQQ"
_SLOTS = tuple(8 * i for i in range(len(_FORMATS)))


def pairs(sites: Sequence[Site], module: str) -> list[tuple[Site, Site]]:
    """A program's (split, combine) sites that may go out as one launch; `module` is the sha256
    of the library's attention cubin."""
    found = []
    for split, combine in zip(sites, sites[1:]):
        if (split.kind == combine.kind == "kernel" and split.entry in JOINED
                and combine.entry == COMBINE and split.module == combine.module == module
                and split.when is None and combine.when is None
                and split.block == SPLIT_BLOCK and combine.block == COMBINE_BLOCK):
            found.append((split, combine))
    return found


def fits(split_grid: tuple[int, int, int], split_args: Sequence[Any],
         combine_grid: tuple[int, int, int], combine_args: Sequence[Any]) -> bool:
    """Whether the two launches, at these values, are one joined launch's work."""
    _, _, _, lens, part, seqs, nq, nk, hd, _, splits, _ = split_args
    c_part, c_lens, _, c_seqs, c_nq, c_hd, c_splits = combine_args
    seqs, nq, nk = int(seqs), int(nq), int(nk)
    return (int(part) == int(c_part) and int(lens) == int(c_lens)
            and (seqs, nq, int(hd), int(splits)) == (int(c_seqs), int(c_nq), int(c_hd),
                                                     int(c_splits))
            and nk > 0 and nq % nk == 0 and nq // nk in GROUPS
            and split_grid[:2] == (seqs, nk) and split_grid[2] > 0
            and combine_grid == (seqs, nq, 1) and 0 < seqs * nk <= COUNTS)


class Pair:
    """One (split, combine) pair's launchers: the split's records, the combine's issues."""

    def __init__(self, backend: Any, function: Any, counts: int, sites: tuple[Site, Site],
                 launchers: tuple[Launcher, Launcher]) -> None:
        self.backend, self.function, self.counts = backend, function, counts
        self.sites, self.launchers = sites, launchers
        self.pending: tuple[tuple[int, int, int], int, tuple[int, ...]] | None = None
        self.storage = ctypes.create_string_buffer(8 * len(_FORMATS))
        base = ctypes.addressof(self.storage)
        self.table = (ctypes.c_void_p * len(_FORMATS))(*[base + at for at in _SLOTS])
        self.joined = 0  # launches that went out joined (the tests read it)

    def record(self, grid: tuple[int, int, int], shared: int, scalars: Sequence[int]) -> None:
        self.pending = (grid, shared, tuple(scalars))

    def issue(self, grid: tuple[int, int, int], shared: int, scalars: Sequence[int]) -> None:
        pending, self.pending = self.pending, None
        if pending is None:
            raise RuntimeError("the decode attention's combine launch came without its split")
        split_grid, split_shared, split_scalars = pending
        split_site, combine_site = self.sites
        split_args = split_site.bind(split_scalars)
        combine_args = combine_site.bind(scalars)
        if not fits(split_grid, split_args, grid, combine_args):
            self.launchers[0](split_grid, split_shared, split_scalars)
            self.launchers[1](grid, shared, scalars)
            return
        values = [*split_args, combine_args[2], self.counts]
        for at, fmt, value in zip(_SLOTS, _FORMATS, values):
            struct.pack_into("<" + fmt, self.storage, at,
                             float(value) if fmt == "f" else int(value))
        self.backend.launch_joined(self.function, split_grid, SPLIT_BLOCK, split_shared,
                                   ctypes.addressof(self.table))
        self.joined += 1


def join(backend: Any, function_of: Callable[[str, str], Any], counts: Callable[[], int],
         programs: Mapping[str, Sequence[Site]],
         launchers: dict[int, Launcher]) -> dict[int, Launcher]:
    """The launchers with every pair's split recording and its combine issuing the joined
    launch; `function_of(entry, module)` gives a kernel, `counts()` the backend's counters."""
    module = library.index()[MODULE]["sha256"]
    found = [pair for sites in programs.values() for pair in pairs(sites, module)]
    joined = dict(launchers)
    for split, combine in found:
        pair = Pair(backend, function_of(JOINED[split.entry], module), counts(),
                    (split, combine), (launchers[split.number], launchers[combine.number]))
        joined[split.number], joined[combine.number] = pair.record, pair.issue
    return joined
