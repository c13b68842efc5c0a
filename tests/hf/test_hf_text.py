"""Text: the example's tokenizer files, TextCodec, streaming decode, chat templates, `run --text`.

The example's tokenizer.json is written by hand (kerncc/example/text.py); here the Hugging
Face `tokenizers` library reads it and round-trips text. TextCodec's streaming decode is
checked against a byte-level tokenizer whose tokens split multi-byte characters, so a naive
per-token decode would print broken UTF-8.
"""

from __future__ import annotations

import json
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kerncc.cli.main import main
from kerncc.diagnostics import KernccError
from kerncc.example import generate
from kerncc.example.text import CHAT_TEMPLATE, vocabulary
from kerncc.hf.tokenizer import TextCodec

ASCII = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126) | st.just("\n"),
                max_size=60)


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    folder = tmp_path_factory.mktemp("example")
    generate(folder, "tiny")
    return folder


def test_the_example_vocabulary_is_exactly_the_model_vocabulary(example):
    tok = Tokenizer.from_file(str(example / "tokenizer.json"))
    assert tok.get_vocab_size() == 256
    for size in (5, 99, 300, 32000):
        vocab, merges = vocabulary(size)
        assert sorted(vocab.values()) == list(range(size))
        assert all(" " not in m.split(" ", 1)[0] for m in merges)
    with pytest.raises(ValueError, match="at least"):
        vocabulary(4)


@settings(max_examples=40)
@given(text=ASCII)
def test_example_tokenizer_round_trips_ascii(example, text):
    codec = TextCodec.from_dir(example)
    ids = codec.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert codec.decode(ids) == text


def test_codec_reads_eos_ids_and_the_chat_template(example):
    codec = TextCodec.from_dir(example)
    assert codec.eos_token_ids == (2, 0)  # generation_config.json: <|im_end|>, <|endoftext|>
    assert codec.has_chat_template
    prompt = codec.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert codec.apply_chat_template([{"role": "user", "content": "hi"}],
                                     add_generation_prompt=False).endswith("<|im_end|>\n")
    ids = codec.encode(prompt)
    assert ids[0] == 3 and 2 in ids  # special tokens written in the text are recognised
    (example / "generation_config.json").rename(example / "gen.bak")
    try:
        assert TextCodec.from_dir(example).eos_token_ids == (2,)  # config.json's
    finally:
        (example / "gen.bak").rename(example / "generation_config.json")


def test_no_tokenizer_json_is_none(tmp_path):
    assert TextCodec.from_dir(tmp_path) is None


def byte_level_folder(tmp_path):
    """A byte-level BPE with no merges: a character of n UTF-8 bytes is n tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 256, "eos_token_id": 0}))
    return tmp_path


@settings(max_examples=40)
@given(text=st.text(max_size=20))
def test_streaming_never_breaks_utf8(tmp_path_factory, text):
    folder = byte_level_folder(tmp_path_factory.mktemp("bytes"))
    codec = TextCodec.from_dir(folder)
    ids = codec.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    stream = codec.stream()
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def test_vocabulary_past_the_model_is_refused(tmp_path):
    folder = byte_level_folder(tmp_path)
    (folder / "config.json").write_text(json.dumps({"vocab_size": 100}))
    codec = TextCodec.from_dir(folder)
    with pytest.raises(KernccError, match="past the model's vocabulary of 100"):
        codec.encode("é")


@pytest.mark.parametrize("name, body, match", [
    ("tokenizer.json", "{not json", "not a tokenizer"),
    ("tokenizer_config.json", json.dumps({"chat_template": "{% for %}"}), "does not parse"),
    ("tokenizer_config.json", json.dumps({"chat_template": 7}), "must be a string"),
    ("generation_config.json", json.dumps({"eos_token_id": "x"}), "eos_token_id"),
    ("chat_template.jinja", "{{ raise_exception('no system role') }}", "no system role"),
])
def test_bad_text_files_name_the_file(example, tmp_path, name, body, match):
    for f in example.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / name).write_text(body)
    with pytest.raises(KernccError, match=match) as err:
        codec = TextCodec.from_dir(tmp_path)
        codec.apply_chat_template([{"role": "user", "content": "x"}])
    assert name in str(err.value)


def test_template_renders_like_transformers_globals(tmp_path, example):
    for f in example.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    template = ("{{ eos_token }}|{{ messages | tojson }}|{{ strftime_now('%Y') | length }}"
                "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}"
                "{{ m.content }}{% endfor %}")
    (tmp_path / "chat_template.jinja").write_text(template)
    codec = TextCodec.from_dir(tmp_path)
    out = codec.apply_chat_template([{"role": "user", "content": "é"},
                                     {"role": "user", "content": "b"}])
    assert out == '<|im_end|>|[{"role": "user", "content": "é"}, {"role": "user", ' \
                  '"content": "b"}]|4b'
    assert "{%- for message in messages %}" in CHAT_TEMPLATE
    (tmp_path / "chat_template.jinja").write_text("{{ 'T' if enable_thinking else 'F' }}")
    codec = TextCodec.from_dir(tmp_path)
    assert codec.apply_chat_template([], enable_thinking=True) == "T"
    assert codec.apply_chat_template([]) == "F"
    assert codec.decode([0, 30, 2], skip_special_tokens=True) == " "


# ---- the command line ----------------------------------------------------------------------


def test_run_text_and_chat(example, capsys):
    target = str(example / "model.json")
    assert main(["run", target, "--backend", "cpu", "--prompt", "1,2,3", "--max-new", "4"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "49 130 222 98"
    assert main(["run", target, "--backend", "cpu", "--text", "hello", "--max-new", "5",
                 "--format", "json"]) == 0
    shown = json.loads(capsys.readouterr().out.splitlines()[-1])
    codec = TextCodec.from_dir(example)
    assert shown["prompt_ids"] == codec.encode("hello")
    assert shown["text"] == codec.decode(shown["ids"]) and len(shown["ids"]) == 5
    assert main(["run", target, "--backend", "cpu", "--text", "hello", "--max-new", "5"]) == 0
    assert capsys.readouterr().out == shown["text"] + "\n"
    assert main(["run", target, "--backend", "cpu", "--chat", "hi", "--max-new", "3",
                 "--format", "json"]) == 0
    chat = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert chat["prompt_ids"] == codec.encode(codec.apply_chat_template(
        [{"role": "user", "content": "hi"}]))


def test_run_stops_at_eos_unless_told(example, capsys):
    """Prompt 1,2,3 generates token 0 (an eos id) as its 40th token."""
    target = str(example / "model.json")
    argv = ["run", target, "--backend", "cpu", "--prompt", "1,2,3", "--max-new", "45",
            "--format", "json"]
    assert main(argv) == 0
    stopped = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert stopped["stop"] == "eos" and len(stopped["ids"]) == 40 and stopped["ids"][-1] == 0
    assert main(argv + ["--ignore-eos"]) == 0
    full = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert full["stop"] == "length" and len(full["ids"]) == 45
    assert full["ids"][:40] == stopped["ids"]


def test_run_prompt_forms_are_exclusive(example, capsys):
    """A usage error (exit 2, as contradicting flags are), before anything loads."""
    target = str(example / "model.json")
    for extra in (["--prompt", "1", "--text", "a"], []):
        with pytest.raises(SystemExit) as exit:
            main(["run", target, "--backend", "cpu", *extra])
        assert exit.value.code == 2
        assert "exactly one of --prompt, --text and --chat" in capsys.readouterr().err


def test_text_without_the_library_names_the_install_command(monkeypatch, example):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` fails
    with pytest.raises(KernccError, match=r"pip install 'kerncc\[hf\]'"):
        TextCodec.from_dir(example)


def test_the_post_processor_adds_bos_except_to_chat_text(tmp_path):
    """Llama 3 style: tokenizer(text) starts with BOS; a chat template writes its own."""
    from tokenizers import AddedToken, processors

    folder = byte_level_folder(tmp_path)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<s>", special=True)])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", bos)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps({"vocab_size": 300}))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "chat_template": "{{ bos_token }}{% for m in messages %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"}))
    codec = TextCodec.from_dir(folder)
    assert codec.encode("ab") == [bos] + codec.encode("ab", add_special_tokens=False)
    rendered = codec.apply_chat_template([{"role": "user", "content": "ab"}])
    assert rendered == "<s>ab"
    assert codec.encode(rendered, add_special_tokens=False) == codec.encode("ab")
