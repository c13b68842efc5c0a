"""The cpu backend: host memory as numpy uint8 arrays, launches run the numpy references.

Kernels dispatch by entry name to `kerncc.kernels.reference.KERNELS` and externs to `EXTERNS`,
with the references' call convention (`fn(launch, *args)`: a pointer is a uint8 view from the
pointed byte to the end of its allocation, a scalar a numpy scalar). The module sha256 is not
needed: a cubin is never loaded here. Everything runs synchronously, so `sync` does nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kerncc.kernels.reference import EXTERNS, KERNELS
from kerncc.runtime.backends.base import Backend, BackendError, Geometry


class CpuBackend(Backend):
    name = "cpu"

    def allocate(self, nbytes: int) -> np.ndarray:
        return np.zeros(int(nbytes), dtype=np.uint8)

    def pointer(self, allocation: np.ndarray, offset: int) -> np.ndarray:
        if not 0 <= offset <= allocation.size:
            raise BackendError(f"offset {offset} is outside an allocation of "
                               f"{allocation.size} bytes")
        return allocation[offset:]

    def address(self, pointer: np.ndarray) -> int:
        return int(pointer.ctypes.data) if pointer.size else 0

    def upload(self, allocation: np.ndarray, offset: int, data: np.ndarray) -> None:
        allocation[offset:offset + data.size] = data

    def host_view(self, allocation: np.ndarray, offset: int, nbytes: int) -> np.ndarray:
        if offset < 0 or offset + nbytes > allocation.size:
            raise BackendError(f"writing {nbytes} bytes at {offset} overruns an allocation of "
                               f"{allocation.size} bytes")
        return allocation[offset:offset + nbytes]

    def download(self, allocation: np.ndarray, offset: int, nbytes: int) -> np.ndarray:
        return allocation[offset:offset + nbytes].copy()

    def check_kernel(self, entry: str, module: str | None) -> None:
        if entry not in KERNELS:
            raise BackendError(f"the cpu backend has no reference for kernel `{entry}`")

    def check_extern(self, name: str) -> None:
        if name not in EXTERNS:
            raise BackendError(f"the cpu backend has no reference for extern `{name}`")

    def launch_kernel(self, geometry: Geometry, args: Sequence[Any]) -> None:
        self.check_kernel(geometry.entry, geometry.module)
        with np.errstate(all="ignore"):  # a NaN in flight is the data's, not a warning's
            KERNELS[geometry.entry](geometry, *args)

    def launch_extern(self, name: str, args: Sequence[Any]) -> None:
        self.check_extern(name)
        with np.errstate(all="ignore"):
            EXTERNS[name](Geometry(name, None, (1, 1, 1), (1, 1, 1)), *args)
