"""`kerncc check BUNDLE [WHOLE]`: re-derive a bundle from its input and compare (docs/bundle.md).

Reads the bundle through kerncc.bundle.reader, the reader the runtime uses (bundle.json, every
stage's files inside its folder and hashed against it, every module against its name), finds
the input manifest (`.json` or `.kir`, read by kerncc.source; its path is relative to the bundle
directory, or WHOLE given on the command line) and checks its sha256. Then it runs the pipeline
bundle.json records on that input, in memory, up to the files emit would write
(passes.emit.build_bundle), and compares what runs with what the bundle holds: every stage's
manifest.json and plan.json as JSON values (types, key order and all: calls, ops and their
launches, modules and their sha256, weight bindings, vars, states, derive and once programs,
the plan), and bundle.json's fields. The first difference is refused, naming the stage, the
file and the JSON pointer of the first differing value. A bundle may differ only where the place
it was written shows (`input`, `checkpoint`, `checkpoint_identity`, when WHOLE is given), in its
`marker` (kerncc.atomic's id of the folder) and in which module files it carries (each is
checked against its sha256 by the reader). The tokenizer files beside the recorded input, when
its tokenizer.json is there (without it no codec reads that folder), are held against
bundle.json's `tokenizer` as the codec of run and serve holds them (a refusal names the file;
with WHOLE named they are not looked at). Each stage.py is checked against kerncc's rendering
of the plan (the code that runs), and the symbolic proof (kerncc.symbolic.check_stages) is run
again. What passes here is exactly what the runtime loads: it reads the same files through the
same reader, each against the sha256 bundle.json records, and check refuses a bundle.json that
leaves one unrecorded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kerncc import manifest as m
from kerncc import source
from kerncc.bundle import reader
from kerncc.files import FileRefused, read_regular
from kerncc.bundle.reader import Index, StageFiles, read_index, stage_files
from kerncc.diagnostics import KernccError, Location, placed
from kerncc.symbolic import Proof, check_stages

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
    return index.dir / recorded  # read_index refused a path that is not relative


def _input(index: Index, whole: str | Path | None
           ) -> tuple[m.Manifest, Callable[[str], Location]]:
    """The input manifest and the locator of its text.

    A path bundle.json records may lead anywhere beside the bundle (`..`), so nothing of the
    file it names is shown until its bytes hash to the recorded sha256: it must name a
    manifest (`.json`, `.kir`) and the bundle must record its sha256 before it is opened, and a
    file that differs is said to differ, without its hash. WHOLE, named by the user, is theirs.
    """
    path = input_path(index, whole)
    expected = (index.data.get("input") or {}).get("sha256")
    if whole is None:
        _check_recorded_input(index, path, expected)
    try:
        data = read_regular(path, "the input manifest")
    except FileRefused as err:  # at the command line's path, or where bundle.json names it
        raise (reader.at_file(path, err.message) if whole is not None
               else index.error(err.message, "/input/path")) from None
    if expected is not None and reader.sha256(data) != expected:
        found = f": sha256 {reader.sha256(data)}, the bundle recorded {expected}" \
            if whole is not None else ""
        raise index.error(f"the input manifest `{path}` was changed after emit{found}",
                          "/input/sha256")
    return source.loads_with_locator(reader.text_of(data, path), path)


def _check_recorded_input(index: Index, path: Path, expected: str | None) -> None:
    """Refuse, before it is opened, an input path bundle.json records that names no manifest
    or whose sha256 it does not record (nothing of another file may be shown)."""
    if path.suffix not in (".json", ".kir"):
        raise index.error(f"input `{index.data['input']['path']}` does not name a manifest "
                          "(`.json` or `.kir`): it is not opened", "/input/path")
    if expected is None:
        raise index.error("the bundle records no sha256 of its input, so the file it names is "
                          "not opened; name the whole manifest: kerncc check WHOLE BUNDLE",
                          "/input/sha256")


def check_bundle(directory: str | Path, whole: str | Path | None = None) -> Proof:
    """Prove again that the bundle's stages compute its input manifest; KernccError if not.

    `whole` overrides the input path recorded in bundle.json (a path the user gives).
    """
    index = read_index(directory)
    files = stage_files(index)
    stages = [reader.stage_manifest(f)[0] for f in files]
    whole_manifest, locate = _input(index, whole)
    with placed(locate):  # its pointers are the whole manifest's calls
        proof = check_stages(whole_manifest, stages)
    # What was proved is what runs: each plan.json fits its stage as the runtime checks it,
    # and each stage.py is kerncc's rendering of that plan.
    read = [reader.read_stage(index, f) for f in files]
    reader.check_links(index, [r.manifest for r in read])
    if whole is None:  # the tokenizer files beside the recorded input, as run and serve read them
        reader.check_tokenizer(index, input_path(index, None).parent)
    compare_derived(index, files, derive(index, whole_manifest, input_path(index, whole), locate),
                    given=whole is not None)
    return proof


# ---------------------------------------------------------------------------------------------
# Re-deriving the bundle from its input and comparing


# bundle.json's fields that say where the bundle, its input and its checkpoint were (they
# differ when the user names the input), and the folder's marker; and a stage entry's sha256s
# (the files they pin are compared themselves; that each is recorded is checked apart).
_PLACE_FIELDS = ("input", "checkpoint", "checkpoint_identity")
_STAGE_SHAS = ("manifest_sha256", "plan_sha256", "stage_py_sha256")


def derive(index: Index, whole: m.Manifest, path: Path, locate: Callable[[str], Location]
           ) -> dict[str, Any]:
    """The JSON files emit writes for `whole` (read from `path`) with the pipeline bundle.json
    records, built in memory (nothing is written), parsed: path in the bundle -> value."""
    import json

    import attrs

    from kerncc.ir import IR
    from kerncc.passes.emit import build_bundle
    from kerncc.pipeline import resolve_pipeline, run_pipeline
    from kerncc.verify import verify

    pipeline = index.data.get("pipeline")
    if not pipeline:
        raise index.error("the bundle records no pipeline, so it cannot be derived again from "
                          "its input", "/pipeline")
    try:
        passes = resolve_pipeline(pipeline)
    except KernccError as err:
        raise index.error(f"the recorded pipeline does not resolve: {err.headline}",
                          "/pipeline") from None
    if not passes or passes[-1].name != "emit" or \
            any(getattr(p, "writes_output", False) for p in passes[:-1]):
        raise index.error(f"the recorded pipeline `{pipeline}` does not end in its one `emit`",
                          "/pipeline")
    emit = attrs.evolve(passes[-1], out=str(index.dir))
    with placed(locate):  # its pointers are the input manifest's
        verify(whole)
        ir = attrs.evolve(IR.from_manifest(whole, source=str(path)), pipeline=pipeline)
        ir = run_pipeline(ir, passes[:-1], input_name=str(path))
        files, _, _ = build_bundle(ir, emit)
    return {name: json.loads(data) for name, data in files.items() if name.endswith(".json")}


def compare_derived(index: Index, files: list[StageFiles], derived: dict[str, Any],
                    given: bool) -> None:
    """Refuse the first difference between the bundle and the files derived from its input."""
    want = derived["bundle.json"]
    got = dict(index.data)
    for k, (entry, stage) in enumerate(zip(got.get("stages", []), files)):
        # null stage_py_sha256 says there is no stage.py (the reader refuses one found)
        missing = [key for key in _STAGE_SHAS if key not in entry or
                   (entry[key] is None and key != "stage_py_sha256")]
        if missing:
            raise index.error(f"stage {k} records no `{missing[0]}`: the runtime would load "
                              "that file unchecked", f"/stages/{k}")
    # `tokenizer` is held against the files by reader.check_tokenizer, not re-derived: a copy
    # of a bundle and its input without the tokenizer runs without one, which check may pass.
    left_out = ("marker", "tokenizer", *(_PLACE_FIELDS if given else ()))
    _refuse_difference(index, _without(got, left_out), _without(want, left_out), "")
    for stage in files:
        _compare_stage(stage, derived)


def _without(index: dict, keys: tuple[str, ...]) -> dict:
    out = {k: v for k, v in index.items() if k not in keys}
    if isinstance(out.get("stages"), list):
        out["stages"] = [{k: v for k, v in e.items() if k not in _STAGE_SHAS}
                         if isinstance(e, dict) else e for e in out["stages"]]
    return out


def _refuse_difference(index: Index, got: Any, want: Any, ptr: str) -> None:
    where = first_difference(got, want, ptr)
    if where is not None:
        raise index.error(f"bundle.json differs at `{where or '/'}` from what its recorded "
                          "pipeline derives from the input manifest", where)


def _compare_stage(stage: StageFiles, derived: dict[str, Any]) -> None:
    import json

    from kerncc.manifest.jsonsource import PositionIndex

    for name in ("manifest.json", "plan.json"):
        path = stage.path(name)
        theirs = stage.texts[name]
        ours = derived.get(f"{stage.dir.name}/{name}")
        got = json.loads(theirs)  # the reader parsed it strictly already
        if name == "plan.json" and isinstance(ours, dict):
            _check_listed_modules(got, stage)
            ours = _with_module_files(ours, stage)
        where = first_difference(got, ours, "")
        if where is not None:
            locate = PositionIndex.locator(theirs.decode("utf-8"), str(path))
            raise reader.refusal(
                f"stage {stage.index} {name} `{path}` differs at `{where or '/'}` from the stage "
                "the recorded pipeline derives from the input manifest: it is not what the "
                "bundle's input compiles to", locate(where))


def _check_listed_modules(plan: Any, stage: StageFiles) -> None:
    """Each module file plan.json lists is one the stage carries (checked by its sha256)."""
    modules = plan.get("modules") if isinstance(plan, dict) else None
    for digest, info in (modules.items() if isinstance(modules, dict) else ()):
        listed = info.get("file") if isinstance(info, dict) else None
        if listed is not None and digest not in stage.modules:
            path = stage.dir / str(listed)
            raise reader.at_file(path, f"stage {stage.index} plan.json lists the module file "
                                 f"`{path}`, which is missing")


def _with_module_files(plan: dict, stage: StageFiles) -> dict:
    """The derived plan with the module files this bundle carries (each checked against its
    sha256 by the reader): which are present is the one thing a plan may differ in."""
    modules = plan.get("modules")
    if not isinstance(modules, dict):
        return plan
    table = {digest: {**info, "file": f"modules/{digest}.cubin" if digest in stage.modules
                      else None} for digest, info in modules.items()}
    missing = sorted(d for d, info in table.items() if info["file"] is None)
    return {**plan, "modules": table, "missing_modules": missing}


def _kind(value: Any) -> str:
    """A JSON value's kind; a boolean is no integer and an integer no float."""
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                       (dict, "object"), (list, "array")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


def first_difference(got: Any, want: Any, ptr: str = "") -> str | None:
    """The JSON pointer of the first place two JSON values differ, or None when they are the
    same: types strictly (1, 1.0 and true differ), objects with their keys in order."""
    import json

    from kerncc.diagnostics import pointer

    if json.dumps(got) == json.dumps(want):  # the same values, kinds and key order: at C speed
        return None
    if _kind(got) != _kind(want):
        return ptr
    if isinstance(got, dict):
        for a, b in zip(got, want):
            if a != b:  # a key added, left out, or out of order: the bundle's, there
                return ptr + pointer(a)
        if len(got) != len(want):
            extra = list(got)[len(want):] or list(want)[len(got):]
            return ptr + pointer(extra[0])
        for key in got:
            found = first_difference(got[key], want[key], ptr + pointer(key))
            if found is not None:
                return found
        return None
    if isinstance(got, list):
        for i, (a, b) in enumerate(zip(got, want)):
            found = first_difference(a, b, ptr + pointer(i))
            if found is not None:
                return found
        return None if len(got) == len(want) else ptr + pointer(min(len(got), len(want)))
    if isinstance(got, float) and got != got and want != want:
        return None
    return None if got == want else ptr
