"""kir, the textual IR of a kern manifest: `dumps` prints one, `loads` reads one (docs/kir.md).

kir carries exactly what the canonical JSON carries, so `writer.dumps(loads(dumps(m)))` equals
`writer.dumps(m)` and `dumps(loads(text))` is a fixed point of printed text. The printer lives in
`kerncc.kir.printer`, the grammar in `grammar/kir.lark`, the parser in `kerncc.kir.parse`; this
module is their face. `loads_with_locator` also returns `locate(json_pointer) -> Location`, so
that later phases, which speak JSON pointers, report kir line:col.
"""

from __future__ import annotations

from kerncc import manifest as m
from kerncc.kir.parse import Locate
from kerncc.kir.parse import loads_with_locator as _loads_with_locator
from kerncc.kir.printer import dumps as _dumps

__all__ = ["dumps", "loads", "loads_with_locator"]


def dumps(manifest: m.Manifest) -> str:
    """The kir text of a manifest, with a trailing newline."""
    return _dumps(manifest)


def loads(text: str, file: str | None = None) -> m.Manifest:
    """Parse kir text strictly; a KernccError names file:line:col for every problem."""
    return _loads_with_locator(text, file)[0]


def loads_with_locator(text: str, file: str | None = None) -> tuple[m.Manifest, Locate]:
    """The manifest and a function mapping its JSON pointers to kir line:col."""
    return _loads_with_locator(text, file)
