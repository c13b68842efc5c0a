"""gpu_bench.write_rows, which puts a bench run's rows into docs/benchmarks.md (decode_bench.py
--doc), on the CPU: the first write goes before the anchor heading, a later one replaces what
stood between the markers and nothing else, and a missing file or broken markers are a clear
error that leaves the file as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from decode_bench import shown_command
from gpu_bench import DocError, write_rows

ANCHOR = "### Where a decode step's time goes"
DOC = f"# Benchmarks\n\nintro\n\n{ANCHOR}\n\nthe profile\n"
ROWS = [("decode", "decode batch 1: graph replay, ms, x roofline", "1.146, 1.89x"),
        ("decode", "decode 32 sequences x 512 tokens: step ms, x roofline", "2.025, 2.09x")]


def test_the_rows_go_before_the_anchor_then_replace_themselves(tmp_path: Path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    write_rows(doc, "decode_bench", ROWS, "run 1 at abc1234:", anchor=ANCHOR)
    first = doc.read_text()
    assert first.index("run 1 at abc1234:") < first.index(ANCHOR) < first.index("the profile")
    assert "| decode | decode batch 1: graph replay, ms, x roofline | 1.146, 1.89x |" in first
    assert first.startswith("# Benchmarks\n\nintro\n") and first.endswith("the profile\n")
    write_rows(doc, "decode_bench", ROWS[1:], "run 2 at def5678:", anchor=ANCHOR)
    second = doc.read_text()
    assert "run 1" not in second and "1.89x" not in second
    assert "run 2 at def5678:" in second and "2.09x" in second
    assert second.count("decode_bench rows: begin") == 1
    assert outside(second) == outside(first)  # only the block changed
    assert not list(tmp_path.glob(".*.tmp"))


def outside(text: str) -> tuple[str, str]:
    """What stands before the block's begin marker and after its end marker."""
    head, rest = text.split("<!-- decode_bench rows: begin", 1)
    return head, rest.split("<!-- decode_bench rows: end -->", 1)[1]


def test_without_the_anchor_the_rows_go_at_the_end(tmp_path: Path):
    doc = tmp_path / "b.md"
    doc.write_text("# only a title")
    write_rows(doc, "decode_bench", ROWS, "header", anchor=ANCHOR)
    text = doc.read_text()
    assert text.startswith("# only a title\n\n<!-- decode_bench rows: begin")
    assert text.endswith("<!-- decode_bench rows: end -->\n")


def test_a_missing_file_or_broken_markers_are_errors_and_change_nothing(tmp_path: Path):
    with pytest.raises(DocError, match="nope.md"):
        write_rows(tmp_path / "nope.md", "decode_bench", ROWS, "h")
    doc = tmp_path / "b.md"
    broken = DOC + "<!-- decode_bench rows: end -->\n"
    doc.write_text(broken)
    with pytest.raises(DocError, match="markers are broken .0 begin, 1 end.; fix them"):
        write_rows(doc, "decode_bench", ROWS, "h", anchor=ANCHOR)
    assert doc.read_text() == broken


def test_the_header_shows_the_measuring_command_without_the_runs_own_options():
    argv = ["--out", "/root/out/db", "--defaults-only", "--skip", "gemm,torch", "--doc",
            "docs/benchmarks.md", "--commit=927aae5", "--layers", "4"]
    assert shown_command(argv) == ("python tests/bench/decode_bench.py --defaults-only --skip "
                                   "gemm,torch --layers 4")
