"""The manifest (spec §1): the typed model, its strict JSON source, reader and writer.

`model` holds the frozen attrs tree (re-exported here: `from kerncc import manifest as m` then
`m.Manifest`, `m.Buffer`, ...); `jsonsource` the strict JSON parser with positions; `reader`
the typed parse (unknown fields, duplicate keys, constants); `writer` the canonical form. The
`.kir` text form lives in `kerncc.kir`; `kerncc.source` reads either.
"""

from __future__ import annotations

from kerncc.manifest.model import *  # noqa: F403  (the model's types are the package's API)
from kerncc.manifest.reader import load, loads
from kerncc.manifest.writer import dumps
