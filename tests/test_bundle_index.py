"""bundle.json's fields (kerncc.bundle.index): the one check the runtime, check and report use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kerncc.bundle.check import check_bundle
from kerncc.bundle.index import index_problems
from kerncc.cli.main import main
from kerncc.diagnostics import KernccError
from kerncc.bundle.report import read_report
from kerncc.runtime import Bundle

GOLDEN_MODEL = Path(__file__).resolve().parent.parent / "golden" / "bundles" / "cut-two"


def _index() -> dict:
    return {"format": "kerncc-bundle/1", "kerncc": "0.1.0", "pipeline": "emit",
            "input": {"path": "../m.json", "sha256": "ab"}, "checkpoint": None, "cut": None,
            "stages": [{"index": 0, "dir": "stage0", "manifest_sha256": "ab",
                        "plan_sha256": "cd", "stage_py_sha256": None, "calls": {"p": 2},
                        "host_inputs": ["x"]}],
            "edges": [{"buffer": "h", "from": 0, "to": 1, "bytes": 64}],
            "proof": {"checked": True, "programs": ["p"], "outputs": 1, "carries": 0,
                      "state_regions": 0}}


def test_a_documented_index_has_no_problems() -> None:
    assert index_problems(_index()) == []


def test_only_format_stages_and_dir_are_required() -> None:
    assert index_problems({"format": "kerncc-bundle/1", "stages": [{"dir": "s"}]}) == []


def test_every_problem_is_found_with_its_pointer() -> None:
    index = _index()
    index["kerncc"] = 1
    index["stages"][0]["calls"]["p"] = "two"
    index["stages"][0]["host_inputs"] = ["x", 3]
    index["edges"][0]["from"] = True  # a boolean is no integer
    del index["edges"][0]["bytes"]
    index["cut"] = {"id": "x", "points": {"p": [1, "2"]}}
    index["proof"]["checked"] = "yes"
    assert index_problems(index) == [
        ("/kerncc", "expected a string or null, found an integer"),
        ("/cut/points/p/1", "expected an integer, found a string"),
        ("/stages/0/calls/p", "expected an integer, found a string"),
        ("/stages/0/host_inputs/1", "expected a string, found an integer"),
        ("/edges/0/from", "expected an integer, found a boolean"),
        ("/edges/0/bytes", "the required field `bytes` is missing"),
        ("/proof/checked", "expected a boolean, found a string"),
    ]


@pytest.mark.parametrize("stages, problem", [
    ([], ("/stages", "a bundle has at least one stage")),
    ([{"index": 0}], ("/stages/0/dir", "the required field `dir` is missing")),
    ([{"dir": "../elsewhere"}], ("/stages/0/dir", "stage directory `../elsewhere` is not "
                                                  "inside the bundle")),
    ([{"dir": "/abs"}], ("/stages/0/dir", "stage directory `/abs` is not inside the bundle")),
    ("stage0", ("/stages", "expected a list, found a string")),
])
def test_stages(stages, problem) -> None:
    index = _index()
    index["stages"] = stages
    assert problem in index_problems(index)


def test_runtime_check_and_report_refuse_the_same_index_at_the_same_place(
        tmp_path: Path) -> None:
    """The integer `kerncc` that check and the runtime passed and report refused (fuzz)."""
    for name in ("model.json", "gemm.cubin"):
        (tmp_path / name).write_bytes((GOLDEN_MODEL / name).read_bytes())
    out = tmp_path / "b"
    assert main(["lower", str(tmp_path / "model.json"), "-p", "cut{at=4},emit", "-o",
                 str(out)]) == 0
    index = json.loads((out / "bundle.json").read_text())
    index["kerncc"] = 1
    (out / "bundle.json").write_text(json.dumps(index, indent=1))
    line = next(i for i, text in enumerate((out / "bundle.json").read_text().splitlines(), 1)
                if '"kerncc": 1' in text)
    for read in (check_bundle, read_report, Bundle):
        with pytest.raises(KernccError) as err:
            read(out)
        where = err.value.diagnostics[0].location
        assert (where.file, where.pointer, where.line) == (str(out / "bundle.json"),
                                                           "/kerncc", line), read
