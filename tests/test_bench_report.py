"""bench/report.py, which every bench shares, on the CPU: the rows go between the bench's markers
in docs/benchmarks.md (replacing what stood there and nothing else, or at the end the first
time), a missing file or broken markers are a clear error that leaves the file as it was, the
header names the command that measures the same again, and a bench's failing section is a row."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.report import DocError, Report, doc_header, shown_command, write_rows

ROWS = [("decode", "decode batch 1: graph replay, ms, x roofline", "1.146, 1.89x"),
        ("decode", "decode 32 sequences x 512 tokens: step ms, x roofline", "2.025, 2.09x")]
BEGIN = "<!-- decode rows: begin (written by the bench; edit the bench, not these lines) -->"
END = "<!-- decode rows: end -->"
DOC = f"# Benchmarks\n\nintro\n\n{BEGIN}\nthe rows by hand\n{END}\n\n## Next\n\nmore\n"


def test_the_rows_replace_what_stood_between_the_markers_and_nothing_else(tmp_path: Path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    write_rows(doc, "decode", ROWS, "run 1 at abc1234:")
    first = doc.read_text()
    assert "the rows by hand" not in first and "run 1 at abc1234:" in first
    assert "| decode | decode batch 1: graph replay, ms, x roofline | 1.146, 1.89x |" in first
    assert first.startswith("# Benchmarks\n\nintro\n\n") and first.endswith("\n\n## Next\n\nmore\n")
    write_rows(doc, "decode", ROWS[1:], "run 2 at def5678:")
    second = doc.read_text()
    assert "run 1" not in second and "1.89x" not in second
    assert "run 2 at def5678:" in second and "2.09x" in second
    assert second.count(BEGIN) == 1 and second.count(END) == 1
    assert outside(second) == outside(first) == outside(DOC)  # only the block changed
    assert not list(tmp_path.glob(".*.tmp"))


def outside(text: str) -> tuple[str, str]:
    """What stands before the block's begin marker and after its end marker."""
    head, rest = text.split(BEGIN, 1)
    return head, rest.split(END, 1)[1]


def test_without_markers_the_rows_go_at_the_end(tmp_path: Path):
    doc = tmp_path / "b.md"
    doc.write_text("# only a title")
    write_rows(doc, "decode", ROWS, "header")
    text = doc.read_text()
    assert text.startswith(f"# only a title\n\n{BEGIN}\nheader\n")
    assert text.endswith(f"{END}\n")


def test_a_missing_file_or_broken_markers_are_errors_and_change_nothing(tmp_path: Path):
    with pytest.raises(DocError, match="nope.md"):
        write_rows(tmp_path / "nope.md", "decode", ROWS, "h")
    doc = tmp_path / "b.md"
    for broken in (DOC + END + "\n", DOC.replace(END, ""), f"{END}\n{BEGIN}\n"):
        doc.write_text(broken)
        with pytest.raises(DocError, match="markers are broken .* fix them"):
            write_rows(doc, "decode", ROWS, "h")
        assert doc.read_text() == broken


def test_the_header_shows_the_measuring_command_without_the_runs_own_options():
    argv = ["--out", "/root/out/db", "--defaults-only", "--skip", "gemm,torch", "--doc",
            "docs/benchmarks.md", "--commit=927aae5", "--layers", "4"]
    assert shown_command("decode", argv) == ("python -m bench.decode --defaults-only --skip "
                                             "gemm,torch --layers 4")
    header = doc_header("decode", "927aae5", "NVIDIA H200", argv)
    assert header.startswith("`python -m bench.decode --defaults-only --skip gemm,torch "
                             "--layers 4` at 927aae5 on NVIDIA H200, 20")


def test_a_failing_section_is_a_row_and_the_run_goes_on_to_write_everything(tmp_path: Path):
    report = Report("decode")
    with report.section("copy"):
        raise RuntimeError("no device")
    with report.section("decode"):
        report.row("decode", "batch 1, ms", "1.146")
    assert report.rows == [("copy", "FAILED", "RuntimeError: no device"),
                           ("decode", "batch 1, ms", "1.146")]
    report.results["decode_ms"] = 1.146
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    args = argparse.Namespace(out=str(tmp_path / "out"), doc=doc, commit="abc1234")
    assert report.finish(args, "NVIDIA H200", ["--doc", str(doc)]) == 0
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == {"decode_ms": 1.146}
    assert "| copy | FAILED | RuntimeError: no device |" in doc.read_text()
    args.doc = tmp_path / "missing.md"
    assert report.finish(args, "NVIDIA H200", []) == 1


@pytest.mark.parametrize("name", ["decode", "serve", "host_step", "lower", "hf_fidelity",
                                  "placement", "streams"])
def test_every_bench_answers_help_on_the_cpu_with_the_shared_options(name, capsys):
    import importlib

    bench = importlib.import_module(f"bench.{name}")
    with pytest.raises(SystemExit) as exit:
        bench.main(["--help"])
    assert exit.value.code == 0
    shown = capsys.readouterr().out
    assert f"python -m bench.{name}" in shown and "--doc" in shown and "--out" in shown


@pytest.mark.parametrize("argv, says", [
    (["--max-seqs", "5000"], "max_seqs must not exceed max_tokens"),
    (["--max-seqs", "-3"], "positive count"),
])
def test_bench_decode_refuses_an_example_it_cannot_build_before_writing_anything(
        argv, says, capsys, tmp_path, monkeypatch):
    from bench import decode

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with pytest.raises(SystemExit) as exit:
        decode.main([*argv, "--only", "copy"])
    assert exit.value.code == 2 and says in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_the_results_page_holds_one_table_of_every_bench_and_stays_short():
    page = (Path(__file__).parent.parent / "docs" / "benchmarks.md").read_text()
    for name in ("lower", "decode", "serve", "host_step", "hf_fidelity", "placement",
                 "streams"):
        begin = f"<!-- {name} rows: begin (written by the bench; edit the bench, not these lines) -->"
        assert page.count(begin) == page.count(f"<!-- {name} rows: end -->") == 1, name
        assert f"`python -m bench.{name}" in page.split(begin, 1)[1].splitlines()[1], name
    assert len(page.splitlines()) <= 300
