"""Fuzz fixtures (seeds, the tiny example model and its bundle, made once per session) and the
case tally printed at the end of the session (and kept in pytest's cache as `fuzz/cases`)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import attrs
import pytest

from kerncc.example import generate

from . import harness
from .seeds import Seed, json_seeds, kir_seeds

BUNDLE_PIPELINE = "cut,slice-derive,emit"


class Seeds:
    """The JSON and kir seeds (a plain class: hypothesis prints fixtures it draws with)."""

    def __init__(self, json_: tuple[Seed, ...], kir: tuple[Seed, ...]) -> None:
        self.json = json_
        self.kir = kir

    def __repr__(self) -> str:
        return f"Seeds({len(self.json)} json, {len(self.kir)} kir)"


@attrs.frozen
class TinyBundle:
    """The tiny model's bundle beside its input and checkpoint (bundle.json names them
    `../model.json`, `../model.safetensors`: a bundle names no absolute path)."""

    dir: Path
    manifest: Path
    checkpoint: Path

    def copy(self, dest: Path) -> Path:
        """A copy of the bundle at `dest`, with copies of its input and checkpoint beside it."""
        shutil.copytree(self.dir, dest)
        for original in (self.manifest, self.checkpoint):
            shutil.copy(original, dest.parent / original.name)
        return dest


@pytest.fixture(scope="session")
def fuzz_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return generate(tmp_path_factory.mktemp("tiny") / "model", "tiny")


@pytest.fixture(scope="session")
def seeds(tiny_model: tuple[Path, Path]) -> Seeds:
    json_ = json_seeds([tiny_model[0]])
    return Seeds(tuple(json_), tuple(kir_seeds(json_)))


@pytest.fixture(scope="session")
def tiny_bundle(tiny_model: tuple[Path, Path]) -> TinyBundle:
    manifest, checkpoint = tiny_model
    out = manifest.parent / "bundle"
    lowered = harness.run_cli(["lower", manifest, "-p", BUNDLE_PIPELINE, "-o", out])
    assert lowered.code == 0, lowered.describe()
    index_path = out / "bundle.json"
    index = json.loads(index_path.read_text())
    # relative to the bundle (a bundle names no absolute path), as emit records them
    index["input"]["path"] = os.path.relpath(manifest.resolve(), out.resolve())
    index["checkpoint"] = os.path.relpath(checkpoint.resolve(), out.resolve())
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    return TinyBundle(out, manifest, checkpoint)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not harness.CASES:
        return
    total = sum(harness.CASES.values())
    terminalreporter.write_sep("-", f"fuzz: {total} cases, {sum(harness.CALLS.values())} runs")
    for title, tally in (("cases", harness.CASES), ("runs", harness.CALLS),
                         ("outcomes", harness.OUTCOMES)):
        terminalreporter.write_line(f"{title}:")
        for name, n in sorted(tally.items()):
            terminalreporter.write_line(f"  {name:<32} {n:>6}")
    cache = getattr(config, "cache", None)  # absent under `-p no:cacheprovider`
    if cache is not None:
        cache.set("fuzz/cases", {"total": total, "cases": dict(harness.CASES),
                                        "runs": dict(harness.CALLS)})
