"""The cuda backend: one NVIDIA GPU, its memory, cubin launches, cuBLAS GEMMs, CUDA graphs.

What lives where (docs/runtime.md, "The cuda backend", has the measurements behind it):
* cuda.core: the device (`Device(i).set_current()`, properties, peer capability), the stream
  and the events, and graph capture (`Stream.create_graph_builder`).
* cuda.bindings (the driver API): plain `cuMemAlloc` allocations (peer copies need plain
  allocations, not pool memory), copies, module loading, and every launch through
  `cuLaunchKernel` with a parameter table built once per launch site (`prepare`): pointers
  are fixed at load (arena base + offset), literal scalars and `bytes<n>` packs are written
  once, and only the var-dependent slots are rewritten before each launch.
* cuBLAS through ctypes (`kerncc.runtime.backends.cublas`) for the GEMM externs, and
  kerncc's own GEMV kernels (`kerncc.runtime.backends.gemv`) for their decode shapes (m <= 8).
* The FP8 decode GEMV `gemv_fp8_bf16` launched as its tensor-core form `gemv_fp8_bf16_tc`
  (the same function and arguments, its own block and grid) where the site allows it
  (`kerncc.runtime.backends.fp8_gemv`, one switch).

Programmatic dependent launch (PDL) in captured graphs, after a kernel of this backend or a
cuBLAS(Lt) call that left one kernel node, and what it measured: docs/runtime.md ("Overlapping
launches"). `KERNCC_PDL=0` turns it off.

Every driver call is checked (cuda.bindings returns its CUresult; it does not raise) and a
failure is a `BackendError` naming the call; the Session adds program, call, op and launch.
Host-to-device copies are stream-ordered: small ones go through a ring of pinned slots, big
ones wait for the stream and copy synchronously; weights at load come through the loader's
pinned staging buffers (`pinned_buffer`, `upload_async`, `fence`: kerncc.runtime.loader) and
are not waited for. Downloads can be taken later (`download_async`), so a chain of stages
never waits for the host between items.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import time
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from kerncc.runtime.backends.base import Backend, BackendError, Geometry

try:  # the optional `cuda` extra
    from cuda.bindings import driver as cu
    from cuda.core import Device, EventOptions, StreamOptions
except ImportError as _err:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"{_err} (install kerncc[cuda])") from None

from kerncc import config
from kerncc.diagnostics import KernccError
from kerncc.kernels import library
from kerncc.runtime.backends import attention_pipe, fp8_gemv, gemv
from kerncc.runtime.backends.cublas import GEMMS, Blas, CublasError, Lt, lt_version
from kerncc.runtime.backends.probe import cuda_devices
from kerncc.runtime.launch import Pack, Site, VarScalar, evaluate

SLOT_BYTES = 1 << 20  # pinned upload slot
LARGE_PAGE = 2 << 20  # the device pages cuMemAlloc takes for all but small allocations
SMALL_ALLOCATION = 1 << 20
SMALL_ALIGN = 512
SLOTS = 32
PARAM_ALIGN = 16
SCALAR_FORMATS = {"i32": ("<i", -2**31, 2**31 - 1), "i64": ("<q", -2**63, 2**63 - 1),
                  "u8": ("<B", 0, 255), "f32": ("<f", None, None)}
# the backend whose context is current on this thread, weakly: a backend nobody holds is
# collected, and gives its device memory back (CudaBackend.close)
_active: list[Any] = [None]
PDL = config.pdl()


@functools.cache
def waiting_modules() -> frozenset[str]:
    """The sha256s of the library's modules whose entries all wait for their predecessor."""
    return frozenset(info["sha256"] for info in library.index().values() if info.get("waits"))


def available() -> str | None:
    """None when a CUDA device can be used, else why not (asked in a child process)."""
    count, why = cuda_devices()
    return None if count else why


def check(result: Any, what: str) -> Any:
    """The values a cuda.bindings call returned, or a BackendError naming the call."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        _, text = cu.cuGetErrorString(err)
        raise BackendError(f"{what} failed: {_text(name)} ({_text(text)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def library_functions(backend: CudaBackend, module: str, entries: Sequence[str]
                      ) -> dict[str, Any]:
    """The entries of library module `module`, its cubin loaded in `backend`'s context."""
    backend.activate()
    path = library.cubin_path(module)
    image = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    loaded = check(cu.cuModuleLoadData(image.ctypes.data), f"cuModuleLoadData({path.name})")
    return {name: check(cu.cuModuleGetFunction(loaded, name.encode()),
                        f"cuModuleGetFunction({name})") for name in entries}


@attrs.define(eq=False)
class Allocation:
    """Device memory from `cuMemAlloc`."""

    ptr: int
    nbytes: int
    device: int


@attrs.define(eq=False)
class _Landing:
    """A receiver-side buffer that peer copies land in, with the events ordering its reuse."""

    allocation: Allocation
    free: Any  # the receiver's: recorded on its stream once the landing was copied out
    arrived: Any = None  # the sender's: recorded on its stream after the peer copy
    used: bool = False


class Download:
    """A device-to-host copy issued on the stream; `result()` waits for it."""

    def __init__(self, backend: CudaBackend, host: int, nbytes: int, event: Any) -> None:
        self._backend, self._host, self._nbytes, self._event = backend, host, nbytes, event
        self._value: np.ndarray | None = None
        # dropped unread, its pinned buffer goes back to the pool once the copy has landed
        self._unread = weakref.finalize(self, backend._pinned_dropped, host, nbytes, event)
        self._unread.atexit = False

    def result(self) -> np.ndarray:
        if self._value is None:
            if self._backend.closed:
                raise BackendError(f"the cuda backend of device {self._backend.index} was "
                                   "closed before this download was read")
            self._event.sync()
            self._value = np.empty(self._nbytes, dtype=np.uint8)
            ctypes.memmove(self._value.ctypes.data, self._host, self._nbytes)  # one copy
            self._unread.detach()
            self._backend._pinned_release(self._host, self._nbytes, self._event)
        return self._value


@attrs.define(eq=False)
class _Held:
    """What a CudaBackend gives back on close or collection: device allocations, pinned host
    buffers, loaded modules, the cuBLAS handle, all in the backend's context."""

    ctx: Any
    allocations: list
    pinned: list
    modules: dict
    blas: Any = None

    def release(self) -> None:
        try:
            check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        except BackendError:
            return  # the context is gone: so is everything it held
        _active[0] = None
        cu.cuCtxSynchronize()  # nothing in flight may still use what is freed below
        for allocation in self.allocations:
            if allocation.ptr:
                cu.cuMemFree(cu.CUdeviceptr(allocation.ptr))
                allocation.ptr = 0
        self.allocations.clear()
        for host in self.pinned:
            cu.cuMemFreeHost(host)
        self.pinned.clear()
        for module in self.modules.values():
            cu.cuModuleUnload(module)
        self.modules.clear()
        if self.blas is not None:
            self.blas.close()
            self.blas = None


class CudaBackend(Backend):
    """One GPU. `CudaBackend(device=0)`; a Chain makes one per device it uses."""

    name = "cuda"
    graphs = True

    def __init__(self, device: int = 0) -> None:
        self._open_device(device)
        self._modules: dict[str, Path] = {}
        self._loaded: dict[str, Any] = {}  # module sha256 -> CUmodule
        self._functions: dict[tuple[str, str | None], Any] = {}
        self._allocations: list[Allocation] = []
        self._pinned_all: list[int] = []  # every pinned host buffer, free or lent
        # what close() (or the collector) gives back; it must not hold the backend itself
        self._held: _Held | None = _Held(self.ctx, self._allocations, self._pinned_all,
                                         self._loaded)
        self._finalizer = weakref.finalize(self, self._held.release)
        self._finalizer.atexit = False  # at exit the process gives everything back
        self._open_blas()
        self._gemv: gemv.Gemv | bool | None = None  # loaded at the first GEMM site
        self._open_pinned()
        self._landings: dict[tuple[int, int], _Landing] = {}  # peer copies' landing buffers
        self.launches = 0
        self.pdl = PDL  # may be switched per backend (benchmarks compare both in one run)
        self.after_kernel = False  # the stream's last operation is a kernel launched here
        self.capturing = False  # launches go into a CUDA graph (the only place they overlap)
        self.overlapped = 0  # launches made with programmatic stream serialization
        # the batched decode's split attention pipelined (runtime/backends/attention_pipe.py);
        # pipe_columns: the fewest (sequence, kv head) columns a launch goes out pipelined at,
        # None: the multiprocessor count (the GPU tests lower it for small models)
        self.pipe_attention = attention_pipe.ENABLED
        self.pipe_columns: int | None = None
        self.piped = 0  # pipelined launches made
        # every GEMM row-invariant (the default; False only for the benches' A/B, set before a
        # Session loads): rewrite_launchers puts `_invariant_extern` in each extern site's place
        self.invariant = gemv.INVARIANT
        self._lt: Lt | None = None
        self.gemm_paths: dict[int, str] = {}  # site number -> "gemv" | "pinned" | "cublas"

    def _open_device(self, device: int) -> None:
        """The device, its primary context (current on this thread) and the backend's stream."""
        problem = available()
        if problem:
            raise BackendError(problem)
        try:
            count = len(Device.get_all_devices())
        except Exception as err:  # noqa: BLE001 - cuda.core raises its own error types
            raise BackendError(f"cannot list CUDA devices: {err}") from None
        if not 0 <= device < count:
            raise BackendError(f"there is no CUDA device {device} (this machine has {count})")
        self.index = device
        self.device = Device(device)
        self.device.set_current()
        self.ctx = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        _active[0] = weakref.ref(self)
        self.stream = self.device.create_stream(options=StreamOptions(nonblocking=True))
        self.stream_handle = self.stream.handle
        self._launch_stream = self.stream_handle  # the capture stream while capturing

    def _open_blas(self) -> None:
        """cuBLAS on the stream with its workspace, or why not (the GEMM externs say it)."""
        self._workspace = self.allocate(32 << 20)
        self.blas: Blas | None = None
        self._blas_error: str | None = None
        try:
            self.blas = Blas(int(self.stream_handle), self._workspace.ptr)
            self._held.blas = self.blas
        except (CublasError, OSError) as err:
            self._blas_error = str(err)

    def _open_pinned(self) -> None:
        """The ring of pinned upload slots, and the pools downloads take host buffers from."""
        self._slots = [self._pinned(SLOT_BYTES) for _ in range(SLOTS)]
        self._slot_events = [self.device.create_event() for _ in range(SLOTS)]
        self._slot_used = [False] * SLOTS
        self._next_slot = 0
        self._pinned_free: dict[int, list[int]] = {}
        self._pinned_landing: list[tuple[int, int, Any]] = []  # dropped downloads' buffers

    def __repr__(self) -> str:
        return f"CudaBackend(device {self.index}: {self.device.name})"

    # ------------------------------------------------------------------------ context

    def activate(self) -> None:
        """Make this device's context current (a no-op when it already is)."""
        current = _active[0]
        if current is None or current() is not self:
            if self._held is None:
                raise BackendError(f"the cuda backend of device {self.index} is closed")
            # The device's primary context, taken once by cuda.core at construction; the
            # driver call alone is the cheapest switch (cuBLAS follows the current context).
            check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
            _active[0] = weakref.ref(self)

    def close(self) -> None:
        """Give back what this backend holds once its stream is done: its device memory, its
        pinned host buffers, its modules and its cuBLAS handle. After it, every use of the
        backend is an error (a download taken before stays readable). A backend nobody holds
        any more does the same when it is collected, so a dropped Chain frees its GPU."""
        if self._held is None:
            return
        self.activate()
        self.stream.sync()
        self._finalizer()
        self._held = None
        if _active[0] is not None and _active[0]() is self:
            _active[0] = None

    @property
    def closed(self) -> bool:
        return self._held is None

    # ------------------------------------------------------------------------ memory

    def allocate(self, nbytes: int) -> Allocation:
        self.activate()
        size = max(int(nbytes), 1)
        ptr = int(check(cu.cuMemAlloc(size), f"cuMemAlloc({size} bytes)"))
        check(cu.cuMemsetD8Async(cu.CUdeviceptr(ptr), 0, size, self.stream_handle),
              "cuMemsetD8Async")
        allocation = Allocation(ptr, int(nbytes), self.index)
        self._allocations.append(allocation)
        return allocation

    def free_bytes(self) -> int | None:
        self.activate()
        free, _total = check(cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free)

    def device_bytes(self, nbytes: int) -> int:
        """cuMemAlloc's rounding: past a small size an allocation takes whole 2 MiB pages;
        below it the driver packs allocations at 512-byte alignment."""
        unit = LARGE_PAGE if nbytes > SMALL_ALLOCATION else SMALL_ALIGN
        return -(-max(int(nbytes), 1) // unit) * unit

    def free(self, allocation: Any) -> None:
        if not isinstance(allocation, Allocation) or allocation.ptr == 0 or self.closed:
            return
        self.activate()
        self.stream.sync()
        check(cu.cuMemFree(cu.CUdeviceptr(allocation.ptr)), "cuMemFree")
        allocation.ptr = 0
        if allocation in self._allocations:
            self._allocations.remove(allocation)

    def pointer(self, allocation: Allocation, offset: int) -> int:
        if not 0 <= offset <= allocation.nbytes:
            raise BackendError(f"offset {offset} is outside an allocation of "
                               f"{allocation.nbytes} bytes")
        return allocation.ptr + int(offset)

    def address(self, pointer: int) -> int:
        return int(pointer)

    def _pinned(self, nbytes: int) -> int:
        host = int(check(cu.cuMemAllocHost(nbytes), f"cuMemAllocHost({nbytes} bytes)"))
        self._pinned_all.append(host)
        return host

    def stream_joined(self) -> None:
        self.after_kernel = False

    def upload(self, allocation: Allocation, offset: int, data: np.ndarray) -> None:
        self.activate()
        self.after_kernel = False
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        n = data.size
        if n == 0:
            return
        if offset < 0 or offset + n > allocation.nbytes:
            raise BackendError(f"writing {n} bytes at {offset} overruns an allocation of "
                               f"{allocation.nbytes} bytes")
        dst = cu.CUdeviceptr(allocation.ptr + offset)
        if n > SLOT_BYTES:  # big (weights): copy from pageable memory on the stream, then wait
            # (a plain cuMemcpyHtoD may return before its DMA lands and is not ordered with
            # this non-blocking stream, so kernels issued next could read stale bytes)
            check(cu.cuMemcpyHtoDAsync(dst, data.ctypes.data, n, self.stream_handle),
                  "cuMemcpyHtoDAsync")
            self.stream.sync()
            return
        i = self._next_slot
        self._next_slot = (i + 1) % SLOTS
        if self._slot_used[i]:
            self._slot_events[i].sync()  # the slot's last copy has been read
        ctypes.memmove(self._slots[i], data.ctypes.data, n)
        check(cu.cuMemcpyHtoDAsync(dst, self._slots[i], n, self.stream_handle),
              "cuMemcpyHtoDAsync")
        self.stream.record(self._slot_events[i])
        self._slot_used[i] = True

    def pinned_buffer(self, nbytes: int) -> np.ndarray:
        """Page-locked host memory for the loader's staging (kerncc.runtime.loader)."""
        self.activate()
        host = self._pinned(int(nbytes))
        return np.ctypeslib.as_array((ctypes.c_uint8 * int(nbytes)).from_address(host))

    def free_pinned(self, buffer: np.ndarray) -> None:
        host = int(buffer.ctypes.data)
        if self.closed or host not in self._pinned_all:
            return  # close gave it back already
        self.activate()
        self._pinned_all.remove(host)
        check(cu.cuMemFreeHost(host), "cuMemFreeHost")

    def upload_async(self, allocation: Allocation, offset: int, data: np.ndarray) -> None:
        """A host-to-device copy from pinned `data` on the stream, not waited for."""
        self.activate()
        self.after_kernel = False
        n = int(data.size)
        if n == 0:
            return
        if offset < 0 or offset + n > allocation.nbytes:
            raise BackendError(f"writing {n} bytes at {offset} overruns an allocation of "
                               f"{allocation.nbytes} bytes")
        check(cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(allocation.ptr + offset), data.ctypes.data,
                                   n, self.stream_handle), "cuMemcpyHtoDAsync")

    def fence(self) -> Any:
        """An event recorded on the stream now (`sync()` waits for it)."""
        self.activate()
        self.after_kernel = False
        return self.stream.record()

    def download(self, allocation: Allocation, offset: int, nbytes: int) -> np.ndarray:
        return self.download_async(allocation, offset, nbytes).result()

    def download_async(self, allocation: Allocation, offset: int, nbytes: int) -> Download:
        self.activate()
        self.after_kernel = False
        if offset < 0 or offset + nbytes > allocation.nbytes:
            raise BackendError(f"reading {nbytes} bytes at {offset} overruns an allocation of "
                               f"{allocation.nbytes} bytes")
        host = self._pinned_take(nbytes)
        if nbytes:
            check(cu.cuMemcpyDtoHAsync(host, cu.CUdeviceptr(allocation.ptr + offset), nbytes,
                                       self.stream_handle), "cuMemcpyDtoHAsync")
        event = self.device.create_event()
        self.stream.record(event)
        return Download(self, host, nbytes, event)

    def _pinned_take(self, nbytes: int) -> int:
        self._pinned_reclaim()
        size = max(1 << 12, 1 << (max(nbytes, 1) - 1).bit_length())
        free = self._pinned_free.setdefault(size, [])
        return free.pop() if free else self._pinned(size)

    def _pinned_release(self, host: int, nbytes: int, event: Any) -> None:
        size = max(1 << 12, 1 << (max(nbytes, 1) - 1).bit_length())
        self._pinned_free.setdefault(size, []).append(host)

    def _pinned_dropped(self, host: int, nbytes: int, event: Any) -> None:
        """A download was dropped unread: its buffer is free once its copy has landed (the
        next take looks). After close the buffer is already gone."""
        if not self.closed:
            self._pinned_landing.append((host, nbytes, event))

    def _pinned_reclaim(self) -> None:
        landing, self._pinned_landing = self._pinned_landing, []
        for host, nbytes, event in landing:
            if event.is_done:
                self._pinned_release(host, nbytes, event)
            else:
                self._pinned_landing.append((host, nbytes, event))

    def copy(self, source: Allocation, source_offset: int, target: Allocation,
             target_offset: int, nbytes: int) -> None:
        self.activate()
        self.after_kernel = False
        if nbytes:
            check(cu.cuMemcpyDtoDAsync(cu.CUdeviceptr(target.ptr + target_offset),
                                       cu.CUdeviceptr(source.ptr + source_offset), nbytes,
                                       self.stream_handle), "cuMemcpyDtoDAsync")

    # ------------------------------------------------------------------------ two GPUs

    def enable_peer(self, other: CudaBackend) -> None:
        """Let this device reach `other`'s memory directly (NVLink / PCIe peer access)."""
        if other.index == self.index:
            return
        if not self.device.can_access_peer(other.device):
            raise BackendError(f"device {self.index} cannot access device {other.index}'s "
                               "memory (no peer access)")
        self.activate()
        err, = cu.cuCtxEnablePeerAccess(other.ctx, 0)
        if err not in (cu.CUresult.CUDA_SUCCESS,
                       cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
            check((err,), f"cuCtxEnablePeerAccess({self.index} -> {other.index})")

    def send(self, source: Allocation, target_backend: CudaBackend, target: Allocation,
             nbytes: int) -> None:
        """Copy `nbytes` from `source` (here) into `target` (on `target_backend`), no host wait.

        The bytes cross into a landing buffer on the receiver with a peer copy on this stream
        (after this stream's work on `source`, before its next), then the receiver's stream
        waits for them and copies them into `target` (after its own work on `target`). The
        landing is reused only once the receiver has copied it out, so neither side waits for
        the other's whole item: the sender blocks only on a landing still unread.
        """
        if nbytes == 0:
            return
        landing = target_backend._landing(target, nbytes)
        self.activate()
        self.after_kernel = target_backend.after_kernel = False
        if landing.arrived is None:  # an event belongs to the device whose stream records it
            landing.arrived = self.device.create_event(EventOptions(timing_enabled=False))
        if landing.used:
            check(cu.cuStreamWaitEvent(self.stream_handle, landing.free.handle, 0),
                  "cuStreamWaitEvent")
        check(cu.cuMemcpyPeerAsync(cu.CUdeviceptr(landing.allocation.ptr), target_backend.ctx,
                                   cu.CUdeviceptr(source.ptr), self.ctx, nbytes,
                                   self.stream_handle), "cuMemcpyPeerAsync")
        check(cu.cuEventRecord(landing.arrived.handle, self.stream_handle), "cuEventRecord")
        target_backend.activate()
        check(cu.cuStreamWaitEvent(target_backend.stream_handle, landing.arrived.handle, 0),
              "cuStreamWaitEvent")
        target_backend.copy(landing.allocation, 0, target, 0, nbytes)
        check(cu.cuEventRecord(landing.free.handle, target_backend.stream_handle),
              "cuEventRecord")
        landing.used = True

    def _landing(self, target: Allocation, nbytes: int) -> _Landing:
        key = (target.ptr, nbytes)
        found = self._landings.get(key)
        if found is None:
            found = _Landing(self.allocate(nbytes),
                             self.device.create_event(EventOptions(timing_enabled=False)))
            # The allocation is zeroed on this (the receiver's) stream, which may still be
            # busy: the sender's first copy must wait for that too, as for any later reuse.
            check(cu.cuEventRecord(found.free.handle, self.stream_handle), "cuEventRecord")
            found.used = True
            self._landings[key] = found
        return found

    # ------------------------------------------------------------------------ modules

    def add_modules(self, cubins: Mapping[str, Path]) -> None:
        self._modules.update(cubins)

    def _module(self, sha: str) -> Any:
        module = self._loaded.get(sha)
        if module is None:
            path = self._modules.get(sha)
            if path is None:
                raise BackendError(f"module {sha[:12]}… has no cubin in the bundle")
            image = np.frombuffer(Path(path).read_bytes(), dtype=np.uint8)
            self.activate()
            module = check(cu.cuModuleLoadData(image.ctypes.data),
                           f"cuModuleLoadData({Path(path).name})")
            self._loaded[sha] = module
        return module

    def _function(self, entry: str, module: str | None) -> Any:
        key = (entry, module)
        fn = self._functions.get(key)
        if fn is None:
            if module is None:
                raise BackendError(f"kernel `{entry}` names no module")
            fn = check(cu.cuModuleGetFunction(self._module(module), entry.encode()),
                       f"cuModuleGetFunction({entry})")
            self._functions[key] = fn
        return fn

    def check_kernel(self, entry: str, module: str | None) -> None:
        self._function(entry, module)

    def check_extern(self, name: str) -> None:
        if name not in GEMMS:
            raise BackendError(f"the cuda backend has no extern `{name}` "
                               f"(known: {', '.join(sorted(GEMMS))})")
        if self.blas is None:
            raise BackendError(f"extern `{name}` needs cuBLAS: {self._blas_error}")

    # ------------------------------------------------------------------------ launching

    def prepare(self, site: Site) -> Callable[[tuple[int, int, int], int, Sequence[int]], None]:
        if site.kind == "extern":
            return self._prepare_extern(site)
        if site.entry == fp8_gemv.ENTRY and fp8_gemv.TENSOR_CORES:
            tensor_cores = self._fp8_tensor_cores(site)
            if tensor_cores is not None:
                return tensor_cores
        return _KernelLaunch(self, site, self._function(site.entry, site.module))

    def _fp8_tensor_cores(self, site: Site) -> Callable | None:
        """A `gemv_fp8_bf16` site on its tensor-core form (runtime/backends/fp8_gemv.py): the
        same arguments, its own block and a grid from m; None where the site's shape or
        pointers are not fixed or not usable, or its module predates the entry (the site then
        runs as the manifest names it)."""
        if len(site.args) != 8:
            return None
        a, w, s, c, m_at, n, k, _ = site.args
        if any(isinstance(v, (VarScalar, Pack)) for v in (a, w, s, c, n, k)):
            return None
        n, k = int(n), int(k)
        if not fp8_gemv.usable(n, k, int(a), int(w)):
            return None
        entry = fp8_gemv.TC_ENTRY
        try:
            fn = self._function(entry, site.module)
        except BackendError:
            return None
        block = (fp8_gemv.TC_THREADS[entry], 1, 1)
        launch = _KernelLaunch(self, attrs.evolve(site, entry=entry, block=block), fn)
        m_var = isinstance(m_at, VarScalar)  # m is then the site's first var-dependent scalar

        def run(grid: tuple[int, int, int], shared: int, scalars: Sequence[int]) -> None:
            m = int(scalars[0]) if m_var else int(m_at)
            blocks = fp8_gemv.grid(m, n) if grid[0] > 0 else 0  # the manifest's "nothing to do"
            launch((blocks, 1, 1), shared, scalars)

        return run

    def _prepare_extern(self, site: Site) -> Callable:
        name = site.extern_name
        self.check_extern(name)
        if len(site.args) != 6:
            raise BackendError(f"extern `{name}` takes 6 arguments (A, W, C, m, n, k), "
                               f"plan.json gives {len(site.args)}")
        fixed = [a if isinstance(a, VarScalar) else int(a) for a in site.args]
        blas = self.blas
        small = self._gemv_site(name)  # decode-shaped launches (m <= gemv.MAX_M)

        def launch(grid: tuple[int, int, int], shared: int, scalars: Sequence[int]) -> None:
            values = iter(scalars)
            a, w, c, m, n, k = (next(values) if isinstance(v, VarScalar) else v for v in fixed)
            m, n, k = int(m), int(n), int(k)
            if small is not None and gemv.usable(m, n, k, a, w, c):
                overlap = self.pdl and self.capturing and self.after_kernel
                small(a, w, c, m, n, k, self._launch_stream, overlap)
                self.overlapped += overlap
                self.after_kernel = True
            else:
                blas.gemm(name, a, w, c, m, n, k)  # type: ignore[union-attr]
                self.after_kernel = self._one_kernel_behind()
            self.launches += 1

        return launch

    def rewrite_launchers(self, programs: Mapping[str, Sequence[Site]],
                          launchers: dict[int, Callable],
                          bounds: Mapping[str, Mapping[str, int]] | None = None,
                          steps: Collection[str] = ()) -> dict[int, Callable]:
        """Each GEMM site batch-invariant (`invariant`: `_invariant_extern`, given each
        program's vars at their largest, `bounds`, and whether it runs a decode step), and the
        batched decode's split attention pipelined (runtime/backends/attention_pipe.py) when
        `pipe_attention` is on; every other site as prepared."""
        if self.invariant:
            launchers = dict(launchers)
            for program, sites in programs.items():
                for site in sites:
                    if site.kind == "extern" and site.number in launchers:
                        launchers[site.number] = self._invariant_extern(
                            site, (bounds or {}).get(program, {}), program in steps)
        if not self.pipe_attention:
            return launchers
        return attention_pipe.pipe(self, self._pipe_launch,
                                   self.device.properties.multiprocessor_count, programs,
                                   launchers, self.pipe_columns)

    def _invariant_extern(self, site: Site, bounds: Mapping[str, int],
                          step: bool = False) -> Callable:
        """A GEMM site whose rows each get the same bits at every m: the path is fixed here,
        once, from the site (its shape, pointers and the most rows it can launch with), never
        from a launch's m (`bounds`: its program's vars at their largest, so a decode step's
        sites are bounded by its batch). The sites of a decode step (`step`: the batch-1
        `decode` and `decode_batch` at any batch bound, so that a sequence's step has the same
        bits alone as among 128) and other sites of at most gemv.DECODE_MAX_M rows (the
        prefill's lm_head) take kerncc's GEMV kernels unless `gemv.takes_lt` (wide or deep
        shapes); others pinned split-free cuBLASLt algorithms (runtime/backends/cublas.py
        PinnedGemm), or the GEMV kernels where cuBLASLt offers none. A shape neither takes
        (k % 8, misaligned) stays on cuBLAS, batch-shaped."""
        name = site.extern_name
        self.check_extern(name)
        fixed = [a if isinstance(a, VarScalar) else int(a) for a in site.args]
        a, w, c, _, n, k = fixed
        max_m = _max_value(fixed[3], bounds)
        shaped = not any(isinstance(v, VarScalar) for v in (a, w, c, n, k))
        small = self._gemv_site(name, invariant=True)
        if not shaped or small is None or not gemv.invariant_usable(n, k, a, w, c):
            self.gemm_paths[site.number] = "cublas"
            return self._prepare_extern(site)
        pinned = None
        if gemv.takes_lt(n, k) or not step and (max_m is None or max_m > gemv.DECODE_MAX_M):
            pinned = self._pinned_gemm(name, n, k, max_m or PREFILL_ROWS, _alignment(a, w, c))
        self.gemm_paths[site.number] = "gemv" if pinned is None else "pinned"
        m_at = fixed[3]

        def launch(grid: tuple[int, int, int], shared: int, scalars: Sequence[int]) -> None:
            m = int(scalars[0] if isinstance(m_at, VarScalar) else m_at)
            if m > 0 and pinned is not None:
                pinned(a, w, c, m, int(self._launch_stream))
                self.after_kernel = self._one_kernel_behind()
            elif m > 0:
                overlap = self.pdl and self.capturing and self.after_kernel
                small(a, w, c, m, n, k, self._launch_stream, overlap)
                self.overlapped += overlap
                self.after_kernel = True
            self.launches += 1

        return launch

    def _one_kernel_behind(self) -> bool:
        """After a library call (cuBLAS, cuBLASLt) while capturing: whether what it left at the
        capture's tail is exactly one kernel node, which the next kernel of ours may then overlap
        (it waits for that kernel's grid to finish before it reads anything, module docstring).
        A library may issue more than one operation, or none, or a copy: then the next launch is
        a plain one, as outside a capture."""
        if not (self.pdl and self.capturing):
            return False
        info = cu.cuStreamGetCaptureInfo(self._launch_stream)
        if info[0] != cu.CUresult.CUDA_SUCCESS or \
                info[1] != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
            return False
        tail = info[4]  # the nodes the next captured operation depends on
        if len(tail) != 1:
            return False
        err, kind = cu.cuGraphNodeGetType(tail[0])
        return err == cu.CUresult.CUDA_SUCCESS and \
            kind == cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL

    def _pinned_gemm(self, name: str, n: int, k: int, max_m: int, align: int) -> Any:
        """The pinned cuBLASLt GEMM of (name, n, k, max_m), or None where cuBLASLt has none."""
        try:
            if self._lt is None:
                self.activate()
                self._lt = Lt(self._workspace.ptr)
            return self._lt.pinned(name, n, k, max_m, align)
        except (CublasError, OSError):
            return None

    def _pipe_launch(self, site: Site, shared: int) -> _KernelLaunch:
        """The pipelined split kernel over `site`'s arguments (the same ABI), allowed `shared`
        bytes of dynamic shared memory."""
        launch = _KernelLaunch(self, site, self._function(attention_pipe.ENTRY, site.module))
        launch._allow_shared(shared)
        return launch

    def _gemv_site(self, name: str, invariant: bool = False) -> gemv.GemvSite | None:
        """The GEMV kernels' launcher for extern `name`, or None when their cubin is missing
        or, for the batch-shaped one (not `invariant`), KERNCC_GEMV_MAX_M turns them off:
        cuBLAS then takes every shape."""
        if name not in gemv.MODES or (gemv.MAX_M <= 0 and not invariant):
            return None
        if self._gemv is None:
            try:
                self._gemv = gemv.Gemv(check)
            except (BackendError, OSError, KeyError):
                self._gemv = False
        return self._gemv.site(name, invariant=invariant) if self._gemv else None

    def launch_kernel(self, geometry: Geometry, args: Sequence[Any]) -> None:
        raise BackendError("the cuda backend launches prepared sites only (Backend.prepare)")

    def launch_extern(self, name: str, args: Sequence[Any]) -> None:
        raise BackendError("the cuda backend launches prepared sites only (Backend.prepare)")

    def sync(self) -> None:
        self.activate()
        self.stream.sync()

    # ------------------------------------------------------------------------ graphs

    def capture(self, issue: Callable[[], None]) -> Any:
        """A CUDA graph of everything `issue()` launches (nothing runs while capturing)."""
        self.activate()
        builder = self.stream.create_graph_builder()
        builder.begin_building()
        self.after_kernel = False  # a graph's first kernel overlaps nothing
        self.capturing = True
        try:
            self._launch_stream = builder.stream.handle
            if self.blas is not None:
                self.blas.set_stream(int(self._launch_stream))
            issue()
        except BaseException:
            try:
                builder.end_building()
            finally:
                self._restore_stream()
            raise
        self._restore_stream()
        graph = builder.end_building().complete()
        graph.upload(self.stream)
        return graph

    def _restore_stream(self) -> None:
        self._launch_stream = self.stream_handle
        self.after_kernel = self.capturing = False
        if self.blas is not None:
            self.blas.set_stream(int(self.stream_handle))

    def replay(self, graph: Any) -> None:
        self.activate()
        self.after_kernel = False
        graph.launch(self.stream)

    # ------------------------------------------------------------------------ timing

    def mark(self) -> Any:
        """A timing event recorded now on the stream."""
        self.activate()
        self.after_kernel = False
        return self.stream.record(options=EventOptions(timing_enabled=True))

    @staticmethod
    def elapsed_ms(start: Any, end: Any) -> float:
        end.sync()
        return float(end - start)

    def kind(self) -> str:
        """The GPU's name and architecture and the cuBLASLt the pinned GEMMs come from."""
        cc = self.device.compute_capability
        try:
            lt = f", cuBLASLt {lt_version()}"
        except (CublasError, OSError):
            lt = ""
        return f"{self.device.name} (sm_{cc.major}{cc.minor}{lt})"

    def describe(self) -> str:
        cc = self.device.compute_capability
        return f"{self.device.name} (sm_{cc.major}{cc.minor}, device {self.index})"


class _KernelLaunch:
    """One kernel launch site: its CUfunction, geometry and parameter table, built at load.

    The parameter block holds every argument at a 16-byte aligned slot (pointers as u64,
    scalars in their width, packs as their bytes); `cuLaunchKernel` gets a table of pointers
    into it (`cuLaunchKernelEx` when the launch may overlap the kernel before: module docstring). Only the slots of var-dependent scalars are rewritten per launch (the driver
    copies parameters at launch time, so rewriting right after is safe, also while capturing).
    """

    def __init__(self, backend: CudaBackend, site: Site, fn: Any) -> None:
        self.backend, self.site, self.fn = backend, site, fn
        self.block = site.block
        self.waits = site.module in waiting_modules()
        self.config = gemv.launch_config(True) if self.waits else None
        slots: list[tuple[int, bytes]] = []
        self.var_slots: list[tuple[int, str, Any, Any]] = []
        offset = 0
        for arg in site.args:
            data, variable = _param_bytes(arg)
            slots.append((offset, data))
            self.var_slots += [(offset + at, fmt, lo, hi) for at, fmt, lo, hi in variable]
            offset += -(-max(len(data), 1) // PARAM_ALIGN) * PARAM_ALIGN
        self._check_params([len(d) for _, d in slots])
        self.storage = ctypes.create_string_buffer(max(offset, 1))
        base = ctypes.addressof(self.storage)
        for at, data in slots:
            ctypes.memmove(base + at, data, len(data))
        self.table = (ctypes.c_void_p * max(len(slots), 1))(*[base + at for at, _ in slots])
        self.params = ctypes.addressof(self.table) if slots else 0
        self.shared_allowed = 48 * 1024  # dynamic shared memory a launch may take unasked
        shared = site.shared_mem
        if isinstance(shared, int):
            self._allow_shared(shared)

    def _allow_shared(self, shared: int) -> None:
        """Raise the kernel's dynamic shared memory limit to `shared` bytes when it is over
        the default (at prepare for a constant amount, at the launch that first needs more
        for one that depends on vars)."""
        if shared > self.shared_allowed:
            check(cu.cuFuncSetAttribute(
                self.fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared), f"cuFuncSetAttribute({self.site.entry}, {shared} bytes of shared memory)")
            self.shared_allowed = shared

    def _check_params(self, sizes: list[int]) -> None:
        """The kernel's own parameter sizes (from the cubin) against plan.json's arguments."""
        getter = getattr(cu, "cuFuncGetParamInfo", None)
        if getter is None:
            return
        found = []
        for i in range(len(sizes) + 1):
            err, *_, size = getter(self.fn, i)
            if err != cu.CUresult.CUDA_SUCCESS:
                break
            found.append(int(size))
        if not found and sizes:
            return  # the driver cannot say; the launch itself will
        if len(found) != len(sizes):
            raise BackendError(f"kernel `{self.site.entry}` takes {len(found)} parameters, "
                               f"plan.json passes {len(sizes)}")
        for i, (want, have) in enumerate(zip(found, sizes)):
            if want != have:
                raise BackendError(f"parameter {i} of kernel `{self.site.entry}` is {want} "
                                   f"bytes, plan.json passes {have}")

    def __call__(self, grid: tuple[int, int, int], shared: int, scalars: Sequence[int]) -> None:
        if len(scalars) != len(self.var_slots):
            raise BackendError(f"{len(scalars)} var-dependent scalars given, the site has "
                               f"{len(self.var_slots)}")
        for (at, fmt, lo, hi), value in zip(self.var_slots, scalars):
            if lo is not None and not lo <= value <= hi:
                raise BackendError(f"{value} does not fit a `{fmt}` parameter")
            struct.pack_into(fmt, self.storage, at, value)
        gx, gy, gz = grid
        if gx <= 0 or gy <= 0 or gz <= 0:
            return  # nothing to cover
        if shared > self.shared_allowed:
            self._allow_shared(shared)
        b, backend = self.block, self.backend
        if self.waits and backend.pdl and backend.capturing and backend.after_kernel:
            self._launch_overlapping(grid, shared)
            backend.overlapped += 1
        else:
            check(cu.cuLaunchKernel(self.fn, gx, gy, gz, b[0], b[1], b[2], shared,
                                    backend._launch_stream, self.params, 0), "cuLaunchKernel")
        backend.after_kernel = True
        backend.launches += 1

    def _launch_overlapping(self, grid: tuple[int, int, int], shared: int) -> None:
        config = self.config
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = self.block
        config.sharedMemBytes = shared
        config.hStream = self.backend._launch_stream
        check(cu.cuLaunchKernelEx(config, self.fn, self.params, 0), "cuLaunchKernelEx")


def _param_bytes(arg: Any) -> tuple[bytes, list[tuple[int, str, Any, Any]]]:
    """An argument's bytes and, for var-dependent parts, (offset, format, lo, hi) to rewrite."""
    if isinstance(arg, (int, np.integer)) and not isinstance(arg, np.generic):
        return struct.pack("<Q", int(arg)), []  # a device pointer
    if isinstance(arg, np.generic):
        return arg.tobytes(), []
    if isinstance(arg, VarScalar):
        fmt, lo, hi = SCALAR_FORMATS[arg.type]
        return bytes(struct.calcsize(fmt)), [(0, fmt, lo, hi)]
    if isinstance(arg, Pack):
        data = bytearray(arg.size)
        variable = []
        for f in arg.fields:
            if isinstance(f.value, VarScalar):
                fmt, lo, hi = SCALAR_FORMATS[f.value.type]
                variable.append((f.at, fmt, lo, hi))
            else:
                data[f.at:f.at + f.width] = f.value[:f.width].ljust(f.width, b"\0")
        return bytes(data), variable
    raise BackendError(f"cannot pass {type(arg).__name__} to a kernel")


def _max_value(value: Any, bounds: Mapping[str, int]) -> int | None:
    """The most a site's scalar can be: itself, or its expression at every var's largest value
    (the expressions a plan writes grow with their vars); None where a var has no bound."""
    if not isinstance(value, VarScalar):
        return int(value)
    try:
        return evaluate(value.expr, dict(bounds))
    except KernccError:  # a var without a bound: the caller treats it as unknown
        return None


def _alignment(*pointers: int) -> int:
    """The largest power of two up to 256 that divides every pointer (cuBLASLt's candidates
    may assume 256-byte alignment unless told less)."""
    low = 256
    for p in pointers:
        low = min(low, p & -p if p else 256)
    return low


# the rows a pinned prefill algorithm is chosen for when a site's m has no bound
PREFILL_ROWS = 2048


def now() -> float:
    return time.perf_counter()
