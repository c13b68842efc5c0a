"""`share-states`: each stage keeps exactly the states its calls need, and says how much it holds.

A state region (state, offset) belongs to the one stage whose driven calls touch it (`cut`
refuses a point with a region touched on both sides; the one rule is `cut.check_regions`, a
query on the dataflow graph of the whole, and it runs again here so that a pipeline built by
other means is held to it). A stage keeps the states its driven calls touch, plus those its
kept init calls read (a fixpoint: an init call that only writes regions of states the stage
does not keep initialises another stage's memory and is dropped). Page and line tables whose
state went away are re-pointed to a kept state of the same kind, or lose their domain (done by
kerncc.stage.assemble). The regions report says, per stage and state, how many of the whole's
regions the stage uses, and the share of its bytes held for other stages.
"""

from __future__ import annotations

import attrs

from kerncc import manifest as m
from kerncc.analysis.access import call_access
from kerncc.diagnostics import Diagnostics
from kerncc.ir import IR
from kerncc.passes.base import Pass, register
from kerncc.passes.cut import HEADLINE, check_regions
from kerncc.stage import assemble, crossing_kinds, unchanged_or


@attrs.frozen
class StateUse:
    """One kept state of one stage: regions used here, regions in the whole (spec §3.8)."""

    state: str
    used: int
    total: int

    @property
    def whole(self) -> bool:
        return self.used == self.total

    @property
    def percent(self) -> int:
        return 100 * self.used // max(self.total, 1)


@attrs.frozen
class RegionsReport:
    stages: tuple[tuple[StateUse, ...], ...]

    def to_text(self) -> str:
        lines = []
        for s, uses in enumerate(self.stages):
            whole = sum(u.whole for u in uses)
            lines.append(f"stage {s}: {whole} of {len(uses)} states used whole")
            lines += [f"stage {s}: state `{u.state}` is allocated whole and its calls touch "
                      f"{u.used} of its {u.total} regions (~{u.percent}% of its bytes)"
                      for u in uses if not u.whole]
        return "\n".join(lines)

    def to_json(self) -> list:
        return [[{"state": u.state, "regions_used": u.used, "regions": u.total,
                  "held_for_others": 1 - u.used / max(u.total, 1)} for u in uses]
                for uses in self.stages]


def _regions(man: m.Manifest, programs) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    regions = (r for program in programs for call in program.calls
               for r in call_access(call, man.ops.get(call.op)).regions)
    for state, offset in regions:
        out.setdefault(state, set()).add(offset)
    return out


def check_ownership(ir: IR) -> None:
    """A region touched by the driven calls of two stages is refused (spec §3.5)."""
    diags = Diagnostics()
    check_regions(ir.whole, ir.points, diags)
    diags.raise_if_any(HEADLINE)


def kept_init_calls(stage: m.Manifest) -> dict[str, tuple[m.Call, ...]]:
    """Init calls minus those that only write regions of states the stage does not keep."""
    driven = [p for p in stage.programs.values() if p.driven]
    keep_states = set(_regions(stage, driven))
    init = {n: p for n, p in stage.programs.items() if not p.driven}
    while True:
        kept = {n: tuple(c for c in p.calls if _useful(stage, c, keep_states))
                for n, p in init.items()}
        reads = {s for calls in kept.values() for c in calls
                 for s, _ in call_access(c, stage.ops.get(c.op)).region_reads}
        if reads <= keep_states:
            return kept
        keep_states |= reads


def _useful(stage: m.Manifest, call: m.Call, keep_states: set[str]) -> bool:
    acc = call_access(call, stage.ops.get(call.op))
    if acc.buffer_writes or not acc.region_writes:
        return True
    return any(state in keep_states for state, _ in acc.region_writes)


def shared_stage(whole: m.Manifest, stage: m.Manifest) -> m.Manifest:
    programs = {n: p for n, p in stage.programs.items() if p.driven}
    programs.update({n: attrs.evolve(stage.programs[n], calls=calls)
                     for n, calls in kept_init_calls(stage).items() if calls})
    return unchanged_or(stage, assemble(whole, programs, crossing_kinds(whole, stage), stage.cut))


def manifest_regions(man: m.Manifest) -> dict[str, set[int]]:
    """State -> the offsets that the calls of all of `man`'s programs touch."""
    return _regions(man, man.programs.values())


def state_uses(totals: dict[str, set[int]], stage: m.Manifest) -> tuple[StateUse, ...]:
    """Each state the stage keeps: its regions the stage touches, of those in `totals`."""
    used = manifest_regions(stage)
    return tuple(StateUse(s, len(used.get(s, ())), len(totals.get(s, ())))
                 for s in sorted(stage.states))


def regions_report(whole: m.Manifest, stages: tuple[m.Manifest, ...]) -> RegionsReport:
    totals = manifest_regions(whole)
    return RegionsReport(tuple(state_uses(totals, stage) for stage in stages))


@register
@attrs.frozen
class ShareStates(Pass):
    """Per stage, keep the states its calls need, check region ownership, report regions held."""

    name = "share-states"

    def run(self, ir: IR) -> IR:
        check_ownership(ir)
        stages = tuple(shared_stage(ir.whole, s) for s in ir.stages)
        report = regions_report(ir.whole, stages)
        return attrs.evolve(ir, stages=stages).with_report(self.name, report)

