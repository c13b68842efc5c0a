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


HOSTILE_TEMPLATES = {
    "nested-loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                    "{% endfor %}",
    "macro-in-loops": "{% macro f() %}{% endmacro %}{% for i in range(100000) %}"
                      "{% for j in range(100000) %}{{ f() }}{% endfor %}{% endfor %}",
    "output-flood": "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx"
                    "{% endfor %}{% endfor %}",
    "repeat": "{{ 'x' * 4000000000 }}",
    "repeat-list": "{{ ([0] * 4000000000)|length }}",
    "power": "{{ (7 ** 10000000000)|string|length }}",
    "wide-filter": "{{ 'x'|center(4000000000) }}",
    "wide-method": "{{ 'x'.ljust(4000000000) }}",
    "wide-format": "{{ '{:4000000000}'.format('x') }}",
    "nested-format": "{{ '{:{}}'.format('x', 4000000000) }}",
    "star-width": "{{ '%*s' % (4000000000, 'x') }}",
    "format-filter": "{{ '%4000000000s'|format('x') }}",
    "percent-width": "{{ '%4000000000s' % 'x' }}",
    # filters were not counted: each of these ran for hours holding 1.5 GB
    "filter-list": "{% for i in range(99999) %}{% set x = ('a' * 16000000)|list|length %}"
                   "{% endfor %}",
    "filter-length": "{% for i in range(99999) %}{% set x = ('a' * 16000000)|length %}"
                     "{% endfor %}",
    "filter-map": "{% for i in range(99999) %}{% set x = ('a' * 1000000)|map('upper')|join %}"
                  "{% endfor %}",
    "method-split": "{% for i in range(99999) %}{% set x = ('a ' * 8000000).split()|length %}"
                    "{% endfor %}",
    "list-repeat-join": "{{ (['x' * 1000] * 1000000)|join }}",
    "tojson": "{% for i in range(99999) %}{% set x = ([1] * 1000000)|tojson %}{% endfor %}",
}


@pytest.mark.parametrize("template", HOSTILE_TEMPLATES.values(), ids=HOSTILE_TEMPLATES.keys())
def test_a_hostile_chat_template_is_stopped_and_named(tmp_path, template):
    """Rendering is bounded in time and memory: a template that would loop for hours or build
    gigabytes is an error naming chat_template.jinja, within seconds."""
    from kerncc.example import generate
    from kerncc.hf.tokenizer import TextCodec

    generate(tmp_path, "tiny")
    (tmp_path / "chat_template.jinja").write_text(template)

    def render():
        return TextCodec.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])

    outcome = within(20, render)
    assert isinstance(outcome, KernccError), outcome
    assert "chat_template.jinja" in str(outcome) and "limit" in str(outcome)


def test_templates_of_published_models_stay_within_the_bounds(tmp_path):
    """The bounds are far past real use: a long conversation with tools renders."""
    from kerncc.example import generate
    from kerncc.hf.tokenizer import TextCodec

    generate(tmp_path, "tiny")
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% for t in tools %}"
        "{{ t|tojson }}{% endfor %}{% endfor %}{{ '=' * 80 }}{{ 2 ** 10 }}")
    messages = [{"role": "user", "content": "word " * 200}] * 500
    text = TextCodec.from_dir(tmp_path).apply_chat_template(
        messages, tools=[{"name": f"tool{i}"} for i in range(20)])
    assert text.endswith("=" * 80 + "1024") and len(text) > 500 * 1000


def test_large_numbers_are_no_width(tmp_path):
    """Only widths are bounded: a timestamp formats, prints and compares as usual."""
    from kerncc.example import generate
    from kerncc.hf.tokenizer import TextCodec

    generate(tmp_path, "tiny")
    (tmp_path / "chat_template.jinja").write_text(
        "{{ '%d' % stamp }} {{ stamp|string }} {{ '{}'.format(stamp) }} {{ '%s-%s' % (stamp, 1) }}"
        " {{ '%5s'|format('x') }}|{{ 'ab'.ljust(4) }}|")
    text = TextCodec.from_dir(tmp_path).apply_chat_template([], stamp=1_700_000_000)
    assert text == "1700000000 1700000000 1700000000 1700000000-1     x|ab  |"


DOUBLING = {
    "concat": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
              "{% endfor %}{{ ns.s|length }}",
    "plus": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
            "{% endfor %}{{ ns.s|length }}",
    "join": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
            "{% set ns.s = [ns.s, ns.s]|join %}{% endfor %}{{ ns.s|length }}",
    "replace": "{% set ns = namespace(s='xx') %}{% for i in range(8) %}"
               "{% set ns.s = ns.s|replace('x', ns.s) %}{% endfor %}{{ ns.s|length }}",
    "macro": "{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}{{ s|length }}"
             "{% endif %}{% endmacro %}{{ d('x', 64) }}",
}


@pytest.mark.parametrize("template", DOUBLING.values(), ids=DOUBLING.keys())
def test_a_template_doubling_a_string_is_stopped(tmp_path, template):
    from kerncc.example import generate
    from kerncc.hf.tokenizer import TextCodec

    generate(tmp_path, "tiny")
    (tmp_path / "chat_template.jinja").write_text(template)
    outcome = within(20, lambda: TextCodec.from_dir(tmp_path).apply_chat_template([]))
    assert isinstance(outcome, KernccError) and "limit" in str(outcome), outcome


@pytest.mark.parametrize("changes, message", [
    ({"max_position_embeddings": 8}, "max_position_embeddings 8 is shorter than one page"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 10**30}},
     "original_max_position_embeddings 1000000000000000000000000000000 is past kerncc's limit"),
])
def test_sizes_past_what_kerncc_serves_name_the_config_field(tmp_path, changes, message):
    """Not the builder's or the verifier's view of it (`--max-context 0`, a launch argument
    that is not an i32)."""
    folder = write_model(tmp_path / "m", "llama")
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(KernccError, match=message) as err:
        import_model(folder)
    assert "config.json" in str(err.value) and "--max-context 0" not in str(err.value)


SLOW = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def _slow_codec(tmp_path, monkeypatch):
    """A codec whose template would run for hours were it not for the render's clock."""
    from kerncc.example import generate
    from kerncc.hf import tokenizer
    from kerncc.hf.tokenizer import TextCodec

    monkeypatch.setattr(tokenizer, "MAX_STEPS", 10**12)  # only time or a stop can end it
    generate(tmp_path, "tiny")
    (tmp_path / "chat_template.jinja").write_text(SLOW)
    return TextCodec.from_dir(tmp_path)


def test_a_render_ends_at_its_deadline(tmp_path, monkeypatch):
    codec = _slow_codec(tmp_path, monkeypatch)
    outcome = within(20, lambda: codec.render_chat([], {}, seconds=0.5))
    assert isinstance(outcome, KernccError), outcome
    assert "more than 0.5 seconds" in str(outcome) and "chat_template.jinja" in str(outcome)


def test_a_render_asked_to_stop_ends_at_its_next_step(tmp_path, monkeypatch):
    codec = _slow_codec(tmp_path, monkeypatch)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    outcome = within(20, lambda: codec.render_chat([], {}, stop=stop.is_set, seconds=600))
    assert isinstance(outcome, KernccError) and "stopped" in str(outcome), outcome


def test_a_chat_template_past_its_bound_is_refused_before_it_is_read(tmp_path):
    """A 3 GiB chat_template.jinja ended in `internal error: MemoryError`."""
    from kerncc.example import generate
    from kerncc.hf.tokenizer import TEMPLATE_LIMIT, TextCodec

    generate(tmp_path, "tiny")
    (tmp_path / "chat_template.jinja").write_text("x" * (TEMPLATE_LIMIT + 1))
    with pytest.raises(KernccError, match="larger than") as err:
        TextCodec.from_dir(tmp_path)
    assert "chat_template.jinja" in str(err.value)


def test_a_tokenizer_json_past_its_bound_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """A 3 GiB tokenizer.json was read whole (3.2 GB resident)."""
    from kerncc.example import generate
    from kerncc.hf import tokenizer
    from kerncc.hf.tokenizer import TextCodec

    generate(tmp_path, "tiny")
    size = (tmp_path / "tokenizer.json").stat().st_size
    monkeypatch.setattr(tokenizer, "TOKENIZER_LIMIT", size - 1)
    with pytest.raises(KernccError, match="larger than") as err:
        TextCodec.from_dir(tmp_path)
    assert "tokenizer.json" in str(err.value)
    monkeypatch.setattr(tokenizer, "TOKENIZER_LIMIT", size)
    assert TextCodec.from_dir(tmp_path) is not None
