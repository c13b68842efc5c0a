"""Hostile model folders: every file of a Hugging Face folder is untrusted input.

Whatever config.json, the shard index, the tokenizer files or `-o` hold, an import or a
TextCodec gives a KernccError naming the file (never another exception, never a hang), and
nothing the user already has is overwritten.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from kerncc.cli.main import main
from kerncc.diagnostics import KernccError
from kerncc.hf.importer import import_model

from .models import config_json, write_model


def within(seconds: float, fn):
    """fn()'s outcome (its value or the exception it raised); fails if it takes longer."""
    outcome: list = []

    def go() -> None:
        try:
            outcome.append(fn())
        except BaseException as err:  # noqa: BLE001 - handed to the test
            outcome.append(err)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still running after {seconds} s"
    return outcome[0]


DEEP = "[" * 100_000 + "]" * 100_000
LONG_INT = '{"hidden_size": ' + "9" * 5000 + "}"


@pytest.mark.parametrize("body", [DEEP, LONG_INT], ids=["deep", "long-int"])
@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_json_the_parser_refuses_is_a_located_error(tmp_path, name, body):
    folder = write_model(tmp_path / "m", "llama", shards=2)
    (folder / name).write_text(body)
    with pytest.raises(KernccError) as err:
        import_model(folder)
    assert name in str(err.value)


def test_a_config_json_that_never_ends_is_refused(tmp_path):
    folder = write_model(tmp_path / "m", "llama")
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")  # a read would wait for a writer forever
    outcome = within(10, lambda: import_model(folder))
    assert isinstance(outcome, KernccError) and "config.json" in str(outcome)
    assert "not a regular file" in str(outcome)


@pytest.mark.parametrize("field", ["rms_norm_eps", "rope_theta"])
def test_a_number_too_large_for_a_float_names_the_field(tmp_path, field):
    folder = write_model(tmp_path / "m", "llama")
    text = json.dumps(config_json("llama"))[:-1] + f', "{field}": ' + "9" * 400 + "}"
    (folder / "config.json").write_text(text)
    with pytest.raises(KernccError, match=f"field `{field}` must be a positive finite number"):
        import_model(folder)


@pytest.mark.parametrize("changes", [
    {"architectures": [["LlamaForCausalLM"]]},
    {"architectures": [{"name": "LlamaForCausalLM"}]},
    {"architectures": None, "model_type": ["llama"]},
    {"architectures": None, "model_type": {"llama": 1}},
])
def test_architectures_of_any_json_type_are_refused_by_name(tmp_path, changes):
    folder = write_model(tmp_path / "m", "llama")
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(KernccError, match="architectures"):
        import_model(folder)


def test_a_chat_template_list_with_odd_names_is_refused_by_name(tmp_path):
    from kerncc.example import generate
    from kerncc.hf.tokenizer import TextCodec

    generate(tmp_path, "tiny")
    templates = [{"name": ["default"], "template": "x"}, {"name": {"a": 1}, "template": "y"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    with pytest.raises(KernccError, match="`chat_template` must be a string or a list"):
        TextCodec.from_dir(tmp_path)


@pytest.mark.parametrize("name", ["config.json", "model-00001-of-00002.safetensors",
                                  "model.safetensors.index.json", "tokenizer.json", "notes.txt"])
def test_the_output_never_replaces_a_file_that_is_not_a_manifest(tmp_path, capsys, name):
    folder = write_model(tmp_path / "m", "qwen3", shards=2)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "notes.txt").write_text("mine")
    before = (folder / name).read_bytes()
    assert main(["import", str(folder), "-o", str(folder / name), "--max-context", "64"]) == 1
    err = capsys.readouterr().err
    assert name in err and "not a kern manifest" in err and "Traceback" not in err
    assert (folder / name).read_bytes() == before


def test_a_second_import_replaces_the_first_manifest(tmp_path):
    folder = write_model(tmp_path / "m", "llama")
    import_model(folder, max_context=64)
    assert import_model(folder, max_context=128).manifest["buffers"]["rope"]["shape"][0] == 128
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []
