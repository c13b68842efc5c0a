"""The manifest (spec §1): the typed model, its strict JSON source, reader and writer.

`model` holds the frozen attrs tree (re-exported here: `from kerncc import manifest as m` then
`m.Manifest`, `m.Buffer`, ...); `jsonsource` the strict JSON parser with positions; `reader`
the typed parse (unknown fields, duplicate keys, constants); `writer` the canonical form. The
`.kir` text form lives in `kerncc.kir`; `kerncc.source` reads either.
"""

from __future__ import annotations

from pathlib import Path

from kerncc.manifest import reader, writer
from kerncc.manifest.model import *  # noqa: F403  (the model's types are the package's API)
from kerncc.manifest.model import Manifest


def load(path: str | Path) -> Manifest:
    """Read a JSON manifest file: parse strictly, no verification (`.kir`: `kerncc.source`)."""
    return reader.load(path)


def loads(text: str, file: str | None = None) -> Manifest:
    """Parse manifest JSON text strictly."""
    return reader.loads(text, file)


def dumps(manifest: Manifest) -> str:
    """The canonical JSON text (spec §1.11), with a trailing newline."""
    return writer.dumps(manifest)
