"""Lowering in process: a manifest file to a stage bundle the runtime can open.

This sits above both the compiler (pipeline, passes) and the runtime, which never imports the
compiler: `kerncc run model.json` and tests lower here, then hand the bundle to the runtime.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path

import attrs

from kerncc.diagnostics import KernccError
from kerncc.ir import IR
from kerncc.pipeline import pass_spec, resolve_pipeline, run_pipeline
from kerncc.checkpoint.shards import checkpoint_beside
from kerncc.runtime.bundle import Bundle
from kerncc.source import load_with_locator
from kerncc.verify import verify


def lower(path: str | Path, pipeline: str, out: str | Path) -> None:
    """`kerncc lower PATH -p PIPELINE -o OUT`, in process; the pipeline must end in `emit`."""
    manifest, locate = load_with_locator(path)
    try:
        verify(manifest)
        passes = resolve_pipeline(pipeline)
        if not passes or passes[-1].name != "emit":
            raise KernccError.elsewhere(f"pipeline `{pipeline}` must end in `emit` to give a "
                                         "bundle")
        passes = tuple(attrs.evolve(p, out=str(out)) if p.name == "emit" else p for p in passes)
        ir = attrs.evolve(IR.from_manifest(manifest, source=str(path)),
                          pipeline=",".join(str(pass_spec(p)) for p in passes))
        run_pipeline(ir, passes, input_name=str(path))
    except KernccError as err:
        raise err.located(locate) from None


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
