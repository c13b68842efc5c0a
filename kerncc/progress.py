"""Progress bars: one line on stderr for a person watching a terminal, nothing for anyone else.

A bar draws only when its stream (stderr unless given) is a TTY and `KERNCC_NO_PROGRESS` is
unset or `0` (kerncc/config.py); otherwise every method is a no-op that costs one attribute
check, so code may wrap any loop without asking who is watching. Scripts, pipes, CI logs and
pytest's captured output never see a byte. No dependency beyond the standard library.

Wrap an iterable (its `len()` is the total when it has one, else pass `total=`):

    from kerncc.progress import progress

    for name in progress(names, "loading weights"):
        load(name)

Or count by hand, in any unit, as a context manager:

    with progress(total=nbytes, label="weights", unit="B") as bar:
        for chunk in chunks:
            copy(chunk)
            bar.update(len(chunk))

`close()` erases the line (also on leaving the `with` block and at the end of the iteration,
exceptions included); closing twice is harmless. Redraws are throttled to one per
`min_interval` seconds, the last always drawn, and the line is cut to the terminal's width;
`enabled=True/False` forces drawing either way (tests do). `unit="B"` shows counts as bytes
(`12.0 MiB/1.5 GiB`); any other unit follows plain counts.

Print nothing else to stderr while a bar is open, or print after `close()`: the bar owns the
line it is drawn on.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Generic, TextIO, TypeVar

from kerncc import config

T = TypeVar("T")

BAR_WIDTH = 24


def should_draw(stream: TextIO) -> bool:
    """A bar draws on a terminal, unless KERNCC_NO_PROGRESS says not to."""
    if config.no_progress():
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def human_bytes(n: float) -> str:
    """A byte count as a person reads it: `512 B`, `12.0 MiB`, at most GiB."""
    for name in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{int(n)} B" if name == "B" else f"{n:.1f} {name}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_count(n: float, unit: str) -> str:
    return human_bytes(n) if unit == "B" else f"{int(n)}"


def render(label: str, done: float, total: float | None, unit: str) -> str:
    """The bar's text: `label [#######.........] 7/16 tensors 43%`, or `label 7` with no total."""
    suffix = f" {unit}" if unit and unit != "B" else ""
    head = f"{label} " if label else ""
    if not total:
        return f"{head}{format_count(done, unit)}{suffix}"
    fraction = min(max(done / total, 0.0), 1.0)
    filled = int(fraction * BAR_WIDTH)
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    counts = f"{format_count(done, unit)}/{format_count(total, unit)}{suffix}"
    return f"{head}[{bar}] {counts} {int(fraction * 100)}%"


class Progress(Generic[T]):
    """One progress line; see the module docstring for the API."""

    def __init__(self, iterable: Iterable[T] | None = None, label: str = "", *,
                 total: float | None = None, unit: str = "", stream: TextIO | None = None,
                 enabled: bool | None = None, min_interval: float = 0.1) -> None:
        self.iterable = iterable
        self.label = label
        self.total = total if total is not None else _length(iterable)
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = should_draw(self.stream) if enabled is None else enabled
        self.min_interval = min_interval
        self.done: float = 0
        self._drawn_at: float | None = None
        self._width = 0
        self._closed = False

    def __iter__(self) -> Iterator[T]:
        if self.iterable is None:
            raise TypeError("this Progress wraps no iterable; call update() instead")
        try:
            for item in self.iterable:
                yield item
                self.update()
        finally:
            self.close()

    def __enter__(self) -> Progress[T]:
        self._draw(force=True)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.done += n
        self._draw(force=self.total is not None and self.done >= self.total)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.enabled and self._width:
            self._write("\r" + " " * self._width + "\r")

    def _draw(self, force: bool = False) -> None:
        if not self.enabled or self._closed:
            return
        now = time.monotonic()
        if not force and self._drawn_at is not None and now - self._drawn_at < self.min_interval:
            return
        self._drawn_at = now
        columns = shutil.get_terminal_size((80, 24)).columns - 1
        text = render(self.label, self.done, self.total, self.unit)[:columns]
        self._write("\r" + text.ljust(self._width))
        self._width = max(self._width, len(text))

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


def _length(iterable: Iterable | None) -> int | None:
    try:
        return len(iterable)  # type: ignore[arg-type]
    except TypeError:
        return None


def progress(iterable: Iterable[T] | None = None, label: str = "", *, total: float | None = None,
             unit: str = "", stream: TextIO | None = None) -> Progress[T]:
    """A `Progress` over `iterable` (or to `update()` by hand); silent unless on a terminal."""
    return Progress(iterable, label, total=total, unit=unit, stream=stream)
