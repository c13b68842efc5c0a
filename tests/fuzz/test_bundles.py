"""Tampered bundles through `kerncc check`, `kerncc run` and the loader API.

The tiny model's two-stage bundle is emitted once per session; each case copies it and
tampers with one or two things: bytes of a cubin, a stage manifest, a plan, stage.py or the
index; a JSON edit at a random pointer of bundle.json, a manifest.json or a plan.json (half
the time with the recorded sha256 updated, so that the loader reads past the hash check);
recorded hashes edited; files deleted or truncated; the checkpoint or the input manifest
missing, or a corrupted copy of either named by the index. Then `kerncc check BUNDLE`,
`kerncc run BUNDLE --backend cpu --prompt 1,2 --max-new 1`, `Bundle.open`, `check_bundle` and
`Session(bundle, 0, "cpu")`: exit 0 or 1, only KernccError, every failure names a file, the
bundle (and the model beside it) unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kerncc.bundle.check import check_bundle
from kerncc.diagnostics import KernccError
from kerncc.runtime import Bundle, Session
from tests.random_manifests import examples

from . import harness
from .harness import fresh_dir, run_cli
from .mutate import dumps, mutate_bytes, mutate_json

TAMPERS = ("bytes", "json", "json+sha", "sha", "delete", "truncate", "checkpoint", "input",
           "index")
SHA_KEYS = {"manifest.json": "manifest_sha256", "plan.json": "plan_sha256",
            "stage.py": "stage_py_sha256"}
RUN = ("--backend", "cpu", "--prompt", "1,2", "--max-new", "1")


def files_of(bundle: Path) -> list[str]:
    return sorted(str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file())


def read_index(bundle: Path) -> dict:
    return json.loads((bundle / "bundle.json").read_text())


def write_index(bundle: Path, index: dict) -> None:
    (bundle / "bundle.json").write_text(json.dumps(index, indent=2))


def record_sha(bundle: Path, rel: str) -> None:
    """Update bundle.json's sha256 of the stage file `rel` to its current bytes."""
    stage, name = Path(rel).parts[0], Path(rel).name
    index = read_index(bundle)
    for entry in index["stages"]:
        if entry.get("dir") == stage and name in SHA_KEYS:
            entry[SHA_KEYS[name]] = hashlib.sha256((bundle / rel).read_bytes()).hexdigest()
    write_index(bundle, index)


# ------------------------------------------------------------------------------ tampers

def tamper(bundle: Path, kind: str, data: st.DataObject) -> set[str]:
    """Damage the bundle copy; the names an error about the damage may give."""
    files = files_of(bundle)
    json_files = [f for f in files if f.endswith(".json")]
    if kind == "bytes":
        rel = data.draw(st.sampled_from(files), label="file")
        (bundle / rel).write_bytes(mutate_bytes((bundle / rel).read_bytes(), data))
        return _names(rel)
    if kind in ("json", "json+sha"):
        rel = data.draw(st.sampled_from(json_files), label="file")
        doc = mutate_json(json.loads((bundle / rel).read_text()), data)
        (bundle / rel).write_text(dumps(doc))
        if kind == "json+sha" and rel != "bundle.json":
            record_sha(bundle, rel)
        return _names(rel)
    if kind == "sha":
        return _edit_sha(bundle, data)
    if kind in ("delete", "truncate"):
        rel = data.draw(st.sampled_from(files), label="file")
        if kind == "delete":
            (bundle / rel).unlink()
        else:
            data_ = (bundle / rel).read_bytes()
            (bundle / rel).write_bytes(data_[:data.draw(st.integers(0, len(data_)))])
        return _names(rel)
    return _edit_reference(bundle, kind, data)


def _point_beside(bundle: Path) -> None:
    """The copy's input and checkpoint paths lead to the copies beside it."""
    index = read_index(bundle)
    index["input"]["path"] = f"../{Path(index['input']['path']).name}"
    index["checkpoint"] = f"../{Path(index['checkpoint']).name}"
    write_index(bundle, index)


def tamper_if_possible(bundle: Path, kind: str, data: st.DataObject) -> set[str]:
    """`tamper`, unless an earlier tamper left nothing it can read (then nothing happens)."""
    try:
        return tamper(bundle, kind, data)
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError,
            RecursionError):
        return set()


# An edit of bundle.json may send the loader to any file it names (a stage dir, the input,
# the checkpoint), and the error then names that file.
INDEXED = {"bundle.json", "manifest.json", "plan.json", "stage.py", ".cubin", "model.json",
           "model.safetensors"}


def _names(rel: str) -> set[str]:
    """A stage manifest that still hashes right but changed fails the proof, which is located
    in the input manifest (model.json), whose calls the proof speaks of."""
    if rel == "bundle.json":
        return INDEXED
    # stage.py's header records its manifest's and plan's sha256: the rendering differs
    rendered = {"stage.py"} if rel.endswith(("manifest.json", "plan.json")) else set()
    return {Path(rel).name, "bundle.json"} | rendered | (
        {"model.json"} if rel.endswith("manifest.json") else set())


def _edit_sha(bundle: Path, data: st.DataObject) -> set[str]:
    index = read_index(bundle)
    entry = index["stages"][data.draw(st.integers(0, len(index["stages"]) - 1))]
    key = data.draw(st.sampled_from((*SHA_KEYS.values(), "input")), label="sha")
    value = data.draw(st.sampled_from(("0" * 64, "", "x", 5, None, [], "A" * 64,
                                       hashlib.sha256(b"").hexdigest())), label="sha value")
    if key == "input":
        index["input"]["sha256"] = value
    elif data.draw(st.booleans(), label="drop it"):
        entry.pop(key, None)
    else:
        entry[key] = value
    write_index(bundle, index)
    return INDEXED


def _edit_reference(bundle: Path, kind: str, data: st.DataObject) -> set[str]:
    """The index pointing at a missing or corrupted checkpoint or input, or odd stage dirs."""
    index = read_index(bundle)
    if kind == "index":
        entry = index["stages"][data.draw(st.integers(0, len(index["stages"]) - 1))]
        entry["dir"] = data.draw(st.sampled_from(("stage0", "stage1", "stage9", "", ".", "..",
                                                  "/", "modules", 0, None, ["stage0"])))
        write_index(bundle, index)
        return INDEXED
    key, original = ("checkpoint", index["checkpoint"]) if kind == "checkpoint" \
        else ("input", index["input"]["path"])
    how = data.draw(st.sampled_from(("missing", "corrupt", "directory")), label=kind)
    copy = bundle.parent / Path(original).name
    if how == "corrupt":
        copy.write_bytes(mutate_bytes((bundle / original).read_bytes(), data))
        if kind == "input" and data.draw(st.booleans(), label="record its sha"):
            index["input"]["sha256"] = hashlib.sha256(copy.read_bytes()).hexdigest()
    elif how == "directory":
        copy.unlink()
        copy.mkdir()
    # relative to the bundle, as a bundle names them
    path = os.path.relpath(copy if how != "missing" else bundle.parent / "nowhere" / copy.name,
                           bundle)
    if key == "checkpoint":
        index["checkpoint"] = path
    else:
        index["input"]["path"] = path
    write_index(bundle, index)
    return {copy.name, "bundle.json"}


# ------------------------------------------------------------------------------ entry points

def check_bundle_everywhere(bundle: Path, names: set[str]) -> None:
    """check, run and the loader API on `bundle`: the contract, and errors that name a file."""
    with harness.unchanged(bundle):
        checked = run_cli(["check", bundle])
        harness.count("bundle: check")
        harness.names_a_file(checked, names)
        ran = run_cli(["run", bundle, *RUN])
        harness.count("bundle: run")
        harness.names_a_file(ran, names)
        reported = run_cli(["report", bundle])
        harness.count("bundle: report")
        harness.names_a_file(reported, names)
        as_json = run_cli(["report", bundle, "--format", "json"])
        harness.count("bundle: report --format json")
        assert as_json.code == reported.code, "report's text and JSON forms disagree"
        if as_json.code == 0:
            json.loads(as_json.out)
        # report hashes every file as check does, but reads on without the input manifest
        # (its totals then say so): it passes wherever check passes, and says "proved" only
        # where check passes (it checks first).
        if checked.code == 0:
            assert reported.code == 0, "check passed, report refused"
            assert "proved now" in reported.out, reported.out
        elif reported.code == 0:
            assert "proved now" not in reported.out, \
                f"report says proved of a bundle check refuses:\n{checked.describe()}"
        harness.tally("bundle: report passed where check did not", 
                      reported.code == 0 and checked.code != 0)
        _api(bundle, names, ran.code)
    harness.tally("bundle: check passed", checked.code == 0)
    harness.tally("bundle: run passed", ran.code == 0)


def _api(bundle: Path, names: set[str], ran: int) -> None:
    proof = harness.api(check_bundle, bundle)
    harness.count("bundle: check_bundle API")
    if isinstance(proof, KernccError):
        harness.error_names_a_file(proof, names)
    opened = harness.api(Bundle.open, bundle)
    harness.count("bundle: Bundle.open API")
    if isinstance(opened, KernccError):
        harness.error_names_a_file(opened, names)
        assert ran == 1, "run took a bundle Bundle.open refuses"
        return
    session = harness.api(Session, opened, 0, "cpu")
    harness.count("bundle: Session API")
    if isinstance(session, KernccError):
        harness.error_names_a_file(session, names)


@pytest.fixture(scope="module")
def pristine(tiny_bundle) -> Path:
    """The untouched bundle passes every entry point (so that a refusal below means damage)."""
    outcome = run_cli(["check", tiny_bundle.dir])
    assert outcome.code == 0, outcome.describe()
    outcome = run_cli(["run", tiny_bundle.dir, *RUN])
    assert outcome.code == 0, outcome.describe()
    outcome = run_cli(["report", tiny_bundle.dir])
    assert outcome.code == 0, outcome.describe()
    return tiny_bundle.dir


@settings(max_examples=examples(180, 3000))
@given(data=st.data())
def test_tampered_bundles(data: st.DataObject, pristine: Path, tiny_bundle,
                          fuzz_root: Path) -> None:
    case = fresh_dir(fuzz_root)
    bundle = case / "bundle"
    shutil.copytree(pristine, bundle)
    # the input and the checkpoint beside the copy, where its relative paths lead
    for original in (tiny_bundle.manifest, tiny_bundle.checkpoint):
        shutil.copy(original, case / original.name)
    _point_beside(bundle)
    names: set[str] = set()
    for _ in range(data.draw(st.integers(1, 2), label="tampers")):
        names |= tamper_if_possible(bundle, data.draw(st.sampled_from(TAMPERS), label="tamper"),
                                    data)
    with harness.unchanged(tiny_bundle.manifest, tiny_bundle.checkpoint):
        check_bundle_everywhere(bundle, names)
    shutil.rmtree(case)
    harness.case("bundle: tampered")


# ------------------------------------------------------------------------------ re-pinned edits


def pin_stage(bundle: Path, k: int) -> None:
    """Record stage k's manifest and plan sha256 anew and render its stage.py from them, as an
    attacker would so that the runtime loads the edited stage."""
    from kerncc.bundle import reader
    from kerncc.bundle.stage_py import render_stage

    for name in ("manifest.json", "plan.json"):
        record_sha(bundle, f"stage{k}/{name}")
    checked = reader.read_index(bundle)
    files = reader.read_stage_files(checked, k)
    man, _ = reader.stage_manifest(files)
    code = render_stage(man, json.loads(files.texts["plan.json"]),
                        reader.stage_header(checked, files))
    (bundle / f"stage{k}" / "stage.py").write_text(code)
    record_sha(bundle, f"stage{k}/stage.py")


@settings(max_examples=examples(60, 1000))
@given(data=st.data())
def test_repinned_stage_edits_are_never_proved(data: st.DataObject, pristine: Path,
                                               tiny_bundle, fuzz_root: Path) -> None:
    """Any edit of a stage's manifest.json or plan.json, pinned again (sha256s and stage.py
    made to fit, so the runtime loads it), is refused by check unless it changed no value:
    zero false "proved" (issue 38.1)."""
    from kerncc.bundle.check import first_difference

    case = fresh_dir(fuzz_root)
    bundle = case / "bundle"
    shutil.copytree(pristine, bundle)
    for original in (tiny_bundle.manifest, tiny_bundle.checkpoint):
        shutil.copy(original, case / original.name)
    _point_beside(bundle)
    k = data.draw(st.sampled_from(range(len(read_index(bundle)["stages"]))), label="stage")
    name = data.draw(st.sampled_from(("manifest.json", "plan.json")), label="file")
    path = bundle / f"stage{k}" / name
    before = json.loads(path.read_text())
    after = mutate_json(before, data)
    path.write_text(dumps(after))
    try:
        pin_stage(bundle, k)
    except Exception:  # noqa: BLE001 - the edit does not read as a stage: no reader takes it
        pass
    proved = harness.api(check_bundle, bundle)
    if not isinstance(proved, KernccError):
        assert first_difference(after, before) is None, "check proved an edited stage"
    harness.tally("bundle: re-pinned edit proved", not isinstance(proved, KernccError))
    shutil.rmtree(case)
    harness.case("bundle: re-pinned edit")
