"""Lowering: the one driver of the pass pipeline, and a manifest file to a bundle in process.

`run_lowering` is what every command that runs passes goes through (`kerncc lower`, `dump`,
`kerncc run model.json`): it schedules the resolved passes, records the schedule on the IR
(the pipeline a bundle records: `emit` reads it there, it re-reads no spec) and runs them.
This sits above both the compiler (pipeline, passes) and the runtime, which never imports the
compiler: `kerncc run model.json` and tests lower here, then hand the bundle to the runtime.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path

import attrs

from kerncc.diagnostics import KernccError, placed
from kerncc.ir import IR
from kerncc.pipeline import (Instrument, Pass, PassSpec, PipelineSpec, ScheduledPass, pass_spec,
                             resolve_pipeline, run_pipeline, schedule_passes)
from kerncc.checkpoint.shards import checkpoint_beside
from kerncc.runtime.bundle import Bundle
from kerncc.source import load_with_locator
from kerncc.verify import verify


def run_lowering(ir: IR, passes: Sequence[Pass], instruments: Sequence[Instrument] = (), *,
                 verify: bool = True, input_name: str = "FILE") -> IR:
    """Run resolved `passes` on a verified `ir`, required passes inserted; the final IR.

    The IR carries the schedule as a spec (`IR.pipeline`, emit's `out` left out: a bundle does
    not record where it was written) and its pass names (`IR.history`)."""
    schedule = schedule_passes(passes)
    ir = attrs.evolve(ir, pipeline=recorded_pipeline(schedule),
                      history=tuple(item.pass_.name for item in schedule))
    return run_pipeline(ir, passes, instruments, verify=verify, input_name=input_name)


def recorded_pipeline(schedule: Sequence[ScheduledPass]) -> str:
    """The schedule printed as a spec, as a bundle records it: emit's `out` left out."""
    specs = [pass_spec(item.pass_) for item in schedule]
    return str(PipelineSpec(tuple(_without_out(spec) for spec in specs)))


def _without_out(spec: PassSpec) -> PassSpec:
    if spec.name != "emit":
        return spec
    return PassSpec(spec.name, tuple((k, v) for k, v in spec.options if k != "out"))


def with_output(passes: Sequence[Pass], out: str | Path, *, replace: bool = False
                ) -> tuple[Pass, ...]:
    """`emit` writing into `out`: where the spec names no directory, or always (`replace`)."""
    return tuple(attrs.evolve(p, out=str(out) if replace or not p.out else p.out)
                 if p.name == "emit" else p for p in passes)


def lower(path: str | Path, pipeline: str, out: str | Path) -> None:
    """`kerncc lower PATH -p PIPELINE -o OUT`, in process; the pipeline must end in `emit`."""
    manifest, locate = load_with_locator(path)
    with placed(locate):
        verify(manifest)
        passes = resolve_pipeline(pipeline)
        if not passes or passes[-1].name != "emit":
            raise KernccError.elsewhere(f"pipeline `{pipeline}` must end in `emit` to give a "
                                         "bundle")
        run_lowering(IR.from_manifest(manifest, source=str(path)),
                     with_output(passes, out, replace=True), input_name=str(path))


def lower_to_bundle(path: str | Path, pipeline: str = "emit") -> Bundle:
    """Lower the manifest at `path` into a temporary bundle and open it.

    The temporary directory lives as long as the returned Bundle. The checkpoint is
    the one beside the manifest (`model.safetensors` or a shard index) when there is one.
    """
    tmp = Path(tempfile.mkdtemp(prefix="kerncc-bundle-"))
    try:
        out = tmp / "bundle"
        lower(Path(path), pipeline, out)
        bundle = Bundle(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    weakref.finalize(bundle, shutil.rmtree, tmp, True)
    beside = checkpoint_beside(Path(path).parent)  # model.safetensors or a shard index
    if beside is not None:
        bundle.checkpoint = beside.resolve()
    return bundle


def open_target(path: str | Path, pipeline: str = "emit") -> Bundle:
    """A bundle directory as is; a manifest file lowered with `pipeline` (ending in emit)."""
    path = Path(path)
    if path.is_dir():
        return Bundle(path)
    if not path.exists():
        raise KernccError.single(f"`{path}` does not exist (expected a bundle directory or "
                                 "a manifest file)")
    return lower_to_bundle(path, pipeline)
