"""`kerncc dump --format dot`: the dataflow of one program for graphviz, with its cut.

Calls are boxes (`#index label` and the op), values are ellipses (`buffer@k`, `state+off@k`:
the k-th version); a solid edge is a write, a dashed one a read, a dotted one the read of the previous
version that a partial write makes (kerncc.analysis.dataflow). The picture is laid out to be
read: calls flow top to bottom, the calls of one layer (labels `l<k>.…`) sit in a box of their
own, stacked; a value sits beside the call that writes it (an input, beside its first reader).
On a pipeline IR each stage is a column of its own colour (the edges that cross a cut do not
push the next stage down), and a buffer that crosses a cut is red with its bytes. An uncut
program draws no stage box.
"""

from __future__ import annotations

from itertools import groupby

from kerncc import manifest as m
from kerncc.diagnostics import KernccError
from kerncc.ir import IR, dataflow_graph

STAGE_COLOURS = ("#cfe2f3", "#d9ead3", "#fff2cc", "#f4cccc", "#d9d2e9", "#fce5cd")
UNCUT_COLOUR = "#eeeeee"


def _quote(text: str) -> str:
    """A DOT string; a newline in `text` becomes DOT's line break `\\n`."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\n", "\\n") + '"'


def _node_id(node: tuple) -> str:
    return _quote("/".join(str(part) for part in node))


def _pick_program(man: m.Manifest, program: str | None) -> str:
    if program is None:
        driven = man.driven_programs()
        return driven[0] if driven else sorted(man.programs)[0]
    if program not in man.programs:
        known = ", ".join(sorted(man.programs))
        raise KernccError.single(f"no program `{program}` (programs: {known})")
    return program


def _stage_of(ir: IR, program: str, index: int) -> int:
    points = ir.points.get(program, ())
    return sum(index >= p for p in points)


def _layer(label: str | None) -> str | None:
    """The layer a call belongs to by its label (`l3.qkv_proj` -> `l3`); None outside one."""
    if not label or "." not in label:
        return None
    return label.split(".", 1)[0]


def _homes(graph) -> dict[tuple, int]:
    """The call each node is drawn beside: a call itself, a value its writer (or, for a value
    nothing in the program writes, its first reader)."""
    home: dict[tuple, int] = {}
    for node, data in graph.nodes(data=True):
        if data["kind"] == "call":
            home[node] = node[2]
            continue
        writers = [src[2] for src in graph.predecessors(node)]
        readers = [dst[2] for dst in graph.successors(node)]
        home[node] = min(writers) if writers else min(readers, default=0)
    return home


def render_dot(ir: IR, program: str | None = None) -> str:
    name = _pick_program(ir.whole, program)
    graph = dataflow_graph(ir.whole, [name]).to_networkx()  # the drawing reads networkx
    cut = len(ir.stages) > 1
    home = _homes(graph)
    stage = {node: _stage_of(ir, name, call) for node, call in home.items()}
    calls = sorted(n for n, d in graph.nodes(data=True) if d["kind"] == "call")
    members: dict[int, list[tuple]] = {}
    for node in graph.nodes:
        members.setdefault(home[node], []).append(node)
    lines = [f"digraph {_quote(name)} {{",
             "  rankdir=TB; newrank=true; nodesep=0.25; ranksep=0.3;",
             "  node [fontname=monospace, fontsize=11];",
             "  edge [arrowsize=0.6, fontname=monospace, fontsize=9];"]
    for s, in_stage in groupby(calls, key=lambda n: stage[n]):
        body = _layers(ir, graph, list(in_stage), members, stage, f"s{s}")
        if not cut:
            lines += [f"  {line}" for line in body]
            continue
        lines += [f"  subgraph cluster_stage{s} {{",
                  f"    label={_quote(f'stage {s}')}; style=dashed; fontname=monospace;",
                  f"    {_quote(f'stage{s}')} [shape=point, style=invis];",
                  *(f"    {line}" for line in body), "  }"]
    lines += _stage_order(calls, stage) if cut else []
    for src, dst, data in graph.edges(data=True):
        style = {"write": "solid", "read": "dashed", "partial": "dotted"}[data["access"]]
        extra = ", constraint=false" if stage[src] != stage[dst] else ""
        label = ", label=inout" if data["direction"] == "inout" else ""
        lines.append(f"  {_node_id(src)} -> {_node_id(dst)} [style={style}{label}{extra}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _layers(ir: IR, graph, calls: list[tuple], members: dict[int, list[tuple]],
            stage: dict[tuple, int], prefix: str) -> list[str]:
    """The node lines of consecutive calls: a box per run of calls of one layer, each call
    followed by the values drawn beside it."""
    lines: list[str] = []
    runs = groupby(calls, key=lambda n: _layer(graph.nodes[n]["label"]))
    for k, (layer, run) in enumerate(runs):
        nodes = [node for call in run for node in
                 sorted(members.get(call[2], ()), key=lambda n: n[0] != "call")]
        body = [f"{_node_id(n)} [{_attrs(ir, graph, n, stage)}];" for n in nodes]
        if layer is None:
            lines += body
            continue
        lines += [f"subgraph {_quote(f'cluster_{prefix}_{k}_{layer}')} {{",
                  f"  label={_quote(layer)}; style=rounded; color=grey; fontname=monospace;",
                  *(f"  {line}" for line in body), "}"]
    return lines


def _stage_order(calls: list[tuple], stage: dict[tuple, int]) -> list[str]:
    """Stage columns left to right: an invisible point atop each stage, all on one rank, joined
    left to right (dot draws such flat edges from left to right)."""
    stages = sorted({stage[c] for c in calls})
    firsts = [next(c for c in calls if stage[c] == s) for s in stages]
    anchors = [_quote(f"stage{s}") for s in stages]
    lines = [f"  {a} -> {_node_id(c)} [style=invis];" for a, c in zip(anchors, firsts)]
    lines.append(f"  {{ rank=min; {' '.join(a + ';' for a in anchors)} }}")
    lines.append(f"  {' -> '.join(anchors)} [style=invis, weight=100];")
    return lines


def _attrs(ir: IR, graph, node: tuple, stage: dict[tuple, int]) -> str:
    data = graph.nodes[node]
    if data["kind"] == "call":
        label, op = data["label"] or "", data["op"]
        text = f"#{node[2]} {label}" + (f"\n{op}" if op != label else "")
        colour = STAGE_COLOURS[stage[node] % len(STAGE_COLOURS)] if len(ir.stages) > 1 \
            else UNCUT_COLOUR
        return f"shape=box, style=filled, fillcolor={_quote(colour)}, label={_quote(text)}"
    return _value_attrs(node, graph, stage, ir.edges)


def _value_attrs(node: tuple, graph, stage: dict[tuple, int], edges) -> str:
    if node[0] == "buf":
        text = f"{node[1]}@{node[2]}"
    else:
        text = f"{node[1]}+{node[2]}@{node[3]}"
    targets = {stage[reader] for reader in graph.successors(node)} - {stage[node]}
    crossing = [e for e in edges if node[0] == "buf" and e.buffer == node[1]
                and e.source == stage[node] and e.target in targets]
    if crossing:
        text += "".join(f"\ncrosses {e.source}->{e.target}: {e.nbytes} B" for e in crossing)
        return f"shape=ellipse, color=red, penwidth=2, label={_quote(text)}"
    if not any(True for _ in graph.predecessors(node)):  # read only here: an input, a weight
        return f"shape=ellipse, color=grey50, fontcolor=grey30, label={_quote(text)}"
    return f"shape=ellipse, label={_quote(text)}"


def render_svg(source: str) -> str:
    """The dot source drawn as SVG by graphviz's `dot` (a clean error when it is missing)."""
    import shutil
    import subprocess

    dot = shutil.which("dot")
    if dot is None:
        raise KernccError.single("`--format svg` needs graphviz's `dot` on PATH (for example "
                                 "`apt install graphviz`); `--format dot` prints the source")
    try:
        done = subprocess.run([dot, "-Tsvg"], input=source, capture_output=True, text=True,
                              timeout=300)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise KernccError.single(f"graphviz's `dot` failed: {err}") from None
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise KernccError.single(f"graphviz's `dot` failed: {reason}")
    return done.stdout
