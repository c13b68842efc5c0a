"""`kerncc check BUNDLE`: re-prove a bundle from its files alone (docs/bundle.md).

Reads `bundle.json`, re-hashes every stage's `manifest.json`, `plan.json` and `stage.py` and
every file under `modules/` against what the bundle recorded, finds the input manifest (its
path is relative to the bundle directory, or absolute) and checks its sha256, then loads the
stage manifests and runs the symbolic check again (kerncc.symbolic.check_stages). A missing or
changed file is a KernccError naming the file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from kerncc import manifest as m
from kerncc.bundle.index import index_problems
from kerncc.diagnostics import Diagnostic, KernccError, Location
from kerncc.manifest.jsonsource import TOO_DEEP, PositionIndex, parse_json
from kerncc.bundle.plan_check import MalformedPlan, check_plan
from kerncc.symbolic import Proof, check_stages
from kerncc.verify import verify

FORMAT = "kerncc-bundle/1"
HEADLINE = "not a valid kerncc bundle:"
STAGE_FILES = (("manifest.json", "manifest_sha256"), ("plan.json", "plan_sha256"),
               ("stage.py", "stage_py_sha256"))


def _fail(message: str, ptr: str = "") -> KernccError:
    return KernccError(HEADLINE, KernccError.single(message, ptr).diagnostics)


def _read(path: Path, what: str, ptr: str = "") -> bytes:
    """The file's bytes; `ptr`, when given, is where bundle.json names the file."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise _fail(f"{what} `{path}` is missing", ptr) from None
    except OSError as err:
        raise _fail(f"cannot read {what} `{path}`: {err.strerror}", ptr) from None


def _text(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise _fail(f"`{path}` is not UTF-8 text") from None


def read_index(bundle: Path) -> dict[str, Any]:
    """bundle.json, checked for the format this module reads."""
    if not bundle.is_dir():
        raise _fail(f"`{bundle}` is not a directory")
    try:
        index = json.loads(_read(bundle / "bundle.json", "the bundle index"))
    except (ValueError, UnicodeDecodeError) as err:  # a JSONDecodeError, or 5000 digits
        raise _fail(f"`{bundle / 'bundle.json'}` is not JSON: {err}") from None
    except RecursionError:
        raise _fail(f"`{bundle / 'bundle.json'}` is not JSON: {TOO_DEEP}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        found = index.get("format") if isinstance(index, dict) else None
        raise _fail(f"`{bundle / 'bundle.json'}` has format {found!r}, not {FORMAT!r}",
                    "/format")
    problems = index_problems(index)
    if problems:  # placed in bundle.json, every one
        raise _in_index(KernccError(HEADLINE, [Diagnostic(message, Location(ptr))
                                               for ptr, message in problems]),
                        bundle / "bundle.json")
    return index


def _checked(path: Path, what: str, expected: Any, ptr: str, named_at: str = "") -> bytes:
    data = _read(path, what, named_at)
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected:
        raise _fail(f"{what} `{path}` was changed after emit: sha256 {digest}, the bundle "
                    f"recorded {expected}", ptr)
    return data


def stage_files(bundle: Path, index: dict[str, Any]) -> list[tuple[Path, dict[str, bytes]]]:
    """Each stage's folder and file bytes by name, after they and its modules hash to what
    bundle.json says."""
    stages = []
    for k, entry in enumerate(index["stages"]):  # read_index checked them
        folder = bundle / entry["dir"]
        texts = {}
        for name, key in STAGE_FILES:
            path, ptr, expected = folder / name, f"/stages/{k}/{key}", entry.get(key)
            if key == "stage_py_sha256" and key in entry and expected is None:
                _check_absent(path, k, ptr)  # null: the stage has no stage.py
                continue
            # a sha256 not recorded is not checked (docs/bundle.md), as the runtime does
            texts[name] = _checked(path, f"stage {k} {name}", expected, ptr) \
                if expected is not None else _read(path, f"stage {k} {name}", ptr)
        _check_modules(folder / "modules", k)
        stages.append((folder, texts))
    return stages


def _check_absent(path: Path, k: int, ptr: str) -> None:
    if path.exists():
        raise _fail(f"stage {k} has a `{path.name}` (`{path}`), but bundle.json records none "
                    "(null): a file the bundle does not pin would run", ptr)


def stage_manifest(folder: Path, texts: dict[str, bytes]) -> m.Manifest:
    path = folder / "manifest.json"
    return m.loads(_text(texts["manifest.json"], path), str(path))


def stage_plan(folder: Path, texts: dict[str, bytes], man: m.Manifest) -> dict[str, Any]:
    """The stage's plan.json, checked against its manifest as the runtime's loader checks it
    (kerncc.bundle.plan_check): what check and report pass, the runtime loads."""
    try:  # the plan is read against a manifest the runtime would load
        verify(man)
    except KernccError as err:
        where = folder / "manifest.json"
        raise err.located(PositionIndex.locator(_text(texts["manifest.json"], where),
                                                str(where))) from None
    path = folder / "plan.json"
    text = _text(texts["plan.json"], path)
    plan = parse_json(text, str(path))  # as strictly as the runtime reads it
    try:
        check_plan(plan, man)
    except MalformedPlan as err:
        raise KernccError(HEADLINE, [Diagnostic(str(err), Location(err.ptr, str(path)))]
                          ).located(PositionIndex.locator(text, str(path))) from None
    return plan


def stage_manifests(bundle: Path, index: dict[str, Any]) -> list[m.Manifest]:
    """Each stage's manifest, after its files and modules hash to what bundle.json says."""
    return [stage_manifest(folder, texts) for folder, texts in stage_files(bundle, index)]


def _check_modules(folder: Path, k: int) -> None:
    """A module file is named by its sha256; one whose bytes hash otherwise was changed."""
    if not folder.is_dir():
        return
    for path in sorted(folder.iterdir()):
        _checked(path, f"stage {k} module", path.name.removesuffix(".cubin"), "")


def input_manifest(bundle: Path, index: dict[str, Any], whole: str | Path | None
                   ) -> m.Manifest:
    """The whole manifest the bundle was lowered from, checked against its recorded sha256."""
    return _input(bundle, index, whole)[0]


def _input(bundle: Path, index: dict[str, Any], whole: str | Path | None
           ) -> tuple[m.Manifest, Callable[[str], Location]]:
    """The input manifest and the locator of its text."""
    recorded = index.get("input") or {}
    if not isinstance(recorded, dict):
        raise _fail(f"`{bundle / 'bundle.json'}`: `input` is not an object", "/input")
    path = whole if whole is not None else recorded.get("path")
    if path is not None and not isinstance(path, (str, Path)):
        raise _fail(f"`{bundle / 'bundle.json'}`: `input.path` is not a string", "/input/path")
    if path is None:
        raise _fail("the bundle records no input manifest (it was emitted from memory); "
                    "name the whole manifest to check it against", "/input/path")
    path = bundle / path if not Path(path).is_absolute() else Path(path)
    text = _text(_checked(path, "the input manifest", recorded.get("sha256"), "/input/sha256",
                          "/input/path" if whole is None else ""), path)
    return m.loads(text, str(path)), PositionIndex.locator(text, str(path))


def check_bundle(directory: str | Path, whole: str | Path | None = None) -> Proof:
    """Prove again that the bundle's stages compute its input manifest; KernccError if not.

    `whole` overrides the input path recorded in bundle.json (relative to the bundle).
    """
    bundle = Path(directory)
    try:
        index = read_index(bundle)
        files = stage_files(bundle, index)
        stages = [stage_manifest(folder, texts) for folder, texts in files]
        source, locate = _input(bundle, index, whole)
    except KernccError as err:
        raise _in_index(err, bundle / "bundle.json") from None
    try:
        proof = check_stages(source, stages)
    except KernccError as err:  # its pointers are the whole manifest's calls
        raise err.located(locate) from None
    # What was proved is what runs: each plan.json fits its stage as the runtime checks it.
    for (folder, texts), man in zip(files, stages):
        stage_plan(folder, texts, man)
    return proof


def _in_index(err: KernccError, index_path: Path) -> KernccError:
    """The error with its bare JSON pointers, which all point into bundle.json, placed there."""
    try:
        locate = PositionIndex.locator(index_path.read_text(encoding="utf-8"), str(index_path))
    except (OSError, UnicodeDecodeError):
        return err
    diags = [d if d.location.file or not d.location.pointer
             else attrs.evolve(d, location=locate(d.location.pointer)) for d in err.diagnostics]
    return KernccError(err.headline, diags)
