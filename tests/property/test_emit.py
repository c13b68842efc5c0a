"""emit on random manifests and cuts: every bundle's stages verify, no two workspaces (or scratch
slots) live at the same call share arena bytes, and `check_bundle` proves the bundle again.

The overlap check does not trust kerncc.analysis.liveness: it decides from the calls alone,
by brute force, which workspaces hold a value still to be read at each call.
"""

from __future__ import annotations

import itertools
import json
import tempfile
from pathlib import Path

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from kerncc import manifest as m
from kerncc.manifest import writer
from kerncc.manifest import reader
from kerncc.analysis.access import call_access
from kerncc.bundle.check import check_bundle
from kerncc.diagnostics import KernccError
from kerncc.ir import IR
from kerncc.passes.cut import cut_ir
from kerncc.pipeline import run_pipeline
from tests.random_manifests import examples, random_manifest, random_points
from kerncc.verify import verify

SLICERS = ("", "share-states,slice-once,slice-derive,")


def _ir(data: st.DataObject, path: Path) -> IR | None:
    """A random manifest written to `path`, cut at random points (None: the cut refused)."""
    def choose(n: int) -> int:
        return data.draw(st.integers(0, n - 1))

    options = {"driven": data.draw(st.integers(1, 2)), "inits": data.draw(st.booleans()),
               "derives": data.draw(st.booleans()),
               "per_layer_states": data.draw(st.booleans())}
    raw = random_manifest(choose, **options)
    _vary(raw, choose)
    man = reader.from_raw(raw)
    path.write_text(writer.dumps(man))
    ir = IR.from_manifest(man, source=str(path))
    if data.draw(st.booleans()):
        return ir
    calls = min(len(man.programs[p].calls) for p in man.driven_programs())
    points = tuple(random_points(choose, calls))
    try:
        return cut_ir(ir, {p: points for p in man.driven_programs()})
    except KernccError:
        return None


def _vary(raw: dict, choose) -> None:
    """Workspaces of different sizes, and op scratch where an op `f1` exists."""
    for buf in raw["buffers"].values():
        if buf["kind"] == "workspace":
            buf["shape"] = ["tokens", 8 * (1 + choose(64))]
    if "f1" in raw["ops"] and choose(2):
        raw["ops"]["f1"]["impl"] = {
            "scratch": {"t": {"dtype": "f32", "shape": ["tokens", 4 * (1 + choose(16))]}},
            "launches": [{"entry": "extern:x", "params": ["in buffer<bf16>", "out buffer<f32>"],
                          "args": [{"param": 0}, {"scratch": "t"}]},
                         {"entry": "extern:x"}]}


def _held(accesses, name: str, i: int) -> bool:
    """Workspace `name` is busy at call i: accessed there, or holding a value read later
    (before any whole overwrite, kern's kill rule)."""
    if name in accesses[i].buffers:
        return True
    for j in range(i + 1, len(accesses)):
        if name in accesses[j].buffer_reads:
            return True
        if name in accesses[j].buffer_kills:
            return False
    return False


def _busy(man: m.Manifest, program: str) -> list[set[str]]:
    """Per call: the workspaces and scratch slots that need their bytes there."""
    calls = man.programs[program].calls
    accesses = [call_access(c, man.ops[c.op]) for c in calls]
    workspaces = [b for b, buf in man.buffers.items() if buf.kind == "workspace"]
    busy = []
    for i, call in enumerate(calls):
        names = {w for w in workspaces if _held(accesses, w, i)}
        names |= {f"op:{call.op}/scratch:{s}@{i}" for s in man.ops[call.op].scratch}
        busy.append(names)
    return busy


def _sizes(man: m.Manifest, program: str) -> dict[str, int]:
    env = man.vars_max()
    sizes = {b: buf.nbytes(env) for b, buf in man.buffers.items() if buf.kind == "workspace"}
    for i, call in enumerate(man.programs[program].calls):
        for s, decl in man.ops[call.op].scratch.items():
            dims = [d if isinstance(d, int) else env[d] for d in decl.shape]
            size = m.DTYPE_SIZES[decl.dtype]
            for d in dims:
                size *= d
            sizes[f"op:{call.op}/scratch:{s}@{i}"] = size
    return sizes


def check_arena(man: m.Manifest, plan: dict) -> None:
    for program in man.programs:
        arena = plan["arena"]["programs"][program]
        offsets, sizes = arena["offsets"], _sizes(man, program)
        assert arena["bytes"] <= plan["arena"]["bytes"]
        for names in _busy(man, program):
            spans = sorted((offsets[n], offsets[n] + sizes[n], n) for n in names if sizes[n])
            for (_, end, a), (start, _, b) in itertools.pairwise(spans):
                assert end <= start, f"`{a}` and `{b}` share arena bytes in `{program}`"
            assert all(stop <= arena["bytes"] for _, stop, _ in spans)


@settings(max_examples=examples(100, 2000))
@given(st.data())
def test_random_bundles_verify_never_overlap_and_check(data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ir = _ir(data, Path(tmp) / "model.json")
        if ir is None:
            return
        out = Path(tmp) / "bundle"
        slicers = data.draw(st.sampled_from(SLICERS))
        # the bundle records the spec that made it (check derives it again from that)
        at = next(iter(ir.points.values()), ()) if ir.is_pipeline else ()
        cut = f"cut{{at={','.join(map(str, at))}}}," if at else ""
        ir = attrs.evolve(ir, pipeline=f"{cut}{slicers}emit")
        run_pipeline(ir, f'{slicers}emit{{out="{out}"}}')
        index = json.loads((out / "bundle.json").read_text())
        assert len(index["stages"]) == (len(ir.stages) if ir.is_pipeline else 1)
        for entry in index["stages"]:
            folder = out / entry["dir"]
            stage = m.loads((folder / "manifest.json").read_text())
            verify(stage)
            check_arena(stage, json.loads((folder / "plan.json").read_text()))
        check_bundle(out)
