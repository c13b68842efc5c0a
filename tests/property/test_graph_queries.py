"""The dataflow graph's queries equal the list scans they replaced (ARCHITECTURE §3).

On random manifests (tests/random_manifests.py, with and without partial writes) the cut's
crossing sets at every call index, the region owners and conflicts, and the once/derive slices
are the same whether asked of the graph (kerncc.analysis.dataflow) or computed by the old
scans (scan_oracles.py). The partial-write edge has its own example: `once: full(a); half(a@256)`
feeding `use(a)` keeps both producers.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kerncc.analysis.dataflow import backward_slice, cut_crossings, dataflow_graph
from kerncc.diagnostics import KernccError
from kerncc.ir import IR
from kerncc.manifest import reader
from kerncc.passes import slicing
from kerncc.passes.cut import cut_ir, region_owners
from kerncc.passes.share_states import ShareStates
from tests.random_manifests import examples, random_manifest, random_points
from kerncc.verify import verify
from tests.property.scan_oracles import scan_crossings, scan_region_conflicts, scan_walk_back


def _draw(data: st.DataObject):
    choose = lambda n: data.draw(st.integers(0, n - 1))  # noqa: E731
    options = dict(driven=data.draw(st.integers(1, 3)), inits=data.draw(st.booleans()),
                   derives=data.draw(st.booleans()), per_layer_states=data.draw(st.booleans()),
                   partial=data.draw(st.booleans()))
    man = reader.from_raw(random_manifest(choose, **options))
    verify(man)
    calls = min(len(man.programs[p].calls) for p in man.driven_programs())
    return man, tuple(random_points(choose, calls))


@settings(max_examples=examples(150, 3_000), deadline=None)
@given(st.data())
def test_crossings_and_owners_equal_the_scans(data: st.DataObject) -> None:
    man, points = _draw(data)
    for name in man.driven_programs():
        every = range(len(man.programs[name].calls) + 1)
        assert cut_crossings(man, name, every) == scan_crossings(man, name)
    at = {p: points for p in man.driven_programs()}
    owner, conflicts = region_owners(man, at)
    expected = scan_region_conflicts(man, at)
    assert [(p, r, i, owner[r], s) for r, p, i, s in conflicts] == expected


@settings(max_examples=examples(100, 2_000), deadline=None)
@given(st.data())
def test_slices_equal_the_scan(data: st.DataObject) -> None:
    man, points = _draw(data)
    try:
        ir = cut_ir(IR.from_manifest(man), {p: points for p in man.driven_programs()})
    except KernccError:
        return
    ir = ShareStates().run(ir)
    for stage in ir.stages:
        for which in ("once", "derive"):
            buffers, regions = slicing._needed_by_others(stage, which)
            extra = set(data.draw(st.lists(st.sampled_from(sorted(stage.buffers)), max_size=2)))
            for seeds in (buffers, buffers | extra):
                graph = slicing._walk_back(stage, which, set(seeds), set(regions))
                assert graph == scan_walk_back(stage, which, set(seeds), set(regions))


def _example(half_first: bool) -> tuple:
    full = {"label": "full", "op": "z", "args": [{"buf": "a"}]}
    half = {"label": "half", "op": "z", "args": [{"buf": "a", "offset": 256}]}
    raw = {"schema_version": 5, "model": "partial", "vars": {"tokens": {"max": 4}},
           "states": {}, "modules": {},
           "buffers": {"a": {"dtype": "bf16", "shape": [512], "kind": "carry"},
                       "x": {"dtype": "bf16", "shape": ["tokens", 8], "kind": "input"},
                       "y": {"dtype": "bf16", "shape": ["tokens", 8], "kind": "output"}},
           "ops": {"z": {"params": ["out buffer<bf16>"],
                         "impl": {"launches": [{"entry": "extern:x"}]}},
                   "use": {"params": ["in buffer<bf16>", "in buffer<bf16>", "out buffer<bf16>"],
                           "impl": {"launches": [{"entry": "extern:x"}]}}},
           "programs": {
               "init": {"once": True, "calls": [half, full] if half_first else [full, half]},
               "p": {"batch": {"groups": 1, "rows": 1}, "calls": [
                   {"label": "use", "op": "use",
                    "args": [{"buf": "a"}, {"buf": "x"}, {"buf": "y"}]}]}}}
    man = reader.from_raw(raw)
    verify(man)
    return man


def test_a_partial_write_keeps_the_earlier_producer() -> None:
    man = _example(half_first=False)
    assert backward_slice(man, ("init",), {"a"}, set()) == {"init": (0, 1)}
    assert slicing.slice_calls(man, "once")["init"] == man.programs["init"].calls
    graph = dataflow_graph(man)
    partial = [(u, v) for u, v, d in graph.edges() if d["access"] == "partial"]
    assert partial == [(("buf", "a", 1), ("call", "init", 1))]
    # The in-house graph is networkx's MultiDiGraph in small: the same ancestors there.
    import networkx as nx

    nxg = graph.to_networkx()
    assert nxg.number_of_edges() == len(graph.edges())
    assert {n for n in nx.ancestors(nxg, ("buf", "a", 2)) if n[0] == "call"} == {
        ("call", "init", 0), ("call", "init", 1)}


def test_a_full_write_after_a_partial_one_drops_it() -> None:
    man = _example(half_first=True)
    assert backward_slice(man, ("init",), {"a"}, set()) == {"init": (1,)}
