"""A bundle is data (issue 15): nothing in it executes, `check` proves what runs, paths stay
inside, inputs are bounded, `-o` deletes only kerncc's files, weights are finite.

Each test reproduces one finding of the issue on the tiny example model (cpu backend) and
expects the refusal, or the untampered result. Every tampered bundle re-records the sha256 of
what it changed, as an attacker who writes bundle.json would.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from kerncc.bundle.check import check_bundle
from kerncc.bundle.report import read_report
from kerncc.cli.main import main
from kerncc.diagnostics import KernccError, render_error
from kerncc.example import generate
from kerncc.runtime import Bundle, Chain
from reference_loop import alone
from kerncc.checkpoint.safetensors import load_file, save_file

PIPELINE = "cut,slice-derive,emit"
TOKENS = "49 130 222 98"  # README: the tiny model's answer to 1,2,3 (4 new tokens)


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, Path]:
    return generate(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="module")
def emitted(model) -> Path:
    out = model[0].parent / "out"
    assert main(["lower", str(model[0]), "-p", PIPELINE, "-o", str(out)]) == 0
    return out


@pytest.fixture
def bundle(emitted, tmp_path) -> Path:
    """A copy of the bundle beside copies of its input and checkpoint (paths stay relative)."""
    for name in ("model.json", "model.safetensors"):
        shutil.copy(emitted.parent / name, tmp_path / name)
    shutil.copytree(emitted, tmp_path / "out")
    return tmp_path / "out"


def rehash(bundle: Path, stage: int, name: str) -> None:
    """Record the file's new sha256 in bundle.json, as whoever writes bundle.json can."""
    key = {"manifest.json": "manifest_sha256", "plan.json": "plan_sha256",
           "stage.py": "stage_py_sha256"}[name]
    index = json.loads((bundle / "bundle.json").read_text())
    data = (bundle / f"stage{stage}" / name).read_bytes()
    index["stages"][stage][key] = hashlib.sha256(data).hexdigest()
    (bundle / "bundle.json").write_text(json.dumps(index, indent=1))


def edit_index(bundle: Path, **fields) -> None:
    index = json.loads((bundle / "bundle.json").read_text())
    index.update(fields)
    (bundle / "bundle.json").write_text(json.dumps(index, indent=1))


def every_reader(bundle: Path) -> list[str]:
    """The refusal of each reader (runtime, check, report): all three must refuse."""
    messages = []
    for read in (Bundle, check_bundle, read_report):
        with pytest.raises(KernccError) as err:
            read(bundle)
        messages.append(str(err.value))
    return messages


def run_tokens(target: Path, *flags: str) -> tuple[int, str, str]:
    return cli("run", str(target), "--backend", "cpu", "--prompt", "1,2,3", "--max-new", "4",
               *flags)


# ---------------------------------------------------------------------------------------------
# 1, 2: what runs is kerncc's rendering of plan.json, never the bundle's stage.py


def test_the_untampered_bundle_runs_and_checks(bundle):
    code, out, err = run_tokens(bundle)
    assert (code, out.split("\n")[-2]) == (0, TOKENS), err
    assert cli("check", str(bundle))[0] == 0


@pytest.mark.parametrize("unpin", [False, True])
def test_code_appended_to_stage_py_never_runs(bundle, tmp_path, unpin):
    marker = tmp_path / "marker"
    stage_py = bundle / "stage1" / "stage.py"
    stage_py.write_text(stage_py.read_text() + f"\nopen({str(marker)!r}, 'w').write('x')\n")
    rehash(bundle, 1, "stage.py")
    if unpin:  # a bundle.json that records no sha256 of stage.py at all
        index = json.loads((bundle / "bundle.json").read_text())
        del index["stages"][1]["stage_py_sha256"]
        (bundle / "bundle.json").write_text(json.dumps(index))
    code, _, err = run_tokens(bundle)
    assert code == 1 and f"{stage_py}" in err and "not kerncc's rendering" in err
    assert not marker.exists()
    for message in every_reader(bundle):
        assert "stage 1 stage.py" in message
    assert not marker.exists()


def test_check_refuses_a_stage_py_that_skips_a_launch(bundle):
    stage_py = bundle / "stage0" / "stage.py"
    lines = stage_py.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("rt.launch("))
    lines[at] = lines[at][:len(lines[at]) - len(lines[at].lstrip())] + "pass\n"
    stage_py.write_text("".join(lines))
    rehash(bundle, 0, "stage.py")
    with pytest.raises(KernccError, match="not kerncc's rendering") as err:
        check_bundle(bundle)
    where = err.value.diagnostics[0].location
    assert (where.file, where.line) == (str(stage_py), at + 1)


# ---------------------------------------------------------------------------------------------
# 3: paths stay inside their folder; refusals show no file's bytes


def test_a_symlink_leaving_the_bundle_is_refused(bundle, tmp_path):
    outside = tmp_path / "elsewhere.json"
    plan = bundle / "stage0" / "plan.json"
    shutil.copy(plan, outside)
    plan.unlink()
    plan.symlink_to(outside)
    for message in every_reader(bundle):
        assert "is a link that leaves" in message


def test_a_stage_folder_linked_from_outside_is_refused(bundle, tmp_path):
    shutil.move(bundle / "stage1", tmp_path / "stage1")
    (bundle / "stage1").symlink_to(tmp_path / "stage1")
    for message in every_reader(bundle):
        assert "stage 1 directory" in message and "leaves" in message


def test_an_absolute_checkpoint_is_refused_without_its_bytes(bundle, tmp_path):
    secret = tmp_path / "shadow"
    secret.write_text("root:SECRET-HASH:19000:0:99999:7:::\n")
    edit_index(bundle, checkpoint=str(secret))
    code, _, err = run_tokens(bundle)
    assert code == 1 and "not a relative path" in err and "SECRET" not in err
    edit_index(bundle, checkpoint="../shadow")  # relative, but no checkpoint: still no bytes
    code, _, err = run_tokens(bundle)
    assert code == 1 and "SECRET" not in err and "root:" not in err


def test_a_module_source_leaving_the_manifest_folder_is_not_read(tmp_path):
    """emit looks for a module beside the input only inside its folder: `../x` or `/x` would
    make it an oracle of "does this file hash to X" (and copy the file when it does)."""
    from kerncc import manifest as m
    from kerncc.passes.emit import find_module

    secret, project = tmp_path / "secret" / "k.cubin", tmp_path / "project"
    secret.parent.mkdir()
    project.mkdir()
    secret.write_bytes(b"secret module bytes")
    digest = hashlib.sha256(secret.read_bytes()).hexdigest()
    for source in ("../secret/k.cubin", str(secret)):
        assert find_module(m.Module(source, digest), project) is None
    (project / "k.cubin").symlink_to(secret)  # a link out of the folder: not followed either
    assert find_module(m.Module("k.cubin", digest), project) is None
    shutil.copy(secret, project / "own.cubin")  # inside: found, as before
    assert find_module(m.Module("own.cubin", digest), project) == secret.read_bytes()


# ---------------------------------------------------------------------------------------------
# 4: special files are refused, not waited on or read forever


def test_a_fifo_module_is_refused_without_hanging(bundle):
    modules = bundle / "stage0" / "modules"
    modules.mkdir(exist_ok=True)
    os.mkfifo(modules / ("0" * 64 + ".cubin"))
    for message in every_reader(bundle):
        assert "a FIFO (named pipe), not a regular file" in message


def test_dev_zero_as_the_input_is_refused(bundle):
    (bundle.parent / "model.json").unlink()
    (bundle.parent / "model.json").symlink_to("/dev/zero")
    with pytest.raises(KernccError, match="a character device, not a regular file"):
        check_bundle(bundle)
    assert read_report(bundle).input_status == "missing"


def test_a_file_past_the_size_limit_is_refused(bundle):
    code, _, err = cli("check", str(bundle), "--max-file-size", "1000")
    assert code == 1 and "larger than 1000 bytes" in err and "--max-file-size" in err


# ---------------------------------------------------------------------------------------------
# 5: diagnostics are bounded


def test_a_minified_manifest_with_many_problems_prints_a_bounded_report(model, tmp_path):
    raw = json.loads(model[0].read_text())
    for i in range(400):
        raw["buffers"][f"unused{i}"] = {"dtype": "f32", "shape": [4], "kind": "workspace"}
    path = tmp_path / "minified.json"
    path.write_text(json.dumps(raw, separators=(",", ":")))
    code, _, err = cli("verify", str(path), "--max-errors", "10")
    assert code == 1 and "... and 390 more errors" in err
    assert max(len(line) for line in err.splitlines()) < 400
    assert len(err) < 10 * 800


def test_a_long_spec_of_unknown_options_prints_a_bounded_report(model):
    spec = "plan-memory{" + ",".join(f"opt{i}=1" for i in range(600)) + "}"
    code, _, err = cli("lower", str(model[0]), "-p", spec)
    assert code == 1 and "... and 550 more errors" in err
    assert max(len(line) for line in err.splitlines()) < 400


def test_render_error_cuts_a_long_line_around_the_column(tmp_path):
    from kerncc.diagnostics import Diagnostic, Location
    path = tmp_path / "long.json"
    path.write_text("x" * 5000 + "HERE" + "y" * 5000)
    err = KernccError("bad:", [Diagnostic("here", Location("", str(path), 1, 5001))])
    source, caret = render_error(err).splitlines()[2:4]
    assert "HERE" in source and len(source) < 200
    assert source[caret.index("^"):].startswith("HERE")


# ---------------------------------------------------------------------------------------------
# 6, 9: -o replaces only a bundle kerncc wrote; leftovers go; files are synced


def test_o_does_not_delete_a_file_kerncc_did_not_write(model, tmp_path):
    data = tmp_path / "data"
    (data / "stage7").mkdir(parents=True)
    (data / "stage7" / "thesis.tex").write_text("x")
    (data / "bundle.json").write_text("{}")
    code, _, err = cli("lower", str(model[0]), "-p", "emit", "-o", str(data))
    assert code == 1 and "refusing to overwrite" in err
    assert (data / "stage7" / "thesis.tex").read_text() == "x"


def test_o_does_not_delete_a_file_added_inside_a_bundle(model, bundle):
    (bundle / "stage0" / "notes.txt").write_text("mine")
    code, _, err = cli("lower", str(model[0]), "-p", PIPELINE, "-o", str(bundle))
    assert code == 1 and (bundle / "stage0" / "notes.txt").read_text() == "mine"


def test_o_replaces_a_bundle_it_wrote_and_removes_leftovers(model, bundle, monkeypatch):
    leftovers = [bundle.parent / ".out.abcd1234", bundle.parent / ".out.old.wxyz5678"]
    for item in leftovers:
        (item / "x").mkdir(parents=True)
    mine = bundle.parent / ".out.backup"  # not a name kerncc gives: left alone
    mine.mkdir()
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    code, _, err = cli("lower", str(bundle.parent / "model.json"), "-p", PIPELINE, "-o",
                       str(bundle))
    assert code == 0, err
    assert not any(item.exists() for item in leftovers) and mine.exists()
    assert len(synced) >= len(list(bundle.rglob("*")))  # every file, then the folders


# ---------------------------------------------------------------------------------------------
# 7: weights are finite


def _poison(bundle: Path, value: float) -> str:
    path = bundle.parent / "model.safetensors"
    tensors = load_file(path)
    name = sorted(tensors)[0]
    array = tensors[name].copy()
    array.reshape(-1)[3] = value
    tensors[name] = array
    save_file(tensors, path)
    return name


def test_a_nan_weight_is_refused_naming_the_tensor(bundle):
    name = _poison(bundle, float("nan"))
    code, _, err = run_tokens(bundle, "--weights", str(bundle.parent / "model.safetensors"))
    assert code == 1 and f"tensor `{name}` holds nan at [0, 3]" in err


def test_an_infinite_weight_runs_with_allow_nonfinite_and_no_warning(bundle):
    _poison(bundle, float("inf"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chain = Chain(bundle, checkpoint=bundle.parent / "model.safetensors",
                      allow_nonfinite=True)
        alone(chain, [1, 2, 3], 2)
    with pytest.raises(KernccError, match="holds inf"):
        Chain(bundle, checkpoint=bundle.parent / "model.safetensors")


# ---------------------------------------------------------------------------------------------
# 8: the right words


@pytest.mark.parametrize("kind, words", [("dir", "holds no *.safetensors file"),
                                         ("fifo", "is a FIFO (named pipe)"),
                                         ("zero", "is a character device")])
def test_a_checkpoint_that_is_no_file_is_named_for_what_it_is(bundle, tmp_path, kind, words):
    target = tmp_path / "ck"
    if kind == "dir":
        target.mkdir()
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        target = Path("/dev/zero")
    code, _, err = run_tokens(bundle, "--weights", str(target))
    assert code == 1 and words in err and "does not exist" not in err


def test_a_prompt_with_a_hole_is_refused(bundle):
    with pytest.raises(SystemExit):
        cli("run", str(bundle), "--prompt", "1,,2")
    assert run_tokens(bundle)[0] == 0  # 1,2,3 still fine, as is "1, 2, 3"
    assert cli("run", str(bundle), "--prompt", "1, 2, 3", "--max-new", "1")[0] == 0


def test_a_write_error_names_the_output(model, tmp_path):
    (tmp_path / "file").write_text("a file where a folder would go")
    out = tmp_path / "file" / "b"
    code, _, err = cli("lower", str(model[0]), "-p", "emit", "-o", str(out))
    assert code == 1 and f"cannot write the bundle `{out}`" in err
    assert "model.json:1:1" not in err


# ---------------------------------------------------------------------------------------------
# issue 14.3, 16.2, 16.8: one reader; .kir inputs; stale checkpoints


def test_a_duplicate_key_in_bundle_json_is_refused_by_every_reader(bundle):
    text = (bundle / "bundle.json").read_text()
    (bundle / "bundle.json").write_text(text.replace('"kerncc":', '"pipeline": "x", "kerncc":', 1))
    for message in every_reader(bundle):
        assert "duplicate name `pipeline`" in message


def test_a_bundle_lowered_from_kir_checks_and_reports(model, tmp_path):
    kir = tmp_path / "model.kir"
    code, text, _ = cli("fmt", str(model[0]), "--to", "kir")
    kir.write_text(text)
    out = tmp_path / "out"
    assert cli("lower", str(kir), "-p", PIPELINE, "-o", str(out))[0] == 0
    assert cli("check", str(out))[0] == 0
    assert read_report(out).input_status == "matches"


def test_a_stale_checkpoint_is_refused_or_with_weights_warned(bundle):
    _poison(bundle, 2.0)  # a different file: rewritten, so its size or header changed
    path = bundle.parent / "model.safetensors"
    with open(path, "ab") as f:
        f.write(b"\0" * 8)
    code, _, err = run_tokens(bundle)
    assert code == 1 and "not the one the bundle was emitted with" in err
    code, _, err = run_tokens(bundle, "--weights", str(path))
    assert code == 0 and "warning: checkpoint" in err
    assert read_report(bundle).checkpoint_status == "changed"
    path.unlink()
    assert read_report(bundle).checkpoint_status == "missing"
    assert "(missing)" in read_report(bundle).to_text()


def test_check_whole_bundle_proves_against_the_named_whole(bundle, tmp_path):
    moved = tmp_path / "moved.json"
    shutil.move(bundle.parent / "model.json", moved)
    assert cli("check", str(bundle))[0] == 1
    code, out, err = cli("check", str(moved), str(bundle))
    assert code == 0 and out.startswith("proved"), err
