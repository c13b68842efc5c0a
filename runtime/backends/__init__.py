"""Backends: where a stage's launches run. `cpu` (numpy reference kernels) and `cuda` (cubins).

`make_backend(name)` is the one place that picks a backend by name; the backends import only
`base`, never each other, so the cpu backend loads without the CUDA libraries.
"""

from __future__ import annotations

from typing import Any

from kerncc.diagnostics import KernccError
from kerncc.runtime.backends.base import BACKENDS, Backend, BackendError


def make_backend(name: str, **options: Any) -> Backend:
    """The backend called `name` (`cpu` or `cuda`)."""
    if name == "cpu":
        from kerncc.runtime.backends.cpu import CpuBackend
        return CpuBackend()
    if name != "cuda":
        raise KernccError.single(f"unknown backend `{name}` (known: {', '.join(BACKENDS)})")
    try:
        from kerncc.runtime.backends import cuda
        return cuda.CudaBackend(**options)
    except (ImportError, BackendError) as err:  # no CUDA libraries, or no usable device
        raise KernccError.single(f"the cuda backend is not available: {err}") from None
