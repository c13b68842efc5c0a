"""`kerncc report BUNDLE` (kerncc.bundle.report): deterministic, and clean errors for damaged bundles.

The goldens (golden/report/) pin the text and JSON forms; here: the report does not depend on
where the bundle lies, agrees with plan.json and bundle.json, and any value of those two files
replaced by one of the wrong type gives a KernccError naming the file, never a traceback.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kerncc.cli.main import main
from kerncc.diagnostics import KernccError
from kerncc.bundle.report import read_report

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
CUT_ONE = GOLDEN / "bundles" / "cut-one"


def _kerncc(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    """A copy of the cut-one golden bundle beside its input manifest."""
    shutil.copy(CUT_ONE / "model.json", tmp_path / "model.json")
    shutil.copytree(CUT_ONE / "expected", tmp_path / "bundle")
    return tmp_path / "bundle"


def test_the_report_does_not_depend_on_where_the_bundle_lies(bundle: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    here = _kerncc("report", str(bundle))
    monkeypatch.chdir(bundle.parent)
    there = _kerncc("report", "bundle")
    assert here == there
    assert here[0] == 0 and str(bundle.parent) not in here[1]


def test_the_report_agrees_with_the_bundle_files(bundle: Path) -> None:
    report = read_report(bundle)
    index = json.loads((bundle / "bundle.json").read_text())
    assert [e.to_json()["buffers"] for e in report.edges] == [
        [{"buffer": e["buffer"], "bytes": e["bytes"]}] for e in index["edges"]]
    for stage, entry in zip(report.stages, index["stages"]):
        plan = json.loads((bundle / entry["dir"] / "plan.json").read_text())
        assert stage.calls == entry["calls"]
        assert stage.arena.bytes == plan["arena"]["bytes"]
        assert stage.arena.lower_bound <= stage.arena.bytes <= stage.arena.naive
        assert stage.staging["peak"] == plan["staging"]["peak"]
        assert {m.sha256 for m in stage.modules} == set(plan["modules"])


def test_json_and_text_forms(bundle: Path) -> None:
    code, out, _ = _kerncc("report", "--format", "json", str(bundle))
    assert code == 0
    data = json.loads(out)
    assert data == read_report(bundle).to_json()
    assert data["input"] == {"path": "../model.json", "status": "matches"}


def test_a_changed_input_manifest_is_noted_not_fatal(bundle: Path) -> None:
    (bundle.parent / "model.json").write_text((bundle.parent / "model.json").read_text() + " ")
    report = read_report(bundle)
    assert report.input_status == "changed"
    assert "the input manifest changed since emit" in report.to_text()


def _paths(value: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every position inside a JSON value (objects and lists), depth first."""
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else ()
    for key, child in items:
        yield prefix + (key,)
        yield from _paths(child, prefix + (key,))


def _replace(value: Any, path: tuple, new: Any) -> Any:
    value = json.loads(json.dumps(value))
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = new
    return value


def _wrong(value: Any) -> list[Any]:
    """Values of other types than `value` (a string for a number, a number for a string...)."""
    if isinstance(value, str):
        return [0, None]
    if isinstance(value, bool) or value is None:
        return ["x"]
    if isinstance(value, int):
        return ["x", True]
    return ["x", None]


def _mutants(data: Any, skip: Callable[[tuple], bool] = lambda path: False
             ) -> Iterator[tuple[tuple, Any]]:
    for path in _paths(data):
        if skip(path):
            continue
        value = data
        for key in path:
            value = value[key]
        for wrong in _wrong(value):
            yield path, _replace(data, path, wrong)


def _rehash(bundle: Path, stage_dir: str) -> None:
    index = json.loads((bundle / "bundle.json").read_text())
    for entry in index["stages"]:
        if entry.get("dir") == stage_dir:
            entry["plan_sha256"] = hashlib.sha256(
                (bundle / stage_dir / "plan.json").read_bytes()).hexdigest()
    (bundle / "bundle.json").write_text(json.dumps(index))


def _outcome(bundle: Path) -> None:
    """The report reads or fails with a KernccError; anything else fails the test."""
    try:
        read_report(bundle).to_text()
    except KernccError as err:
        assert str(bundle) in str(err) or any(
            str(bundle) in (d.location.file or "") for d in err.diagnostics), str(err)


def test_any_wrong_value_in_bundle_json_is_a_clean_error(bundle: Path) -> None:
    original = json.loads((bundle / "bundle.json").read_text())
    for _, mutant in _mutants(original):
        (bundle / "bundle.json").write_text(json.dumps(mutant))
        _outcome(bundle)


def test_any_wrong_value_in_plan_json_is_a_clean_error(bundle: Path) -> None:
    plan_path = bundle / "stage1" / "plan.json"
    original = json.loads(plan_path.read_text())
    index = (bundle / "bundle.json").read_text()
    # The report reads no launch record (only each program's kind) and nothing of `memory`.
    skip = lambda path: path[0] == "memory" or (path[0] == "programs" and len(path) > 2)
    for _, mutant in _mutants(original, skip):
        plan_path.write_text(json.dumps(mutant))
        (bundle / "bundle.json").write_text(index)
        _rehash(bundle, "stage1")
        _outcome(bundle)
