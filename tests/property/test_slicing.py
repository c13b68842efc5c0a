"""share-states, slice-once, slice-derive: the stages still compute the whole, and keep no more
init calls than they need; kern's two slicer defects are fixed (spec §3.6 step 3)."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kerncc import symbolic
from kerncc.manifest import reader
from kerncc.analysis.access import call_access
from kerncc.diagnostics import KernccError
from kerncc.ir import IR
from kerncc.passes.cut import cut_ir
from kerncc.passes.share_states import ShareStates
from kerncc.passes.slicing import SliceDerive, SliceOnce
from tests.random_manifests import examples, random_manifest, random_points
from kerncc.verify import verify

SLICERS = (ShareStates(), SliceOnce(), SliceDerive())


def _lowered(data: st.DataObject):
    choose = lambda n: data.draw(st.integers(0, n - 1))  # noqa: E731
    options = dict(driven=data.draw(st.integers(1, 2)), inits=True, derives=True,
                   per_layer_states=data.draw(st.booleans()))
    man = reader.from_raw(random_manifest(choose, **options))
    calls = min(len(man.programs[p].calls) for p in man.driven_programs())
    points = tuple(random_points(choose, calls))
    try:
        ir = cut_ir(IR.from_manifest(man), {p: points for p in man.driven_programs()})
    except KernccError:
        return None
    for pass_ in SLICERS:
        ir = pass_.run(ir)
        ir.verify()
    return ir


@settings(max_examples=examples(200, 5_000))
@given(st.data())
def test_sliced_stages_compute_the_whole(data: st.DataObject) -> None:
    ir = _lowered(data)
    if ir is not None:
        symbolic.check_stages(ir.whole, list(ir.stages))


def _without_call(stage, program: str, index: int):
    p = stage.programs[program]
    calls = p.calls[:index] + p.calls[index + 1:]
    programs = {**stage.programs, program: attrs.evolve(p, calls=calls)}
    if not calls:
        del programs[program]
    return attrs.evolve(stage, programs=programs)


@settings(max_examples=examples(60, 1_000))
@given(st.data())
def test_every_kept_init_call_is_needed(data: st.DataObject) -> None:
    """Dropping any kept once/derive call breaks verification or the proof."""
    ir = _lowered(data)
    if ir is None:
        return
    for s, stage in enumerate(ir.stages):
        for name, program in stage.programs.items():
            if program.driven:
                continue
            for index in range(len(program.calls)):
                stages = list(ir.stages)
                stages[s] = _without_call(stage, name, index)
                with pytest.raises(KernccError):
                    verify(stages[s])
                    symbolic.check_stages(ir.whole, stages)


# ------------------------------------------------------------------ kern's defects, fixed

def kern_slice(stage, needed: set[str]) -> dict[str, list[int]]:
    """kern's slicer (spec §3.6 step 3): programs one by one in name order, buffers only."""
    kept: dict[str, list[int]] = {}
    for name in sorted(stage.programs):
        program = stage.programs[name]
        if not (program.once or program.derive):
            continue
        kept[name] = []
        for index in reversed(range(len(program.calls))):
            acc = call_access(program.calls[index], stage.ops[program.calls[index].op])
            if acc.buffer_writes & needed:
                kept[name].append(index)
                needed |= acc.buffer_reads
    return kept


def _manifest(programs: dict, states: dict | None = None) -> dict:
    buffers = {"x": {"dtype": "bf16", "shape": ["tokens", 8], "kind": "input"},
               "y": {"dtype": "bf16", "shape": ["tokens", 8], "kind": "output"},
               "w": {"dtype": "bf16", "shape": ["tokens", 8], "kind": "workspace"},
               "c": {"dtype": "bf16", "shape": [8], "kind": "carry"},
               "e": {"dtype": "bf16", "shape": [8], "kind": "carry"}}
    ops = {"f1": ["in buffer<bf16>", "out buffer<bf16>"], "f2": ["in buffer<bf16>",
           "in buffer<bf16>", "out buffer<bf16>"], "z": ["out buffer<bf16>"],
           "zs": ["out state"], "sr": ["in state", "in buffer<bf16>", "out buffer<bf16>"]}
    used = {c["op"] for p in programs.values() for c in p["calls"]}
    names = {a["buf"] for p in programs.values() for c in p["calls"] for a in c["args"]
             if "buf" in a}
    return {"schema_version": 5, "model": "slicing", "vars": {"tokens": {"max": 4}},
            "states": states or {},
            "buffers": {k: v for k, v in buffers.items() if k in names}, "modules": {},
            "ops": {k: {"params": v, "impl": {"launches": [{"entry": "extern:x"}]}}
                    for k, v in ops.items() if k in used},
            "programs": programs}


def _call(op: str, *args: dict, label: str) -> dict:
    return {"label": label, "op": op, "args": list(args)}


def _lower(raw: dict, at: int):
    man = reader.from_raw(raw)
    verify(man)
    ir = cut_ir(IR.from_manifest(man), {"p": (at,)})
    for pass_ in SLICERS:
        ir = pass_.run(ir)
    symbolic.check_stages(man, list(ir.stages))
    return ir


def test_a_state_initialiser_is_kept() -> None:
    """kern drops a once call that only initialises a state region the stage reads."""
    raw = _manifest({
        "init": {"once": True, "calls": [_call("zs", {"state": "s", "offset": 16}, label="zero")]},
        "p": {"batch": {"groups": 1, "rows": 1}, "calls": [
            _call("f1", {"buf": "x"}, {"buf": "w"}, label="a"),
            _call("sr", {"state": "s", "offset": 16}, {"buf": "w"}, {"buf": "y"}, label="b")]},
    }, states={"s": {"bytes_per_token": 32}})
    ir = _lower(raw, 1)
    stage1 = ir.stages[1]
    assert kern_slice(stage1, {"w"}) == {"init": []}
    assert [c.label for c in stage1.programs["init"].calls] == ["zero"]
    assert "init" not in ir.stages[0].programs  # stage 0 never touches `s`


def test_a_producer_in_an_earlier_named_program_is_kept() -> None:
    """kern loses `init_a`'s producer of `c` when only `init_b`'s call (kept later) reads it."""
    raw = _manifest({
        "init_a": {"once": True, "calls": [_call("z", {"buf": "c"}, label="make_c")]},
        "init_b": {"once": True, "calls": [_call("f1", {"buf": "c"}, {"buf": "e"},
                                                 label="make_e")]},
        "p": {"batch": {"groups": 1, "rows": 1}, "calls": [
            _call("f1", {"buf": "x"}, {"buf": "w"}, label="a"),
            _call("f2", {"buf": "w"}, {"buf": "e"}, {"buf": "y"}, label="b")]},
    })
    ir = _lower(raw, 1)
    stage1 = ir.stages[1]
    # on the unsliced stage, kern's walk keeps make_e but has already passed make_c by
    assert kern_slice(_lower_unsliced(raw), {"w", "e"}) == {"init_a": [], "init_b": [0]}
    assert [c.label for c in stage1.programs["init_a"].calls] == ["make_c"]
    assert [c.label for c in stage1.programs["init_b"].calls] == ["make_e"]


def _lower_unsliced(raw: dict):
    man = reader.from_raw(raw)
    return cut_ir(IR.from_manifest(man), {"p": (1,)}).stages[1]
