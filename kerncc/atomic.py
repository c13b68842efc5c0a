"""Writing an output directory all at once: a temporary sibling, renamed into place at the end.

On any failure the temporary directory is removed and nothing appears at the target. An
existing target is replaced only when it is a directory kerncc wrote (it holds `bundle.json`
or only `stage<k>.json` files) or is empty; anything else is refused.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kerncc.diagnostics import KernccError

_OURS = re.compile(r"stage\d+\.json|bundle\.json|stage\d+")


def _is_ours(path: Path) -> bool:
    names = [p.name for p in path.iterdir()]
    return all(_OURS.fullmatch(n) for n in names)


@contextlib.contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise KernccError.elsewhere(f"`{target}` exists and is not a directory")
    if target.is_dir() and not _is_ours(target):
        raise KernccError.elsewhere(f"`{target}` is a directory kerncc did not write; "
                                    "refusing to overwrite it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
            target.rename(old / "x")
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(target: str | Path, text: str) -> None:
    """Write a file all at once: a temporary sibling renamed over `target`."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with open(fd, "w", encoding="utf-8") as out:
            out.write(text)
        Path(tmp).replace(target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
