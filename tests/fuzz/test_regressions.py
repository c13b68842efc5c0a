"""Regression seeds: each input the fuzz suite once failed on, run through the same invariants
as the fuzz case that found it, plus the exact behaviour the fix gave it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from kerncc.manifest import reader
from kerncc.diagnostics import KernccError
from tests.random_manifests import Xorshift, random_manifest

from . import harness
from .test_manifests import check_manifest_everywhere

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = (ROOT / "examples" / "minimal.json").read_text()


def _with_value(text: str) -> str:
    """examples/minimal.json with `text` as the max of var `tokens` (line 6)."""
    assert '"tokens": {"max": 8,' in MINIMAL
    return MINIMAL.replace('"tokens": {"max": 8,', f'"tokens": {{"max": {text},')


# Numbers serde_json refuses were reported with no pointer and no line (`NaN` is not JSON),
# the 5000-digit integer as Python's own ValueError text. Now each is a diagnostic at its
# pointer and line:col (kerncc/manifest/jsonsource.py).
@pytest.mark.parametrize("raw, message", [
    ("NaN", "`NaN` is not JSON"), ("-Infinity", "`-Infinity` is not JSON"),
    ("1e400", "number out of range `1e400`"), ("1" * 5000, "(5000 digits)"),
])
def test_refused_numbers_are_located(tmp_path: Path, raw: str, message: str) -> None:
    path = tmp_path / "model.json"
    path.write_text(_with_value(raw))
    with pytest.raises(KernccError) as err:
        reader.load(path)
    (diag,) = err.value.diagnostics
    assert message in diag.message
    assert (diag.location.pointer, diag.location.line) == ("/vars/tokens/max", 6)
    check_manifest_everywhere(path)


def test_nesting_too_deep_is_located(tmp_path: Path) -> None:
    path = tmp_path / "model.json"
    path.write_text(_with_value("[" * 5000 + "]" * 5000))
    with pytest.raises(KernccError, match="recursion limit exceeded") as err:
        reader.load(path)
    assert err.value.diagnostics[0].location.line == 6
    check_manifest_everywhere(path)


# A byte that is not UTF-8 gave "cannot read `FILE`: 'utf-8' codec can't decode byte 0x80 in
# position 0" with no line:col (kerncc/manifest/reader.py).
def test_bytes_that_are_not_utf8_are_located(tmp_path: Path) -> None:
    path = tmp_path / "model.json"
    path.write_bytes(MINIMAL.encode().replace(b'"minimal"', b'"mini\xc3mal"'))
    with pytest.raises(KernccError) as err:
        reader.load(path)
    (diag,) = err.value.diagnostics
    assert diag.message == "not UTF-8: byte 0xc3 (invalid continuation byte)"
    assert (diag.location.line, diag.location.column) == (3, 17)
    check_manifest_everywhere(path)


# `kerncc verify` printed serving-protocol errors with a JSON pointer but no line:col, unlike
# every other error about a file (kerncc/cli/main.py).
def test_protocol_errors_are_located(tmp_path: Path) -> None:
    path = tmp_path / "model.json"
    path.write_text(json.dumps(random_manifest(Xorshift(11)), indent=2))
    outcome = harness.run_cli(["verify", path])
    assert outcome.code == 1
    assert f"{path}:4:3: /vars: no var has `axis: groups`" in outcome.err
    check_manifest_everywhere(path)


def _deep_grid(depth: int, op: str = "ceil_div") -> str:
    """examples/minimal.json with a `depth`-deep expression as the step launch's grid x."""
    doc = json.loads(MINIMAL)
    doc["ops"]["step"]["impl"]["launches"][0]["grid"][0] = "@@"
    expr = f'{{"{op}": [' * depth + '"tokens"' + ", 2]}" * depth
    return json.dumps(doc, indent=2).replace('"@@"', expr)


# A grid expression 300 deep (600 JSON levels, which Python's decoder takes) overflowed the
# stack in the reader, the writer and the kir printer: an internal RecursionError from verify,
# fmt and dump. JSON nested deeper than 128 levels is now refused as serde_json refuses it,
# at its pointer (kerncc/manifest/jsonsource.py); the deepest expression that parses (60 levels here)
# goes through every command.
@pytest.mark.parametrize("depth", [61, 300, 3000])
@pytest.mark.parametrize("op", ["ceil_div", "add"])
def test_expressions_nested_too_deep_are_refused(tmp_path: Path, depth: int, op: str) -> None:
    path = tmp_path / "model.json"
    path.write_text(_deep_grid(depth, op))
    with pytest.raises(KernccError, match=r"recursion limit exceeded \(nested deeper than 128\)"):
        reader.load(path)
    check_manifest_everywhere(path)


@pytest.mark.parametrize("op", ["ceil_div", "add"])
def test_the_deepest_expression_that_parses_goes_everywhere(tmp_path: Path, op: str) -> None:
    path = tmp_path / "model.json"
    path.write_text(_deep_grid(60, op))
    assert reader.load(path).ops["step"].launches[0].grid[0]
    check_manifest_everywhere(path)
    kir_path = tmp_path / "model.kir"
    kir_path.write_text(harness.run_cli(["fmt", path, "--to", "kir"]).out)
    check_manifest_everywhere(kir_path)


# The same in kir: a chain of 3000 `ceildiv 2` was "expression nested too deeply" at 1:1; now
# the builder names the attribute, and a chain that builds but nests too deep is located too.
@pytest.mark.parametrize("length, where", [(61, "18:53"), (3000, "18:47")])
def test_kir_expressions_nested_too_deep_are_located(tmp_path: Path, length: int,
                                                     where: str) -> None:
    text = harness.run_cli(["fmt", "--to", "kir", ROOT / "examples" / "minimal.json"]).out
    grid = "grid=[tokens" + " ceildiv 2" * length + ", 1, 1]"
    path = tmp_path / "model.kir"
    path.write_text(text.replace("grid=[tokens ceildiv 128, 1, 1]", grid))
    outcome = harness.run_cli(["verify", path])
    assert f"{path}:{where}: /ops/step/impl/launches/0/grid" in outcome.err
    assert "recursion limit exceeded" in outcome.err
    check_manifest_everywhere(path)


# `lower model.json -p cut,emit,cut -o out` wrote the bundle, then the second cut failed
# ("the manifest is already a stage of a cut"): exit 1 with `out/` left behind. A pass that
# writes the output now has to be the last (kerncc/pipeline/base.py: Pass.writes_output).
@pytest.mark.parametrize("spec, column", [("cut,emit,cut", 5), ("emit,liveness", 1),
                                          ("cut,emit{out=b},emit", 5)])
def test_nothing_runs_after_emit(tiny_model, tmp_path: Path, spec: str, column: int) -> None:
    target = tmp_path / "out"
    outcome = harness.run_cli(["lower", tiny_model[0], "-p", spec, "-o", target], cwd=tmp_path)
    assert outcome.code == 1
    assert f"pipeline:1:{column}: pass `emit` writes the output, so it comes last" in outcome.err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_runner_refuses_a_pass_after_emit(tiny_model, tmp_path: Path) -> None:
    from kerncc.ir import IR
    from kerncc.passes.emit import Emit
    from kerncc.passes.liveness import LivenessPass
    from kerncc.pipeline import run_pipeline

    ir = IR.from_manifest(reader.load(tiny_model[0]))
    with pytest.raises(KernccError, match="pass `emit` writes the output, so it comes last"):
        run_pipeline(ir, [Emit(out=str(tmp_path / "out")), LivenessPass()])
    assert not (tmp_path / "out").exists()


# ---- bundles: each edit once crashed `kerncc run` / Bundle.open (TypeError,
# UnicodeDecodeError, RecursionError) or `kerncc check` (AttributeError, RecursionError), or
# gave an error that named no file; now each is a KernccError naming bundle.json or the file.
def _index_edit(key_path: tuple, value) -> callable:
    def edit(bundle: Path) -> None:
        index = json.loads((bundle / "bundle.json").read_text())
        node = index
        for key in key_path[:-1]:
            node = node[key]
        node[key_path[-1]] = value
        (bundle / "bundle.json").write_text(json.dumps(index, indent=2))
    return edit


def _bytes_edit(rel: str, data: bytes) -> callable:
    def edit(bundle: Path) -> None:
        (bundle / rel).write_bytes(data)
    return edit


BUNDLE_EDITS = {
    "host_inputs null": (_index_edit(("stages", 0, "host_inputs"), None), "run"),
    "host_inputs empty": (_index_edit(("stages", 0, "host_inputs"), ""), "run"),
    "host_inputs short": (_index_edit(("stages", 0, "host_inputs"), ["positions"]), "run"),
    "edge from a string": (_index_edit(("edges", 0, "from"), "0"), "run"),
    "checkpoint a number": (_index_edit(("checkpoint",), 5), "run"),
    "stage dir a number": (_index_edit(("stages", 0, "dir"), 0), "run"),
    "stage dir outside": (_index_edit(("stages", 1, "dir"), "/"), "run"),
    "input a list": (_index_edit(("input",), []), "check"),
    "input path a number": (_index_edit(("input", "path"), 7), "check"),
    "input missing": (_index_edit(("input",), None), "check"),
    "input path to nothing": (_index_edit(("input", "path"), "nowhere.json"), "check"),
    "index not UTF-8": (_bytes_edit("bundle.json", b'{"format": "\xff"}'), "run"),
    "index too deep": (_bytes_edit("bundle.json", b"[" * 100_000 + b"]" * 100_000), "run"),
    "index a 5000-digit number": (_bytes_edit("bundle.json", b"1" * 5000), "check"),
}


@pytest.mark.parametrize("edit", sorted(BUNDLE_EDITS))
def test_damaged_bundle_index(tiny_bundle, tmp_path: Path, edit: str) -> None:
    from .test_bundles import check_bundle_everywhere

    bundle = tmp_path / "bundle"
    tiny_bundle.copy(bundle)
    damage, refuses = BUNDLE_EDITS[edit]
    damage(bundle)
    check_bundle_everywhere(bundle, {"bundle.json"})
    outcome = harness.run_cli([refuses, bundle, *(("--prompt", "1,2") if refuses == "run" else ())])
    assert outcome.code == 1 and "bundle.json" in outcome.err


# ---- command lines
# `--dump-dir` naming a file (or a place that cannot be made) was an internal FileExistsError;
# now it is an error about the flag, not located in the input (kerncc/pipeline/instruments.py: DumpDir).
@pytest.mark.parametrize("command", ["dump", "lower"])
def test_a_dump_dir_that_cannot_be_made(tiny_model, tmp_path: Path, command: str) -> None:
    (tmp_path / "file").write_text("x")
    outcome = harness.run_cli([command, tiny_model[0], "-p", "cut", "--dump-dir",
                               tmp_path / "file" / "dumps"])
    assert outcome.code == 1
    assert outcome.err.startswith(f"error: --dump-dir `{tmp_path / 'file' / 'dumps'}`: ")
    assert str(tiny_model[0]) not in outcome.err


# Found by the fuzz in kerncc/example and kerncc/cli/run.py, fixed there (f11092a):
# internal errors (FileExistsError, IsADirectoryError, FileNotFoundError, OverflowError).
def test_example_into_a_file(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("x")
    assert harness.run_cli(["example", "qwen", "-o", tmp_path / "taken"]).code == 1


def test_a_trace_into_a_directory(tiny_bundle, tmp_path: Path) -> None:
    assert harness.run_cli(["run", tiny_bundle.dir, "--prompt", "1,2", "--max-new", "1",
                            "--trace", tmp_path]).code == 1


# plan.json or manifest.json edited with its sha256 updated in bundle.json (so the hash check
# passes): each of these was an internal error of `kerncc run` (AttributeError, KeyError,
# TypeError, "negative dimensions", "could not broadcast") from the memory, staging, launch
# parsing or weights code. The loader now checks each plan against its manifest
# (kerncc/bundle/plan_check.py) and verifies each stage manifest (runtime/bundle.py).
def _edit_stage_file(bundle: Path, rel: str, tokens: tuple, value) -> None:
    import hashlib

    doc = json.loads((bundle / rel).read_text())
    node = doc
    for key in tokens[:-1]:
        node = node[key]
    node[tokens[-1]] = value
    (bundle / rel).write_text(json.dumps(doc, indent=2))
    index = json.loads((bundle / "bundle.json").read_text())
    key = {"plan.json": "plan_sha256", "manifest.json": "manifest_sha256"}[Path(rel).name]
    stage = next(e for e in index["stages"] if e["dir"] == Path(rel).parts[0])
    stage[key] = hashlib.sha256((bundle / rel).read_bytes()).hexdigest()
    (bundle / "bundle.json").write_text(json.dumps(index, indent=2))


STAGE_EDITS = {
    "staging null": ("stage1/plan.json", ("staging",), None, "/staging"),
    "staging too small": ("stage1/plan.json", ("staging", "total"), 0, "/staging/windows/0"),
    "a window that is not an object": ("stage1/plan.json", ("staging", "windows", 0), [],
                                       "/staging/windows/0"),
    "buffer bytes 0": ("stage1/plan.json", ("memory", "buffers", "block_table", "bytes"), 0,
                       "/memory/buffers/block_table"),
    "buffers a list": ("stage1/plan.json", ("memory", "buffers"), [], "/memory/buffers"),
    "arena bytes negative": ("stage1/plan.json", ("arena", "bytes"), -1, "/arena/bytes"),
    "arena bytes a string": ("stage0/plan.json", ("arena", "bytes"), "x", "/arena/bytes"),
    "program null": ("stage1/plan.json", ("programs", "convert"), None, "/programs/convert"),
    "launches a string": ("stage0/plan.json", ("programs", "decode", "calls", 0, "launches"),
                          "x", "/programs/decode/calls/0/launches"),
    "shape names no var": ("stage0/manifest.json", ("buffers", "residual", "shape", 0), "",
                           "/buffers/residual/shape/0"),
}


@pytest.mark.parametrize("edit", sorted(STAGE_EDITS))
def test_damaged_stage_files_with_their_hash_updated(tiny_bundle, tmp_path: Path,
                                                     edit: str) -> None:
    from kerncc.runtime import Bundle

    from .test_bundles import check_bundle_everywhere

    rel, tokens, value, ptr = STAGE_EDITS[edit]
    bundle = tmp_path / "bundle"
    tiny_bundle.copy(bundle)
    _edit_stage_file(bundle, rel, tokens, value)
    with pytest.raises(KernccError) as err:
        Bundle.open(bundle)
    assert [(d.location.file, d.location.pointer) for d in err.value.diagnostics][:1] == \
        [(str(bundle / rel), ptr)]
    check_bundle_everywhere(bundle, {Path(rel).name})


# Two calls of stage 0 swapped (the hash updated): `kerncc check` refused the proof with bare
# pointers into the whole manifest; they are now placed in it (kerncc/bundle/check.py; the
# same for `kerncc check WHOLE STAGE...` in kerncc/cli/main.py).
def test_a_proof_failure_is_located_in_the_input(tiny_bundle, tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    tiny_bundle.copy(bundle)
    doc = json.loads((bundle / "stage0" / "manifest.json").read_text())
    calls = doc["programs"]["decode"]["calls"]
    _edit_stage_file(bundle, "stage0/manifest.json", ("programs", "decode", "calls"),
                     [calls[0], calls[2], calls[1], *calls[3:]])
    outcome = harness.run_cli(["check", bundle])
    assert outcome.code == 1
    whole = bundle / ".." / "model.json"  # the input beside the copy, as bundle.json names it
    assert re.search(re.escape(str(whole)) + r":\d+:\d+: /programs/decode/calls/1:",
                     outcome.err), outcome.err
    stages = [bundle / "stage0" / "manifest.json", bundle / "stage1" / "manifest.json"]
    outcome = harness.run_cli(["check", tiny_bundle.manifest, *stages])
    assert re.search(re.escape(str(tiny_bundle.manifest)) + r":\d+:\d+: /programs/decode/calls/1:",
                     outcome.err), outcome.err


def test_a_token_id_past_int32(tiny_bundle) -> None:
    assert harness.run_cli(["run", tiny_bundle.dir, "--prompt", "99999999999",
                            "--max-new", "1"]).code == 1


# A launch record whose entry is a list (plan.json's hash updated): the cpu backend's kernel
# lookup raised TypeError (unhashable) while loading. One whose args lost an entry: the
# reference kernel's call failed with a message that named no file. Launch records are now
# checked against the ones the manifest gives (kerncc/bundle/plan_check.py), and launch
# parsing types a record's fields for callers that build plans themselves (launch.py).
@pytest.mark.parametrize("tokens, value, ptr", [
    (("programs", "decode", "calls", 0, "launches", 0, "entry"), [],
     "/programs/decode/calls/0/launches/0/entry"),
    (("programs", "load", "calls", 0, "launches", 0, "args"), [],
     "/programs/load/calls/0/launches/0/args"),
])
def test_launch_records_that_differ_from_the_manifest(tiny_bundle, tmp_path: Path, tokens,
                                                      value, ptr: str) -> None:
    from kerncc.runtime import Bundle

    bundle = tmp_path / "bundle"
    tiny_bundle.copy(bundle)
    _edit_stage_file(bundle, "stage0/plan.json", tokens, value)
    with pytest.raises(KernccError, match="but manifest.json and the arena give") as err:
        Bundle.open(bundle)
    assert err.value.diagnostics[0].location.pointer == ptr
    outcome = harness.run_cli(["run", bundle, "--prompt", "1,2", "--max-new", "1"])
    assert outcome.code == 1 and "stage0/plan.json" in outcome.err


def test_launch_parsing_types_the_record(tiny_bundle) -> None:
    from kerncc.runtime.launch import PlanError, parse_sites

    class Resolver:
        def pointer(self, record: dict, program: str) -> int:
            return 0

    plan = json.loads((tiny_bundle.dir / "stage0" / "plan.json").read_text())
    plan["programs"]["decode"]["calls"][0]["launches"][0]["entry"] = []
    with pytest.raises(PlanError, match=r"/programs/decode/calls/0/launches/0: `entry` is \[\]"):
        parse_sites(plan, Resolver())


# A label written `"\ud800"` (a lone surrogate: valid JSON escape syntax, but no character)
# parsed, then `cut` crashed encoding the manifest for its id (UnicodeEncodeError, an internal
# error); fmt would have printed what no UTF-8 stream can hold. serde_json refuses it, and now
# so does the reader, at the string's pointer, in JSON and in kir (kerncc/manifest/jsonsource.py).
@pytest.mark.parametrize("escape", ["\\ud800", "\\udfff", "x\\ud800y"])
def test_a_lone_surrogate_is_refused(tmp_path: Path, escape: str) -> None:
    path = tmp_path / "model.json"
    path.write_text(MINIMAL.replace('"minimal"', f'"{escape}"'))
    outcome = harness.run_cli(["verify", path])
    assert outcome.code == 1 and f"{path}:3:3: /model: lone surrogate" in outcome.err
    check_manifest_everywhere(path)
    kir_text = harness.run_cli(["fmt", "--to", "kir", ROOT / "examples" / "minimal.json"]).out
    kir_path = tmp_path / "model.kir"
    kir_path.write_text(kir_text.replace('model "minimal"', f'model "{escape}"'))
    outcome = harness.run_cli(["verify", kir_path])
    assert outcome.code == 1 and f"{kir_path}:2:1: /model: lone surrogate" in outcome.err
    check_manifest_everywhere(kir_path)


def test_a_surrogate_pair_is_a_character(tmp_path: Path) -> None:
    path = tmp_path / "model.json"
    path.write_text(MINIMAL.replace('"minimal"', '"\\ud83d\\ude00"'))
    assert reader.load(path).model == "\U0001f600"
    check_manifest_everywhere(path)


def test_logits_into_a_missing_directory(tiny_bundle, tmp_path: Path) -> None:
    target = tmp_path / "missing" / "logits.npy"
    harness.run_cli(["run", tiny_bundle.dir, "--prompt", "1,2", "--max-new", "1", "--logits",
                     target])
    assert target.exists()  # the directory is made


# kir took numbers JSON refuses: `max=1e400` became inf and `kerncc fmt --to json` printed
# `Infinity` (which kerncc's own reader refuses); a 5000-digit integer raised ValueError from
# int() in the builder (an internal error). Both are now "number out of range" at the token
# (kerncc/kir/parse.py).
@pytest.mark.parametrize("old, new, where", [
    ("max=2.5e-05", "max=1e400", "19:49"),
    ("max=2.5e-05", "max=" + "9" * 5000, "19:49"),
    ("schema_version 5", "schema_version " + "9" * 5000, "2:16"),
])
def test_kir_numbers_json_cannot_carry(tmp_path: Path, old: str, new: str, where: str) -> None:
    text = (ROOT / "golden" / "inputs" / "kitchen_sink.kir").read_text()
    assert old in text
    path = tmp_path / "model.kir"
    path.write_text(text.replace(old, new, 1))
    outcome = harness.run_cli(["fmt", path, "--to", "json"])
    assert outcome.code == 1 and f"{path}:{where}: number out of range" in outcome.err
    check_manifest_everywhere(path)


# A param type `bytes<²>` (str.isdigit takes it, int() does not) or with 5000 digits raised
# ValueError from the reader (kerncc/manifest/reader.py parse_param_type).
@pytest.mark.parametrize("count", ["²", "9" * 5000, "18446744073709551616"])
def test_byte_counts_that_are_not_a_usize(tmp_path: Path, count: str) -> None:
    doc = json.loads(MINIMAL)
    doc["ops"]["step"]["params"][-1] = f"bytes<{count}>"
    path = tmp_path / "model.json"
    path.write_text(json.dumps(doc, indent=2, ensure_ascii=False))
    with pytest.raises(KernccError, match="invalid byte count in param type"):
        reader.load(path)
    check_manifest_everywhere(path)


# `kerncc example qwen --head-dim 0` (or --kv-heads 0) divided by zero generating the model,
# an internal error; sizes below 1 are now refused (kerncc/example/config.py).
@pytest.mark.parametrize("flag", ["--head-dim", "--kv-heads", "--heads", "--vocab"])
def test_example_sizes_below_one(tmp_path: Path, flag: str) -> None:
    outcome = harness.run_cli(["example", "qwen", "-o", tmp_path / "out", flag, "0"])
    assert outcome.code == 1 and "must be positive" in outcome.err
