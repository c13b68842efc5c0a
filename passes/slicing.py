"""`slice-once` and `slice-derive`: per stage, keep only the init calls the stage's calls need.

A backward slice, JAX `dce_jaxpr` style, asked of the dataflow graph of the class's programs
(kerncc.analysis.dataflow.backward_slice): the kept calls are the ancestors of the values the
stage's other calls read (driven calls, plus kept once calls when slicing derive programs) as
the class's programs (run in name order) leave them. Two defects of kern's slicer are fixed by
construction: state regions are dependencies like buffers (a call that initialises a region
the stage reads stays, and the regions a kept call reads pull in their producers), and one
graph over all programs of the class makes the result independent of how their names sort. A
partial write (an `out` at an offset, an `inout`, any state write) reads the previous version,
so an earlier producer of the rest of the buffer stays too.

`slice-derive` also lays out the stage's source staging (the bytes that hold a checkpoint's
source tensors while derive programs turn them into the weights): each source's window
[first reader, last reader] over the concatenated derive calls, placed first-fit, 256-aligned
(kerncc.analysis.layout.staging_layout), with the peak = derived carry bytes + the widest set of
sources live at one derive call.
"""

from __future__ import annotations

import attrs

from kerncc import manifest as m
from kerncc.analysis.access import Region, call_access
from kerncc.analysis.dataflow import backward_slice, execution_order
from kerncc.analysis.liveness import buffer_sizes
from kerncc.ir import IR
from kerncc.analysis.layout import StagingLayout, Window, staging_layout
from kerncc.passes.base import Pass, register
from kerncc.stage import assemble, crossing_kinds, unchanged_or


def _is_class(program: m.Program, which: str) -> bool:
    return program.once if which == "once" else program.derive


def _needed_by_others(stage: m.Manifest, which: str) -> tuple[set[str], set[Region]]:
    """Buffers and regions read by the stage's calls outside the class being sliced.

    Derive programs run before once programs, so slicing derive also serves the once calls.
    """
    buffers: set[str] = set()
    regions: set[Region] = set()
    for program in stage.programs.values():
        if program.derive or (program.once and which == "once"):
            continue
        for call in program.calls:
            acc = call_access(call, stage.ops.get(call.op))
            buffers |= acc.buffer_reads
            regions |= acc.region_reads
    return buffers, regions


def slice_calls(stage: m.Manifest, which: str) -> dict[str, tuple[m.Call, ...]]:
    """The kept calls of every program of the class (`once` or `derive`), in original order.

    A carry that kept calls use but no kept call writes (it was read before its only writer
    ran) still needs a writer to verify: it is then needed at the end, keeping its last writer.
    """
    buffers, regions = _needed_by_others(stage, which)
    while True:
        kept = _walk_back(stage, which, set(buffers), set(regions))
        orphans = _unwritten_carries(stage, which, kept) - buffers
        if not orphans:
            return kept
        buffers |= orphans


def _unwritten_carries(stage: m.Manifest, which: str,
                       kept: dict[str, tuple[m.Call, ...]]) -> set[str]:
    calls = [c for n, p in stage.programs.items() if n not in kept for c in p.calls]
    calls += [c for cs in kept.values() for c in cs]
    used, written = set(), set()
    for call in calls:
        acc = call_access(call, stage.ops.get(call.op))
        used |= acc.buffers
        written |= acc.buffer_writes
    return {b for b in used - written if stage.buffers[b].kind in ("carry", "output")}


def _walk_back(stage: m.Manifest, which: str, buffers: set[str],
               regions: set[Region]) -> dict[str, tuple[m.Call, ...]]:
    names = tuple(p for p in execution_order(stage) if _is_class(stage.programs[p], which))
    kept = backward_slice(stage, names, buffers, regions)
    return {p: tuple(stage.programs[p].calls[i] for i in kept[p]) for p in names}


def sliced_stage(whole: m.Manifest, stage: m.Manifest, which: str) -> m.Manifest:
    calls = slice_calls(stage, which)
    programs = {name: p for name, p in stage.programs.items() if not _is_class(p, which)}
    programs.update({name: attrs.evolve(stage.programs[name], calls=kept)
                     for name, kept in calls.items() if kept})
    return unchanged_or(stage, assemble(whole, programs, crossing_kinds(whole, stage), stage.cut))


@register
@attrs.frozen
class SliceOnce(Pass):
    """Per stage, keep only the once calls its calls need (buffers and state regions, all programs at once)."""

    name = "slice-once"

    def run(self, ir: IR) -> IR:
        stages = tuple(sliced_stage(ir.whole, s, "once") for s in ir.stages)
        report = SliceReport.of(ir, stages, "once")
        return attrs.evolve(ir, stages=stages).with_report(self.name, report)


@attrs.frozen
class SliceReport:
    """Calls kept per stage out of the whole's calls of the class."""

    which: str
    kept: tuple[int, ...]
    total: int
    staging: tuple[StagingPlan, ...] = ()

    @classmethod
    def of(cls, ir: IR, stages: tuple[m.Manifest, ...], which: str,
           staging: tuple[StagingPlan, ...] = ()) -> SliceReport:
        def count(man: m.Manifest) -> int:
            return sum(len(p.calls) for p in man.programs.values() if _is_class(p, which))
        return cls(which, tuple(count(s) for s in stages), count(ir.whole), staging)

    def to_text(self) -> str:
        lines = [f"stage {i}: keeps {k} of {self.total} {self.which} calls"
                 for i, k in enumerate(self.kept)]
        for i, plan in enumerate(self.staging):
            lines.append(f"stage {i}: {plan.summary()}")
        return "\n".join(lines)


@attrs.frozen
class StagingPlan:
    """One stage's source staging: windows, their layout, and the load-time peak (spec §5)."""

    windows: tuple[Window, ...]
    layout: StagingLayout
    derived_bytes: int
    widest_live: int

    @property
    def peak(self) -> int:
        return self.derived_bytes + self.widest_live

    def summary(self) -> str:
        return (f"staging {self.layout.total} B for {len(self.windows)} sources, "
                f"peak {self.peak} B = {self.derived_bytes} B derived + "
                f"{self.widest_live} B widest live sources")

    def to_json(self) -> dict:
        return {"total": self.layout.total, "derived_bytes": self.derived_bytes,
                "widest_live": self.widest_live, "peak": self.peak,
                "windows": [{"source": w.name, "first": w.first, "last": w.last,
                             "bytes": w.bytes, "offset": self.layout.offsets[w.name]}
                            for w in self.windows]}


def staging_plan(stage: m.Manifest) -> StagingPlan:
    """Windows over the concatenated derive calls (program-name order), laid out first-fit."""
    sizes = buffer_sizes(stage)
    calls = [c for p in execution_order(stage) if stage.programs[p].derive
             for c in stage.programs[p].calls]
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    derived: set[str] = set()
    for i, call in enumerate(calls):
        acc = call_access(call, stage.ops.get(call.op))
        for b in acc.buffers:
            if stage.buffers[b].kind == "source":
                first.setdefault(b, i)
                last[b] = i
        derived |= {b for b in acc.buffer_writes if stage.buffers[b].kind == "carry"}
    windows = tuple(Window(first[b], last[b], sizes[b], b) for b in first)
    widest = max((sum(w.bytes for w in windows if w.first <= i <= w.last)
                  for i in range(len(calls))), default=0)
    return StagingPlan(windows, staging_layout(list(windows)),
                       sum(sizes[b] for b in derived), widest)


@register
@attrs.frozen
class SliceDerive(Pass):
    """Per stage, keep only the derive calls its calls need, and lay out its source staging."""

    name = "slice-derive"

    def run(self, ir: IR) -> IR:
        stages = tuple(sliced_stage(ir.whole, s, "derive") for s in ir.stages)
        plans = tuple(staging_plan(s) for s in stages)
        report = SliceReport.of(ir, stages, "derive", plans)
        return attrs.evolve(ir, stages=stages).with_report(self.name, report)
