"""The argument types and shared flags of the command line: each parse said once (and the
target `run` and `serve` open).

A bad value is an `argparse.ArgumentTypeError`, so argparse reports it with the command's
usage and exit code 2 (a usage error, not bad input).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kerncc.diagnostics import KernccError


def positive(text: str) -> int:
    """A whole number of at least 1 (counts, sizes, rows)."""
    return _whole(text, 1)


def seconds(text: str) -> float:
    """A duration in seconds, finite and at least 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got `{text}`") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text}")
    return value


def non_negative(text: str) -> int:
    """A whole number of at least 0 (a count that may be none)."""
    return _whole(text, 0)


def _whole(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got `{text}`") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected a number of at least {least}, got {value}")
    return value


def positive_seconds(text: str) -> float:
    """A duration in seconds, finite and more than 0 (a timeout that can pass)."""
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def no_stdin(what: str) -> Callable[[str], str]:
    """A path argument that `-` cannot stand for (`what` says why), refused as a usage error:
    a bundle is a folder, and a manifest that `run` or `serve` lowers is read beside its
    checkpoint, which standard input has none of."""
    def path(text: str) -> str:
        if text == "-":
            raise argparse.ArgumentTypeError(f"`-` (standard input) cannot be {what}")
        return text

    return path


def prompt_conflict(args: argparse.Namespace) -> str | None:
    """`kerncc run` takes exactly one of --prompt, --text and --chat (the text flags are
    there when the hf extra registered them): a usage error otherwise."""
    given = [f for f, v in (("--prompt", args.prompt), ("--text", getattr(args, "text", None)),
                            ("--chat", getattr(args, "chat", None))) if v is not None]
    if len(given) == 1:
        return None
    forms = "--prompt, --text and --chat" if hasattr(args, "text") else "--prompt"
    return f"give exactly one of {forms}" + (f" (got {', '.join(given)})" if given else "")


def devices(text: str) -> list[int]:
    """GPU ids, `0,1`."""
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected device ids like 0,1, got `{text}`") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected device ids like 0,1, got `{text}`")
    return ids


def token_ids(text: str) -> list[int]:
    """A prompt as token ids, `1,2,3` (or space separated); a hole (`1,,2`) is refused."""
    parts = re.split(r"\s*,\s*|\s+", text.strip())
    if "" in parts:  # `1,,2`, `1,`: a list with a hole is a typo, not a shorter prompt
        raise argparse.ArgumentTypeError(f"expected token ids like 1,2,3, got `{text}` "
                                         "(an empty entry)")
    try:
        ids = [int(t) for t in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids like 1,2,3, got `{text}`") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative token ids, got `{text}`")
    return ids


def port(text: str) -> int:
    """A TCP port, 0..65535 (0: any free one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got `{text}`") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is outside 0..65535")
    return value


def number(kind: type) -> Callable[[str], object]:
    """A value of `kind` (int or float); the range is the caller's to check."""
    def parse(text: str):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got `{text}`") from None
    return parse


def limit_flags(p: argparse.ArgumentParser) -> None:
    """`--max-errors` and `--max-file-size`, on every command that reads files."""
    from kerncc.bundle.format import MAX_FILE_SIZE
    from kerncc.diagnostics import MAX_ERRORS

    p.add_argument("--max-errors", type=positive, default=MAX_ERRORS, metavar="N",
                   help=f"print at most N diagnostics, count the rest (default {MAX_ERRORS})")
    p.add_argument("--max-file-size", type=positive, metavar="BYTES",
                   help=f"the largest manifest, bundle.json, plan or module read (default "
                   f"{MAX_FILE_SIZE})")


def open_run_target(target: str, pipeline: str | None) -> Any:
    """The Bundle of `run` and `serve`'s BUNDLE_OR_MANIFEST: a manifest lowered with
    --pipeline (default emit), a bundle directory as is; --pipeline with a bundle directory
    is refused (it is lowered already: the flag would do nothing)."""
    from kerncc.lower import open_target

    _check_folder(Path(target))
    if pipeline is not None and Path(target).is_dir():
        raise KernccError.single(f"--pipeline {pipeline}: `{target}` is a bundle directory, "
                                 "lowered already (--pipeline lowers a manifest file)")
    return open_target(target, pipeline or "emit")


def _check_folder(folder: Path) -> None:
    """A folder that is no bundle (no bundle.json), said with the manifest it holds, if any:
    `kerncc run FOLDER` is what a newcomer types for a model folder."""
    if not folder.is_dir() or (folder / "bundle.json").exists():
        return
    manifests = [folder / n for n in ("model.json", "model.kir") if (folder / n).is_file()]
    hint = (f"to run the manifest in it, give `{manifests[0]}`" if manifests else
            "give a bundle directory (kerncc lower FILE -p ...,emit -o DIR) or a manifest file")
    raise KernccError.single(f"`{folder}` is a folder but no bundle (it has no bundle.json); "
                             f"{hint}")
