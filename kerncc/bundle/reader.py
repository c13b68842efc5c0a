"""The one reader of a bundle's files (docs/bundle.md): the runtime, `check` and `report` use it.

Reading goes in steps, each refusing with the same words whoever reads: `read_index` (bundle.json,
strict JSON, its fields typed by kerncc.bundle.index), `stage_files` (every stage's files inside
its folder, regular, bounded, hashed against bundle.json; every module named by its sha256),
`stage_manifest` and `verified_manifest`, `stage_plan` (checked against its manifest by
kerncc.bundle.plan_check) and `stage_code`: kerncc's own rendering of the plan
(kerncc.bundle.stage_py), which is what runs. A stage.py that differs from it is refused, so
nothing written into a bundle executes and proving plan.json proves what runs.

Every refusal is a KernccError headed `HEADLINE` whose diagnostic is placed in the file it is
about: a bundle.json field at its line and column, a file's own problem at that file. No
refusal shows a file's bytes. The compiler (symbolic, passes, kir) is not imported here: the
runtime reads bundles through this module.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from kerncc import manifest as m
from kerncc.files import FileRefused, inside, read_regular
from kerncc.bundle.format import FORMAT, HEADLINE, STAGE_FILES, TOKENIZER_FILES
from kerncc.bundle.index import index_problems
from kerncc.bundle.plan_check import MalformedPlan, check_plan
from kerncc.diagnostics import Diagnostic, KernccError, Location, placed
from kerncc.manifest.jsonsource import PositionIndex, parse_json
from kerncc.verify import verify

Locate = Callable[[str], Location]
_MODULE_NAME = re.compile(r"[0-9a-f]{64}\.cubin")


def refusal(message: str, location: Location | None = None) -> KernccError:
    """A refusal to read a bundle: HEADLINE and one diagnostic."""
    return KernccError(HEADLINE, [Diagnostic(message, location or Location())])


def at_file(path: Path, message: str) -> KernccError:
    return refusal(message, Location(file=str(path)))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def text_of(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise at_file(path, f"`{path}` is not UTF-8 text") from None


def json_of(data: bytes, path: Path) -> tuple[Any, str]:
    """The file's JSON (read as strictly as a manifest: no duplicate key, no NaN) and text."""
    text = text_of(data, path)
    try:
        return parse_json(text, str(path)), text
    except KernccError as err:
        raise KernccError(HEADLINE, [
            attrs.evolve(d, message=f"not valid JSON: {d.message}",
                         location=attrs.evolve(d.location, file=d.location.file or str(path)))
            for d in err.diagnostics]) from None


@attrs.frozen
class Index:
    """bundle.json, read and checked: its folder, its fields, and where each one is."""

    dir: Path
    data: dict[str, Any]
    text: str = attrs.field(repr=False)

    @property
    def path(self) -> Path:
        return self.dir / "bundle.json"

    def locate(self, ptr: str) -> Location:
        return PositionIndex.locator(self.text, str(self.path))(ptr)

    def error(self, message: str, ptr: str) -> KernccError:
        """A refusal about the field of bundle.json at `ptr`, placed at its line and column."""
        return refusal(message, self.locate(ptr))


def read_index(bundle: str | Path) -> Index:
    """bundle.json of the folder `bundle`, its format and every field checked."""
    bundle = Path(bundle)
    if not bundle.is_dir():
        raise refusal(f"`{bundle}` is not a directory (a bundle is one: kerncc lower FILE "
                      "-p emit -o DIR)")
    path = bundle / "bundle.json"
    value, text = json_of(_read(bundle, "bundle.json", "the bundle index"), path)
    index = Index(bundle, value, text) if isinstance(value, dict) else None
    if index is None or value.get("format") != FORMAT:
        found = value.get("format") if isinstance(value, dict) else None
        where = index.locate("/format") if index else Location(file=str(path))
        raise refusal(f"`{path}` has format {_short(found)}, not {FORMAT!r}", where)
    problems = index_problems(value) or _outside_paths(value)
    if problems:
        raise KernccError(HEADLINE, [Diagnostic(message, index.locate(ptr))
                                     for ptr, message in problems])
    return index


def _outside_paths(index: dict[str, Any]) -> list[tuple[str, str]]:
    """The input's and the checkpoint's paths, when recorded, are relative to the bundle, and
    the checkpoint's names a checkpoint (a path that leads elsewhere is never opened)."""
    named = [("/checkpoint", "checkpoint", index.get("checkpoint")),
             ("/input/path", "input", (index.get("input") or {}).get("path"))]
    problems = [(ptr, f"{what} `{path}` is not a relative path: a bundle names the files "
                      "beside it relative to its folder") for ptr, what, path in named
                if path and not is_recorded_path(path)]
    checkpoint = index.get("checkpoint")
    if not problems and isinstance(checkpoint, str) and checkpoint \
            and not checkpoint.endswith(CHECKPOINT_SUFFIXES):
        problems.append(("/checkpoint", f"checkpoint `{_shown_path(checkpoint)}` does not name "
                         "a checkpoint (`.safetensors` or `.safetensors.index.json`): it is not "
                         "opened"))
    return problems


# What a checkpoint bundle.json records is named (emit records model.safetensors or an index).
CHECKPOINT_SUFFIXES = (".safetensors", ".safetensors.index.json")


def _shown_path(name: str) -> str:
    return name.encode("unicode_escape").decode("ascii")[:200]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


# ---------------------------------------------------------------------------------------------
# A stage's files


@attrs.frozen
class StageFiles:
    """A stage's folder and the bytes of its files (by name), after they hash to bundle.json's
    record; `modules` maps each module file's sha256 to its path."""

    index: int
    dir: Path
    texts: dict[str, bytes]
    modules: dict[str, Path]

    def path(self, name: str) -> Path:
        return self.dir / name


def stage_files(index: Index) -> list[StageFiles]:
    """Every stage's files, read as `read_stage_files` reads one."""
    return [read_stage_files(index, k) for k in range(len(index.data["stages"]))]


def read_stage_files(index: Index, k: int) -> StageFiles:
    entry, ptr = index.data["stages"][k], f"/stages/{k}"
    try:
        folder = inside(index.dir, entry["dir"], f"stage {k} directory")
    except FileRefused as err:
        raise index.error(err.message, f"{ptr}/dir") from None
    if not folder.is_dir():
        raise index.error(f"stage {k} directory `{folder}` is missing or not a directory",
                          f"{ptr}/dir")
    texts = {}
    for name, key in STAGE_FILES:
        path, expected = folder / name, entry.get(key)
        if key == "stage_py_sha256" and key in entry and expected is None:
            _check_absent(index, path, k, f"{ptr}/{key}")  # null: the stage has no stage.py
            continue
        data = _read(folder, name, f"stage {k} {name}")
        # a sha256 not recorded is not checked (docs/bundle.md)
        if expected is not None and sha256(data) != expected:
            raise index.error(f"stage {k} {name} `{path}` was changed after emit: sha256 "
                              f"{sha256(data)}, the bundle recorded {expected}", f"{ptr}/{key}")
        texts[name] = data
    return StageFiles(k, folder, texts, _modules(folder, k))


def _read(folder: Path, name: str, what: str) -> bytes:
    try:
        return read_regular(inside(folder, name, what), what)
    except FileRefused as err:
        raise at_file(folder / name, err.message) from None


def _check_absent(index: Index, path: Path, k: int, ptr: str) -> None:
    if path.exists() or path.is_symlink():
        raise index.error(f"stage {k} has a `{path.name}` (`{path}`), but bundle.json records "
                          "none (null): a file the bundle does not pin would be trusted", ptr)


def _modules(folder: Path, k: int) -> dict[str, Path]:
    """The module files of `folder/modules`: each a `<sha256>.cubin` whose bytes hash to it."""
    modules = folder / "modules"
    if not (modules.exists() or modules.is_symlink()):
        return {}
    try:
        inside(folder, "modules", f"stage {k} modules")
    except FileRefused as err:
        raise at_file(modules, err.message) from None
    if not modules.is_dir():
        raise at_file(modules, f"stage {k} modules `{modules}` is not a directory")
    found = {}
    for path in sorted(modules.iterdir()):
        if not _MODULE_NAME.fullmatch(path.name):
            raise at_file(path, f"stage {k} modules/ holds `{path.name}`, which is not a "
                          "module file (`<sha256>.cubin`)")
        data = _read(modules, path.name, f"stage {k} module")
        digest = path.name.removesuffix(".cubin")
        if sha256(data) != digest:
            raise at_file(path, f"stage {k} module `{path}` was changed after emit: its "
                          f"sha256 is {sha256(data)}, not the one its name records")
        found[digest] = path
    return found


# ---------------------------------------------------------------------------------------------
# What the files say


def stage_manifest(files: StageFiles) -> tuple[m.Manifest, Locate]:
    """The stage's manifest.json, parsed (not verified), and its locator."""
    path = files.path("manifest.json")
    text = text_of(files.texts["manifest.json"], path)
    return m.loads(text, str(path)), PositionIndex.locator(text, str(path))


def verified_manifest(files: StageFiles) -> tuple[m.Manifest, Locate]:
    """The stage's manifest, verified: what runs must verify, whatever wrote the file."""
    man, locate = stage_manifest(files)
    with placed(locate):
        verify(man)
    return man, locate


def stage_plan(files: StageFiles, man: m.Manifest) -> dict[str, Any]:
    """The stage's plan.json, checked against its manifest (kerncc.bundle.plan_check)."""
    path = files.path("plan.json")
    plan, text = json_of(files.texts["plan.json"], path)
    try:
        check_plan(plan, man)
    except MalformedPlan as err:
        raise refusal(str(err), PositionIndex.locator(text, str(path))(err.ptr)) from None
    return plan


def stage_header(index: Index, files: StageFiles) -> dict[str, str]:
    """The header values emit renders into stage.py, as bundle.json and the files give them."""
    data = index.data
    return {"kerncc": str(data.get("kerncc")), "pipeline": data.get("pipeline", ""),
            "input sha256": str((data.get("input") or {}).get("sha256")),
            "manifest sha256": sha256(files.texts["manifest.json"]),
            "plan sha256": sha256(files.texts["plan.json"])}


def stage_code(index: Index, files: StageFiles, man: m.Manifest, plan: dict[str, Any]
               ) -> str | None:
    """The Python that runs the stage: kerncc's rendering of its plan, None without stage.py.

    The bundle's stage.py is the listing of that code; one that differs is refused, naming it.
    """
    listing = files.texts.get("stage.py")
    if listing is None:
        return None
    from kerncc.bundle.stage_py import render_stage

    code = render_stage(man, plan, stage_header(index, files))
    if code.encode() != listing:
        path = files.path("stage.py")
        line = _first_difference(code, listing)
        raise refusal(f"stage {files.index} stage.py `{path}` is not kerncc's rendering of its "
                      f"plan.json and bundle.json (they differ from line {line}): only the "
                      "rendering runs, so an edited listing is refused",
                      Location(file=str(path), line=line))
    return code


def _first_difference(code: str, listing: bytes) -> int:
    ours = code.encode().split(b"\n")
    theirs = listing.split(b"\n")
    return next((i + 1 for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                min(len(ours), len(theirs)) + 1)


@attrs.frozen
class ReadStage:
    """A stage read and checked as the runtime runs it."""

    files: StageFiles
    manifest: m.Manifest
    locate: Locate
    plan: dict[str, Any]
    code: str | None


def read_stage(index: Index, files: StageFiles) -> ReadStage:
    man, locate = verified_manifest(files)
    plan = stage_plan(files, man)
    return ReadStage(files, man, locate, plan, stage_code(index, files, man, plan))


# ---------------------------------------------------------------------------------------------
# Across stages: the edges, the host inputs


def check_links(index: Index, manifests: list[m.Manifest]) -> None:
    """Each edge joins two stages in order by a buffer both have, and each stage's recorded
    host inputs are the ones its manifest and the edges give (kerncc.stage.host_inputs)."""
    from kerncc.stage import host_inputs

    edges = index.data.get("edges", [])
    count = len(manifests)
    for i, edge in enumerate(edges):  # read_index checked their fields' types
        if not 0 <= edge["from"] < edge["to"] < count:
            raise index.error(f"edge {i} runs from stage {edge['from']} to stage {edge['to']}; "
                              f"an edge runs forward between the bundle's {count} stages",
                              f"/edges/{i}")
        for end in ("from", "to"):
            if edge["buffer"] not in manifests[edge[end]].buffers:
                raise index.error(f"edge buffer `{edge['buffer']}` is not a buffer of stage "
                                  f"{edge[end]}", f"/edges/{i}/buffer")
    for k, (entry, man) in enumerate(zip(index.data["stages"], manifests)):
        if "host_inputs" not in entry:
            continue
        arriving = {e["buffer"] for e in edges if e["to"] == k}
        expected = host_inputs(man, arriving)
        if list(entry["host_inputs"]) != expected:
            raise index.error(f"stage {k} records host inputs {list(entry['host_inputs'])}, "
                              f"but its manifest.json and the edges give {expected}",
                              f"/stages/{k}/host_inputs")


# ---------------------------------------------------------------------------------------------
# Paths to files outside the bundle: the input manifest and the checkpoint


def is_recorded_path(name: str) -> bool:
    """A path bundle.json records for a file beside the bundle: relative (`..` allowed, since
    emit records where the user's own input and checkpoint lay), never absolute."""
    return bool(name) and "\x00" not in name and not Path(name).is_absolute() \
        and not name.startswith("\\") and not (len(name) > 1 and name[1] == ":")


# The reference reader refuses safetensors headers past 100 MB.
_MAX_HEADER = 100_000_000


def checkpoint_identity(path: str | Path) -> dict[str, Any] | None:
    """A checkpoint file's identity as bundle.json records it: its size and the sha256 of its
    safetensors header (length and JSON), or of a shard index file; None for a directory. FileRefused if the
    file cannot be read as a checkpoint (missing, special, or its header is no header)."""
    path = Path(path)
    if path.is_dir():
        return None
    if path.name.endswith(".index.json"):  # a shard index: the index's own bytes
        data = read_regular(path, "checkpoint index")
        return {"bytes": len(data), "header_sha256": sha256(data)}
    head = read_regular(path, "checkpoint", 8, prefix=True)
    if len(head) < 8:
        raise FileRefused(f"checkpoint `{path}` is not a safetensors file (shorter than 8 bytes)")
    length = int.from_bytes(head, "little")
    size = path.stat().st_size
    if length > min(_MAX_HEADER, size - 8):
        raise FileRefused(f"checkpoint `{path}` is not a safetensors file (its header length "
                          "field is past its end)")
    header = read_regular(path, "checkpoint", 8 + length, prefix=True)
    return {"bytes": size, "header_sha256": sha256(header)}


def checkpoint_mismatch(index: Index, path: str | Path | None, given: bool) -> str | None:
    """None when the checkpoint at `path` is the one emit recorded (or nothing is recorded);
    else the difference, returned as a warning when the user `given` the path, else refused."""
    recorded = index.data.get("checkpoint_identity")
    if not isinstance(recorded, dict) or path is None:
        return None
    try:
        found = checkpoint_identity(path)
    except FileRefused as err:
        raise KernccError.single(err.message) from None
    if found is None or found == recorded:
        return None
    what = "size" if found["bytes"] != recorded["bytes"] else "safetensors header"
    message = (f"checkpoint `{path}` is not the one the bundle was emitted with: its {what} "
               "differs from bundle.json's `checkpoint_identity`")
    if given:  # the user's own file: its size and hash may be shown
        return message + (f" ({found['bytes']} bytes, header sha256 "
                          f"{found['header_sha256'][:12]}; recorded {recorded['bytes']} bytes, "
                          f"{recorded['header_sha256'][:12]})")
    # a path bundle.json names may lead to any file: nothing of it is shown
    raise index.error(message + "; lower the manifest again, or give the checkpoint with "
                      "--weights to run it anyway", "/checkpoint_identity")


# ---------------------------------------------------------------------------------------------
# The tokenizer files beside the input (bundle.json `tokenizer`)


def tokenizer_record(folder: Path) -> list[dict[str, Any]]:
    """The tokenizer files in `folder` as bundle.json records them: name, bytes, sha256, in
    TOKENIZER_FILES' order; each read as any file a bundle names (regular, bounded)."""
    record = []
    for name in TOKENIZER_FILES:
        path = folder / name
        if not path.exists() and not path.is_symlink():
            continue
        data = read_regular(path, "tokenizer file")
        record.append({"name": name, "bytes": len(data), "sha256": sha256(data)})
    return record


@attrs.frozen
class TokenizerPins:
    """The tokenizer files a bundle was lowered with, which the text codec checks as it reads
    (kerncc.hf.tokenizer.TextCodec.from_dir's `pins`): `folder(dir)` before it reads (the same
    files are there, no more, no fewer), `file(path, data)` for the bytes it read. A refusal
    names the file and the bundle, never a hash or a byte: the folder may be anywhere. Only a
    folder holding tokenizer.json is read, so only such a folder is held to the record."""

    files: dict[str, tuple[int, str]]  # name -> (bytes, sha256)
    bundle: Path

    def folder(self, directory: Path) -> None:
        for name in TOKENIZER_FILES:
            path = directory / name
            there = path.exists() or path.is_symlink()
            if there and name not in self.files:
                raise self._refusal(path, "is not one of the tokenizer files the bundle "
                                    f"`{self.bundle}` was lowered with (bundle.json `tokenizer` "
                                    "records none of that name)")
            if not there and name in self.files:
                raise self._refusal(path, f"is missing: the bundle `{self.bundle}` was lowered "
                                    "with one (bundle.json `tokenizer`)")

    def file(self, path: Path, data: bytes) -> None:
        recorded = self.files.get(path.name)
        if recorded is not None and recorded == (len(data), sha256(data)):
            return
        raise self._refusal(path, f"is not the file the bundle `{self.bundle}` was lowered with "
                            "(it differs from bundle.json's `tokenizer` record)")

    @staticmethod
    def _refusal(path: Path, message: str) -> KernccError:
        return at_file(path, f"tokenizer file `{path}` {message}; lower the manifest again, or "
                       "name the folder with --tokenizer to use it as it is")


def tokenizer_pins(index: dict[str, Any], bundle: Path) -> TokenizerPins | None:
    """The pins of bundle.json's `tokenizer` record (read_index checked it), or None when the
    bundle records none (a bundle emitted from memory, or written by hand: not checked)."""
    files = index.get("tokenizer")
    if not isinstance(files, list):
        return None
    return TokenizerPins({f["name"]: (f["bytes"], f["sha256"]) for f in files}, bundle)


def check_tokenizer(index: Index, folder: Path) -> None:
    """The tokenizer files in `folder` (the recorded input's) are the ones bundle.json records,
    as the codec would find them: what `kerncc check` passes, the codec accepts."""
    pins = tokenizer_pins(index.data, index.dir)
    if not (folder / "tokenizer.json").is_file():
        return  # without tokenizer.json no codec reads the folder (TextCodec.from_dir)
    if pins is None:
        raise index.error("the bundle records no `tokenizer`: run and serve would read the "
                          "tokenizer beside its input unchecked; lower the manifest again",
                          "/tokenizer" if "tokenizer" in index.data else "")
    pins.folder(folder)
    for name in pins.files:
        path = folder / name
        try:
            data = read_regular(path, "tokenizer file")
        except FileRefused as err:
            raise at_file(path, err.message) from None
        pins.file(path, data)
