"""The invariants every fuzz case checks, and the case counter.

`run_cli(argv)` runs `kerncc.cli.main` in process (stdout and stderr captured, under a per-case
deadline) and checks what the CLI promises for any input: exit code 0 or 1 (2 only for argparse
misuse), no traceback and no internal error. An internal error is re-run with KERNCC_DEBUG=1 so
that the failure shows the traceback. `api(fn, ...)` does the same for library calls: they may
raise `KernccError` and nothing else. `located_*` check that a failure says where the problem is,
`unchanged(paths)` that the inputs were not written, `no_partial_output(dir)` that a failed
`lower -o DIR` left nothing behind. `case(family)` tallies the fuzz cases (mutated inputs) and
`count(entry)` the runs of each entry point; the session prints both (tests/fuzz/conftest.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import signal
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs

from kerncc.cli.main import main
from kerncc.diagnostics import KernccError

CASES: Counter[str] = Counter()  # mutated inputs, per family
CALLS: Counter[str] = Counter()  # runs, per entry point (a case drives several)
OUTCOMES: Counter[str] = Counter()  # how often a property held: cases that went deep
CASE_TIMEOUT = 30.0  # seconds; the largest seed takes well under one
USAGE = 2  # argparse's exit code for a malformed command line
INTERNAL = ("Traceback (most recent call last)", "internal error", "this is a bug in kerncc")


def case(family: str) -> None:
    CASES[family] += 1


def count(entry: str) -> None:
    CALLS[entry] += 1


def tally(what: str, held: bool) -> None:
    """Count how often `what` held, to show how deep the mutated cases go."""
    OUTCOMES[f"{what}: {'yes' if held else 'no'}"] += 1


class Hang(BaseException):
    """Raised by the deadline's alarm; a BaseException so that no `except Exception` eats it."""


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Fail the case when `what` runs longer than `seconds` (SIGALRM; main thread only)."""
    def alarm(signum: int, frame: Any) -> None:
        raise Hang(what)

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except Hang:
        raise AssertionError(f"hang: {what} ran longer than {seconds:.0f} s") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@attrs.frozen
class Outcome:
    """One CLI run: the command line, exit code and captured streams."""

    argv: tuple[str, ...]
    code: int
    out: str
    err: str

    def describe(self) -> str:
        return (f"kerncc {' '.join(self.argv)}\nexit {self.code}\n--- stdout\n{self.out[:2000]}"
                f"\n--- stderr\n{self.err[:4000]}")


def _invoke(argv: list[str], cwd: Path | None) -> Outcome:
    out, err = io.StringIO(), io.StringIO()
    chdir = contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext()
    with chdir, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse exits; anything else is main's to return
            code = exit_.code if isinstance(exit_.code, int) else USAGE
    return Outcome(tuple(argv), code, out.getvalue(), err.getvalue())


def run_cli(argv: Iterable[str], *, cwd: Path | None = None, usage_ok: bool = False,
            timeout: float = CASE_TIMEOUT) -> Outcome:
    """`kerncc ARGV` in process; AssertionError unless it kept the CLI's contract."""
    argv = [str(a) for a in argv]
    with deadline(timeout, f"kerncc {' '.join(argv)}"):
        outcome = _invoke(argv, cwd)
    allowed = (0, 1, USAGE) if usage_ok else (0, 1)
    if outcome.code not in allowed or any(mark in outcome.err for mark in INTERNAL):
        raise AssertionError(f"the CLI broke its contract:\n{outcome.describe()}"
                             f"\n--- traceback (KERNCC_DEBUG=1)\n{_debug_traceback(argv, cwd)}")
    return outcome


def _debug_traceback(argv: list[str], cwd: Path | None) -> str:
    """The same command again with KERNCC_DEBUG=1, so the internal error shows where it is."""
    previous = os.environ.get("KERNCC_DEBUG")
    os.environ["KERNCC_DEBUG"] = "1"
    try:
        with deadline(CASE_TIMEOUT, "the debug re-run"):
            _invoke(argv, cwd)
    except Exception:  # noqa: BLE001 - this is what we came for
        return traceback.format_exc(limit=-25)
    finally:
        os.environ.pop("KERNCC_DEBUG")
        if previous is not None:
            os.environ["KERNCC_DEBUG"] = previous
    return "(no exception on the re-run)"


def api(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args)`: its result, or the KernccError it raised; anything else fails the case."""
    what = f"{getattr(fn, '__qualname__', fn)}{args!r:.200}"
    try:
        with deadline(CASE_TIMEOUT, what):
            return fn(*args, **kwargs)
    except KernccError as err:
        return err
    except AssertionError:
        raise
    except Exception as err:  # noqa: BLE001 - the invariant under test
        raise AssertionError(f"{what} raised {type(err).__name__} (only KernccError is "
                             f"allowed):\n{traceback.format_exc(limit=-25)}") from None


# ------------------------------------------------------------------------------ locations

def located_in_text(outcome: Outcome, file: str) -> None:
    """A failure about a text input names `file:line:col` of the problem."""
    if outcome.code == 0:
        return
    if not re.search(re.escape(file) + r":\d+:\d+", outcome.err):
        raise AssertionError(f"the error does not say where in {file} it is:\n"
                             f"{outcome.describe()}")


def located_in_json(outcome: Outcome) -> None:
    """`verify --format json`: one JSON document; every diagnostic of a failed file has a line,
    or a pointer."""
    for record in _json_document(outcome)["files"]:
        for diag in record.get("diagnostics", ()):
            if diag.get("line") is None and not diag.get("pointer"):
                raise AssertionError(f"an unlocated diagnostic {diag}:\n{outcome.describe()}")
        if not record["ok"] and not record.get("diagnostics"):
            raise AssertionError(f"a failure without diagnostics:\n{outcome.describe()}")


def _json_document(outcome: Outcome) -> dict:
    try:
        document = json.loads(outcome.out)
    except json.JSONDecodeError:
        raise AssertionError(f"--format json printed something other than one JSON document:\n"
                             f"{outcome.describe()}") from None
    if not isinstance(document, dict) or "ok" not in document or "files" not in document:
        raise AssertionError(f"--format json printed {document!r}\n{outcome.describe()}")
    if document["ok"] != all(record["ok"] for record in document["files"]):
        raise AssertionError(f"`ok` disagrees with the files:\n{outcome.describe()}")
    return document


NOT_IN_THE_INPUT = ("emit needs a directory", "exists and is not a directory",
                    "did not write", "cannot write the bundle", "a cut has at least 2 stages",
                    "must end in `emit`")
"""Problems about a path, a flag or a pass option rather than the manifest (raised as
`KernccError.elsewhere`): said without a place in the input, where no place is true."""


def located_in_pipeline_or_file(outcome: Outcome, file: str) -> None:
    """A `-p SPEC` failure points into the spec (`pipeline:1:c`) or into the input file, or
    is one of the problems that are in neither (NOT_IN_THE_INPUT)."""
    if outcome.code == 0:
        return
    if re.search(r"(^|\s)pipeline:\d+:\d+", outcome.err):
        return
    if any(text in outcome.err for text in NOT_IN_THE_INPUT):
        if f"{file}:1:1" in outcome.err:
            raise AssertionError(f"a problem outside the input is put at its 1:1:\n"
                                 f"{outcome.describe()}")
        return
    located_in_text(outcome, file)


def names_a_file(outcome: Outcome, names: Iterable[str]) -> None:
    """A failure about a bundle names one of the files involved."""
    if outcome.code == 0:
        return
    names = list(names)
    if not any(name in outcome.err for name in names):
        raise AssertionError(f"the error names none of {names}:\n{outcome.describe()}")


def error_names_a_file(err: KernccError, names: Iterable[str]) -> None:
    text = str(err) + "".join(d.location.file or "" for d in err.diagnostics)
    names = list(names)
    if not any(name in text for name in names):
        raise AssertionError(f"the error names none of {names}:\n{err}")


# ------------------------------------------------------------------------------ files

def digest_tree(paths: Iterable[Path]) -> dict[str, str]:
    """sha256 of every file under `paths` (files or directories)."""
    out: dict[str, str] = {}
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in files:
            out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@contextlib.contextmanager
def unchanged(*paths: Path) -> Iterator[None]:
    """The files under `paths` have the same bytes after the block (and none come or go)."""
    before = digest_tree(paths)
    yield
    after = digest_tree(paths)
    if after != before:
        changed = sorted(set(before.items()) ^ set(after.items()))
        raise AssertionError(f"an input was modified: {changed[:5]}")


def no_partial_output(outcome: Outcome, target: Path) -> None:
    """`lower -o DIR`: DIR exists after success and not after failure; no temporaries remain."""
    siblings = target.parent.iterdir() if target.parent.is_dir() else ()
    leftovers = [p.name for p in siblings if p.name.startswith(f".{target.name}.")]
    if leftovers:
        raise AssertionError(f"temporary directories left behind: {leftovers}\n"
                             f"{outcome.describe()}")
    if outcome.code != 0 and target.exists():
        raise AssertionError(f"a failed lower left {target} behind:\n{outcome.describe()}")
    if outcome.code == 0 and "-o" in outcome.argv and not target.is_dir():
        raise AssertionError(f"lower succeeded but wrote no {target}:\n{outcome.describe()}")


def fresh_dir(base: Path) -> Path:
    """A new empty directory for one case."""
    return Path(tempfile.mkdtemp(dir=base))
