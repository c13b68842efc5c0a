"""`kerncc report BUNDLE`: what an emitted bundle holds, read from its files alone.

The summary of docs/bundle.md's files a person wants before running or shipping a bundle: the
stages and the calls each runs per program; the buffers crossing each edge with their bytes;
the states each stage keeps and how many of the whole manifest's regions of each it touches
(spec §3.8, as `share-states` reports it); per stage the arena against its lower bound and the
derive staging peak; the modules and whether their cubins were found.

The bundle is checked as `kerncc check` checks it before anything is read (every file hashed
against bundle.json, cubins against their names), and every value read from a file is checked
for its type, so a damaged bundle is a KernccError naming the file. The input manifest is
needed only for the regions' totals: when it is gone or was changed, totals count the regions
of all stages instead, and the report says so. The output is deterministic: no timings, and no
paths but those bundle.json records (relative to the bundle).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from kerncc import manifest as m
from kerncc.bundle import reader
from kerncc.bundle.check import input_manifest, input_path
from kerncc.files import FileRefused, check_regular
from kerncc.bundle.reader import Index, read_index, stage_files
from kerncc.diagnostics import KernccError
from kerncc.progress import human_bytes
from kerncc.passes.share_states import StateUse, manifest_regions, state_uses
from kerncc.runtime import footprint
from kerncc.runtime.footprint import StageFootprint, bundle_footprints

INPUT_NOTES = {
    "missing": "the input manifest is missing",
    "changed": "the input manifest changed since emit",
    "not recorded": "the bundle records no input manifest",
}


@attrs.frozen
class Arena:
    """Arena bytes as planned, the most bytes live at one call, every item its own space."""

    bytes: int
    lower_bound: int
    naive: int

    def to_json(self) -> dict[str, int]:
        return {"bytes": self.bytes, "lower_bound": self.lower_bound, "naive": self.naive}


@attrs.frozen
class Module:
    sha256: str
    names: tuple[str, ...]
    source: str | None
    found: bool


@attrs.frozen
class StageReport:
    index: int
    calls: dict[str, int]  # program -> number of calls, every program of the stage
    kinds: dict[str, str]  # program -> driven | once | derive | harness
    host_inputs: tuple[str, ...]
    states: tuple[StateUse, ...]
    arena: Arena  # the stage's arena: the largest of its programs'
    programs: dict[str, Arena]
    staging: dict[str, int]  # total, derived_bytes, widest_live, peak
    modules: tuple[Module, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "programs": {p: {"kind": self.kinds.get(p), "calls": n,
                             "arena": self.programs[p].to_json() if p in self.programs else None}
                         for p, n in self.calls.items()},
            "host_inputs": list(self.host_inputs),
            "states": [{"state": u.state, "regions_used": u.used, "regions": u.total}
                       for u in self.states],
            "arena": self.arena.to_json(),
            "staging": self.staging,
            "modules": [{"sha256": mod.sha256, "names": list(mod.names), "source": mod.source,
                         "found": mod.found} for mod in self.modules],
        }


@attrs.frozen
class Edge:
    """The buffers stage `source` hands to stage `target`, with their bytes at var max."""

    source: int
    target: int
    buffers: tuple[tuple[str, int], ...]

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.buffers)

    def to_json(self) -> dict[str, Any]:
        return {"from": self.source, "to": self.target, "bytes": self.bytes,
                "buffers": [{"buffer": b, "bytes": n} for b, n in self.buffers]}


@attrs.frozen
class BundleReport:
    model: str
    kerncc: str
    pipeline: str
    input_path: str | None
    input_status: str  # matches | changed | missing | not recorded
    checkpoint: str | None
    checkpoint_status: str  # matches | changed | missing | not recorded | not checked
    cut: dict[str, Any] | None
    proof: dict[str, Any] | None  # None: bundle.json records no proof
    stages: tuple[StageReport, ...]
    edges: tuple[Edge, ...]
    footprints: tuple[StageFootprint, ...] = ()  # device memory per stage, from the plans

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model, "kerncc": self.kerncc, "pipeline": self.pipeline,
            "input": {"path": self.input_path, "status": self.input_status},
            "checkpoint": self.checkpoint, "checkpoint_status": self.checkpoint_status,
            "cut": self.cut, "proof": self.proof,
            "stages": [s.to_json() for s in self.stages],
            "edges": [e.to_json() for e in self.edges],
            "device_memory": [f.to_json() for f in self.footprints],
        }

    def to_text(self) -> str:
        sections = [_header(self), _calls(self), _crossing(self), _host_inputs_section(self),
                    _states(self), _memory(self), _device_memory(self),
                    _modules_section(self)]
        return "\n\n".join(sections) + "\n"


# ---------------------------------------------------------------------------------------------
# Reading: bundle.json was checked by read_index (kerncc.bundle.index) and plan.json by
# stage_plan (kerncc.bundle.plan_check), so their values are read plainly.


def _arena(record: dict) -> Arena:
    return Arena(record.get("bytes", 0), record["lower_bound"], record["naive"])


def _read_modules(plan: dict) -> tuple[Module, ...]:
    modules = plan.get("modules", {})
    return tuple(Module(sha, tuple(modules[sha].get("names", ())), modules[sha].get("source"),
                        modules[sha].get("file") is not None) for sha in sorted(modules))


def _stage(index: int, host_inputs: tuple[str, ...], man: m.Manifest, plan: dict,
           states: tuple[StateUse, ...]) -> StageReport:
    records = plan["arena"].get("programs", {})
    programs = {name: _arena(records[name]) for name in sorted(records)}
    kinds = {name: plan["programs"][name]["kind"] for name in sorted(plan["programs"])}
    staging = {key: plan.get("staging", {}).get(key, 0)
               for key in ("total", "derived_bytes", "widest_live", "peak")}
    arena = Arena(plan["arena"].get("bytes", 0),
                  max((a.lower_bound for a in programs.values()), default=0),
                  max((a.naive for a in programs.values()), default=0))
    return StageReport(
        index=index, calls={name: len(man.programs[name].calls) for name in sorted(man.programs)},
        kinds=kinds, host_inputs=host_inputs,
        states=states, arena=arena, programs=programs, staging=staging,
        modules=_read_modules(plan))


def _edges(index: dict) -> tuple[Edge, ...]:
    grouped: dict[tuple[int, int], list[tuple[str, int]]] = {}
    for edge in index.get("edges", ()):
        grouped.setdefault((edge["from"], edge["to"]), []).append((edge["buffer"],
                                                                   edge["bytes"]))
    return tuple(Edge(a, b, tuple(sorted(bufs))) for (a, b), bufs in sorted(grouped.items()))


def _whole(index: Index, recorded: str | None) -> tuple[m.Manifest | None, str]:
    """The input manifest and its status; None when it cannot be had as it was emitted."""
    if recorded is None:
        return None, "not recorded"
    try:
        check_regular(input_path(index, None), "the input manifest")
    except (FileRefused, KernccError):
        return None, "missing"
    try:
        return input_manifest(index, None), "matches"
    except KernccError:
        return None, "changed"


def _checkpoint_status(index: Index) -> str:
    """matches | changed | missing | not recorded | not checked (no identity recorded)."""
    recorded = index.data.get("checkpoint")
    if not recorded:
        return "not recorded"
    path = index.dir / recorded
    if not path.exists():  # (read_index refused a path that is not relative)
        return "missing"
    if not isinstance(index.data.get("checkpoint_identity"), dict):
        return "not checked"
    try:
        return "changed" if reader.checkpoint_mismatch(index, path, given=True) else "matches"
    except KernccError:
        return "changed"


def _region_totals(whole: m.Manifest | None, stages: Sequence[m.Manifest]
                   ) -> dict[str, set[int]]:
    if whole is not None:
        return manifest_regions(whole)
    # Without the whole, the regions of all stages together stand in for its regions.
    totals: dict[str, set[int]] = {}
    for stage in stages:
        for state, offsets in manifest_regions(stage).items():
            totals.setdefault(state, set()).update(offsets)
    return totals


def _proof(checked: Index, input_status: str) -> dict[str, Any]:
    """The proof as `kerncc check` finds it now (bundle.json's claim is not repeated): its
    summary and `"status": "proved"`, or `"checked": false` and why it is not proved."""
    if input_status != "matches":
        return {"checked": False, "status": f"not checked: the input manifest is {input_status}"}
    from kerncc.bundle.check import check_bundle

    try:
        proof = check_bundle(checked.dir)
    except KernccError as err:
        why = err.diagnostics[0].message if err.diagnostics else err.headline
        return {"checked": False, "status": f"not proved: {why}"}
    return {**proof.to_json(), "status": "proved"}


def read_report(directory: str | Path) -> BundleReport:
    """The report of the bundle at `directory`; KernccError naming the file if it is damaged."""
    checked = read_index(directory)
    read = [reader.read_stage(checked, files) for files in stage_files(checked)]
    manifests = [r.manifest for r in read]
    reader.check_links(checked, manifests)
    index = checked.data
    recorded = (index.get("input") or {}).get("path")
    whole, status = _whole(checked, recorded)
    totals = _region_totals(whole, manifests)
    stages = tuple(_stage(k, tuple(index["stages"][k].get("host_inputs", ())), manifests[k],
                          r.plan, state_uses(totals, manifests[k]))
                   for k, r in enumerate(read))
    return BundleReport(
        model=manifests[0].model, kerncc=index.get("kerncc") or "?",
        pipeline=index.get("pipeline") or "", input_path=recorded,
        input_status=status, checkpoint=index.get("checkpoint"),
        checkpoint_status=_checkpoint_status(checked),
        cut=index.get("cut"), proof=_proof(checked, status), stages=stages, edges=_edges(index),
        footprints=tuple(bundle_footprints([(r.manifest, r.plan) for r in read])))


# ---------------------------------------------------------------------------------------------
# The text form: a header, then one section per question, each a small aligned table.


def _table(rows: list[list[str]], right: int = 99, indent: str = "  ") -> list[str]:
    """Rows aligned in columns; columns from index `right` on are right-aligned (numbers)."""
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [cell.rjust(w) if c >= right else cell.ljust(w)
                 for c, (cell, w) in enumerate(zip(row, widths))]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one}" if n == 1 else f"{n} {many or one + 's'}"


def _cut_text(cut: dict[str, Any] | None) -> str:
    if not cut:
        return "none (one stage)"
    points = cut.get("points") or {}
    where = " ".join(f"{p}@{','.join(str(i) for i in at)}" for p, at in sorted(points.items()))
    return f"{cut.get('id')}: before calls {where}"


def _proof_text(proof: dict[str, Any] | None) -> str:
    if proof is None:
        return "not recorded"
    if not proof.get("checked"):
        return str(proof.get("status") or "not checked")
    return (f"proved now: {_count(len(proof.get('programs', ())), 'driven program')}, "
            f"{_count(proof.get('outputs', 0), 'output')}, "
            f"{_count(proof.get('carries', 0), 'carry', 'carries')}, "
            f"{_count(proof.get('state_regions', 0), 'state region')} equal to the whole's")


def _header(r: BundleReport) -> str:
    status = {"matches": "sha256 matches", "changed": "changed since emit",
              "missing": "missing", "not recorded": "not recorded"}[r.input_status]
    rows = [["pipeline", r.pipeline], ["input", f"{r.input_path or '-'} ({status})"],
            ["checkpoint", _checkpoint_text(r)], ["cut", _cut_text(r.cut)],
            ["proof", _proof_text(r.proof)]]
    head = f"bundle of `{r.model}`: {_count(len(r.stages), 'stage')} (kerncc {r.kerncc})"
    return "\n".join([head] + _table(rows))


def _checkpoint_text(r: BundleReport) -> str:
    if r.checkpoint is None:
        return "none"
    status = {"changed": "changed since emit", "missing": "missing"}.get(r.checkpoint_status)
    return f"{r.checkpoint} ({status})" if status else r.checkpoint


def _stage_columns(r: BundleReport) -> list[str]:
    return [f"stage{s.index}" for s in r.stages]


def _calls(r: BundleReport) -> str:
    programs = sorted({p for s in r.stages for p in s.calls})
    rows = [["program", "kind", *_stage_columns(r)]]
    for p in programs:
        kind = next((s.kinds[p] for s in r.stages if p in s.kinds), "-")
        rows.append([p, kind, *(str(s.calls[p]) if p in s.calls else "-" for s in r.stages)])
    return "\n".join(["calls per program"] + _table(rows, right=2))


def _crossing(r: BundleReport) -> str:
    if not r.edges:
        return "crossing buffers: none"
    lines = ["crossing buffers (bytes at var max)"]
    for e in r.edges:
        lines.append(f"  stage {e.source} -> {e.target}: {_count(len(e.buffers), 'buffer')}, "
                     f"{human_bytes(e.bytes)}")
        lines += _table([[b, human_bytes(n)] for b, n in e.buffers], right=1, indent="    ")
    return "\n".join(lines)


def _host_inputs_section(r: BundleReport) -> str:
    rows = [[f"stage {s.index}", " ".join(s.host_inputs) or "-"] for s in r.stages]
    return "\n".join(["host inputs (written before each run)"] + _table(rows))


def _states(r: BundleReport) -> str:
    lines = ["states kept (regions touched / regions in the whole)"]
    if r.input_status != "matches":
        lines.append(f"  note: {INPUT_NOTES[r.input_status]}: totals count the regions "
                     "of all stages")
    for s in r.stages:
        whole = [u.state for u in s.states if u.whole]
        lines.append(f"  stage {s.index}: {len(whole)} of {_count(len(s.states), 'state')} "
                     f"used whole" + (f": {' '.join(whole)}" if whole else ""))
        lines += [f"    `{u.state}` {u.used}/{u.total} regions (~{u.percent}% of its bytes)"
                  for u in s.states if not u.whole]
    return "\n".join(lines)


def _ratio(arena: Arena) -> str:
    return f"{arena.bytes / arena.lower_bound:.2f}" if arena.lower_bound else "-"


def _memory(r: BundleReport) -> str:
    rows = [["", *_stage_columns(r)],
            ["arena", *(human_bytes(s.arena.bytes) for s in r.stages)],
            ["lower bound", *(human_bytes(s.arena.lower_bound) for s in r.stages)],
            ["arena / bound", *(_ratio(s.arena) for s in r.stages)],
            ["no reuse", *(human_bytes(s.arena.naive) for s in r.stages)],
            ["staging peak", *(human_bytes(s.staging["peak"]) for s in r.stages)]]
    return "\n".join(["memory per stage (arena: the largest program's)"] + _table(rows, right=1))


def _device_memory(r: BundleReport) -> str:
    """Each stage's device memory as the runtime will allocate it at the default token
    capacity (a device with less free memory gets the KV pages that fit, runtime/footprint.py
    fitting_capacity; a load that cannot hold one chunk's is refused before any weight moves)."""
    if not r.footprints:
        return "device memory: not planned"
    head = "device memory per stage at load (the staging is freed after it: resident stays)"
    foot = (["  (kv pool: every sequence at the context bound, or the pages a device's memory "
             "holds)"] if any(f.pages for f in r.footprints) else [])
    return "\n".join([head] + _table(footprint.text(r.footprints), right=1) + foot)


def _modules_section(r: BundleReport) -> str:
    stages: dict[str, list[int]] = {}
    first: dict[str, Module] = {}
    for s in r.stages:
        for mod in s.modules:
            stages.setdefault(mod.sha256, []).append(s.index)
            first.setdefault(mod.sha256, mod)
    if not first:
        return "modules: none"
    rows = [[sha[:12], " ".join(mod.names),
             "stage" + ("s " if len(stages[sha]) > 1 else " ")
             + ",".join(str(k) for k in stages[sha]),
             "found" if mod.found else f"missing ({mod.source})"]
            for sha, mod in sorted(first.items(), key=lambda item: item[1].names)]
    missing = sum(not mod.found for mod in first.values())
    head = f"modules ({len(first)}, {missing} missing: the cuda backend cannot launch those)" \
        if missing else f"modules ({len(first)}, every cubin found)"
    return "\n".join([head] + _table(rows))
