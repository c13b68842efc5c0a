"""The one place kerncc reads its environment.

KERNCC_DEBUG=1   show Python tracebacks for internal errors (never for bad input)
KERNCC_BACKEND   default runtime backend (`cpu` or `cuda`), `cpu` unless set
KERNCC_NO_PROGRESS=1   never draw progress bars (kerncc.progress), even on a terminal
The cuda backend's (docs/runtime.md), read when its modules load:
KERNCC_PDL=0     no programmatic dependent launch in CUDA graphs (1, the default: on)
KERNCC_GEMV_MAX_M=N   the largest m kerncc's GEMV kernels take, 0 to 8 (default 8; 0: cuBLAS)
KERNCC_INVARIANT=0   a measurement switch for the benches' A/B, not a mode to serve with: the
                 GEMMs as before batch-invariance (cuBLAS picks a kernel by m, so a row's bits
                 depend on the batch); 1, the default: every GEMM row-invariant (docs/runtime.md)
KERNCC_PIPE_ATTENTION=0   the batched decode's split attention one split a block as before (1,
                 the default: pipelined across each block's splits, faster on an H200)
KERNCC_API_KEY   the key `kerncc serve` asks clients for (as --api-key; the flag wins)
A value outside these is an error naming the variable, never ignored.
"""

from __future__ import annotations

import os

from kerncc.diagnostics import KernccError


def debug() -> bool:
    return os.environ.get("KERNCC_DEBUG", "") not in ("", "0")


def default_backend() -> str:
    return os.environ.get("KERNCC_BACKEND", "cpu")


def no_progress() -> bool:
    return os.environ.get("KERNCC_NO_PROGRESS", "") not in ("", "0")


def hypothesis_profile() -> str:
    """`ci` (bounded, the default) or `long` (deeper property runs): HYPOTHESIS_PROFILE."""
    return os.environ.get("HYPOTHESIS_PROFILE", "ci")


def _choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(name, default).strip()
    if value not in allowed:
        raise KernccError.single(f"{name}={value!r}: expected one of {', '.join(allowed)}")
    return value


def pdl() -> bool:
    return _choice("KERNCC_PDL", "1", ("0", "1")) == "1"


def gemv_max_m() -> int:
    value = os.environ.get("KERNCC_GEMV_MAX_M", "8").strip()
    if not value.isdigit() or int(value) > 8:
        raise KernccError.single(f"KERNCC_GEMV_MAX_M={value!r}: expected a whole number from "
                                 "0 to 8")
    return int(value)


def invariant() -> bool:
    """Whether the cuda backend's GEMMs give each row the same bits whatever the batch
    (KERNCC_INVARIANT; 0 only for the benches' A/B against the batch-shaped path)."""
    return _choice("KERNCC_INVARIANT", "1", ("0", "1")) == "1"


def pipe_attention() -> bool:
    """Whether the cuda backend launches the batched decode's split attention pipelined
    (runtime/backends/attention_pipe.py)."""
    return _choice("KERNCC_PIPE_ATTENTION", "1", ("0", "1")) == "1"


def api_key() -> str | None:
    """KERNCC_API_KEY, or None when unset or empty."""
    return os.environ.get("KERNCC_API_KEY") or None
