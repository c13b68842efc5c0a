"""`kerncc dump --format dot`: the dataflow of one program for graphviz, with its cut.

Calls are boxes (label, op), values are ellipses (`buffer@k`, `state+off@k`); reads (dashed),
writes (solid) and partial writes' reads of the previous version (dotted) are edges. On a pipeline IR each call is coloured by the stage that runs it, cut points are
marked by a dashed cluster border, and the buffers that cross a cut carry their bytes.
"""

from __future__ import annotations

from kerncc import manifest as m
from kerncc.diagnostics import KernccError
from kerncc.ir import IR, dataflow_graph

STAGE_COLOURS = ("#cfe2f3", "#d9ead3", "#fff2cc", "#f4cccc", "#d9d2e9", "#fce5cd")


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


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


def render_dot(ir: IR, program: str | None = None) -> str:
    name = _pick_program(ir.whole, program)
    graph = dataflow_graph(ir.whole, (name,))
    crossing = {e.buffer: e for e in ir.edges}
    lines = [f"digraph {_quote(name)} {{", "  rankdir=TB;", "  node [fontname=monospace];"]
    for stage in range(len(ir.stages)):
        members = [n for n, d in graph.nodes.items()
                   if d["kind"] == "call" and _stage_of(ir, name, n[2]) == stage]
        lines.append(f"  subgraph cluster_stage{stage} {{")
        lines.append(f"    label={_quote(f'stage {stage}')}; style=dashed;")
        for node in members:
            data = graph.nodes[node]
            text = f"#{node[2]} {data['label'] or ''}\\n{data['op']}"
            colour = STAGE_COLOURS[stage % len(STAGE_COLOURS)]
            lines.append(f"    {_node_id(node)} [shape=box, style=filled, "
                         f"fillcolor={_quote(colour)}, label={_quote(text)}];")
        lines.append("  }")
    for node, data in graph.nodes.items():
        if data["kind"] == "value":
            lines.append(f"  {_node_id(node)} [{_value_attrs(node, crossing)}];")
    for src, dst, data in graph.edges():
        style = {"write": "solid", "read": "dashed", "partial": "dotted"}[data["access"]]
        lines.append(f"  {_node_id(src)} -> {_node_id(dst)} [style={style}, "
                     f"label={_quote(data['direction'])}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _value_attrs(node: tuple, crossing: dict) -> str:
    if node[0] == "buf":
        text = f"{node[1]}@{node[2]}"
    else:
        text = f"{node[1]}+{node[2]}@{node[3]}"
    if node[0] == "buf" and node[1] in crossing:
        edge = crossing[node[1]]
        text += f"\\ncrosses {edge.source}->{edge.target}: {edge.nbytes} B"
        return f"shape=ellipse, color=red, penwidth=2, label={_quote(text)}"
    return f"shape=ellipse, label={_quote(text)}"


def render_svg(source: str) -> str:
    """The dot source drawn as SVG by graphviz's `dot` (a clean error when it is missing)."""
    import shutil
    import subprocess

    from kerncc.diagnostics import KernccError

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
