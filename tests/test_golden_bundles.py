"""Golden bundles: each `golden/bundles/<case>/` holds its input files, a `RUN` file with its own
command line (`# RUN: kerncc lower model.json -p ... -o bundle`) and the bundle it must produce
under `expected/`. The runner copies the inputs to a temporary directory, runs the command
there, and compares every file of the bundle byte for byte: same names, same contents (a bundle
is deterministic, so nothing is normalised). `pytest --update-goldens` rewrites `expected/`.
"""

from __future__ import annotations

import contextlib
import io
import shlex
import shutil
from pathlib import Path

import pytest

from kerncc.bundle.check import check_bundle
from kerncc.cli.main import main

BUNDLES = Path(__file__).resolve().parent.parent / "golden" / "bundles"
CASES = sorted(p for p in BUNDLES.iterdir() if (p / "RUN").is_file())
PREFIX = "# RUN: kerncc "


def run_line(case: Path) -> list[str]:
    for line in (case / "RUN").read_text().splitlines():
        if line.startswith(PREFIX):
            return shlex.split(line[len(PREFIX):])
    raise AssertionError(f"{case / 'RUN'}: no `{PREFIX}...` line")


def output_dir(argv: list[str]) -> str:
    if "-o" not in argv:
        raise AssertionError(f"the RUN line {argv} names no bundle directory (`-o DIR`)")
    return argv[argv.index("-o") + 1]


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` by its relative path, but kerncc's output marker (a random id
    marking the folder as kerncc's, kerncc.atomic.MARKER), whose presence is checked here."""
    from kerncc.atomic import MARKER

    assert (root / MARKER).is_file() or root.name == "expected"
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != MARKER}


def run_case(case: Path, work: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Copy the case's inputs to `work`, run its command there; the bundle directory."""
    for item in case.iterdir():
        if item.name not in ("RUN", "expected"):
            shutil.copy(item, work / item.name)
    argv = run_line(case)
    monkeypatch.chdir(work)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(argv)
    assert code == 0, err.getvalue()
    return work / output_dir(argv)


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.name)
def test_golden_bundle(case: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                       update_goldens: bool) -> None:
    bundle = run_case(case, tmp_path, monkeypatch)
    expected = case / "expected"
    if update_goldens or not expected.exists():
        shutil.rmtree(expected, ignore_errors=True)
        shutil.copytree(bundle, expected)
        if not update_goldens:
            pytest.fail(f"{expected} was missing; written now, review and commit it")
    got, want = tree(bundle), tree(expected)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], f"{case.name}/{name} differs from the golden"
    check_bundle(bundle)


def test_a_case_is_deterministic_wherever_it_is_written(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs in different directories give byte-identical bundles."""
    case = CASES[0]
    first = run_case(case, tmp_path, monkeypatch)
    elsewhere = tmp_path / "a" / "b"
    elsewhere.mkdir(parents=True)
    assert tree(first) == tree(run_case(case, elsewhere, monkeypatch))
