"""`plan-memory`: lay each program's workspaces and op scratch into one arena per stage.

Workspaces are dead between runs (no run reads a workspace value an earlier run left), so
every program of a stage gets its own layout in one shared arena: the stage allocates the
largest. In a program, a workspace occupies its
bytes over its *live segments*: the calls that access it or between which its value is still
to be read (kern's kill rule: an `out` access at offset 0 ends the old value). A
buffer rewritten every layer is therefore free between its last read and the next overwrite,
and other buffers may use its bytes there; `whole-life=true` places each workspace for its
whole first..last access range instead. An op's scratch is live only during its call and gets
one slot per call, named `op:<op>/scratch:<name>@<call index>`; all sizes are at var max.
Placement is `kerncc.analysis.layout.arena_layout` (256-aligned); the report gives, per program, the
arena against its lower bound (the most bytes live at one call) and the naive sum.
"""

from __future__ import annotations

import math

import attrs

from kerncc import manifest as m
from kerncc.analysis.access import program_access
from kerncc.analysis.liveness import buffer_sizes, live_ins
from kerncc.bundle.plan import scratch_slot
from kerncc.ir import IR
from kerncc.analysis.layout import ArenaLayout, Interval, arena_layout
from kerncc.passes.base import Pass, register


@attrs.frozen
class ProgramArena:
    """One program's arena: what lives where (intervals) and the layout chosen."""

    program: str
    intervals: tuple[Interval, ...]
    layout: ArenaLayout

    @property
    def ratio(self) -> float:
        """Arena bytes over the lower bound (1.0 is optimal; an empty arena counts as 1.0)."""
        return self.layout.total / self.layout.lower_bound if self.layout.lower_bound else 1.0

    def to_json(self) -> dict:
        offsets = self.layout.offsets
        return {"bytes": self.layout.total, "lower_bound": self.layout.lower_bound,
                "naive": self.layout.naive,
                "offsets": {name: offsets[name] for name in sorted(offsets, key=_slot_key)}}


@attrs.frozen
class StageArena:
    """A stage's arena: one layout per program; the stage allocates the largest."""

    programs: dict[str, ProgramArena]
    # The manifest planned, so a consumer can tell whether a later pass changed the stage.
    manifest: m.Manifest | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def bytes(self) -> int:
        return max((p.layout.total for p in self.programs.values()), default=0)

    def to_json(self) -> dict:
        return {"bytes": self.bytes,
                "programs": {name: self.programs[name].to_json()
                             for name in sorted(self.programs, key=str.encode)}}


@attrs.frozen
class MemoryReport:
    """The arena of every stage (one entry before a cut)."""

    stages: tuple[StageArena, ...]

    def worst_ratio(self) -> float:
        return max((p.ratio for s in self.stages for p in s.programs.values()), default=1.0)

    def to_text(self) -> str:
        lines: list[str] = []
        for index, stage in enumerate(self.stages):
            lines.append(f"stage {index}: arena {stage.bytes} B "
                         f"(the largest of {len(stage.programs)} programs)")
            for name in sorted(stage.programs, key=str.encode):
                lines += _program_lines(stage.programs[name])
        return "\n".join(lines)


def _program_lines(arena: ProgramArena) -> list[str]:
    lay = arena.layout
    scratch = sum(1 for name in lay.offsets if name.startswith("op:"))
    head = (f"  program {arena.program}: {lay.total} B, lower bound {lay.lower_bound} B "
            f"({arena.ratio:.3f}x), naive {lay.naive} B; {len(lay.offsets) - scratch} "
            f"workspaces, {scratch} scratch slots; {lay.strategy}")
    lines = [head]
    ranges: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    for iv in arena.intervals:
        ranges.setdefault(iv.name, []).append(f"[{iv.start}, {iv.end}]")
        sizes[iv.name] = iv.bytes
    for name in sorted(lay.offsets, key=lambda n: (lay.offsets[n], _slot_key(n))):
        lines.append(f"    @{lay.offsets[name]:<10} {sizes[name]:>10} B  {name}  "
                     f"{' '.join(ranges[name])}")
    return lines


def _slot_key(name: str) -> tuple[int, bytes]:
    # Workspaces first, then scratch slots: both by name bytes, so the order is deterministic.
    return (name.startswith("op:"), name.encode())


# ---------------------------------------------------------------------------------------------
# Live ranges


def _runs(calls: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive call indices, as inclusive (start, end) pairs."""
    runs: list[tuple[int, int]] = []
    for i in calls:
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def workspace_intervals(man: m.Manifest, program: str, whole_life: bool = False
                        ) -> list[Interval]:
    """The live segments (or, with `whole_life`, the access range) of each workspace."""
    accesses = program_access(man, man.programs[program])
    workspaces = frozenset(name for name, b in man.buffers.items() if b.kind == "workspace")
    # The workspaces' liveness only: a full live set also holds every weight read later.
    ins = live_ins(accesses, within=workspaces)
    occupied: dict[str, list[int]] = {}
    for i, acc in enumerate(accesses):
        held = workspaces & acc.buffers if whole_life else (workspaces & acc.buffers) | ins[i]
        for name in sorted(held):
            occupied.setdefault(name, []).append(i)
    sizes = buffer_sizes(man)
    out = []
    for name in sorted(occupied, key=str.encode):
        calls = occupied[name]
        runs = [(calls[0], calls[-1])] if whole_life else _runs(calls)
        out += [Interval(name, start, end, sizes[name]) for start, end in runs]
    return out


def scratch_bytes(scratch: m.Scratch, env: dict[str, int]) -> int:
    dims = [d if isinstance(d, int) else env[d] for d in scratch.shape]
    return m.DTYPE_SIZES[scratch.dtype] * math.prod(dims)


def scratch_intervals(man: m.Manifest, program: str) -> list[Interval]:
    """One single-call interval per scratch of each call's op."""
    env = man.vars_max()
    out = []
    for i, call in enumerate(man.programs[program].calls):
        op = man.ops.get(call.op)
        for name in sorted(op.scratch if op else (), key=str.encode):
            out.append(Interval(scratch_slot(call.op, name, i), i, i,
                                scratch_bytes(op.scratch[name], env)))
    return out


def plan_program(man: m.Manifest, program: str, whole_life: bool = False) -> ProgramArena:
    intervals = workspace_intervals(man, program, whole_life) + scratch_intervals(man, program)
    return ProgramArena(program, tuple(intervals), arena_layout(intervals))


def plan_stage(man: m.Manifest, whole_life: bool = False) -> StageArena:
    return StageArena({name: plan_program(man, name, whole_life)
                       for name in sorted(man.programs, key=str.encode)}, man)


@register
@attrs.frozen
class PlanMemory(Pass):
    """Lay each program's workspaces and op scratch into one arena per stage, by live range."""

    name = "plan-memory"
    whole_life: bool = attrs.field(default=False, metadata={
        "help": "place a workspace for its whole first..last access range, not its live segments"})

    def run(self, ir: IR) -> IR:
        report = MemoryReport(tuple(plan_stage(s, self.whole_life) for s in ir.stages))
        return ir.with_report(self.name, report)
