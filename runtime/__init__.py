"""The kerncc runtime: load a stage bundle, allocate, load weights, run programs (ARCHITECTURE §6).

`Bundle` reads and checks a bundle (or lowers a manifest into one); `Session` runs one stage on a
backend; `Chain` runs every stage in order. Backends live in `kerncc.runtime.backends`.
"""

from kerncc.runtime.bundle import Bundle
from kerncc.runtime.chain import Chain
from kerncc.runtime.session import Session

__all__ = ["Bundle", "Chain", "Session"]
