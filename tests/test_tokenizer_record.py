"""The tokenizer files a bundle was lowered beside are recorded in bundle.json (`tokenizer`:
name, bytes, sha256) and held to it: a template or tokenizer changed, added or removed after
lowering is refused by the codec of `run`/`serve` and by `kerncc check`, naming the file and
never its hash; a folder named with --tokenizer is the user's and is used as it is.
`kerncc import --max-file-size` bounds the tokenizer files as serve's flag does."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

from kerncc.cli.main import main
from kerncc.diagnostics import KernccError

# the codec of run and serve needs the `tokenizers` library (the hf extra); check and import
# do not
needs_codec = pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None,
                                 reason="needs the tokenizers library: pip install 'kerncc[hf]'")

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture
def lowered(tmp_path: Path) -> tuple[Path, Path]:
    """The tiny example with a chat template, lowered beside it: (model folder, bundle)."""
    from kerncc.example import generate

    folder = tmp_path / "model"
    model, _ = generate(folder, "tiny")
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    out = tmp_path / "bundle"
    assert main(["lower", str(model), "-p", "emit", "-o", str(out)]) == 0
    return folder, out


def _codec(bundle_dir: Path, tokenizer: str | None = None):
    """The codec `kerncc serve` loads for the bundle (kerncc.cli.serve)."""
    from kerncc.cli import serve
    from kerncc.cli.hf import tokenizer_pins
    from kerncc.runtime.bundle import Bundle

    bundle = Bundle(bundle_dir)
    args = argparse.Namespace(tokenizer=tokenizer)
    folders = [Path(tokenizer)] if tokenizer else [bundle.dir, bundle.checkpoint.parent,
                                                    bundle_dir.parent]
    return serve._tokenizer(folders, tokenizer, tokenizer_pins(args, bundle))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_record_names_every_tokenizer_file_with_its_size_and_hash(lowered, tmp_path):
    folder, out = lowered
    record = json.loads((out / "bundle.json").read_text())["tokenizer"]
    names = ["chat_template.jinja", "config.json", "generation_config.json", "tokenizer.json",
             "tokenizer_config.json"]
    assert [f["name"] for f in record] == names
    for entry in record:
        path = folder / entry["name"]
        assert entry == {"name": path.name, "bytes": path.stat().st_size, "sha256": _sha(path)}


def test_the_record_is_deterministic(lowered, tmp_path):
    folder, out = lowered
    again = tmp_path / "again"
    assert main(["lower", str(folder / "model.json"), "-p", "emit", "-o", str(again)]) == 0
    assert (again / "bundle.json").read_bytes() == (out / "bundle.json").read_bytes()


@needs_codec
def test_the_recorded_files_load(lowered):
    _, out = lowered
    codec = _codec(out)
    assert codec is not None and codec.chat
    assert main(["check", str(out)]) == 0


@needs_codec
def test_a_template_edited_after_lowering_is_refused_by_serve(lowered):
    folder, out = lowered
    (folder / "chat_template.jinja").write_text(TEMPLATE.replace("<|assistant|>", "<|bot|>"))
    with pytest.raises(KernccError) as err:
        _codec(out)
    text = str(err.value) + "".join(d.message for d in err.value.diagnostics)
    assert "chat_template.jinja" in text and "lowered with" in text
    assert _sha(folder / "chat_template.jinja") not in text  # no hash of a file outside
    # a folder the user names is theirs: used as it is
    assert _codec(out, str(folder)).chat


def test_a_template_edited_after_lowering_is_refused_by_check(lowered, capsys):
    folder, out = lowered
    (folder / "chat_template.jinja").write_text(TEMPLATE + " ")
    assert main(["check", str(out)]) != 0
    err = capsys.readouterr().err
    assert "chat_template.jinja" in err and "lowered with" in err
    assert _sha(folder / "chat_template.jinja") not in err


@needs_codec
@pytest.mark.parametrize("change", ["added", "removed", "config"])
def test_a_tokenizer_file_added_or_removed_or_changed_is_refused(lowered, change):
    """A template in tokenizer_config.json, or one dropped beside the bundle, changes the
    prompt as surely as an edited chat_template.jinja."""
    folder, out = lowered
    if change == "added":
        # a tokenizer dropped into the bundle's folder (looked in first), its template changed
        for path in folder.iterdir():
            if path.name.endswith((".json", ".jinja")) and path.name != "model.json":
                (out / path.name).write_bytes(path.read_bytes())
        (out / "chat_template.jinja").write_text("{{ 'x' }}")
        name = "chat_template.jinja"
    elif change == "removed":
        (folder / "chat_template.jinja").unlink()
        name = "chat_template.jinja"
    else:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = "{{ 'y' }}"
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        name = "tokenizer_config.json"
    with pytest.raises(KernccError) as err:
        _codec(out)
    assert name in str(err.value) + "".join(d.message for d in err.value.diagnostics)


@needs_codec
def test_run_chat_refuses_an_edited_template(lowered, capsys):
    folder, out = lowered
    args = ["run", str(out), "--chat", "hi", "--max-new", "2"]
    (folder / "chat_template.jinja").write_text(TEMPLATE + "!")
    assert main(args) != 0
    assert "chat_template.jinja" in capsys.readouterr().err
    assert main([*args, "--tokenizer", str(folder)]) == 0


def test_import_bounds_the_tokenizer_files_with_max_file_size(tmp_path, capsys):
    from tests.hf.models import write_model

    folder = write_model(tmp_path / "m", "llama")
    (folder / "tokenizer.json").write_text(json.dumps({"pad": "x" * 4000}))
    assert main(["import", str(folder), "--max-file-size", "2000"]) != 0
    err = capsys.readouterr().err
    assert "tokenizer.json" in err and "larger than 2000 bytes" in err
    assert not (folder / "model.json").exists()
    assert main(["import", str(folder)]) == 0


def test_check_refuses_a_bundle_that_leaves_the_tokenizer_unrecorded(lowered, capsys):
    _, out = lowered
    index = json.loads((out / "bundle.json").read_text())
    del index["tokenizer"]
    (out / "bundle.json").write_text(json.dumps(index, indent=2))
    assert main(["check", str(out)]) != 0
    assert "records no `tokenizer`" in capsys.readouterr().err


def test_check_passes_a_copy_without_the_tokenizer(lowered, tmp_path):
    """Without tokenizer.json beside the input no codec reads that folder: run and serve take
    ids only, which is what the stages compute."""
    folder, out = lowered
    (folder / "tokenizer.json").unlink()
    assert main(["check", str(out)]) == 0


@pytest.mark.parametrize("field", ["bytes", "sha256"])
def test_check_refuses_a_record_changed_in_bundle_json(lowered, capsys, field):
    _, out = lowered
    index = json.loads((out / "bundle.json").read_text())
    entry = next(f for f in index["tokenizer"] if f["name"] == "tokenizer.json")
    entry[field] = entry[field] + 1 if field == "bytes" else "0" * 64
    (out / "bundle.json").write_text(json.dumps(index, indent=2))
    assert main(["check", str(out)]) != 0
    assert "tokenizer.json" in capsys.readouterr().err
    if importlib.util.find_spec("tokenizers") is not None:
        with pytest.raises(KernccError):
            _codec(out)


def test_bundle_json_names_only_tokenizer_files(lowered, capsys):
    """The record names files by a fixed list, never a path: `../x` is refused as it is read."""
    _, out = lowered
    index = json.loads((out / "bundle.json").read_text())
    index["tokenizer"][0]["name"] = "../../etc/passwd"
    (out / "bundle.json").write_text(json.dumps(index, indent=2))
    assert main(["check", str(out)]) != 0
    assert "is not a tokenizer file kerncc reads" in capsys.readouterr().err
