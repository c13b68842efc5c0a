"""Golden tests, lit style: each `golden/**/*.test` carries its own command line.

A case file holds `# RUN: kerncc <args>` (paths relative to `golden/`, where the command runs);
the expected output sits beside it as `<case>.expected`: the exit code, stdout and stderr of
the command, compared exactly. `pytest --update-goldens` rewrites the expected files.
"""

from __future__ import annotations

import contextlib
import io
import shlex
from pathlib import Path

import pytest

from kerncc.cli.main import main

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
CASES = sorted(p for p in GOLDEN.rglob("*.test"))


def run_line(case: Path) -> list[str]:
    for line in case.read_text().splitlines():
        if line.startswith("# RUN: kerncc "):
            return shlex.split(line[len("# RUN: kerncc "):])
    raise AssertionError(f"{case}: no `# RUN: kerncc ...` line")


def run_case(case: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(GOLDEN)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(run_line(case))
    return f"exit: {code}\n--- stdout\n{out.getvalue()}--- stderr\n{err.getvalue()}"


@pytest.mark.parametrize("case", CASES, ids=lambda p: str(p.relative_to(GOLDEN)))
def test_golden(case: Path, monkeypatch: pytest.MonkeyPatch, update_goldens: bool) -> None:
    got = run_case(case, monkeypatch)
    expected = case.with_suffix(".expected")
    if update_goldens or not expected.exists():
        expected.write_text(got)
        if not update_goldens:
            pytest.fail(f"{expected} was missing; written now, review and commit it")
    assert got == expected.read_text()
