"""The one place kerncc reads its environment.

KERNCC_DEBUG=1   show Python tracebacks for internal errors (never for bad input)
KERNCC_BACKEND   default runtime backend (`cpu` or `cuda`), `cpu` unless set
KERNCC_NO_PROGRESS=1   never draw progress bars (kerncc.progress), even on a terminal
"""

from __future__ import annotations

import os


def debug() -> bool:
    return os.environ.get("KERNCC_DEBUG", "") not in ("", "0")


def default_backend() -> str:
    return os.environ.get("KERNCC_BACKEND", "cpu")


def no_progress() -> bool:
    return os.environ.get("KERNCC_NO_PROGRESS", "") not in ("", "0")


def hypothesis_profile() -> str:
    """`ci` (bounded, the default) or `long` (deeper property runs): HYPOTHESIS_PROFILE."""
    return os.environ.get("HYPOTHESIS_PROFILE", "ci")
