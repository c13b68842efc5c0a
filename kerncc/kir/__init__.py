"""kir, the textual IR of a kern manifest: `dumps` prints one, `loads` reads one (docs/kir.md).

kir carries exactly what the canonical JSON carries, so `writer.dumps(loads(dumps(m)))` equals
`writer.dumps(m)` and `dumps(loads(text))` is a fixed point of printed text. The printer lives in
`kerncc.kir.printer`, the grammar in `grammar/kir.lark`, the parser in `kerncc.kir.parse`; this
module is their face. `loads_with_locator` also returns `locate(json_pointer) -> Location`, so
that later phases, which speak JSON pointers, report kir line:col.
"""

from __future__ import annotations

from kerncc import manifest as m
from kerncc.kir.parse import loads_with_locator
from kerncc.kir.printer import dumps

__all__ = ["dumps", "loads", "loads_with_locator"]


def loads(text: str, file: str | None = None) -> m.Manifest:
    """Parse kir text strictly; a KernccError names file:line:col for every problem."""
    return loads_with_locator(text, file)[0]
