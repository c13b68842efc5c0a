"""A manifest source a user hands us: JSON (`kerncc.manifest`) or the textual IR (`kerncc.kir`).

The one place that chooses between the two forms by the file's suffix, so that every command
reading a user's file (verify, lower, fmt, dump, check's input) accepts both. Bundles hold JSON
only and are read by `kerncc.manifest.reader` directly.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kerncc import kir
from kerncc.diagnostics import Location
from kerncc.manifest import model as m
from kerncc.manifest.jsonsource import PositionIndex
from kerncc.manifest.reader import STDIN, loads, read_text
from kerncc.manifest.reader import load_with_locator as load_json_with_locator

STDIN_NAME = "<stdin>"


def is_kir(path: str | Path) -> bool:
    return Path(path).suffix == ".kir"


def looks_like_json(text: str) -> bool:
    """Standard input has no suffix: a manifest in JSON opens with `{`, a kir text does not."""
    return text.lstrip().startswith("{")


def load(path: str | Path) -> m.Manifest:
    """Read a `.json` manifest or a `.kir` text; parse strictly, no verification."""
    return load_with_locator(path)[0]


def load_with_locator(path: str | Path) -> tuple[m.Manifest, Callable[[str], Location]]:
    """The manifest and a function mapping a JSON pointer to its place in the file.

    `-` reads standard input, JSON or kir by its first character."""
    if str(path) == STDIN:
        text = read_text(path)
        return loads_with_locator(text, STDIN_NAME, kir_text=not looks_like_json(text))
    if not is_kir(path):
        return load_json_with_locator(path)
    return kir.loads_with_locator(read_text(path), str(path))


def loads_with_locator(text: str, name: str | Path, kir_text: bool | None = None
                       ) -> tuple[m.Manifest, Callable[[str], Location]]:
    """Parse text already read (JSON or kir) as `load_with_locator` parses a file; the form
    is `kir_text`, or when not given the one the suffix of `name` names."""
    name = str(name)
    if kir_text is None:
        kir_text = is_kir(name)
    if kir_text:
        return kir.loads_with_locator(text, name)
    return loads(text, name), PositionIndex.locator(text, name)
