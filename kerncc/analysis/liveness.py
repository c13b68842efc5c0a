"""Liveness of buffers in each program (one reverse scan, torch.fx style), and cut crossings.

Per program and call: live-in and live-out buffer sets, with kern's kill rule (spec §3.3: only
an `out` access at offset 0 kills). Per buffer: its [first write, last read] interval. At every
call index a: the buffers that would cross a cut there (kern's definition: live into
calls[a:] and written by calls[:a]) with their bytes at var max. Peak live bytes counts the
workspaces live at one call (what an arena must hold at once).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import attrs

from kerncc import manifest as m
from kerncc.analysis.access import CallAccess, program_access
from kerncc.analysis.cache import per_manifest


@attrs.frozen
class LiveRange:
    """A buffer's life in one program: first call writing it, last call reading it (or None)."""

    buffer: str
    first_write: int | None
    last_read: int | None


@attrs.frozen
class ProgramLiveness:
    program: str
    live_in: tuple[frozenset[str], ...]
    live_out: tuple[frozenset[str], ...]
    intervals: dict[str, LiveRange]
    crossing: tuple[frozenset[str], ...]      # crossing[a]: buffers crossing a cut before call a
    crossing_bytes: tuple[int, ...]
    peak_bytes: int
    peak_call: int | None


@attrs.frozen
class Liveness:
    programs: dict[str, ProgramLiveness]


def live_ins(accesses: Sequence[CallAccess], within: frozenset[str] | None = None
             ) -> list[frozenset[str]]:
    """live_in[i] for every call i, and live_in[n] = {} (after the last call), by one scan back.

    `within`: only those buffers (each buffer's liveness is its own, so this is every set
    intersected with `within`, without building the whole sets first).
    """
    live: set[str] = set()
    out = [frozenset(live)]
    for acc in reversed(accesses):
        live -= acc.buffer_kills
        live |= acc.buffer_reads if within is None else acc.buffer_reads & within
        out.append(frozenset(live))
    out.reverse()
    return out


def written_before(accesses: Sequence[CallAccess]) -> list[frozenset[str]]:
    """written[a] = buffers written by calls[:a], for a in 0..n."""
    seen: set[str] = set()
    out = [frozenset()]
    for acc in accesses:
        seen |= acc.buffer_writes
        out.append(frozenset(seen))
    return out


@per_manifest
def analyze_program(man: m.Manifest, name: str) -> ProgramLiveness:
    program = man.programs[name]
    accesses = program_access(man, program)
    ins = live_ins(accesses)
    written = written_before(accesses)
    cross = [ins[a] & written[a] for a in range(len(accesses) + 1)]
    sizes = buffer_sizes(man)
    peak, peak_call = _peak(man, accesses, ins, sizes)
    return ProgramLiveness(
        program=name,
        live_in=tuple(ins[:-1]),
        live_out=tuple(ins[1:]),
        intervals=_intervals(accesses),
        crossing=tuple(cross),
        crossing_bytes=tuple(sum(sizes.get(b, 0) for b in c) for c in cross),
        peak_bytes=peak,
        peak_call=peak_call,
    )


def analyze(man: m.Manifest) -> Liveness:
    return Liveness({name: analyze_program(man, name) for name in sorted(man.programs)})


@per_manifest
def buffer_sizes(man: m.Manifest) -> Mapping[str, int]:
    """Each buffer's bytes at var max (those with a computable shape); read-only, cached."""
    env = man.vars_max()
    return MappingProxyType({name: b.nbytes(env) for name, b in man.buffers.items()
                             if all(isinstance(d, int) or d in env for d in b.shape)})


def _intervals(accesses: Sequence[CallAccess]) -> dict[str, LiveRange]:
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, acc in enumerate(accesses):
        for b in acc.buffer_writes:
            first.setdefault(b, i)
        for b in acc.buffer_reads:
            last[b] = i
    names = sorted(set(first) | set(last))
    return {b: LiveRange(b, first.get(b), last.get(b)) for b in names}


def _peak(man: m.Manifest, accesses: Sequence[CallAccess], ins: list[frozenset[str]],
          sizes: Mapping[str, int]) -> tuple[int, int | None]:
    """Largest workspace bytes live at one call: what it reads or keeps, plus what it writes."""
    best, where = 0, None
    workspaces = {b: sizes.get(b, 0) for b, buf in man.buffers.items() if buf.kind == "workspace"}
    names = frozenset(workspaces)
    for i, acc in enumerate(accesses):
        # Intersect first: a live set holds every weight read later (hundreds of names), the
        # workspaces are a few, and `&` walks the smaller side.
        live = (names & ins[i]) | (names & ins[i + 1]) | (names & acc.buffer_writes)
        total = sum(map(workspaces.__getitem__, live))
        if total > best:
            best, where = total, i
    return best, where
