"""Mutated JSON manifests through verify, fmt, dump and lower (and the reader/verifier API).

Each case mutates a seed (JSON values at random pointers, shape-keeping edits that mostly still
parse and so reach the verifier and the passes, or raw bytes), writes it to a fresh directory
and runs `verify` (text or `--format json`), `fmt` (json or kir) and one of dump or
lower. Besides the CLI contract (harness.py) it checks that the commands agree with each other
(a manifest that verifies also formats; one that does not verify neither dumps nor lowers), that
what `fmt` prints reads back to the same manifest in both forms, and that a failure is located.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kerncc import kir, source
from kerncc.manifest import writer
from kerncc.manifest import reader
from kerncc.diagnostics import KernccError
from tests.random_manifests import examples
from kerncc.verify import verify

from . import harness
from .harness import count, fresh_dir, run_cli
from .mutate import dumps, edit_manifest, mutate_bytes, mutate_json

SPECS = ("cut,slice-derive,emit", "cut{at=3},share-states,slice-once,slice-derive,plan-memory,emit",
         "cut{stages=3},emit", "default", "cut{at-label=l1.qkv_proj}", "liveness,plan-memory")
DUMPS = (("--pass", "liveness"), ("--format", "dot"), ("--format", "json", "-p", "cut"),
         ("--format", "kir", "-p", "default"), ("--pass", "plan-memory"))


def check_manifest_file(path: Path, data: st.DataObject) -> None:
    """The manifest commands on the file at `path`, with the invariants of the module doc."""
    with harness.unchanged(path):
        valid = api_accepts(path)
        harness.tally("manifest: still valid", valid)
        verify_case(path, data.draw(st.sampled_from(("text", "json")), label="verify format"),
                    valid)
        fmt_case(path, data.draw(st.sampled_from(("json", "kir")), label="fmt --to"), valid)
        if data.draw(st.booleans(), label="lower (else dump)"):
            lower_case(path, data.draw(st.sampled_from(SPECS), label="spec"), valid)
        else:
            dump_case(path, data.draw(st.sampled_from(DUMPS), label="dump"), valid)


def check_manifest_everywhere(path: Path) -> None:
    """Every manifest command with every flag set of this module on `path` (regressions)."""
    with harness.unchanged(path):
        valid = api_accepts(path)
        for fmt in ("text", "json"):
            verify_case(path, fmt, valid)
        for to in ("json", "kir"):
            fmt_case(path, to, valid)
        for flags in DUMPS:
            dump_case(path, flags, valid)
        for spec in SPECS:
            lower_case(path, spec, valid)


def verify_case(path: Path, fmt: str, valid: bool) -> None:
    outcome = run_cli(["verify", "--format", fmt, path])
    count("manifest: verify")
    if fmt == "json":
        harness.located_in_json(outcome)
    else:
        harness.located_in_text(outcome, str(path))
    assert valid or outcome.code == 1, "`kerncc verify` took what verify() refuses"


def fmt_case(path: Path, to: str, valid: bool) -> None:
    outcome = run_cli(["fmt", path, "--to", to])
    count("manifest: fmt")
    harness.located_in_text(outcome, str(path))
    assert not valid or outcome.code == 0, "verifies, but fmt cannot read it"
    if outcome.code == 0:
        check_round_trip(outcome.out, to, source.load(path))


def check_round_trip(text: str, form: str, manifest) -> None:
    """What fmt printed reads back (in its form) to the same canonical manifest."""
    canonical = writer.dumps(manifest)
    back = harness.api(kir.loads if form == "kir" else reader.loads, text)
    assert not isinstance(back, KernccError), f"fmt --to {form} printed what it cannot read:\n" \
        f"{back}\n--- printed\n{text[:3000]}"
    assert writer.dumps(back) == canonical, f"fmt --to {form} does not round-trip"
    if form == "json":
        assert text == canonical, "fmt --to json is not the canonical form"


def dump_case(path: Path, flags: tuple[str, ...], valid: bool) -> None:
    outcome = run_cli(["dump", path, *flags])
    count("manifest: dump")
    harness.located_in_text(outcome, str(path))
    assert valid or outcome.code == 1, "dump took a manifest that does not verify"


def lower_case(path: Path, spec: str, valid: bool) -> None:
    target = path.parent / "out"
    outcome = run_cli(["lower", path, "-p", spec, "-o", target], cwd=path.parent)
    count("manifest: lower")
    harness.tally("manifest: lowered", outcome.code == 0)
    harness.located_in_text(outcome, str(path))
    harness.no_partial_output(outcome, target)
    assert valid or outcome.code == 1, "lower took a manifest that does not verify"
    if outcome.code == 0:
        shutil.rmtree(target)


def api_accepts(path: Path) -> bool:
    """The library's reader and verifier on the file (KernccError and nothing else): whether
    they accept it."""
    loaded = harness.api(source.load_with_locator, path)
    count("manifest: reader/verify API")
    if isinstance(loaded, KernccError):
        return False
    return not isinstance(harness.api(verify, loaded[0]), KernccError)


@settings(max_examples=examples(300, 6000))
@given(data=st.data())
def test_mutated_json_values(data: st.DataObject, seeds, fuzz_root: Path) -> None:
    seed = data.draw(st.sampled_from(seeds.json), label="seed")
    doc = mutate_json(seed.doc, data)
    case = fresh_dir(fuzz_root)
    path = case / "model.json"
    path.write_text(dumps(doc, indent=data.draw(st.sampled_from((2, None)), label="indent")))
    check_manifest_file(path, data)
    shutil.rmtree(path.parent)
    harness.case("manifest: json values")


@settings(max_examples=examples(150, 4000))
@given(data=st.data())
def test_mutated_json_bytes(data: st.DataObject, seeds, fuzz_root: Path) -> None:
    seed = data.draw(st.sampled_from(seeds.json), label="seed")
    case = fresh_dir(fuzz_root)
    path = case / "model.json"
    path.write_bytes(mutate_bytes(seed.text.encode(), data))
    check_manifest_file(path, data)
    shutil.rmtree(path.parent)
    harness.case("manifest: json bytes")


@settings(max_examples=examples(250, 4000))
@given(data=st.data())
def test_edited_manifests(data: st.DataObject, seeds, fuzz_root: Path) -> None:
    """Edits that keep the manifest's shape, so most cases reach the verifier and the passes."""
    seed = data.draw(st.sampled_from(seeds.json), label="seed")
    doc = edit_manifest(seed.doc, data)
    path = fresh_dir(fuzz_root) / "model.json"
    path.write_text(dumps(doc))
    check_manifest_file(path, data)
    shutil.rmtree(path.parent)
    harness.case("manifest: edits")
