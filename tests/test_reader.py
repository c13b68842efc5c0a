"""The strict reader and canonical writer: round trips, kern's parse texts, and robustness."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kerncc import manifest as m
from kerncc.manifest import writer
from kerncc.manifest import reader
from kerncc.diagnostics import KernccError
from tests.random_manifests import Xorshift, examples, random_manifest

ROOT = Path(__file__).resolve().parent.parent
MINIMAL = json.loads((ROOT / "examples" / "minimal.json").read_text())
FIXTURES = [MINIMAL] + [json.loads(p.read_text()) for p in sorted((ROOT / "tests" / "fixtures")
                                                                  .glob("*.json"))]


def _messages(raw) -> list[tuple[str, str]]:
    with pytest.raises(KernccError) as err:
        reader.from_raw(raw)
    return [(d.message, d.location.pointer) for d in err.value.diagnostics]


@pytest.mark.parametrize("raw", FIXTURES, ids=lambda r: r["model"])
def test_round_trip_is_a_fixed_point(raw) -> None:
    text = writer.dumps(reader.from_raw(raw))
    assert writer.dumps(m.loads(text)) == text


def test_defaults_stay_implicit_and_maps_sort() -> None:
    raw = copy.deepcopy(MINIMAL)
    raw["buffers"]["slots"]["export"] = False
    text = writer.dumps(reader.from_raw(raw))
    assert '"export"' not in text
    assert '"params"' not in text.split('"launches"')[1]  # launch params left implicit
    assert list(json.loads(text)["buffers"]) == sorted(raw["buffers"])


def test_unknown_fields_missing_fields_and_types_are_all_reported() -> None:
    raw = copy.deepcopy(MINIMAL)
    raw["buffers"]["slots"]["dtyp"] = "i32"
    del raw["modules"]["step"]["sha256"]
    raw["vars"]["tokens"]["max"] = -3
    raw["programs"]["decode"]["calls"][0]["args"][0] = {"buf": "token_ids", "offest": 4}
    found = dict((p, msg) for msg, p in _messages(raw))
    assert found["/buffers/slots/dtyp"].startswith("unknown field `dtyp`, expected one of")
    assert found["/modules/step"] == "missing field `sha256`"
    assert found["/vars/tokens/max"] == "invalid value: integer `-3`, expected u64"
    assert found["/programs/decode/calls/0/args/0"] == \
        "data did not match any variant of untagged enum Arg"


@pytest.mark.parametrize("text,message", [
    ("i33", "invalid param type `i33`"),
    ("u32", "invalid param type `u32`"),
    ("bytes<0>", "invalid byte count in param type `bytes<0>`"),
    ("sideways state", "invalid direction `sideways` in param type `sideways state`"),
    ("state", "invalid param type `state`"),
])
def test_param_type_texts(text: str, message: str) -> None:
    raw = copy.deepcopy(MINIMAL)
    raw["ops"]["step"]["params"][6] = text
    assert (message, "/ops/step/params/6") in _messages(raw)


def test_duplicate_names_anywhere_are_refused_with_a_position() -> None:
    text = '{"schema_version": 5, "model": "m",\n "buffers": {"a": 1, "a": 2}}'
    with pytest.raises(KernccError) as err:
        m.loads(text, "d.json")
    diag = err.value.diagnostics[0]
    assert diag.message == "duplicate name `a`"
    # At the repeated key itself (line 2, the second "a"), as the .kir reader does.
    assert (diag.location.pointer, diag.location.line, diag.location.column) == \
        ("/buffers/a", 2, 22)


def test_constants_expand_in_numeric_positions() -> None:
    raw = copy.deepcopy(MINIMAL)
    raw["constants"] = {"MAX_TOKENS": 8, "WIDTH": 3}
    raw["vars"]["tokens"]["max"] = "MAX_TOKENS"
    raw["buffers"]["block_table"]["shape"] = ["seqs", "WIDTH"]
    man = reader.from_raw(raw)
    assert man.vars["tokens"].max == 8 and man.buffers["block_table"].shape == ("seqs", 3)
    assert "constants" not in writer.dumps(man)


@pytest.mark.parametrize("constants,message", [
    ([1], "constants must be an object"),
    ({"": 1}, "constants require nonempty names and numeric literal values"),
    ({"K": "x"}, "constants require nonempty names and numeric literal values"),
    ({"tokens": 3}, "constant `tokens` conflicts with a var"),
])
def test_constant_rules(constants, message: str) -> None:
    raw = copy.deepcopy(MINIMAL)
    raw["constants"] = constants
    assert message in [msg for msg, _ in _messages(raw)]


def test_an_undefined_constant_is_named() -> None:
    raw = copy.deepcopy(MINIMAL)
    raw["constants"] = {"K": 1}
    raw["vars"]["tokens"]["max"] = "NOPE"
    assert ("undefined constant `NOPE`", "/vars/tokens/max") in _messages(raw)


@pytest.mark.parametrize("text", ["", "{", "[1, 2]", '{"a": NaN}', "1e999", "[" * 5000,
                                  '{"schema_version": 5', "\x00"])
def test_broken_json_is_a_kerncc_error(text: str) -> None:
    with pytest.raises(KernccError):
        m.loads(text, "broken.json")


@settings(max_examples=examples(60, 2_000))
@given(st.data())
def test_random_manifests_round_trip(data: st.DataObject) -> None:
    choose = lambda n: data.draw(st.integers(0, n - 1))  # noqa: E731
    raw = random_manifest(choose, driven=2, inits=True, derives=True)
    text = writer.dumps(reader.from_raw(raw))
    assert writer.dumps(m.loads(text)) == text


def _mutate(raw, path: list, mutation):
    node = raw
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = mutation
    return raw


def _paths(node, prefix=()):
    yield list(prefix)
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


MUTATIONS = [None, True, -1, 2**70, 1.5, "x", [], {}, [1, "a"], {"zz": 1}, "extern:x"]


@settings(max_examples=examples(300, 5_000))
@given(st.integers(0, 10**6), st.sampled_from(MUTATIONS), st.sampled_from(FIXTURES))
def test_mutated_manifests_fail_only_with_kerncc_errors(pick: int, mutation, base) -> None:
    from kerncc.verify import verify

    raw = copy.deepcopy(base)
    paths = [p for p in _paths(raw) if p]
    _mutate(raw, paths[pick % len(paths)], mutation)
    try:
        verify(reader.from_raw(raw))
    except KernccError:
        pass


def test_seeded_random_manifests_verify() -> None:
    from kerncc.verify import verify

    for seed in range(1, 30):
        verify(reader.from_raw(random_manifest(Xorshift(seed), driven=2, inits=True)))


def test_the_cli_prints_no_traceback_for_bad_input(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 5, "model": 3, "buffers": []}')
    result = subprocess.run([sys.executable, "-m", "kerncc", "verify", str(bad)],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "invalid type: integer `3`, expected a string" in result.stderr
    assert "bad.json:1:" in result.stderr
