"""`emit`: write the stage bundle of docs/bundle.md, atomically, after proving it.

Everything is decided before anything is written: the symbolic proof that the stages compute
the whole (unless `check=false`), each stage's own checks (kern's verifier, and the serving
protocol as far as the whole fits it: `check_unsampled` for every stage, `check` for the last
when the whole passes it), the arena (the `plan-memory` report, re-planned if a later pass
changed a stage), the source staging (`kerncc.passes.slicing.staging_plan`, computed here so
it always matches the stage written), the launch records, `stage.py`, and the module files
found beside the input manifest or in the kernel library and checked against their sha256,
and the tokenizer files beside the input manifest (name, size, sha256).
Then `kerncc.atomic.atomic_directory` writes the files into a temporary sibling and renames it
into place, so a failure leaves nothing behind and a directory kerncc did not write is never
overwritten. The bundle is deterministic: no timestamps, and paths (input manifest,
checkpoint) are recorded relative to the bundle directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from json.encoder import encode_basestring  # the C one, as json.dumps uses
from pathlib import Path
from typing import Any

import attrs

from kerncc import __version__
from kerncc import protocol
from kerncc import manifest as m
from kerncc.atomic import atomic_directory
from kerncc.files import FileRefused, inside, read_regular
from kerncc.bundle.format import FORMAT
from kerncc.bundle.plan import memory_json, program_records
from kerncc.bundle.reader import checkpoint_identity, tokenizer_record
from kerncc.bundle.stage_py import render_stage
from kerncc.diagnostics import Diagnostic, KernccError, Location, pointer, split_pointer
from kerncc.ir import IR
from kerncc.kernels import library
from kerncc.manifest import writer
from kerncc.passes.base import Pass, register
from kerncc.passes.plan_memory import MemoryReport, StageArena, plan_stage
from kerncc.passes.slicing import staging_plan
from kerncc.checkpoint.shards import checkpoint_beside
from kerncc.symbolic import Proof, check_stages
from kerncc.verify import verify

STAGE_HEADLINE = "a stage of the bundle fails its own checks:"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _expanded(path: tuple) -> bool:
    # Two levels everywhere, and under `programs` down to the launch lists: every launch
    # record, buffer and window then sits on one line of its own.
    return len(path) <= 2 or (path[0] == "programs" and len(path) <= 5)


# `json.dumps(x, ensure_ascii=False)` builds a new encoder per call; this one is built once
# (the same class and options, so the same text), which halves a one-line item's cost. The plan
# is built here from a manifest, a tree: no container can hold itself, so no circular check.
_encode = json.JSONEncoder(ensure_ascii=False, check_circular=False).encode


def _one_line(value: Any) -> str:
    """`json.dumps(value, ensure_ascii=False)`; keys and numbers (most items) spelled here."""
    kind = type(value)
    if kind is str:
        return encode_basestring(value)
    if kind is int:
        return int.__repr__(value)
    return _encode(value)


def pretty_json(value: Any, path: tuple = ()) -> str:
    """JSON indented by two spaces down to the depth `_expanded` allows, one line below it.

    The one-line parts go through the C encoder, which `json.dumps(indent=...)` never uses:
    a 36-layer plan.json prints ten times faster this way.
    """
    if not isinstance(value, (dict, list)) or not value or not _expanded(path):
        return _one_line(value)
    pad, end = "  " * (len(path) + 1), "  " * len(path)
    if isinstance(value, dict):
        items = [f"{pad}{_one_line(k)}: {pretty_json(v, path + (k,))}"
                 for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{end}}}"
    items = [f"{pad}{pretty_json(v, path + (i,))}" for i, v in enumerate(value)]
    return "[\n" + ",\n".join(items) + f"\n{end}]"


def json_bytes(value: Any) -> bytes:
    return (pretty_json(value) + "\n").encode()


@attrs.frozen
class EmitReport:
    """What `emit` wrote: where, how many stages and files, and what was proved."""

    out: str
    stages: int
    files: tuple[str, ...]
    proof: Proof | None
    missing_modules: int

    def to_text(self) -> str:
        proved = "not checked" if self.proof is None else (
            f"proved ({len(self.proof.programs)} driven programs, {self.proof.outputs} outputs, "
            f"{self.proof.carries} carries, {self.proof.regions} state regions)")
        return (f"bundle {self.out}: {self.stages} stages, {len(self.files)} files, "
                f"{self.missing_modules} modules missing; {proved}")


@register
@attrs.frozen
class Emit(Pass):
    """Prove the stages, then write the stage bundle of docs/bundle.md atomically."""

    name = "emit"
    requires = ("plan-memory",)
    writes_output = True
    out: str = attrs.field(default="", metadata={
        "help": "the bundle directory (`kerncc lower -o DIR` sets it)"})
    check: bool = attrs.field(default=True, metadata={
        "help": "prove the stages compute the whole before writing (refuse if not)"})

    def run(self, ir: IR) -> IR:
        if not self.out:
            raise KernccError.elsewhere("emit needs a directory: `emit{out=DIR}` or "
                                        "`kerncc lower ... -o DIR`")
        files, proof, missing = build_bundle(ir, self)
        write_bundle(files, self.out)
        report = EmitReport(self.out, len(ir.stages), tuple(files), proof, missing)
        return ir.with_report(self.name, report)


# ---------------------------------------------------------------------------------------------
# Building the files


def build_bundle(ir: IR, emit: Emit) -> tuple[dict[str, bytes], Proof | None, int]:
    """Every file of the bundle (path relative to it -> bytes), the proof, missing modules."""
    proof = check_stages(ir.whole, list(ir.stages)) if emit.check else None
    check_stage_contracts(ir)
    arenas = stage_arenas(ir)
    meta = BundleMeta.of(ir, emit)
    files: dict[str, bytes] = {}
    entries, missing = [], 0
    modules: dict[tuple[str, str], bytes | None] = {}  # stages share most modules: read once
    for index, arena in enumerate(arenas):
        stage_files, entry, lost = stage_bundle(ir, index, arena, meta, modules)
        files.update(stage_files)
        entries.append(entry)
        missing += lost
    bundle = bundle_json(ir, meta, entries, proof)
    return {"bundle.json": json_bytes(bundle), **files}, proof, missing


@attrs.frozen
class BundleMeta:
    """What every stage's header and the index share: version, pipeline, input, checkpoint."""

    pipeline: str
    input_path: str | None
    input_sha256: str
    checkpoint: str | None
    input_dir: Path | None
    checkpoint_identity: dict | None = None
    tokenizer: list[dict] | None = None  # the tokenizer files beside the input, or None

    @classmethod
    def of(cls, ir: IR, emit: Emit) -> BundleMeta:
        if ir.source is None:
            # No file: the canonical text stands in for the input's bytes.
            digest = sha256(writer.dumps(ir.whole).encode())
            return cls(ir.pipeline, None, digest, None, None)
        source = Path(ir.source)
        digest = sha256(_read(source, "the input manifest"))
        checkpoint = checkpoint_beside(source.parent)  # model.safetensors or a shard index
        identity = _identity(checkpoint) if checkpoint is not None else None
        return cls(ir.pipeline, bundle_relative(source, emit.out), digest,
                   bundle_relative(checkpoint, emit.out) if identity else None,
                   source.parent, identity, _tokenizer(source.parent))


def _read(path: Path, what: str) -> bytes:
    try:
        return read_regular(path, what)
    except FileRefused as err:
        raise KernccError.elsewhere(err.message) from None


def _tokenizer(folder: Path) -> list[dict]:
    """The tokenizer files beside the input (name, bytes, sha256): `kerncc run --text` and
    `kerncc serve` refuse one that differs later."""
    try:
        return tokenizer_record(folder)
    except FileRefused as err:
        raise KernccError.elsewhere(err.message) from None


def _identity(checkpoint: Path) -> dict | None:
    """The checkpoint's identity (size, header sha256), so that a run can tell a stale one;
    None (and no checkpoint recorded) when the file beside the input is no safetensors file."""
    try:
        return checkpoint_identity(checkpoint)
    except FileRefused:
        return None


def bundle_relative(path: Path, out: str) -> str:
    """`path` as the bundle records it: relative to the bundle directory when possible."""
    try:
        return os.path.relpath(os.path.abspath(path), os.path.abspath(out))
    except ValueError:  # another drive (Windows): no relative path exists
        return os.path.abspath(path)


def stage_arenas(ir: IR) -> list[StageArena]:
    """The plan-memory arenas, re-planned for any stage a later pass replaced."""
    report = ir.reports.get("plan-memory")
    planned = report.stages if isinstance(report, MemoryReport) else ()
    out = []
    for index, stage in enumerate(ir.stages):
        arena = planned[index] if index < len(planned) else None
        out.append(arena if arena is not None and arena.manifest is stage else plan_stage(stage))
    return out


def stage_bundle(ir: IR, index: int, arena: StageArena, meta: BundleMeta,
                 read: dict[tuple[str, str], bytes | None] | None = None
                 ) -> tuple[dict[str, bytes], dict, int]:
    """The files of stage `index`, its entry in bundle.json, and how many modules are missing
    (`read`: module files already looked for, by sha256 and source, shared between stages)."""
    stage = ir.stages[index]
    folder = f"stage{index}"
    modules, found = module_files(stage, meta.input_dir, read)
    plan = stage_plan(stage, index, arena, modules)
    manifest_bytes = writer.dumps(stage).encode()
    plan_bytes = json_bytes(plan)
    manifest_sha, plan_sha = sha256(manifest_bytes), sha256(plan_bytes)
    header = {"kerncc": __version__, "pipeline": meta.pipeline,
              "input sha256": meta.input_sha256, "manifest sha256": manifest_sha,
              "plan sha256": plan_sha}
    stage_py = render_stage(stage, plan, header).encode()
    files = {f"{folder}/manifest.json": manifest_bytes, f"{folder}/plan.json": plan_bytes,
             f"{folder}/stage.py": stage_py}
    files.update({f"{folder}/modules/{digest}.cubin": data for digest, data in found.items()})
    entry = {"index": index, "dir": folder, "manifest_sha256": manifest_sha,
             "plan_sha256": plan_sha, "stage_py_sha256": sha256(stage_py),
             "calls": {name: len(stage.programs[name].calls)
                       for name in sorted(stage.programs, key=str.encode)},
             "host_inputs": ir.host_inputs(index)}
    return files, entry, len(plan["missing_modules"])


def stage_plan(stage: m.Manifest, index: int, arena: StageArena, modules: dict) -> dict:
    offsets = {name: p.layout.offsets for name, p in arena.programs.items()}
    missing = sorted(digest for digest, info in modules.items() if info["file"] is None)
    return {"stage": index, "arena": arena.to_json(), "staging": staging_plan(stage).to_json(),
            "memory": memory_json(stage), "modules": modules, "missing_modules": missing,
            "programs": program_records(stage, offsets)}


# ---------------------------------------------------------------------------------------------
# Modules


def module_files(stage: m.Manifest, input_dir: Path | None,
                 read: dict[tuple[str, str], bytes | None] | None = None
                 ) -> tuple[dict, dict[str, bytes]]:
    """plan.json's `modules` (by sha256) and the bytes of every module file found (`read`:
    what find_module gave for a (sha256, source) already, filled in here)."""
    table: dict[str, dict] = {}
    found: dict[str, bytes] = {}
    read = {} if read is None else read
    for name in sorted(stage.modules, key=str.encode):
        module = stage.modules[name]
        entry = table.setdefault(module.sha256, {"names": [], "source": module.source,
                                                 "file": None})
        entry["names"].append(name)
        if module.sha256 in found:
            continue
        key = (module.sha256, module.source)
        if key not in read:
            read[key] = find_module(module, input_dir)
        data = read[key]
        if data is not None:
            found[module.sha256] = data
            entry["file"] = f"modules/{module.sha256}.cubin"
    return {d: table[d] for d in sorted(table)}, found


def find_module(module: m.Module, input_dir: Path | None) -> bytes | None:
    """The module's bytes from beside the input manifest or the kernel library, if they hash
    to its sha256; None when no candidate file does."""
    for path in _module_candidates(module, input_dir):
        try:
            data = read_regular(path, "module")
        except FileRefused:
            continue
        if sha256(data) == module.sha256:
            return data
    return None


def _module_candidates(module: m.Module, input_dir: Path | None) -> list[Path]:
    # `source` is a label (spec §1.7): only a plain file name or relative path is local.
    # A local one is looked for beside the input only when it stays inside its folder: a
    # `source` of `../../etc/x` or `/etc/x` would make emit an oracle of "does file X hash to".
    local = not re.match(r"[a-z][a-z0-9+.-]*:", module.source)
    candidates = []
    if input_dir is not None and local:
        try:
            candidates.append(inside(input_dir, module.source, "module source"))
        except FileRefused:
            pass
    candidates += [library.KERNELS_DIR / info["file"] for info in library.index().values()
                   if info["sha256"] == module.sha256]
    return candidates


# ---------------------------------------------------------------------------------------------
# Checks every stage passes on its own


def whole_protocol(whole: m.Manifest) -> str | None:
    """The strictest protocol check the whole passes: `sampled`, `unsampled`, or None."""
    if not whole.driven_programs():
        return None
    verified = verify(whole)
    for level, check in (("sampled", protocol.check), ("unsampled", protocol.check_unsampled)):
        try:
            check(verified)
            return level
        except KernccError:
            continue
    return None


def check_stage_contracts(ir: IR) -> None:
    """Every stage verifies, and fits the serving protocol as far as the whole does."""
    level = whole_protocol(ir.whole)
    problems: list[Diagnostic] = []
    last = len(ir.stages) - 1
    for index, stage in enumerate(ir.stages):
        try:
            verified = verify(stage)
            if level is not None:
                sampled = level == "sampled" and index == last
                protocol.check(verified, sampled=sampled)
        except KernccError as err:
            problems += [_in_stage(ir, index, d) for d in err.diagnostics or
                         [Diagnostic(err.headline)]]
    if problems:
        raise KernccError(STAGE_HEADLINE, problems)


def _in_stage(ir: IR, index: int, diag: Diagnostic) -> Diagnostic:
    """The diagnostic said of stage `index`, its pointer mapped into the whole manifest."""
    prefix = f"stage {index}: " if ir.is_pipeline else ""
    ptr = whole_pointer(ir, index, diag.location.pointer)
    return attrs.evolve(diag, message=prefix + diag.message,
                        location=attrs.evolve(diag.location, pointer=ptr))


def whole_pointer(ir: IR, index: int, ptr: str) -> str:
    """A stage pointer into `/programs/P/calls/I...`, re-pointed at the same call of the whole."""
    tokens = split_pointer(ptr)
    if len(tokens) < 4 or tokens[0] != "programs" or tokens[2] != "calls":
        return ptr
    program, call_index = tokens[1], int(tokens[3]) if tokens[3].isdigit() else -1
    stage_program = ir.stages[index].programs.get(program)
    if stage_program is None or not 0 <= call_index < len(stage_program.calls):
        return ptr
    if program in ir.points:
        # A driven program's stage is one slice of the whole's calls, in order.
        first = [0, *ir.points[program]][index] if index <= len(ir.points[program]) else 0
        return _replace_call(tokens, first + call_index)
    call = stage_program.calls[call_index]
    found = next((j for j, c in enumerate(ir.whole.programs[program].calls) if c is call), None)
    return ptr if found is None else _replace_call(tokens, found)


def _replace_call(tokens: list[str], call_index: int) -> str:
    return pointer(*tokens[:3], call_index, *tokens[4:])


# ---------------------------------------------------------------------------------------------
# The index and the write


def bundle_json(ir: IR, meta: BundleMeta, stages: list[dict], proof: Proof | None) -> dict:
    cut = None
    if ir.is_pipeline:
        points = {name: list(at) for name, at in sorted(ir.points.items())}
        cut = {"id": ir.stages[0].cut.id, "points": points}
    return {
        "format": FORMAT, "kerncc": __version__, "pipeline": meta.pipeline,
        "input": {"path": meta.input_path, "sha256": meta.input_sha256},
        "checkpoint": meta.checkpoint, "checkpoint_identity": meta.checkpoint_identity,
        "tokenizer": meta.tokenizer,
        "cut": cut, "stages": stages,
        "edges": [{"buffer": e.buffer, "from": e.source, "to": e.target, "bytes": e.nbytes}
                  for e in ir.edges],
        "proof": proof.to_json() if proof is not None else {"checked": False},
    }


def write_bundle(files: dict[str, bytes], out: str) -> None:
    """Write the files under `out` at once: all of them, or (on any failure) none."""
    try:
        with atomic_directory(out) as tmp:
            for relative, data in files.items():
                path = tmp / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
    except OSError as err:
        raise KernccError.elsewhere(f"cannot write the bundle `{out}`: "
                                    f"{err.strerror or err}") from None

