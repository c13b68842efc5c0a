"""Bundles that try to run code, follow links out, read special files or escape by path.

Each case copies the tiny model's bundle (with its input and checkpoint beside it) and makes
one attack of issue 15: Python written into a stage.py at a random line (its sha256 recorded,
dropped, or left stale), a stage file or folder replaced by a link out of the bundle, a file
replaced by a FIFO or a link to /dev/zero, or a path in bundle.json that leaves the bundle.
`kerncc check`, `kerncc run` and `kerncc report` must refuse each (exit 1, no hang: the
harness's deadline) and the marker file the payload writes must never appear.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.random_manifests import examples

from . import harness
from .harness import fresh_dir, run_cli

ATTACKS = ("code", "link", "special", "path")
RUN = ("--backend", "cpu", "--prompt", "1,2", "--max-new", "1")
STAGE_FILES = ("manifest.json", "plan.json", "stage.py")


def _index(bundle: Path) -> dict:
    return json.loads((bundle / "bundle.json").read_text())


def _write_index(bundle: Path, index: dict) -> None:
    (bundle / "bundle.json").write_text(json.dumps(index, indent=2))


def _code(bundle: Path, marker: Path, data: st.DataObject) -> None:
    k = data.draw(st.integers(0, 1), label="stage")
    path = bundle / f"stage{k}" / "stage.py"
    lines = path.read_text().splitlines(keepends=True)
    at = data.draw(st.integers(0, len(lines)), label="line")
    payload = f"open({str(marker)!r}, 'w').write('ran')\n"
    if at < len(lines) and lines[at].startswith("    "):
        payload = "    " + payload  # inside a program's function
    path.write_text("".join(lines[:at]) + payload + "".join(lines[at:]))
    index = _index(bundle)
    how = data.draw(st.sampled_from(("record", "drop", "stale")), label="sha")
    if how == "record":
        index["stages"][k]["stage_py_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    elif how == "drop":
        del index["stages"][k]["stage_py_sha256"]
    _write_index(bundle, index)


def _link(bundle: Path, data: st.DataObject) -> None:
    k = data.draw(st.integers(0, 1), label="stage")
    name = data.draw(st.sampled_from((*STAGE_FILES, "", "bundle.json")), label="file")
    target = bundle / "bundle.json" if name == "bundle.json" else bundle / f"stage{k}" / name
    outside = bundle.parent / "outside" / (name or f"stage{k}")
    outside.parent.mkdir(exist_ok=True)
    shutil.move(target, outside)
    target.symlink_to(outside)


def _special(bundle: Path, data: st.DataObject) -> None:
    k = data.draw(st.integers(0, 1), label="stage")
    name = data.draw(st.sampled_from((*STAGE_FILES, "bundle.json", "module")), label="file")
    if name == "module":
        target = bundle / f"stage{k}" / "modules" / (hashlib.sha256(b"").hexdigest() + ".cubin")
        target.parent.mkdir(exist_ok=True)
    else:
        target = bundle / "bundle.json" if name == "bundle.json" else bundle / f"stage{k}" / name
        target.unlink()
    if data.draw(st.booleans(), label="fifo"):
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/zero")


def _path(bundle: Path, data: st.DataObject) -> None:
    index = _index(bundle)
    field = data.draw(st.sampled_from(("dir", "checkpoint", "input")), label="field")
    escape = data.draw(st.sampled_from(("/tmp", "/etc/hostname", "../../x", "stage0/../..",
                                        str(bundle.parent.resolve() / "model.json"))),
                       label="path")
    if field == "dir":
        index["stages"][data.draw(st.integers(0, 1), label="stage")]["dir"] = escape
    elif field == "checkpoint":
        index["checkpoint"] = escape if escape.startswith("/") else "/" + escape.lstrip("./")
    else:
        index["input"]["path"] = escape if escape.startswith("/") else "/" + escape.lstrip("./")
    _write_index(bundle, index)


@settings(max_examples=examples(16, 300), deadline=None)
@given(data=st.data())
def test_bundles_that_try_to_escape_are_refused(data: st.DataObject, tiny_bundle,
                                                fuzz_root: Path) -> None:
    case = fresh_dir(fuzz_root)
    bundle = case / "bundle"
    shutil.copytree(tiny_bundle.dir, bundle)
    for original in (tiny_bundle.manifest, tiny_bundle.checkpoint):
        shutil.copy(original, case / original.name)
    index = _index(bundle)
    index["input"]["path"], index["checkpoint"] = "../model.json", "../model.safetensors"
    _write_index(bundle, index)
    marker = case / "marker"
    attack = data.draw(st.sampled_from(ATTACKS), label="attack")
    if attack == "code":
        _code(bundle, marker, data)
    elif attack == "link":
        _link(bundle, data)
    elif attack == "special":
        _special(bundle, data)
    else:
        _path(bundle, data)
    for argv in (["check", bundle], ["run", bundle, *RUN], ["report", bundle]):
        outcome = run_cli(argv)
        harness.count(f"escape: {argv[0]}")
        assert outcome.code == 1, f"{attack}: not refused\n{outcome.describe()}"
        assert not marker.exists(), f"{attack}: the bundle's code ran\n{outcome.describe()}"
    shutil.rmtree(case)
    harness.case(f"escape: {attack}")
