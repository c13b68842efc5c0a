"""The `liveness` pass: attach buffer liveness of every program (kerncc.analysis.liveness).

It changes no manifest; `kerncc dump FILE --pass liveness` prints its report: per program and
call the live-in and live-out buffers, per buffer its [first write, last read] interval, the
buffers that would cross a cut at each index with their bytes at var max, and the peak of
workspace bytes live at one call.
"""

from __future__ import annotations

import attrs

from kerncc import manifest as m
from kerncc.analysis.liveness import Liveness, ProgramLiveness, analyze
from kerncc.diagnostics import KernccError
from kerncc.ir import IR
from kerncc.passes.base import Pass, register
from kerncc.progress import human_bytes


@attrs.frozen
class LivenessReport:
    """Liveness per stage (one entry before a cut)."""

    stages: tuple[tuple[m.Manifest, Liveness], ...]

    def to_text(self, program: str | None = None) -> str:
        parts = []
        for index, (man, live) in enumerate(self.stages):
            if len(self.stages) > 1:
                parts.append(f"// stage {index}")
            parts += [render_program(man, live.programs[p]) for p in self._names(live, program)]
        return "\n".join(parts)

    def to_json(self, program: str | None = None) -> dict:
        """The report as one JSON document: per stage, per program, the same facts as text."""
        return {"stages": [{name: program_json(live.programs[name])
                            for name in self._names(live, program)}
                           for _, live in self.stages]}

    def _names(self, live: Liveness, program: str | None) -> list[str]:
        """Every program, or the one asked for (`kerncc dump --program`)."""
        if program is None:
            return sorted(live.programs)
        if not any(program in lv.programs for _, lv in self.stages):
            known = ", ".join(sorted({p for _, lv in self.stages for p in lv.programs}))
            raise KernccError.single(f"no program `{program}` (programs: {known})")
        return [program] if program in live.programs else []


@register
@attrs.frozen
class LivenessPass(Pass):
    """Compute buffer liveness, cut crossings and peak live bytes of every program."""

    name = "liveness"

    def run(self, ir: IR) -> IR:
        report = LivenessReport(tuple((s, analyze(s)) for s in ir.stages))
        return ir.with_report(self.name, report)


READ_ONLY = ("input", "weight", "source", "peer")


def _names(names: frozenset[str], man: m.Manifest | None = None) -> str:
    """Buffers the program computes (inputs and weights are live throughout: left out)."""
    if man is not None:
        names = frozenset(n for n in names if man.buffers[n].kind not in READ_ONLY)
    return " ".join(sorted(names)) or "-"


def render_program(man: m.Manifest, live: ProgramLiveness) -> str:
    program = man.programs[live.program]
    peak_at = f" at #{live.peak_call}" if live.peak_call is not None else ""
    lines = [f"program {live.program}: {len(program.calls)} calls, "
             f"peak workspace {human_bytes(live.peak_bytes)}{peak_at}"]
    lines.append("  calls (live-in -> live-out; inputs and weights left out):")
    for i, call in enumerate(program.calls):
        name = call.label or call.op
        lines.append(f"    #{i:<4} {name:<24} {_names(live.live_in[i], man)} -> "
                     f"{_names(live.live_out[i], man)}")
    lines.append("  buffers [first write, last read]:")
    for b, iv in live.intervals.items():
        first = "-" if iv.first_write is None else iv.first_write
        last = "-" if iv.last_read is None else iv.last_read
        lines.append(f"    {b:<28} [{first}, {last}]")
    lines.append("  crossing a cut before call:")
    for a in range(1, len(program.calls)):
        crossing = live.crossing[a]
        lines.append(f"    #{a:<4} {human_bytes(live.crossing_bytes[a]):>10}  {_names(crossing)}")
    return "\n".join(lines)


def program_json(live: ProgramLiveness) -> dict:
    """One program's liveness as JSON: live sets per call, intervals, crossings, peak."""
    return {
        "live_in": [sorted(s) for s in live.live_in],
        "live_out": [sorted(s) for s in live.live_out],
        "intervals": {b: {"first_write": iv.first_write, "last_read": iv.last_read}
                      for b, iv in live.intervals.items()},
        "crossing": [{"before": a, "buffers": sorted(live.crossing[a]),
                      "bytes": live.crossing_bytes[a]} for a in range(1, len(live.live_in))],
        "peak_bytes": live.peak_bytes,
        "peak_call": live.peak_call,
    }
