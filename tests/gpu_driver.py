"""The CUDA driver API, just enough for the kernel-level GPU tests to launch entries of the
library's cubins (tests/test_elementwise_cuda.py, tests/test_attention_pipe_cuda.py)."""

from __future__ import annotations

import ctypes

import numpy as np

from kerncc.kernels import library


class Gpu:
    """The driver API, just enough to launch entries of the library's cubins."""

    def __init__(self) -> None:
        from cuda.bindings import driver as cu

        self.cu = cu
        self.check(cu.cuInit(0))
        self.ctx = self.check(cu.cuDevicePrimaryCtxRetain(self.check(cu.cuDeviceGet(0))))
        self.check(cu.cuCtxSetCurrent(self.ctx))
        self.modules: dict[str, object] = {}
        self.ptrs: list[int] = []

    def check(self, result):
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA error {err}")
        return values[0] if len(values) == 1 else (tuple(values) or None)

    def function(self, module: str, entry: str):
        if module not in self.modules:
            image = np.frombuffer(library.cubin_path(module).read_bytes(), dtype=np.uint8)
            self.modules[module] = self.check(self.cu.cuModuleLoadData(image.ctypes.data))
        return self.check(self.cu.cuModuleGetFunction(self.modules[module], entry.encode()))

    def upload(self, data: np.ndarray, shift: int = 0) -> int:
        """A device copy of `data` starting `shift` bytes past a 256-byte aligned allocation."""
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        base = int(self.check(self.cu.cuMemAlloc(raw.nbytes + shift + 16)))
        self.ptrs.append(base)
        self.check(self.cu.cuMemcpyHtoD(self.cu.CUdeviceptr(base + shift), raw.ctypes.data,
                                        raw.nbytes))
        return base + shift

    def download(self, ptr: int, like: np.ndarray) -> np.ndarray:
        out = np.empty_like(like)
        self.check(self.cu.cuCtxSynchronize())
        self.check(self.cu.cuMemcpyDtoH(out.ctypes.data, self.cu.CUdeviceptr(ptr), out.nbytes))
        return out

    def allow_shared(self, module: str, entry: str, nbytes: int) -> None:
        """Let `entry` launch with up to `nbytes` of dynamic shared memory."""
        attribute = self.cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self.check(self.cu.cuFuncSetAttribute(self.function(module, entry), attribute, nbytes))

    def launch(self, module: str, entry: str, grid: int | tuple[int, int], block: int,
               args: list, shared: int = 0) -> None:
        slots = [a if isinstance(a, ctypes._SimpleCData) else ctypes.c_uint64(a) for a in args]
        table = (ctypes.c_void_p * len(slots))(*[ctypes.addressof(s) for s in slots])
        x, y = grid if isinstance(grid, tuple) else (grid, 1)
        self.check(self.cu.cuLaunchKernel(self.function(module, entry), x, y, 1, block, 1, 1,
                                          shared, 0, ctypes.addressof(table), 0))

    def close(self) -> None:
        for p in self.ptrs:
            self.check(self.cu.cuMemFree(self.cu.CUdeviceptr(p)))
        self.ptrs.clear()
