"""The dataflow graph of a manifest, and the queries the passes ask of it (ARCHITECTURE §3).

Nodes are calls (`("call", program, index)`, ordered within their program as operations in an
MLIR block) and SSA-style value versions (`("buf", name, k)`, `("state", name, offset, k)`).
Edges go value -> call for a read and call -> value for a write, with `access` ("read",
"write" or "partial"), the param `direction` and the byte `offset`. A call makes at most one
new version of each buffer or region it writes. Versions count writes in execution order over
the programs given (default all: derive, then once, then driven, each group in name order), so
a value written by one program and read by another links the programs.

The partial-write edge: a write that may not cover the whole value also *reads* the previous
version (edge `access="partial"`), so no producer is lost. For a buffer that is every write but
an `out` at offset 0 (kern's kill rule, spec §3.3); a state region is never known to be
overwritten whole, so every region write is partial. A call that also reads the key (an
`inout`, or an `in` of the same buffer) has its read edge instead: same dependency.

Queries (each a pure function of the graph; the list scans they replaced are the oracles of
tests/property/test_graph_queries.py):
- `cut_crossings`: per cut point, the buffers produced before it and used after it;
- `backward_slice`: the calls of some programs that are ancestors of the values others read;
- `region_touches`: which calls touch each (state, offset) region.
The graph and the indexes are built once per manifest object (kerncc.analysis.cache).

The graph is a small adjacency structure (`Dataflow`) rather than a networkx MultiDiGraph:
the passes need successors and predecessors only, and importing networkx costs more than
building the graph of a 36-layer model. `Dataflow.to_networkx()` gives the MultiDiGraph for
anyone who wants networkx's algorithms.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from kerncc import manifest as m
from kerncc.analysis.access import Access, Region, program_access
from kerncc.analysis.cache import memo, per_manifest

if TYPE_CHECKING:
    import networkx as nx

CallNode = tuple[str, str, int]
Key = tuple  # ("buf", name) | ("state", name, offset)
EdgeData = dict[str, Any]


class Dataflow:
    """A directed multigraph: nodes with attributes, parallel edges with attributes."""

    def __init__(self) -> None:
        self.nodes: dict[tuple, EdgeData] = {}
        self.graph: dict[str, Any] = {}
        self._succ: dict[tuple, list[tuple[tuple, EdgeData]]] = {}
        self._pred: dict[tuple, list[tuple[tuple, EdgeData]]] = {}

    def __contains__(self, node: object) -> bool:
        return node in self.nodes

    def add_node(self, node: tuple, **data: Any) -> None:
        if node not in self.nodes:
            self.nodes[node] = data
            self._succ[node] = []
            self._pred[node] = []

    def add_edge(self, src: tuple, dst: tuple, **data: Any) -> None:
        self._succ[src].append((dst, data))
        self._pred[dst].append((src, data))

    def successors(self, node: tuple) -> Iterable[tuple]:
        return dict.fromkeys(dst for dst, _ in self._succ[node])

    def predecessors(self, node: tuple) -> Iterable[tuple]:
        return dict.fromkeys(src for src, _ in self._pred[node])

    def out_edges(self, node: tuple) -> list[tuple[tuple, tuple, EdgeData]]:
        return [(node, dst, data) for dst, data in self._succ[node]]

    def edges(self) -> list[tuple[tuple, tuple, EdgeData]]:
        """Every edge (source, target, data), sources in insertion order."""
        return [(src, dst, data) for src, out in self._succ.items() for dst, data in out]

    def to_networkx(self) -> nx.MultiDiGraph:
        import networkx as nx

        graph = nx.MultiDiGraph(**self.graph)
        graph.add_nodes_from(self.nodes.items())
        graph.add_edges_from(self.edges())
        return graph


def execution_order(man: m.Manifest) -> list[str]:
    """Programs in the order a runtime runs them: derive, once, then driven; names sorted."""
    def group(p: m.Program) -> int:
        return 0 if p.derive else 1 if p.once else 2
    return sorted(man.programs, key=lambda name: (group(man.programs[name]), name.encode()))


def dataflow_graph(man: m.Manifest, programs: Sequence[str] | None = None) -> Dataflow:
    """The dataflow graph of `programs` (default: all, in execution order), built once per
    manifest object and program list. Read-only: callers share it.

    `graph.graph["versions"]` is each key's last version after the last program.
    """
    return _graph(man, None if programs is None else tuple(programs))


@per_manifest
def _graph(man: m.Manifest, programs: tuple[str, ...] | None) -> Dataflow:
    return build_graph(man, programs)


def build_graph(man: m.Manifest, programs: Sequence[str] | None = None) -> Dataflow:
    """The dataflow graph, built afresh (what `dataflow_graph` caches)."""
    graph = Dataflow()
    version: dict[Key, int] = {}
    for name in execution_order(man) if programs is None else programs:
        calls = man.programs[name].calls
        for index, (call, acc) in enumerate(zip(calls, program_access(man, man.programs[name]))):
            node = ("call", name, index)
            graph.add_node(node, kind="call", label=call.label, op=call.op)
            _add_accesses(graph, node, acc.accesses, version)
    graph.graph["versions"] = MappingProxyType(version)
    return graph


def _key(acc: Access) -> Key:
    return ("buf", acc.name) if acc.kind == "buffer" else ("state", acc.name, acc.offset)


def _add_accesses(graph: Dataflow, node: CallNode, accesses: Sequence[Access],
                  version: dict[Key, int]) -> None:
    # In argument order (so nodes appear as the call spells its args), but every read is of
    # the version before the call, and a call makes one new version per key it writes.
    keys = [_key(a) for a in accesses]
    before = {key: version.get(key, 0) for key in keys}
    # A write keeps the old bytes it does not cover unless the call overwrites the whole
    # buffer; when the call also reads the key, the read edge already says so.
    covered = {key for key, a in zip(keys, accesses) if a.kills or a.reads}
    for key, acc in zip(keys, accesses):
        old = key + (before[key],)
        if acc.reads:
            _edge(graph, old, node, "read", acc)
        if not acc.writes:
            continue
        version[key] = before[key] + 1
        _edge(graph, node, key + (before[key] + 1,), "write", acc)
        if key not in covered:
            _edge(graph, old, node, "partial", acc)


def _edge(graph: Dataflow, src: tuple, dst: tuple, access: str, acc: Access) -> None:
    # The graph's add_node and add_edge, inlined: this runs for every access of every call.
    value = dst if src[0] == "call" else src
    if value not in graph.nodes:
        graph.add_node(value, kind="value")
    data = {"access": access, "direction": acc.direction, "offset": acc.offset}
    graph._succ[src].append((dst, data))
    graph._pred[dst].append((src, data))


# ---------------------------------------------------------------------------------------------
# The cut: values produced on one side and used on the other.

def live_spans(man: m.Manifest, program: str) -> tuple[tuple[str, int, int], ...]:
    """Per buffer value written in `program`: (buffer, writer index, last use index).

    A use is a read by a later call of the same program, or a partial write whose new version
    is used in turn (the old bytes it keeps are then still needed). A value with no use has
    last use -1, so it crosses no cut.
    """
    return memo(man, ("live_spans", program), lambda: _live_spans(man, program))


def _live_spans(man: m.Manifest, program: str) -> tuple[tuple[str, int, int], ...]:
    graph = dataflow_graph(man)
    last_use: dict[tuple, int] = {}
    spans = []
    # Later calls first: a partial writer's new version is measured before the old one.
    written = ((index, value) for index in reversed(range(len(man.programs[program].calls)))
               for value in graph.successors(("call", program, index)) if value[0] == "buf")
    for index, value in written:
        last_use[value] = _last_use(graph, program, value, last_use)
        spans.append((value[1], index, last_use[value]))
    return tuple(spans)


def _last_use(graph: Dataflow, program: str, value: tuple,
              last_use: dict[tuple, int]) -> int:
    best = -1
    for _, user, data in graph.out_edges(value):
        if user[1] != program:
            continue
        if data["access"] == "read":
            best = max(best, user[2])
            continue
        kept = value[:2] + (value[2] + 1,)  # the version the partial writer makes (later: done)
        best = max(best, last_use.get(kept, -1))
    return best


def cut_crossings(man: m.Manifest, program: str, points: Iterable[int]) -> list[frozenset[str]]:
    """For each cut point a: the buffers written by calls[:a] and used by calls[a:]."""
    spans = live_spans(man, program)
    return [frozenset(b for b, writer, last in spans if writer < a <= last) for a in points]


# ---------------------------------------------------------------------------------------------
# Slices: the calls whose values others need.

def backward_slice(man: m.Manifest, programs: tuple[str, ...], buffers: Iterable[str],
                   regions: Iterable[Region]) -> dict[str, tuple[int, ...]]:
    """The calls of `programs` (run in that order) that the values others read depend on.

    Others read `buffers` and `regions` after `programs` ran, so the seeds are the last
    versions those programs leave; the slice is every call among their ancestors.
    """
    graph = dataflow_graph(man, programs)
    versions = graph.graph["versions"]
    keys = [("buf", b) for b in buffers] + [("state", s, off) for s, off in regions]
    found = _ancestors(graph, [key + (versions[key],) for key in keys if versions.get(key, 0)])
    kept: dict[str, list[int]] = {p: [] for p in programs}
    for node in found:
        if node[0] == "call":
            kept[node[1]].append(node[2])
    return {p: tuple(sorted(indices)) for p, indices in kept.items()}


def _ancestors(graph: Dataflow, seeds: list[tuple]) -> set[tuple]:
    """The seeds and every node with a path to one (networkx.ancestors, many sources at once)."""
    found, stack = set(seeds), list(seeds)
    while stack:
        fresh = [p for p in graph.predecessors(stack.pop()) if p not in found]
        found.update(fresh)
        stack += fresh
    return found


# ---------------------------------------------------------------------------------------------
# State regions: who touches what.

def region_touches(man: m.Manifest) -> Mapping[Region, tuple[tuple[str, int], ...]]:
    """Each (state, offset) region: the calls (program, index) that read or write it, sorted."""
    return memo(man, "region_touches", lambda: _region_touches(man))


def _region_touches(man: m.Manifest) -> Mapping[Region, tuple[tuple[str, int], ...]]:
    graph = dataflow_graph(man)
    touches: dict[Region, set[tuple[str, int]]] = {}
    for node, data in graph.nodes.items():
        if data["kind"] != "value" or node[0] != "state":
            continue
        calls = touches.setdefault((node[1], node[2]), set())
        for end in (*graph.predecessors(node), *graph.successors(node)):
            calls.add((end[1], end[2]))
    return MappingProxyType({r: tuple(sorted(c)) for r, c in touches.items()})
