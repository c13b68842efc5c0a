"""`kerncc check` derives each stage again from the input and compares what runs (issue 38.1).

A tampered stage that is pinned again (its sha256 in bundle.json updated and stage.py rendered
anew from the tampered plan, so that the runtime loads it) used to "prove": the symbolic proof
never looked at weight bindings or op definitions. Here the runtime is shown to load each such
bundle, and `check` (and `report`) to refuse it, naming the stage, the file and the JSON
pointer of the first difference. A sweep changes every leaf of every stage file (and of
bundle.json) of the tiny example's two-stage bundle and asserts that none is proved.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kerncc.bundle import reader
from kerncc.bundle.check import (_compare_stage as compare_stage, _input, check_bundle,
                                 compare_derived, derive, first_difference)
from kerncc.bundle.stage_py import render_stage
from kerncc.cli.main import main
from kerncc.diagnostics import KernccError
from kerncc.runtime import Bundle
from tests.bundles import whole_and_two


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return whole_and_two(tmp_path_factory.mktemp("derives"))


@pytest.fixture
def two(made: dict[str, Path], tmp_path: Path) -> Path:
    """A copy of the two-stage bundle beside a copy of its model (paths stay relative)."""
    shutil.copytree(made["two"].parent / "model", tmp_path / "model")
    shutil.copytree(made["two"], tmp_path / "two")
    return tmp_path / "two"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pin(bundle: Path, k: int) -> None:
    """Pin stage k again as an attacker would: its manifest's and plan's sha256 recorded anew
    and stage.py rendered from them, so the runtime loads the stage as it now is."""
    index = json.loads((bundle / "bundle.json").read_text())
    entry, folder = index["stages"][k], bundle / f"stage{k}"
    entry["manifest_sha256"] = sha((folder / "manifest.json").read_bytes())
    entry["plan_sha256"] = sha((folder / "plan.json").read_bytes())
    (bundle / "bundle.json").write_text(json.dumps(index, indent=2))
    checked = reader.read_index(bundle)
    files = reader.read_stage_files(checked, k)
    man, _ = reader.stage_manifest(files)
    plan = json.loads(files.texts["plan.json"])
    code = render_stage(man, plan, reader.stage_header(checked, files)).encode()
    (folder / "stage.py").write_bytes(code)
    entry["stage_py_sha256"] = sha(code)
    (bundle / "bundle.json").write_text(json.dumps(index, indent=2))


def edit_json(path: Path, edit) -> None:
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value, indent=2))


def refused(bundle: Path) -> str:
    with pytest.raises(KernccError) as err:
        check_bundle(bundle)
    return str(err.value) + "\n" + "\n".join(d.message for d in err.value.diagnostics)


def test_the_untampered_bundles_prove(made):
    for bundle in made.values():
        assert check_bundle(bundle).outputs > 0


def test_lm_head_rewired_to_the_embedding_loads_but_is_refused(two, capsys):
    def rewire(man: dict) -> None:
        man["buffers"]["lm_head.w"]["bind"][0]["tensor"] = "model.embed_tokens.weight"

    edit_json(two / "stage1" / "manifest.json", rewire)
    pin(two, 1)
    Bundle(two)  # the runtime loads it: only check can tell
    text = refused(two)
    assert "stage 1 manifest.json" in text
    assert "/buffers/lm_head.w/bind/0/tensor" in text
    assert main(["report", str(two)]) == 0
    out = capsys.readouterr().out
    assert "proved" not in out.replace("not proved", "")
    assert "not proved" in out


def test_an_epsilon_changed_in_manifest_and_plan_is_refused(two):
    eps = 1e-06

    def bump(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: bump(v) for k, v in value.items()}
        if isinstance(value, list):
            return [bump(v) for v in value]
        return 2e-06 if isinstance(value, float) and value == eps else value

    for name in ("manifest.json", "plan.json"):
        path = two / "stage1" / name
        path.write_text(json.dumps(bump(json.loads(path.read_text())), indent=2))
    pin(two, 1)
    Bundle(two)
    assert "stage 1 manifest.json" in refused(two)


def test_report_says_proved_only_after_checking(two, capsys):
    assert main(["report", str(two)]) == 0
    assert "proved" in capsys.readouterr().out
    (two.parent / "model" / "model.json").unlink()
    assert main(["report", str(two)]) == 0
    out = capsys.readouterr().out
    assert "not checked" in out and "proved" not in out.replace("not proved", "")


def test_a_stage_entry_without_its_sha256_is_refused(two):
    index = json.loads((two / "bundle.json").read_text())
    del index["stages"][0]["plan_sha256"]
    (two / "bundle.json").write_text(json.dumps(index, indent=2))
    assert "plan_sha256" in refused(two)


def test_first_difference_is_strict_about_types_and_order():
    assert first_difference({"a": 1}, {"a": 1}) is None
    assert first_difference({"a": 1}, {"a": 1.0}) == "/a"
    assert first_difference({"a": True}, {"a": 1}) == "/a"
    assert first_difference({"a": 1, "b": 2}, {"b": 2, "a": 1}) == "/a"
    assert first_difference([1, 2], [1, 2, 3]) == "/2"
    assert first_difference({"a": [0, {"x~/": 1}]}, {"a": [0, {"x~/": 2}]}) == "/a/1/x~0~1"


# ---------------------------------------------------------------------------------------------
# The sweep: every leaf of every stage file and of bundle.json, changed


def leaves(value: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(value, dict) and value:
        return [p for k, v in value.items() for p in leaves(v, (*path, k))]
    if isinstance(value, list) and value:
        return [p for i, v in enumerate(value) for p in leaves(v, (*path, i))]
    return [path]


def changed(value: Any) -> Any:
    """Another value of the leaf, as close as can be: what an edit of one field gives."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "x"
    if value is None:
        return 0
    return [0] if value == {} else {"x": 0}


def set_at(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    copy = dict(doc) if isinstance(doc, dict) else list(doc)
    copy[path[0]] = set_at(doc[path[0]], path[1:], value)
    return copy


# bundle.json's leaves the reader checks itself (the stage files' sha256s, the tokenizer files'
# record: tests/test_tokenizer_record.py) or that may differ (the folder's marker)
_NOT_COMPARED = ("manifest_sha256", "plan_sha256", "stage_py_sha256", "marker", "tokenizer")


def test_every_leaf_changed_is_refused(made, monkeypatch):
    """Every leaf of both stages' manifest.json and plan.json and of bundle.json, changed one
    at a time: compared with the stage derived from the input (once), each is refused."""
    from kerncc.diagnostics import Location
    from kerncc.manifest.jsonsource import PositionIndex

    # placing each of 4,000 refusals at its line costs minutes; the refusal is what counts
    monkeypatch.setattr(PositionIndex, "locator",
                        staticmethod(lambda text, file: lambda ptr: Location(ptr, file=file)))
    bundle = made["two"]
    index = reader.read_index(bundle)
    files = reader.stage_files(index)
    whole, locate = _input(index, None)
    derived = derive(index, whole, Path(bundle / index.data["input"]["path"]), locate)
    compare_derived(index, files, derived, given=False)  # the bundle as written: no difference
    swept = 0
    for k, stage in enumerate(files):
        for name in ("manifest.json", "plan.json"):
            doc = json.loads(stage.texts[name])
            for path in leaves(doc):
                text = json.dumps(set_at(doc, path, changed(_get(doc, path)))).encode()
                tampered = type(stage)(stage.index, stage.dir, {**stage.texts, name: text},
                                       stage.modules)
                with pytest.raises(KernccError, match=f"stage {k} {name}"):
                    compare_stage(tampered, derived)  # what compare_derived does per stage
                swept += 1
    for path in leaves(index.data):
        if any(key in _NOT_COMPARED for key in path):
            continue
        data = set_at(index.data, path, changed(_get(index.data, path)))
        tampered_index = type(index)(index.dir, data, index.text)
        with pytest.raises(KernccError, match="bundle.json differs"):
            compare_derived(tampered_index, files, derived, given=False)
        swept += 1
    assert swept > 3000


def _get(doc: Any, path: tuple) -> Any:
    for key in path:
        doc = doc[key]
    return doc
