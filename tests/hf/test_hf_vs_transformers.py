"""TextCodec against transformers itself, where transformers is installed (CI skips this).

The example folder's tokenizer as `AutoTokenizer` loads it gives the same ids and text as
TextCodec, and chat templates (the example's, one using transformers' globals and filters, one
with `{% generation %}` blocks) render to the same string; `AutoConfig` reads the example's
config.json as a Qwen3 config. Seen passing with transformers 5.24 (no torch needed).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kerncc.example import generate
from kerncc.hf.tokenizer import TextCodec

transformers = pytest.importorskip("transformers")

from bench import hf_fidelity as fidelity  # noqa: E402 (bench/ is on pytest's pythonpath)


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("example")
    generate(folder, "tiny")
    return folder


def test_ids_and_text_equal_autotokenizer(example):
    theirs = transformers.AutoTokenizer.from_pretrained(example)
    ours = TextCodec.from_dir(example)
    for text in fidelity.TEXTS:
        assert theirs(text).input_ids == ours.encode(text)
        ids = ours.encode(text)
        assert theirs.decode(ids) == ours.decode(ids)


@pytest.mark.parametrize("name", sorted(fidelity.TEMPLATES))
def test_chat_templates_render_alike(example, tmp_path, name):
    for f in example.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    template = fidelity.TEMPLATES[name]
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        fidelity.MESSAGES, tokenize=False, add_generation_prompt=True,
        **({"chat_template": template} if template else {}))
    if template:
        (tmp_path / "chat_template.jinja").write_text(template)
    assert TextCodec.from_dir(tmp_path).apply_chat_template(fidelity.MESSAGES) == theirs


def test_autoconfig_reads_the_example_config(example):
    config = transformers.AutoConfig.from_pretrained(example)
    assert type(config).__name__ == "Qwen3Config" and config.vocab_size == 256
