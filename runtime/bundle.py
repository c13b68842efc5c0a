"""Reading a stage bundle (docs/bundle.md): every file checked before anything runs.

`Bundle(dir)` reads the bundle through kerncc.bundle.reader, the one reader `kerncc check` and
`kerncc report` use too: bundle.json, each stage's `manifest.json`, `plan.json` and (when
present) `stage.py` inside its folder, regular and bounded, every recorded sha256 checked, the
cubins under `modules/` against their names, each plan against its manifest, and each stage.py
against kerncc's own rendering of the plan, which is the code that runs (the file is only its
listing). Anything missing, tampered or malformed is a KernccError whose diagnostics carry the
file's path. The runtime never lowers: `kerncc.lower` (above both the compiler and the runtime)
turns a manifest into a temporary bundle, so that a manifest and a bundle run through the same
code.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs

from kerncc import manifest as m
from kerncc.bundle import reader
from kerncc.files import FileRefused, check_regular
from kerncc.diagnostics import Diagnostic, KernccError, Location



def bundle_error(path: Path | str, message: str, ptr: str = "") -> KernccError:
    """An error about one file of a bundle, located at that file."""
    return KernccError(f"cannot load bundle file `{path}`:",
                       [Diagnostic(message, Location(ptr, file=str(path)))])


@attrs.frozen
class Stage:
    """One stage of a bundle: its manifest, its plan, its generated code, its host inputs.

    `code` is kerncc's rendering of the plan (the stage.py listing equals it), None when the
    bundle records no stage.py; `modules` maps each checked module file's sha256 to its path.
    """

    index: int
    dir: Path
    manifest: m.Manifest
    plan: dict
    stage_py: Path | None
    host_inputs: tuple[str, ...]
    locate: Callable[[str], Location] = attrs.field(eq=False, repr=False)
    code: str | None = attrs.field(default=None, eq=False, repr=False)
    modules: dict[str, Path] = attrs.field(factory=dict, eq=False, repr=False)

    def located(self, err: KernccError) -> KernccError:
        """The error with its JSON pointers placed in this stage's manifest.json."""
        return err.located(self.locate)

    def plan_path(self) -> Path:
        return self.dir / "plan.json"


class Bundle:
    """A checked bundle directory: `stages`, `edges`, `checkpoint`, `pipeline`, `index`."""

    def __init__(self, path: str | Path) -> None:
        self.dir = Path(path)
        self._index = reader.read_index(self.dir)
        self.index = self._index.data
        self.pipeline: str = self.index.get("pipeline", "")
        self.edges: list[dict] = list(self.index.get("edges", []))
        self.checkpoint = self._checkpoint()
        self.stages = [self._stage(k) for k in range(len(self.index["stages"]))]
        reader.check_links(self._index, [s.manifest for s in self.stages])

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

    def _stage(self, k: int) -> Stage:
        files = reader.read_stage_files(self._index, k)
        read = reader.read_stage(self._index, files)
        stage_py = files.path("stage.py") if "stage.py" in files.texts else None
        entry = self.index["stages"][k]
        return Stage(k, files.dir, read.manifest, read.plan, stage_py,
                     tuple(entry.get("host_inputs", ())), read.locate, read.code, files.modules)

    def _checkpoint(self) -> Path | None:
        """The checkpoint bundle.json records, relative to the bundle (read_index refused one
        that is not)."""
        recorded = self.index.get("checkpoint")
        return (self.dir / recorded).resolve() if recorded else None

    def check_checkpoint(self, path: str | Path | None, given: bool) -> str | None:
        """Compare the checkpoint at `path` with the identity bundle.json records.

        A checkpoint that differs from the one emit saw is refused, or, when the user `given`
        it (`--weights`), is a warning (returned); None when it matches or nothing is recorded.
        """
        if path is None:
            return None
        if not given and not isinstance(self.index.get("checkpoint_identity"), dict):
            # the path bundle.json names may lead to any file: without the identity to check
            # it against first, nothing of it (its size, its header) may reach a message
            raise self._index.error(f"bundle.json names the checkpoint `{path}` but records no "
                                    "`checkpoint_identity` to check it against, so it is not "
                                    "opened (give it with --weights FILE)", "/checkpoint")
        if not Path(path).is_dir():  # a directory of shards is checked as it is opened
            try:
                check_regular(Path(path), "checkpoint")
            except FileRefused as err:
                hint = "" if given else " (give one: --weights FILE)"
                raise KernccError.single(err.message + hint) from None
        return reader.checkpoint_mismatch(self._index, path, given)
