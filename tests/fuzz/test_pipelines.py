"""Pipeline specs for `-p`: mutated valid specs and specs built from the grammar's pieces.

The API (`parse_pipeline`, `resolve_pipeline`) may raise only KernccError, each diagnostic at
`pipeline:line:col`; a spec that parses prints back to an equal spec, and one that resolves
prints back (`pass_spec`) to the same passes. Then the spec drives `kerncc lower` (into a
fresh directory, or to stdout) or `kerncc dump -p`, on the tiny example model or on
golden/inputs/layers3.json: the CLI contract, a location in the spec or in the input, and no
partial output. A spec whose `emit{out=...}` leaves the case directory is resolved but not run.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kerncc.diagnostics import KernccError
from kerncc.passes import pass_options, registry
from kerncc.pipeline import parse_pipeline, pass_spec, resolve_pipeline
from tests.random_manifests import examples

from . import harness
from .harness import fresh_dir, run_cli
from .mutate import INTERESTING_INTS, mutate_tokens, tokenize
from .seeds import GOLDEN_INPUTS

VALID = ("cut{at=3},share-states,slice-once,slice-derive,plan-memory,emit",
         "cut,slice-derive,emit", "cut{at=12},share-states,slice-once,slice-derive,emit",
         "cut{at-label=l1.qkv_proj}", "cut{stages=3},emit{check=false}", "default",
         "liveness,plan-memory{whole-life=true}", "cut{at=2,5}", "emit{out=b}", "")
TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[A-Za-z0-9_.\/:+@~-]+|\s+|.', re.DOTALL)
PASSES = ("cut", "emit", "liveness", "plan-memory", "share-states", "slice-derive",
          "slice-once", "default", "slise-derive", "Cut", "cut-", "")
KEYS = ("at", "at-label", "stages", "out", "check", "whole-life", "at_label", "x", "")
VALUES = ("0", "1", "2", "3", "12", "-1", "true", "false", "l1.qkv_proj", "l0.mlp", "embed",
          "nope", '"a b"', '"l1.qkv_proj"', '""', "b", "/tmp", "..", "é", "名前", "\U0001f600",
          "9" * 40, "99999999999999999999", "1e3", "0x10", '"\\u0000"', '"\\ud800"', '"\\q"')
EXTRA = PASSES + KEYS + VALUES + ("{", "}", ",", "=", '"', " ", "{{", "}}", "=,", "\n", "\t",
                                  "\u00a0", "\x00", "\ufeff")


REAL_PASSES = ("cut", "emit", "liveness", "plan-memory", "share-states", "slice-derive",
               "slice-once", "default")
LABELS = ("l0.qkv_proj", "l1.qkv_proj", "l1.mlp", "embed", "final_norm", "lm_head", "nope", "")
KIND_VALUES = {"at": st.integers(-1, 30).map(str), "stages": st.integers(0, 9).map(str),
               "at-label": st.sampled_from(LABELS), "out": st.sampled_from(("b", "b/c", '"b c"')),
               "check": st.sampled_from(("true", "false")),
               "whole-life": st.sampled_from(("true", "false"))}


def _option_keys(name: str) -> tuple[str, ...]:
    cls = registry().get(name)
    return tuple(info.key for info in pass_options(cls)) if cls is not None else ()


@st.composite
def specs(draw: st.DrawFn) -> str:
    """Specs from the grammar's pieces: mostly real passes with their own options and values
    of about the right kind (small ints, labels, booleans, relative paths), now and then a
    wrong pass, key or value (any of the lists above, any short text)."""
    passes = []
    for _ in range(draw(st.integers(0, 5))):
        odd = draw(st.integers(0, 9)) == 0
        name = draw(st.sampled_from(PASSES if odd else REAL_PASSES))
        keys = _option_keys(name)
        many = 2 if keys else int(draw(st.integers(0, 9)) == 0)
        options = [_option(draw, keys) for _ in range(draw(st.integers(0, many)))]
        passes.append(name + ("{" + ",".join(options) + "}" if options else ""))
    return ",".join(passes)


def _option(draw: st.DrawFn, keys: tuple[str, ...]) -> str:
    odd = not keys or draw(st.integers(0, 9)) == 0
    key = draw(st.sampled_from(KEYS if odd else keys))
    right = KIND_VALUES.get(key, st.sampled_from(VALUES))
    anything = st.one_of(st.sampled_from(VALUES), st.sampled_from(INTERESTING_INTS).map(str),
                         st.text(max_size=4))
    items = 3 if key in ("at", "at-label") or odd else 1
    values = draw(st.lists(anything if draw(st.integers(0, 9)) == 0 else right,
                           min_size=0 if odd else 1, max_size=items))
    return f"{key}={','.join(values)}"


def spec_cases() -> st.SearchStrategy[str]:
    mutated = st.builds(lambda base, data: (base, data), st.sampled_from(VALID), st.data())
    return st.one_of(specs(), mutated.map(lambda bd: mutate_tokens(
        tokenize(bd[0], TOKEN), EXTRA, bd[1])))


def check_spec_api(text: str) -> tuple | None:
    """Parse and resolve `text` through the API; the passes when it resolves."""
    parsed = harness.api(parse_pipeline, text)
    harness.count("pipeline: parse API")
    if isinstance(parsed, KernccError):
        located_in_spec(parsed, text)
    else:
        again = harness.api(parse_pipeline, str(parsed))
        assert again == parsed, f"{text!r} parses to {parsed}, which parses back to {again}"
    passes = harness.api(resolve_pipeline, text)
    harness.count("pipeline: resolve API")
    if isinstance(passes, KernccError):
        located_in_spec(passes, text)
        return None
    assert not isinstance(parsed, KernccError), f"{text!r} resolves but does not parse"
    printed = ",".join(str(pass_spec(p)) for p in passes)
    again = harness.api(resolve_pipeline, printed)
    assert again == passes, f"{text!r} resolves to {printed!r}, which resolves to {again}"
    return passes


def located_in_spec(err: KernccError, text: str) -> None:
    for diag in err.diagnostics:
        loc = diag.location
        assert loc.file == "pipeline" and loc.line is not None, \
            f"the spec error is not located: {diag.render()}\nspec: {text!r}"
        assert 1 <= loc.line <= text.count("\n") + 1, f"line {loc.line} of {text!r}"


def emit_target(passes: tuple, case: Path, default: Path) -> Path | None:
    """Where the pipeline writes its bundle; None when that is outside the case directory."""
    outs = [p.out for p in passes if p.name == "emit" and p.out]
    if not outs:
        return default
    out = Path(outs[-1])
    if out.is_absolute() or ".." in out.parts or out.parts[:1] == ("~",):
        return None
    return case / out


def run_spec(text: str, passes: tuple | None, model: Path, data: st.DataObject,
             case: Path) -> None:
    """`kerncc lower` (to a directory or stdout) or `kerncc dump -p` with the spec (written
    `--pipeline=SPEC`, so that a spec starting with `-` is not taken for a flag)."""
    how = data.draw(st.sampled_from(("lower -o", "lower", "dump")), label="command")
    target = case / "out"
    if passes is not None:
        target = emit_target(passes, case, target)
        if target is None:
            return
    if how == "dump":
        outcome = run_cli(["dump", model, f"--pipeline={text}", "--format", "json"], cwd=case)
    else:
        flags = ["-o", target] if how == "lower -o" else []
        outcome = run_cli(["lower", model, f"--pipeline={text}", *flags], cwd=case)
        if how == "lower -o" or "emit" in text:
            harness.no_partial_output(outcome, target)
    harness.count(f"pipeline: {how.split()[0]}")
    harness.located_in_pipeline_or_file(outcome, str(model))
    if passes is None:
        assert outcome.code == 1, "the CLI took a spec the API refuses"
        assert re.search(r"pipeline:\d+:\d+", outcome.err), outcome.describe()
    harness.tally("pipeline: ran", outcome.code == 0)
    shutil.rmtree(case)


@settings(max_examples=examples(1000, 20000))
@given(text=spec_cases())
def test_pipeline_specs_parse_resolve_and_print_back(text: str) -> None:
    check_spec_api(text)
    harness.case("pipeline: specs (API)")


@settings(max_examples=examples(150, 4000))
@given(data=st.data())
def test_pipeline_specs_drive_the_cli(data: st.DataObject, tiny_model, fuzz_root: Path) -> None:
    text = data.draw(spec_cases(), label="spec")
    passes = check_spec_api(text)
    harness.tally("pipeline: resolves", passes is not None)
    model = data.draw(st.sampled_from((tiny_model[0], GOLDEN_INPUTS / "layers3.json")))
    with harness.unchanged(model):
        run_spec(text, passes, model, data, fresh_dir(fuzz_root))
    harness.case("pipeline: specs (CLI)")
