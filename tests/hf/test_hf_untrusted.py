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

from .models import write_model


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
