"""`dump --format dot`: every edge joins declared nodes, calls are coloured by stage, the
layout is one a person can read (issue 16: layers stacked, a column per stage, real line
breaks, no stage box on an uncut program)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from kerncc.manifest import reader
from kerncc.dot import render_dot
from kerncc.ir import IR, dataflow_graph
from kerncc.passes.cut import cut_ir

MODEL = Path(__file__).resolve().parent.parent / "golden" / "inputs" / "layers3.json"
NODE = re.compile(r'^\s+("(?:[^"\\]|\\.)*") \[(.*)\];$')
EDGE = re.compile(r'^\s+("(?:[^"\\]|\\.)*") -> ("(?:[^"\\]|\\.)*") \[(.*)\];$')


def _parse(text: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The visible nodes and edges (the invisible stage anchors left out)."""
    nodes, edges = {}, []
    for line in text.splitlines():
        if "style=invis" in line:
            continue
        if match := EDGE.match(line):
            edges.append((match[1], match[2]))
        elif match := NODE.match(line):
            nodes[match[1]] = match[2]
    return nodes, edges


def test_dot_of_a_cut_program() -> None:
    man = reader.load(MODEL)
    ir = cut_ir(IR.from_manifest(man), {p: (10,) for p in man.driven_programs()})
    text = render_dot(ir, "decode")
    assert text.startswith('digraph "decode" {') and text.rstrip().endswith("}")
    nodes, edges = _parse(text)
    graph = dataflow_graph(man, ["decode"])
    assert len(nodes) == len(graph.nodes)
    assert len(edges) == len(graph.edges())
    assert all(a in nodes and b in nodes for a, b in edges)
    assert text.count("subgraph cluster_stage") == 2
    crossing = [attrs for attrs in nodes.values() if "crosses 0->1" in attrs]
    assert crossing and all("color=red" in a for a in crossing)


def _edge_attrs(text: str) -> dict[tuple[str, str], str]:
    return {(m[1], m[2]): m[3] for line in text.splitlines() if (m := EDGE.match(line))}


def test_an_uncut_program_draws_no_stage_box_and_stacks_its_layers() -> None:
    text = render_dot(IR.from_manifest(reader.load(MODEL)), "decode")
    assert "cluster_stage" not in text and "stage 0" not in text
    layers = re.findall(r'subgraph "cluster_s0_\d+_(l\d+)"', text)
    assert layers == ["l0", "l1", "l2"]
    assert "rankdir=TB" in text and "newrank=true" in text


def test_labels_break_lines_with_dot_escape_not_a_literal_backslash() -> None:
    man = reader.load(MODEL)
    text = render_dot(cut_ir(IR.from_manifest(man), {p: (10,) for p in man.driven_programs()}),
                      "decode")
    assert "\\\\n" not in text  # the old `\\n`: graphviz drew a backslash and an n
    assert re.search(r'label="#\d+ [^"]*\\n[^"]*"', text)
    assert re.search(r'label="[^"]*@\d+\\ncrosses 0->1: \d+ B"', text)


def test_each_stage_is_a_column_the_cut_does_not_push_down() -> None:
    man = reader.load(MODEL)
    ir = cut_ir(IR.from_manifest(man), {p: (10, 20) for p in man.driven_programs()})
    text = render_dot(ir, "decode")
    assert text.count("subgraph cluster_stage") == 3
    assert '{ rank=min; "stage0"; "stage1"; "stage2"; }' in text
    edges = _edge_attrs(text)
    crossing = [(a, b) for (a, b), attrs in edges.items() if "constraint=false" in attrs]
    assert crossing and all(b.startswith('"call/decode/') for _, b in crossing)


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's `dot` is not installed")
def test_the_drawn_picture_is_taller_than_wide() -> None:
    import subprocess

    text = render_dot(IR.from_manifest(reader.load(MODEL)), "decode")
    plain = subprocess.run(["dot", "-Tplain"], input=text, capture_output=True, text=True,
                           timeout=60, check=True).stdout
    _, _, width, height = plain.splitlines()[0].split()
    assert float(height) > float(width)  # was 101 x 8 inches for 22 calls: one long row


def _fake_dot(tmp_path: Path, monkeypatch, script: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    dot = bin_dir / "dot"
    dot.write_text("#!/bin/sh\n" + script)
    dot.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


def test_svg_is_the_dot_source_drawn_by_graphviz(tmp_path, monkeypatch, capsys) -> None:
    from kerncc.cli.main import main

    # A stand-in `dot` that proves it was handed the dot source on stdin with -Tsvg.
    _fake_dot(tmp_path, monkeypatch, 'test "$1" = -Tsvg || exit 3\n'
              'grep -q "^digraph" && echo "<svg>drawn</svg>"\n')
    manifest = str(Path(__file__).parent.parent / "golden" / "inputs" / "layers3.json")
    assert main(["dump", manifest, "--format", "svg", "-p", "cut{at=4}"]) == 0
    assert capsys.readouterr().out == "<svg>drawn</svg>\n"


def test_svg_without_graphviz_is_a_clean_error(tmp_path, monkeypatch, capsys) -> None:
    from kerncc.cli.main import main

    monkeypatch.setenv("PATH", str(tmp_path))
    manifest = str(Path(__file__).parent.parent / "golden" / "inputs" / "layers3.json")
    assert main(["dump", manifest, "--format", "svg"]) == 1
    assert "needs graphviz's `dot` on PATH" in capsys.readouterr().err
    _fake_dot(tmp_path, monkeypatch, "echo 'syntax error in line 1' >&2; exit 1\n")
    assert main(["dump", manifest, "--format", "svg"]) == 1
    assert "graphviz's `dot` failed: syntax error in line 1" in capsys.readouterr().err
