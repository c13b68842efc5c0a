"""Writing an output directory all at once: a temporary sibling, renamed into place at the end.

On any failure the temporary directory is removed and nothing appears at the target. Every file
is fsynced before the rename (and the directories after it), so a crash leaves the old output or
the new one, never a torn one. An existing target is replaced only when it is empty or holds
exactly what kerncc writes there and nothing else: a bundle (bundle.json and, checked file by
file down every folder, the stage files it lists) or `stage<k>.json` files. Anything else is
refused and nothing is changed. Temporary siblings left by a killed run (`.OUT.xxxxxxxx`,
`.OUT.old.xxxxxxxx`) are removed by the next write to the same place.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from kerncc.diagnostics import KernccError

_UMASK = os.umask(0o022)  # read once, at import (os.umask can only be read by setting it)
os.umask(_UMASK)
_STAGE_MANIFEST = re.compile(r"stage\d+\.json")
_MODULE = re.compile(r"[0-9a-f]{64}\.cubin")
_STAGE_FILES = ("manifest.json", "plan.json", "stage.py")


def _leftover(name: str) -> re.Pattern[str]:
    """The names mkdtemp gives this module's temporary siblings of `name`."""
    return re.compile(re.escape(f".{name}.") + r"(old\.)?[A-Za-z0-9_]{8}")


def _entries(root: Path) -> Iterator[tuple[str, os.stat_result]]:
    """Every path under `root` (relative, `/`-separated) with its lstat: links not followed."""
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            yield path.relative_to(root).as_posix(), path.lstat()


def _bundle_files(root: Path) -> tuple[set[str], set[str]] | None:
    """The folders and files bundle.json says a bundle of kerncc's holds (module files aside);
    None if it is not one (not a regular bundle.json, not JSON, or no stage list)."""
    index_path = root / "bundle.json"
    try:
        if not stat.S_ISREG(index_path.lstat().st_mode) or index_path.stat().st_size > 1 << 26:
            return None
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    stages = index.get("stages") if isinstance(index, dict) else None
    if not isinstance(stages, list):
        return None
    folders, files = set(), {"bundle.json"}
    for entry in stages:
        folder = entry.get("dir") if isinstance(entry, dict) else None
        if not isinstance(folder, str) or not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*",
                                                           folder):
            return None
        folders |= {folder, f"{folder}/modules"}
        files |= {f"{folder}/{name}" for name in _STAGE_FILES}
    return folders, files


# The file marking a folder as kerncc's output: a random id, written into every output (a
# user's folder that merely looks like a bundle lacks it, and is never replaced).
MARKER = ".kerncc-output"
_MARKER_TEXT = re.compile(r"kerncc-output [0-9a-f]{32}\n")


def _marked(path: Path) -> bool:
    marker = path / MARKER
    try:
        if not stat.S_ISREG(marker.lstat().st_mode) or marker.stat().st_size > 64:
            return False
        return bool(_MARKER_TEXT.fullmatch(marker.read_text(encoding="ascii")))
    except (OSError, ValueError):
        return False


def _is_ours(path: Path) -> bool:
    """`path` is empty, or kerncc marked it as its own and it holds only what kerncc writes
    there: a bundle, or stage<k>.json files."""
    entries = [(name, st) for name, st in _entries(path) if name != MARKER]
    if not entries:
        return not (path / MARKER).exists() or _marked(path)
    if not _marked(path):
        return False
    if all(_STAGE_MANIFEST.fullmatch(name) and stat.S_ISREG(st.st_mode)
           for name, st in entries):
        return True
    listed = _bundle_files(path)
    if listed is None:
        return False
    folders, files = listed
    for name, st in entries:  # every entry, down every folder; a link or FIFO is not ours
        folder, _, base = name.rpartition("/")
        if stat.S_ISDIR(st.st_mode):
            ok = name in folders
        else:
            module = folder in folders and folder.endswith("/modules") and _MODULE.fullmatch(base)
            ok = stat.S_ISREG(st.st_mode) and (name in files or bool(module))
        if not ok:
            return False
    return True


def remove_leftovers(target: Path) -> None:
    """Remove the temporary siblings of `target` a killed run left behind; an old output a
    run killed between its two renames left aside (and nothing at `target`) is put back."""
    pattern = _leftover(target.name)
    with contextlib.suppress(OSError):
        for item in target.parent.iterdir():
            aside = item / "x"
            if pattern.fullmatch(item.name) and ".old." in item.name and aside.is_dir() \
                    and not aside.is_symlink() and not target.exists() \
                    and not target.is_symlink():
                aside.rename(target)
        for item in target.parent.iterdir():
            if pattern.fullmatch(item.name) and item.is_dir() and not item.is_symlink():
                shutil.rmtree(item, ignore_errors=True)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every folder (its entries), deepest first."""
    folders = []
    for folder, _, files in os.walk(root):
        folders.append(folder)
        for name in files:
            _fsync(Path(folder) / name)
    for folder in reversed(folders):
        fsync_dir(Path(folder))


def fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a folder be fsynced
        _fsync(folder)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    target = Path(target)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise KernccError.elsewhere(f"`{target}` exists and is not a directory")
    if target.is_dir() and not _is_ours(target):
        raise KernccError.elsewhere(f"`{target}` is a directory kerncc did not write, or holds "
                                    "files besides what kerncc wrote; refusing to overwrite it")
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(target)  # first: it may put back an old output a crash left aside
    if target.is_dir() and not _is_ours(target):
        raise KernccError.elsewhere(f"`{target}` is a directory kerncc did not write, or holds "
                                    "files besides what kerncc wrote; refusing to overwrite it")
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        os.chmod(tmp, 0o777 & ~_UMASK)  # mkdtemp's 0700 would outlive the rename
        yield tmp
        (tmp / MARKER).write_text(f"kerncc-output {secrets.token_hex(16)}\n", encoding="ascii")
        fsync_tree(tmp)
        if target.exists():
            _replace(tmp, target)
        else:
            tmp.rename(target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace(new: Path, target: Path) -> None:
    """Put the folder `new` at `target` in one step: the two are exchanged (Linux's
    renameat2 RENAME_EXCHANGE), so a crash at any point leaves the old folder or the new one
    at `target`; the old one, then at `new`'s name, is removed after. Where the exchange is not
    to be had, two renames, and a crash between them leaves the old folder in a leftover
    sibling that the next write to `target` puts back first (`remove_leftovers`)."""
    if exchange(new, target):
        shutil.rmtree(new, ignore_errors=True)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
    target.rename(old / "x")
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swap the paths `a` and `b` atomically; False where the system cannot (then nothing
    changed)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    done = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return done == 0


def write_text_atomic(target: str | Path, text: str) -> None:
    """Write a file all at once: a temporary sibling, fsynced, renamed over `target`."""
    write_atomic(target, lambda out: out.write(text.encode("utf-8")))


def write_atomic(target: str | Path, save: Callable[[BinaryIO], object]) -> None:
    """`save(file)` into a temporary sibling (binary), fsynced, renamed over `target` once
    whole: a full disk or a Ctrl-C midway leaves the earlier file (or none), never a torn one."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)  # as open() would make it, not mkstemp's 0600
        with open(fd, "wb") as out:
            save(out)
            out.flush()
            os.fsync(out.fileno())
        Path(tmp).replace(target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
