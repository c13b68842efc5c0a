"""The list-scan formulations the dataflow-graph queries replaced, kept as test oracles.

These are the passes' implementations before the graph became the IR (cut.py's crossing sets
from liveness and its region check, slicing.py's reverse walk): one scan over call accesses
each. They had no partial-write defect: a scan kills a buffer only at an `out` at offset 0 and
never kills a state region, which is what the graph's partial-write edge now says. The
property test (test_graph_queries.py) holds the graph queries equal to them.
"""

from __future__ import annotations

from kerncc import manifest as m
from kerncc.analysis.access import Region, call_access, program_access
from kerncc.analysis.dataflow import execution_order
from kerncc.analysis.liveness import live_ins, written_before


def scan_crossings(whole: m.Manifest, program: str) -> list[frozenset[str]]:
    """kern's crossing set at every call index (live into calls[a:], written by calls[:a])."""
    accesses = list(program_access(whole, whole.programs[program]))
    ins, written = live_ins(accesses), written_before(accesses)
    return [ins[a] & written[a] for a in range(len(accesses) + 1)]


def scan_region_conflicts(whole: m.Manifest, points: dict[str, tuple[int, ...]]
                          ) -> list[tuple[str, str, int, int, int]]:
    """cut.py's check_regions as it was: (program, region, call, owner, stage)."""
    owner: dict[Region, int] = {}
    reported: set[Region] = set()
    found = []
    for name in sorted(points):
        accesses = program_access(whole, whole.programs[name])
        bounds = [0, *points[name], len(accesses)]
        for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            for i in range(lo, hi):
                for region in sorted(accesses[i].regions):
                    first = owner.setdefault(region, s)
                    if first != s and region not in reported:
                        reported.add(region)
                        found.append((name, region, i, first, s))
    return found


def scan_walk_back(stage: m.Manifest, which: str, buffers: set[str],
                   regions: set[Region]) -> dict[str, tuple[m.Call, ...]]:
    """slicing.py's reverse walk as it was: keep a call writing something needed, then need
    what it reads (buffers killed by an `out` at offset 0, regions never)."""
    def in_class(p: m.Program) -> bool:
        return p.once if which == "once" else p.derive

    names = [p for p in execution_order(stage) if in_class(stage.programs[p])]
    kept: dict[str, list[m.Call]] = {p: [] for p in names}
    for name in reversed(names):
        for call in reversed(stage.programs[name].calls):
            acc = call_access(call, stage.ops.get(call.op))
            if not (acc.buffer_writes & buffers or acc.region_writes & regions):
                continue
            kept[name].append(call)
            buffers -= acc.buffer_kills
            buffers |= acc.buffer_reads
            regions |= acc.region_reads
    return {p: tuple(reversed(calls)) for p, calls in kept.items()}
