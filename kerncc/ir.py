"""The IR: the whole manifest, its stages once cut, the reports passes attach, cached analyses.

Before a cut the IR has one stage, the whole manifest. `cut` replaces `stages` with one verified
manifest per pipeline stage, plus the cut points (per driven program) and the crossing buffers
of each edge. Later passes rewrite stages (always through `kerncc.stage.assemble`, so every
stage verifies) and file reports under their own name (`reports["liveness"]`...). The IR is
frozen: passes return `attrs.evolve(ir, ...)`. Analyses are cached per manifest object.

The dataflow graph (`dataflow_graph`) is a networkx MultiDiGraph: nodes are calls
(`("call", program, index)`) and SSA-style value versions (`("buf", name, k)`,
`("state", name, offset, k)`); edges are reads (value -> call) and writes (call -> value) with
the direction and byte offset. Versions count writes in execution order over all programs
(derive, then once, then driven, each group in name order); a value written by one program and
read by another links the programs.
"""

from __future__ import annotations

from typing import Any

import attrs
import networkx as nx

from kerncc import manifest as m
from kerncc.analysis.access import call_access
from kerncc.stage import host_inputs


@attrs.frozen
class Edge:
    """A buffer that leaves stage `source` for stage `target`, and its bytes at var max."""

    buffer: str
    source: int
    target: int
    nbytes: int


@attrs.frozen
class IR:
    whole: m.Manifest
    stages: tuple[m.Manifest, ...]
    points: dict[str, tuple[int, ...]] = attrs.field(factory=dict)
    edges: tuple[Edge, ...] = ()
    reports: dict[str, Any] = attrs.field(factory=dict)
    history: tuple[str, ...] = ()
    source: str | None = None
    pipeline: str = ""

    @classmethod
    def from_manifest(cls, manifest: m.Manifest, source: str | None = None) -> IR:
        return cls(whole=manifest, stages=(manifest,), source=source)

    @property
    def is_pipeline(self) -> bool:
        return self.stages[0].cut is not None

    def with_report(self, name: str, report: Any) -> IR:
        return attrs.evolve(self, reports={**self.reports, name: report})

    def host_inputs(self, stage: int) -> list[str]:
        """Inputs of a stage the host must write: its inputs that no earlier stage hands on."""
        return host_inputs(self.stages[stage], {e.buffer for e in self.edges
                                                if e.target == stage})

    def verify(self) -> None:
        """Every stage verifies on its own (the runner calls this after each pass)."""
        from kerncc.diagnostics import KernccError
        from kerncc.verify import verify

        problems = []
        for index, stage in enumerate(self.stages):
            try:
                verify(stage)
            except KernccError as err:
                prefix = f"stage {index}: " if self.is_pipeline else ""
                problems += [attrs.evolve(d, message=prefix + d.message) for d in err.diagnostics]
        if problems:
            raise KernccError("manifest failed verification:", problems)

    def to_text(self) -> str:
        """The canonical text: the `.kir` of each stage (one, before a cut)."""
        from kerncc import kir

        if not self.is_pipeline:
            return kir.dumps(self.whole)
        parts = [f"// stage {i} of {len(self.stages)}\n{kir.dumps(s)}"
                 for i, s in enumerate(self.stages)]
        return "\n".join(parts)


def execution_order(man: m.Manifest) -> list[str]:
    """Programs in the order a runtime runs them: derive, once, then driven; names sorted."""
    def group(p: m.Program) -> int:
        return 0 if p.derive else 1 if p.once else 2
    return sorted(man.programs, key=lambda name: (group(man.programs[name]), name.encode()))


def dataflow_graph(man: m.Manifest, programs: list[str] | None = None) -> nx.MultiDiGraph:
    """The dataflow graph of `programs` (default: all, in execution order)."""
    graph = nx.MultiDiGraph()
    version: dict[tuple, int] = {}
    for name in programs or execution_order(man):
        for index, call in enumerate(man.programs[name].calls):
            node = ("call", name, index)
            graph.add_node(node, kind="call", label=call.label, op=call.op)
            _add_accesses(graph, man, call, node, version)
    return graph


def _add_accesses(graph: nx.MultiDiGraph, man: m.Manifest, call: m.Call, node: tuple,
                  version: dict[tuple, int]) -> None:
    for acc in call_access(call, man.ops.get(call.op)).accesses:
        key = ("buf", acc.name) if acc.kind == "buffer" else ("state", acc.name, acc.offset)
        if acc.reads:
            value = key + (version.get(key, 0),)
            graph.add_node(value, kind="value")
            graph.add_edge(value, node, access="read", direction=acc.direction,
                           offset=acc.offset)
        if acc.writes:
            version[key] = version.get(key, 0) + 1
            value = key + (version[key],)
            graph.add_node(value, kind="value")
            graph.add_edge(node, value, access="write", direction=acc.direction,
                           offset=acc.offset)
