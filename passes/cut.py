"""The `cut` pass: split every driven program into pipeline stages, with kern's semantics.

Points come three ways: `at=218,290` (call indices, the same in every driven program, as
`kern cut --at`), `at-label=l18.qkv_proj` (the call with that label in each driven program, so
programs whose layers sit at different indices still cut at the same layer), or `stages=N`
(legal points whose heaviest stage is within 3% of the best balance, and among those the
fewest crossing bytes). Plain `cut` means `stages=2`. A buffer crosses a cut when a value of
it is produced on one side and used on the other (a query on the dataflow graph,
kerncc.analysis.dataflow: kern's live-across rule); crossing buffers become input / inout /
output with `export` in the stages on either side. A point is refused, with kern's text, when
something other than a workspace would cross it, when an output or carry is written before it,
or when a state region is touched on both sides of it (the graph's region index). Once and
derive programs are kept whole here; `slice-once` / `slice-derive` trim them.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from collections.abc import Sequence

import attrs

from kerncc import manifest as m
from kerncc.manifest import writer
from kerncc.analysis.access import CallAccess, Region, program_access
from kerncc.analysis.dataflow import cut_crossings, region_touches
from kerncc.analysis.liveness import buffer_sizes
from kerncc.bundle.format import CUT_HEADLINE
from kerncc.diagnostics import Diagnostics, KernccError, pointer
from kerncc.ir import IR, Edge, verify_stages
from kerncc.passes.base import Pass, register
from kerncc.stage import assemble, keep_programs

HEADLINE = CUT_HEADLINE


@register
@attrs.frozen
class Cut(Pass):
    """Split every driven program into pipeline stages at call indices, labels, or balanced points."""

    name = "cut"
    requires = ()
    at: tuple[int, ...] = attrs.field(default=(), metadata={
        "help": "cut before these call indices (the same in every driven program)"})
    at_label: tuple[str, ...] = attrs.field(default=(), metadata={
        "help": "cut before the call with each label, in every driven program"})
    stages: int = attrs.field(default=0, metadata={
        "help": "cut into N stages at balanced points (when neither at nor at-label is given)",
        "default_text": "2"})

    def run(self, ir: IR) -> IR:
        if ir.is_pipeline:
            raise KernccError.single("the manifest is already a stage of a cut")
        whole = ir.whole
        points = self.points(whole)
        return cut_ir(ir, points)

    def points(self, whole: m.Manifest) -> dict[str, tuple[int, ...]]:
        chosen = [x for x in (self.at, self.at_label, self.stages) if x]
        if len(chosen) > 1:
            raise KernccError.single("cut takes one of `at`, `at-label` and `stages`")
        if self.at:
            return {p: tuple(self.at) for p in whole.driven_programs()}
        if self.at_label:
            return label_points(whole, self.at_label)
        from kerncc.analysis.balance import balanced_points
        return balanced_points(whole, self.stages or 2)


def label_points(whole: m.Manifest, labels: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    diags = Diagnostics()
    points: dict[str, tuple[int, ...]] = {}
    for name in whole.driven_programs():
        index = {c.label: i for i, c in reversed(list(enumerate(whole.programs[name].calls)))}
        missing = [lab for lab in labels if lab not in index]
        for lab in missing:
            diags.error(f"program `{name}` has no call labelled `{lab}`",
                        pointer("programs", name))
        points[name] = tuple(index.get(lab, 0) for lab in labels)
    diags.raise_if_any(HEADLINE)
    return points


def cut_ir(ir: IR, points: dict[str, tuple[int, ...]]) -> IR:
    stages, crossing = cut_manifest(ir.whole, points)
    sizes = buffer_sizes(ir.whole)
    edges = tuple(Edge(b, e, e + 1, sizes.get(b, 0))
                  for e, names in enumerate(crossing) for b in sorted(names))
    return attrs.evolve(ir, stages=tuple(stages), points=points, edges=edges)


def cut_manifest(whole: m.Manifest, points: dict[str, tuple[int, ...]]
                 ) -> tuple[list[m.Manifest], list[frozenset[str]]]:
    """kern's `cut` (spec §3) with per-program points; raises KernccError with every refusal."""
    check_preconditions(whole, points)
    accesses = {p: program_access(whole, whole.programs[p]) for p in points}
    count = len(next(iter(points.values()))) + 1
    diags = Diagnostics()
    crossing = crossing_sets(whole, points, count, diags)
    check_output_writes(whole, points, accesses, diags)
    kinds = stage_kinds(whole, points, accesses, crossing, count, diags)
    check_regions(whole, points, diags)
    diags.raise_if_any(HEADLINE)
    cut_id = cut_identity(whole, points)
    stages = [build_stage(whole, points, s, count, kinds[s], cut_id) for s in range(count)]
    verify_stages(stages, HEADLINE)  # spec §3.6 step 10
    return stages, crossing


def check_preconditions(whole: m.Manifest, points: dict[str, tuple[int, ...]]) -> None:
    diags = Diagnostics()
    if whole.topology is not None:
        diags.error("the manifest has a topology; a cut takes a single-rank manifest",
                    "/topology")
    if whole.cut is not None:
        diags.error("the manifest is already a stage of a cut", "/cut")
    if not points:
        diags.error("no program declares a `batch`: nothing to cut", "/programs")
    for name, at in sorted(points.items()):
        if not at or at[0] == 0 or any(b <= a for a, b in zip(at, at[1:])):
            diags.error(f"cut points {list(at)}: at least one, increasing, none at 0")
            break
    lengths = {len(at) for at in points.values()}
    if len(lengths) > 1:
        diags.error("every driven program needs the same number of cut points")
    for name, at in sorted(points.items()):
        calls = len(whole.programs[name].calls)
        if at and at[-1] >= calls:
            diags.error(f"program `{name}` has {calls} calls; it cannot be cut before call {at[-1]}",
                        pointer("programs", name, "calls"))
    diags.raise_if_any(HEADLINE)


def stage_bounds(at: tuple[int, ...], calls: int) -> list[tuple[int, int]]:
    bounds = [0, *at, calls]
    return list(zip(bounds, bounds[1:]))


def crossing_sets(whole: m.Manifest, points: dict[str, tuple[int, ...]], count: int,
                  diags: Diagnostics) -> list[frozenset[str]]:
    """Spec §3.3: per edge, the union over driven programs of the buffers whose values are
    produced before the point and used after it (the dataflow graph's query)."""
    crossing: list[set[str]] = [set() for _ in range(count - 1)]
    for name, at in sorted(points.items()):
        for edge, (a, found) in enumerate(zip(at, cut_crossings(whole, name, at))):
            crossing[edge] |= _travelling(whole, name, a, found, diags)
    return [frozenset(c) for c in crossing]


def _travelling(whole: m.Manifest, name: str, a: int, found: frozenset[str],
                diags: Diagnostics) -> set[str]:
    """The crossing buffers that may travel (workspaces); the others are refused."""
    for b in sorted(found):
        kind = whole.buffers[b].kind
        if kind != "workspace":
            diags.error(f"program `{name}`: {kind} buffer `{b}` is live across the cut "
                        f"before call {a}; only a workspace travels",
                        pointer("programs", name, "calls", a))
    return {b for b in found if whole.buffers[b].kind == "workspace"}


def check_output_writes(whole: m.Manifest, points: dict[str, tuple[int, ...]],
                        accesses: dict[str, Sequence[CallAccess]], diags: Diagnostics) -> None:
    early = [(name, i, b) for name, at in sorted(points.items())
             for i, acc in enumerate(accesses[name][:at[-1]]) for b in sorted(acc.buffer_writes)]
    for name, i, b in early:
        kind = whole.buffers[b].kind
        if kind in ("output", "carry"):
            diags.error(f"program `{name}` call {i} writes {kind} buffer `{b}` before the "
                        "last stage; a pipeline's outputs come from its last stage",
                        pointer("programs", name, "calls", i))


def stage_kinds(whole: m.Manifest, points: dict[str, tuple[int, ...]],
                accesses: dict[str, Sequence[CallAccess]], crossing: list[frozenset[str]],
                count: int, diags: Diagnostics) -> list[dict[str, str]]:
    """Spec §3.4: the kind each crossing buffer takes in each stage."""
    kinds: list[dict[str, str]] = []
    for s in range(count):
        stage_accesses = [acc for name, at in points.items()
                          for acc in _slice(accesses[name], stage_bounds(at, len(accesses[name]))[s])]
        touched = set().union(*(acc.buffers for acc in stage_accesses))
        written = set().union(*(acc.buffer_writes for acc in stage_accesses))
        arriving = crossing[s - 1] if s > 0 else frozenset()
        leaving = crossing[s] if s < count - 1 else frozenset()
        kinds.append({})
        for b in sorted(arriving | leaving):
            if b not in touched:
                diags.error(f"stage {s}: `{b}` passes through untouched; a stage carries only "
                            "what it uses", pointer("buffers", b))
            elif b in arriving:
                kinds[s][b] = "inout" if b in written else "input"
            else:
                kinds[s][b] = "output"
    return kinds


def _slice(items: Sequence[CallAccess], bounds: tuple[int, int]) -> Sequence[CallAccess]:
    return items[bounds[0]:bounds[1]]


def region_owners(whole: m.Manifest, points: dict[str, tuple[int, ...]]
                  ) -> tuple[dict[Region, int], list[tuple[Region, str, int, int]]]:
    """Spec §3.5: the stage owning each region the driven calls touch, and the conflicts.

    The owner is the stage of the first touching call in (program name, call index) order; a
    conflict is (region, program, call, stage) for the first call of another stage.
    """
    touches = sorted((program, index, region) for region, calls in region_touches(whole).items()
                     for program, index in calls if program in points)
    owner: dict[Region, int] = {}
    conflicts: list[tuple[Region, str, int, int]] = []
    reported: set[Region] = set()
    for program, index, region in touches:
        stage = bisect.bisect_right(points[program], index)
        first = owner.setdefault(region, stage)
        if first != stage and region not in reported:
            reported.add(region)
            conflicts.append((region, program, index, stage))
    return owner, conflicts


def check_regions(whole: m.Manifest, points: dict[str, tuple[int, ...]],
                  diags: Diagnostics) -> None:
    """Spec §3.5: a (state, offset) region belongs to one stage, over all driven programs."""
    owner, conflicts = region_owners(whole, points)
    for region, program, index, stage in conflicts:
        diags.error(f"program `{program}`: {region_display(region)} is touched by stages "
                    f"{owner[region]} and {stage}; a state region belongs to one stage",
                    pointer("programs", program, "calls", index))


def region_display(region: tuple[str, int]) -> str:
    state, offset = region
    return f"state `{state}`+{offset}" if offset else f"state `{state}`"


def build_stage(whole: m.Manifest, points: dict[str, tuple[int, ...]], s: int, count: int,
                kinds: dict[str, str], cut_id: str) -> m.Manifest:
    calls: dict[str, tuple[m.Call, ...]] = {}
    for name, program in whole.programs.items():
        if name in points:
            lo, hi = stage_bounds(points[name], len(program.calls))[s]
            calls[name] = program.calls[lo:hi]
        elif program.once or program.derive:
            calls[name] = program.calls
    stage = assemble(whole, keep_programs(whole, calls), kinds, m.Cut(cut_id, s, count))
    return stage


def cut_identity(whole: m.Manifest, points: dict[str, tuple[int, ...]]) -> str:
    """A 64-bit digest of the canonical JSON and the points (spec §3.7).

    kern uses FNV-1a over serde's bytes; ARCHITECTURE §8 only asks for determinism, and a byte
    loop in Python costs 0.3 s on a 36-layer model, so this is BLAKE2b with 8-byte digests.
    """
    data = writer.dumps(whole).encode()
    distinct = {tuple(at) for at in points.values()}
    if len(distinct) == 1:
        data += b"".join(struct.pack("<Q", a) for a in next(iter(distinct)))
    else:
        for name in sorted(points):
            data += name.encode() + b"".join(struct.pack("<Q", a) for a in points[name])
    return hashlib.blake2b(data, digest_size=8).hexdigest()
