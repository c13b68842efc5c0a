"""The backend interface: what a Session needs from a device, and how a backend is chosen.

A backend owns memory and launches; it knows nothing of manifests, plans or programs. The
Session (kerncc.runtime.session) allocates every buffer, state, arena and staging area through
`allocate`, turns (allocation, byte offset) into the pointer value a launch takes with `pointer`
(fixed once, at load), moves bytes with `upload` / `download` / `copy`, and issues launches.
Kernels and externs are looked up once per launch site at load (`check_kernel`, `check_extern`)
so that an unknown entry fails before anything runs; a backend raises `BackendError` with a
plain reason and the Session adds where (program, call, op, launch).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

if TYPE_CHECKING:
    from kerncc.runtime.launch import Site

Launcher = Callable[[tuple[int, int, int], int, Sequence[int]], None]
BACKENDS = ("cpu", "cuda")


class BackendError(Exception):
    """A backend cannot do what was asked (unknown entry, missing module, failed launch)."""


@attrs.frozen
class Geometry:
    """A kernel launch's shape, as the reference kernels receive it (`launch.grid` ...)."""

    entry: str
    module: str | None
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int = 0


class Backend(abc.ABC):
    """One device (or the host, for `cpu`): memory, copies, kernel and extern launches."""

    name: str = ""

    @abc.abstractmethod
    def allocate(self, nbytes: int) -> Any:
        """A zero-filled allocation of `nbytes` bytes."""

    def free(self, allocation: Any) -> None:
        """Give an allocation back (the default leaves it to garbage collection)."""

    @abc.abstractmethod
    def pointer(self, allocation: Any, offset: int) -> Any:
        """The value a launch takes for a pointer to byte `offset` of `allocation`."""

    @abc.abstractmethod
    def address(self, pointer: Any) -> int:
        """A pointer as the integer a `bytes<n>` pack holds."""

    def tensormap(self, pointer: Any, record: dict) -> bytes:
        """The 128-byte descriptor of a pack's `tensormap` field (cpu: zeros; no kernel reads
        it)."""
        return bytes(128)

    @abc.abstractmethod
    def upload(self, allocation: Any, offset: int, data: np.ndarray) -> None:
        """Write `data` (uint8) at byte `offset`."""

    @abc.abstractmethod
    def download(self, allocation: Any, offset: int, nbytes: int) -> np.ndarray:
        """A host copy (uint8) of `nbytes` bytes at `offset`."""

    def copy(self, source: Any, source_offset: int, target: Any, target_offset: int,
             nbytes: int) -> None:
        """Copy bytes between two allocations of this backend."""
        self.upload(target, target_offset, self.download(source, source_offset, nbytes))

    # ---- loading weights (kerncc.runtime.loader): in place, or staged in pinned memory ----

    def host_view(self, allocation: Any, offset: int, nbytes: int) -> np.ndarray | None:
        """A writable uint8 view of `nbytes` bytes at `offset` when the allocation is host
        memory (cpu), which a loader fills in place; None when it is not."""
        return None

    def pinned_buffer(self, nbytes: int) -> np.ndarray | None:
        """A host buffer (uint8) that `upload_async` copies from while the host goes on
        (page-locked on cuda), given back with `free_pinned`; None when the backend has none."""
        return None

    def free_pinned(self, buffer: np.ndarray) -> None:
        """Give back a buffer of `pinned_buffer` (every copy from it has passed a fence)."""

    def upload_async(self, allocation: Any, offset: int, data: np.ndarray) -> None:
        """Write `data` (uint8, inside a `pinned_buffer`) at byte `offset` in the order of the
        backend's work, without waiting: `data` must stay as it is until a `fence()` recorded
        after this call has passed."""
        self.upload(allocation, offset, data)

    def fence(self) -> Any:
        """A point behind everything issued so far: `fence().sync()` waits until it passed."""
        return Passed()

    def add_modules(self, cubins: Mapping[str, Path]) -> None:
        """Learn where the cubins of a stage are: {module sha256: file} (cpu: not needed)."""

    @abc.abstractmethod
    def check_kernel(self, entry: str, module: str | None) -> None:
        """Raise BackendError when kernel `entry` (of module sha256 `module`) cannot launch."""

    @abc.abstractmethod
    def check_extern(self, name: str) -> None:
        """Raise BackendError when extern `name` (without `extern:`) is unknown."""

    @abc.abstractmethod
    def launch_kernel(self, geometry: Geometry, args: Sequence[Any]) -> None:
        """Issue one kernel launch with its args in the launch's param order."""

    @abc.abstractmethod
    def launch_extern(self, name: str, args: Sequence[Any]) -> None:
        """Issue one extern launch (a GEMM) with its args in param order."""

    def sync(self) -> None:
        """Wait until every issued launch and copy has finished."""

    def free_bytes(self) -> int | None:
        """Device memory free now, in bytes; None where there is no device limit (the cpu's
        host memory). A load is refused before any allocation when its plan does not fit
        (kerncc.runtime.footprint)."""
        return None

    def device_bytes(self, nbytes: int) -> int:
        """What an allocation of `nbytes` takes of the device (its rounding)."""
        return nbytes

    # ---- what the Session uses beyond the basics (defaults: synchronous, no graphs) ----

    graphs: bool = False  # whether `capture` / `replay` work

    def activate(self) -> None:
        """Make this backend's device current (several GPUs in one process)."""

    def prepare(self, site: Site) -> Launcher:
        """A launcher for one site, built once at load: `launcher(grid, shared, scalars)`.

        The default binds the args at each launch and calls `launch_kernel` / `launch_extern`;
        a GPU backend builds the site's parameter table here instead.
        """
        if site.kind == "extern":
            name = site.extern_name

            def extern(grid: tuple[int, int, int], shared: int, scalars: Sequence[int]) -> None:
                self.launch_extern(name, site.bind(scalars))

            return extern

        def kernel(grid: tuple[int, int, int], shared: int, scalars: Sequence[int]) -> None:
            geometry = Geometry(site.entry, site.module, grid, site.block, shared)
            self.launch_kernel(geometry, site.bind(scalars))

        return kernel

    def kind(self) -> str:
        """What kind of device computes (system_fingerprint): the same kind gives the same bits
        (a GPU: its name and architecture, not its index)."""
        return self.name

    def rewrite_launchers(self, programs: Mapping[str, Sequence[Site]],
                          launchers: dict[int, Launcher],
                          bounds: Mapping[str, Mapping[str, int]] | None = None,
                          steps: Collection[str] = ()) -> dict[int, Launcher]:
        """The launchers a Session issues with, given each program's sites in order, per
        program each var's largest value in a call of it (`bounds`), and which programs run a
        decode step (`steps`: session.step_programs): a backend may put another launch that
        computes the same bits in a site's place (cuda: the pipelined decode attention,
        runtime/backends/attention_pipe.py), or fix per site what it would pick per launch
        (cuda: the GEMMs' path, so that a row's bits do not depend on the batch). The default
        issues each site as prepared."""
        return launchers

    def stream_joined(self) -> None:
        """Work other than this backend's own launches may have joined its stream (a new run,
        another library): the next launch must not overlap what came before it."""

    def download_async(self, allocation: Any, offset: int, nbytes: int) -> Any:
        """A download to take later: an object whose `result()` is the uint8 host copy."""
        return Ready(self.download(allocation, offset, nbytes))

    def capture(self, issue: Callable[[], None]) -> Any:
        """A replayable graph of what `issue()` launches (only when `graphs` is True)."""
        raise BackendError(f"the {self.name} backend has no graphs")

    def replay(self, graph: Any) -> None:
        raise BackendError(f"the {self.name} backend has no graphs")

    def mark(self) -> Any:
        """A point in this backend's timeline (host time here: everything is synchronous)."""
        return time.perf_counter()

    @staticmethod
    def elapsed_ms(start: Any, end: Any) -> float:
        return (end - start) * 1e3


class Passed:
    """A fence of a synchronous backend: everything before it is done."""

    def sync(self) -> None:
        pass


class Ready:
    """A download that is already on the host."""

    def __init__(self, value: np.ndarray) -> None:
        self.value = value

    def result(self) -> np.ndarray:
        return self.value
