"""`kerncc check BUNDLE [WHOLE]`: re-prove a bundle from its files alone (docs/bundle.md).

Reads the bundle through kerncc.bundle.reader, the reader the runtime uses (bundle.json, every
stage's files inside its folder and hashed against it, every module against its name), finds
the input manifest (`.json` or `.kir`, read by kerncc.source; its path is relative to the bundle
directory, or WHOLE given on the command line) and checks its sha256, then runs the symbolic
check again (kerncc.symbolic.check_stages). What was proved is what runs: each plan.json is
checked against its stage as the runtime checks it, and each stage.py against kerncc's
rendering of that plan (the code that runs). A missing or changed file is a KernccError naming
the file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kerncc import manifest as m
from kerncc import source
from kerncc.bundle import reader
from kerncc.files import FileRefused, read_regular
from kerncc.bundle.format import HEADLINE
from kerncc.bundle.reader import Index, StageFiles, read_index, stage_files
from kerncc.diagnostics import KernccError, Location
from kerncc.symbolic import Proof, check_stages

__all__ = ["HEADLINE", "check_bundle", "input_manifest", "read_index", "stage_files",
           "stage_manifest", "stage_manifests", "stage_plan"]


def stage_manifest(files: StageFiles) -> m.Manifest:
    return reader.stage_manifest(files)[0]


def stage_plan(index: Index, files: StageFiles, man: m.Manifest) -> dict[str, Any]:
    """The stage's plan.json and its code, checked as the runtime's loader checks them: what
    check and report pass, the runtime loads."""
    read = reader.read_stage(index, files)
    return read.plan


def stage_manifests(index: Index) -> list[m.Manifest]:
    """Each stage's manifest, after its files and modules hash to what bundle.json says."""
    return [stage_manifest(files) for files in stage_files(index)]


def input_manifest(index: Index, whole: str | Path | None) -> m.Manifest:
    """The whole manifest the bundle was lowered from, checked against its recorded sha256."""
    return _input(index, whole)[0]


def input_path(index: Index, whole: str | Path | None) -> Path:
    """Where the input manifest is: WHOLE as the user gave it, else bundle.json's record."""
    if whole is not None:
        return Path(whole)
    recorded = (index.data.get("input") or {}).get("path")
    if recorded is None:
        raise index.error("the bundle records no input manifest (it was emitted from memory); "
                          "name the whole manifest to check it against: kerncc check BUNDLE "
                          "WHOLE", "/input/path")
    if not reader.is_recorded_path(recorded):
        raise index.error(f"input path `{recorded}` is not a relative path: a bundle names its "
                          "input relative to its folder", "/input/path")
    return index.dir / recorded


def _input(index: Index, whole: str | Path | None
           ) -> tuple[m.Manifest, Callable[[str], Location]]:
    """The input manifest and the locator of its text."""
    path = input_path(index, whole)
    try:
        data = read_regular(path, "the input manifest", index.limit)
    except FileRefused as err:  # at the command line's path, or where bundle.json names it
        raise (reader.at_file(path, err.message) if whole is not None
               else index.error(err.message, "/input/path")) from None
    expected = (index.data.get("input") or {}).get("sha256")
    if expected is not None and reader.sha256(data) != expected:
        raise index.error(f"the input manifest `{path}` was changed after emit: sha256 "
                          f"{reader.sha256(data)}, the bundle recorded {expected}",
                          "/input/sha256")
    return source.loads_with_locator(reader.text_of(data, path), path)


def check_bundle(directory: str | Path, whole: str | Path | None = None,
                 max_file_size: int | None = None) -> Proof:
    """Prove again that the bundle's stages compute its input manifest; KernccError if not.

    `whole` overrides the input path recorded in bundle.json (a path the user gives).
    """
    index = read_index(directory, max_file_size)
    files = stage_files(index)
    stages = [stage_manifest(f) for f in files]
    whole_manifest, locate = _input(index, whole)
    try:
        proof = check_stages(whole_manifest, stages)
    except KernccError as err:  # its pointers are the whole manifest's calls
        raise err.located(locate) from None
    # What was proved is what runs: each plan.json fits its stage as the runtime checks it,
    # and each stage.py is kerncc's rendering of that plan.
    read = [reader.read_stage(index, f) for f in files]
    reader.check_links(index, [r.manifest for r in read])
    return proof
