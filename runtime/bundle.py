"""Reading a stage bundle (docs/bundle.md): every file checked before anything runs.

`Bundle(dir)` reads `bundle.json` and each stage's `manifest.json`, `plan.json` and (when
present) `stage.py`, checking every recorded sha256 against the bytes read, the cubins under
`modules/` against their names, and each plan against its manifest
(kerncc.bundle.plan_check). Anything missing, tampered or malformed is a KernccError whose
diagnostics carry the file's path. The runtime never lowers: `kerncc.lower` (above both the
compiler and the runtime) turns a manifest into a temporary bundle, so that a manifest and a
bundle run through the same code.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from kerncc import manifest as m
from kerncc.diagnostics import Diagnostic, KernccError, Location
from kerncc.bundle.index import index_problems
from kerncc.manifest.jsonsource import PositionIndex, parse_json
from kerncc.manifest.reader import load_with_locator, read_text
from kerncc.bundle.plan_check import MalformedPlan, check_plan
from kerncc.checkpoint.shards import checkpoint_beside
from kerncc.stage import host_inputs
from kerncc.verify import verify

FORMAT = "kerncc-bundle/1"
WEIGHTS_BESIDE_MANIFEST = "model.safetensors"  # or its shard index: kerncc.checkpoint.shards


def bundle_error(path: Path | str, message: str, ptr: str = "") -> KernccError:
    """An error about one file of a bundle, located at that file."""
    return KernccError(f"cannot load bundle file `{path}`:",
                       [Diagnostic(message, Location(ptr, file=str(path)))])


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@attrs.frozen
class Stage:
    """One stage of a bundle: its manifest, its plan, its generated code, its host inputs."""

    index: int
    dir: Path
    manifest: m.Manifest
    plan: dict
    stage_py: Path | None
    host_inputs: tuple[str, ...]
    locate: Callable[[str], Location] = attrs.field(eq=False, repr=False)

    def located(self, err: KernccError) -> KernccError:
        """The error with its JSON pointers placed in this stage's manifest.json."""
        return err.located(self.locate)

    def plan_path(self) -> Path:
        return self.dir / "plan.json"


class Bundle:
    """A checked bundle directory: `stages`, `edges`, `checkpoint`, `pipeline`, `index`."""

    def __init__(self, path: str | Path) -> None:
        self.dir = Path(path)
        self.index = _read_index(self.dir)
        self.pipeline: str = self.index.get("pipeline", "")
        self.edges: list[dict] = list(self.index.get("edges", []))
        self.checkpoint = self._checkpoint()
        self.stages = [_read_stage(self.dir, entry, i)
                       for i, entry in enumerate(self.index["stages"])]
        self._check_edges()
        self._check_host_inputs()

    def __repr__(self) -> str:
        return f"Bundle({str(self.dir)!r}, stages={len(self.stages)})"

    @classmethod
    def open(cls, path: str | Path) -> Bundle:
        """A bundle directory (a manifest file is lowered first: `kerncc.lower.open_target`)."""
        path = Path(path)
        if path.is_dir():
            return cls(path)
        if not path.exists():
            raise KernccError.single(f"`{path}` does not exist (expected a bundle directory)")
        raise KernccError.single(f"`{path}` is not a bundle directory (lower a manifest with "
                                 "`kerncc lower FILE -p emit -o DIR`)")

    def _checkpoint(self) -> Path | None:
        recorded = self.index.get("checkpoint")
        if not recorded:
            return None
        return (self.dir / recorded).resolve()

    def _check_edges(self) -> None:
        count = len(self.stages)
        for i, edge in enumerate(self.edges):
            ok = isinstance(edge, dict) and {"buffer", "from", "to"} <= set(edge)
            if not ok or not (0 <= edge["from"] < edge["to"] < count):
                raise bundle_error(self.dir / "bundle.json", f"malformed edge {edge!r}",
                                   f"/edges/{i}")
            for end in ("from", "to"):
                if edge["buffer"] not in self.stages[edge[end]].manifest.buffers:
                    raise bundle_error(self.dir / "bundle.json",
                                       f"edge buffer `{edge['buffer']}` is not a buffer of "
                                       f"stage {edge[end]}", f"/edges/{i}")

    def _check_host_inputs(self) -> None:
        """Each stage's recorded host inputs are the ones its manifest and the edges give."""
        for stage in self.stages:
            arriving = {e["buffer"] for e in self.edges if e["to"] == stage.index}
            expected = host_inputs(stage.manifest, arriving)
            if list(stage.host_inputs) != expected:
                raise bundle_error(self.dir / "bundle.json", f"stage {stage.index} records host "
                                   f"inputs {list(stage.host_inputs)}, but its manifest.json "
                                   f"and the edges give {expected}",
                                   f"/stages/{stage.index}/host_inputs")


# ---------------------------------------------------------------------------------------------
# Reading and checking files


def _read_json(path: Path) -> Any:
    """The file's JSON, read as strictly as a manifest (UTF-8, no NaN, bounded nesting)."""
    if not path.is_file():
        raise bundle_error(path, "the file is missing")
    try:
        return parse_json(read_text(path), str(path))
    except KernccError as err:
        raise KernccError(f"cannot load bundle file `{path}`:", [
            attrs.evolve(d, message=f"not valid JSON: {d.message}") for d in err.diagnostics]
        ) from None


def _read_index(root: Path) -> dict:
    if not root.is_dir():
        raise KernccError.single(f"`{root}` is not a bundle directory")
    path = root / "bundle.json"
    if not path.is_file():
        raise bundle_error(path, f"`{root}` is not a bundle: bundle.json is missing")
    index = _read_json(path)
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        found = index.get("format") if isinstance(index, dict) else None
        raise bundle_error(path, f"format is {found!r}, expected {FORMAT!r}", "/format")
    problems = index_problems(index)
    if problems:
        locate = PositionIndex.locator(read_text(path), str(path))
        raise KernccError(f"cannot load bundle file `{path}`:",
                          [Diagnostic(message, locate(ptr)) for ptr, message in problems])
    return index


def _check_sha(path: Path, entry: dict, key: str, where: Path, ptr: str) -> None:
    """The file's sha256 against the bundle's record, when the bundle records one."""
    expected = entry.get(key)
    if expected is None:
        return
    if not path.is_file():
        raise bundle_error(path, "the file is missing")
    actual = sha256_of(path)
    if actual != expected:
        raise bundle_error(path, f"sha256 is {actual}, but {where.name} records {expected} "
                           f"({ptr}/{key}): the file was changed after emit")


def _read_stage(root: Path, entry: dict, i: int) -> Stage:
    index_path, ptr = root / "bundle.json", f"/stages/{i}"
    stage_dir = root / entry["dir"]
    manifest_path = stage_dir / "manifest.json"
    _check_sha(manifest_path, entry, "manifest_sha256", index_path, ptr)
    _check_sha(stage_dir / "plan.json", entry, "plan_sha256", index_path, ptr)
    _check_sha(stage_dir / "stage.py", entry, "stage_py_sha256", index_path, ptr)
    if "stage_py_sha256" in entry and entry["stage_py_sha256"] is None \
            and (stage_dir / "stage.py").exists():
        raise bundle_error(stage_dir / "stage.py", f"bundle.json records no stage.py for stage "
                           f"{i} ({ptr}/stage_py_sha256 is null), but the file is there: a "
                           "file the bundle does not pin would run")
    if not manifest_path.is_file():
        raise bundle_error(manifest_path, "the file is missing")
    manifest, locate = load_with_locator(manifest_path)
    try:
        verify(manifest)  # what runs must verify, whatever wrote the file
    except KernccError as err:
        raise err.located(locate) from None
    plan = _read_json(stage_dir / "plan.json")
    try:
        check_plan(plan, manifest)
    except MalformedPlan as err:
        raise bundle_error(stage_dir / "plan.json", str(err), err.ptr) from None
    _check_modules(stage_dir / "modules")
    stage_py = stage_dir / "stage.py"
    return Stage(i, stage_dir, manifest, plan, stage_py if stage_py.is_file() else None,
                 tuple(entry.get("host_inputs", ())), locate)


def _check_modules(modules: Path) -> None:
    if not modules.is_dir():
        return
    for cubin in sorted(modules.glob("*.cubin")):
        if sha256_of(cubin) != cubin.stem:
            raise bundle_error(cubin, "the cubin's sha256 is not the one its name records")
