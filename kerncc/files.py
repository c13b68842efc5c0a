"""Reading the files a bundle or a manifest names: inside their folder, regular, bounded.

Every file a bundle names (a stage folder, its manifest, plan, stage.py and modules) and every
module `source` a manifest names is resolved by `inside`: a relative path without `..` whose
real path (symlinks followed) stays under the folder it is relative to. `read_regular` opens
without blocking, refuses anything but a regular file (a FIFO would hang, a device never end)
and reads at most `limit` bytes; `read_json` reads a JSON file so (config.json, a shard index),
whatever its parser refuses an error naming the file. A refusal names the path, never the
file's bytes.
A path the user gives on the command line is not checked by `inside`: it is theirs to choose.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from kerncc.bundle.format import MAX_FILE_SIZE
from kerncc.diagnostics import Diagnostic, KernccError, Location

# The limit `read_regular` applies by default; `--max-file-size` sets it for one command.
_limit = [MAX_FILE_SIZE]


def max_file_size() -> int:
    return _limit[0]


def set_max_file_size(limit: int) -> None:
    _limit[0] = limit


def limit_or(default: int) -> int:
    """`--max-file-size` when it was given (set to other than MAX_FILE_SIZE), else `default`:
    the limit of files that have a tighter one of their own (a tokenizer, a chat template)."""
    return default if _limit[0] == MAX_FILE_SIZE else _limit[0]

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


class FileRefused(KernccError):
    """A file that cannot be read as asked: missing, special, too large, or outside."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def kind_of(mode: int) -> str:
    """What a file of this mode is, in words (`a FIFO (named pipe)`)."""
    return next((word for test, word in _KINDS if test(mode)), "not a regular file")


def is_local(name: str) -> bool:
    """`name` is a relative path that stays where it starts: not absolute, no `..`."""
    path = PurePosixPath(name.replace("\\", "/"))
    return bool(name) and "\x00" not in name and not path.is_absolute() \
        and ".." not in path.parts and not (len(name) > 1 and name[1] == ":")


def inside(root: Path, name: str, what: str) -> Path:
    """`root / name`, refused unless it is local and its real path stays under `root`."""
    if not isinstance(name, str) or not is_local(name):
        raise FileRefused(f"{what} `{_shown(name)}` is not inside `{root}` (a path a bundle or "
                          "manifest names is relative, without `..`)")
    path = root / name
    real, base = path.resolve(), root.resolve()
    if real != base and base not in real.parents:
        raise FileRefused(f"{what} `{path}` is a link that leaves `{root}`")
    return path


def _shown(name: object) -> str:
    """The name as it can be shown on one line: control characters escaped, length capped."""
    text = str(name).encode("unicode_escape").decode("ascii")
    return text if len(text) <= 200 else text[:200] + "..."


def read_regular(path: Path, what: str, limit: int | None = None, prefix: bool = False
                 ) -> bytes:
    """The bytes of the regular file at `path`, at most `limit` of them; FileRefused if not.

    With `prefix`, a longer file is no error: its first `limit` bytes are returned. The
    default limit is `max_file_size()`.
    """
    limit = max_file_size() if limit is None else limit
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise FileRefused(f"{what} `{path}` is missing") from None
    except OSError as err:
        raise FileRefused(f"cannot read {what} `{path}`: {err.strerror or err}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise FileRefused(f"{what} `{path}` is {kind_of(mode)}, not a regular file")
    with os.fdopen(fd, "rb") as file:
        try:
            data = file.read(limit if prefix else limit + 1)
        except OSError as err:
            raise FileRefused(f"cannot read {what} `{path}`: {err.strerror or err}") from None
    if len(data) > limit:
        raise FileRefused(f"{what} `{path}` is larger than {limit} bytes (--max-file-size "
                          "raises the limit)")
    return data


def check_regular(path: Path, what: str) -> None:
    """FileRefused unless `path` exists and is a regular file (symlinks followed)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileRefused(f"{what} `{path}` does not exist") from None
    except OSError as err:
        raise FileRefused(f"cannot read {what} `{path}`: {err.strerror or err}") from None
    if not stat.S_ISREG(mode):
        raise FileRefused(f"{what} `{path}` is {kind_of(mode)}, not a regular file")


def read_json(path: Path, what: str) -> Any:
    """A JSON file's value; unreadable or malformed is a KernccError naming the file.

    Read as untrusted: a regular file only (a FIFO would block, /dev/zero never end), at most
    `--max-file-size` bytes, and whatever the parser refuses (nesting past the recursion limit,
    an integer of more digits than Python converts) is an error, not a traceback."""
    if not path.exists() and not path.is_symlink():
        raise KernccError.single(f"{path}: no {what} (expected {path.name})")
    try:
        text = read_regular(path, what).decode("utf-8")
    except FileRefused as err:
        raise KernccError(f"{path}: cannot read {what}", [Diagnostic(
            err.headline, Location("", file=str(path)))]) from None
    except UnicodeDecodeError as err:
        raise KernccError.single(f"{path}: cannot read {what}: {err}") from None
    return parse_json(path, text, what)


def parse_json(path: Path, text: str, what: str) -> Any:
    """The value of JSON `text` read from `path`; a refusal names the file (and the line)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        diag = Diagnostic(f"not JSON: {err.msg}", Location("", file=str(path), line=err.lineno,
                                                           column=err.colno))
    except RecursionError:
        diag = Diagnostic("not JSON kerncc reads: nested too deeply", Location("", file=str(path)))
    except ValueError as err:  # an integer of more digits than Python converts
        diag = Diagnostic(f"not JSON kerncc reads: {str(err).split(';')[0]}",
                          Location("", file=str(path)))
    raise KernccError(f"{path}: bad {what}", [diag]) from None
