"""The kernel library's index: which modules (cubins) exist, their sha256 and entries.

Reads `kernels/cubins.json` (written by `kernels/build.py`). Generators use it to fill a
manifest's `modules` (source = cubin file name, sha256 = the cubin's hash); backends use
`cubin_path` to find the file a module names.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent


@functools.cache
def index() -> dict[str, dict]:
    """{module name: {"file": path relative to kernels/, "sha256": hex, "entries": [names]}}."""
    return json.loads((KERNELS_DIR / "cubins.json").read_text())


def cubin_path(module: str) -> Path:
    return KERNELS_DIR / index()[module]["file"]


def module_of(entry: str) -> str:
    """The module whose cubin defines kernel `entry`."""
    for name, info in index().items():
        if entry in info["entries"]:
            return name
    raise KeyError(f"no module defines kernel `{entry}`")
