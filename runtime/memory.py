"""A stage's memory on a backend: the arena, one allocation per buffer and state, the staging.

Sizes come from plan.json (docs/bundle.md): the arena at its planned bytes; every buffer that is
not a workspace or a source at its bytes at var max; states by kind (bytes_per_token × token
capacity, bytes, bytes_per_seq × seq slots). Sources have no allocation of their own: while
derive programs run they sit in the one staging allocation at their window offsets (spec §5).
`pointer(record, program)` turns a launch record's `ptr` into the backend's pointer value.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import ml_dtypes
import numpy as np

from kerncc import manifest as m
from kerncc.diagnostics import KernccError
from kerncc.runtime.backends.base import Backend, BackendError
from kerncc.runtime.launch import PlanError

NUMPY_DTYPES: dict[str, np.dtype] = {
    "bf16": np.dtype(ml_dtypes.bfloat16), "f16": np.dtype(np.float16),
    "f32": np.dtype(np.float32), "fp8e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "fp8e8m0": np.dtype(ml_dtypes.float8_e8m0fnu), "i8": np.dtype(np.int8),
    "i32": np.dtype(np.int32), "u32": np.dtype(np.uint32), "i64": np.dtype(np.int64),
    "u64": np.dtype(np.uint64), "u8": np.dtype(np.uint8),
}

PAGE_MULTIPLE = 16
NOT_ALLOCATED = ("workspace", "source")


def numpy_dtype(dtype: str) -> np.dtype:
    return NUMPY_DTYPES[dtype]


def _dim_max(man: m.Manifest, dim: m.Dim) -> int:
    return man.vars[dim].max if isinstance(dim, str) else int(dim)


def chain_token_capacity(manifests: Iterable[m.Manifest], given: int | None = None) -> int:
    """`given`, else the largest default of the stages: one pool of page ids serves every
    stage, so every stage gets the same capacity."""
    return given or max(default_token_capacity(man) for man in manifests)


def default_token_capacity(man: m.Manifest) -> int:
    """Token slots of paged states: `seqs.max` sequences at the context bound, a multiple of 16.

    The bound comes from the page tables (inputs indexing a per-token state, shaped
    [groups, width], `stride` tokens per entry); without one, the largest var bound.
    """
    best = 0
    for buf in man.buffers.values():
        target = buf.domain.index_into if buf.domain else None
        if buf.kind not in ("input", "inout") or target not in man.states:
            continue
        if man.states[target].bytes_per_token == 0 or len(buf.shape) != 2:
            continue
        rows, width = (_dim_max(man, d) for d in buf.shape)
        best = max(best, rows * width * buf.domain.stride)
    if best == 0:
        best = max((v.max for v in man.vars.values()), default=1)
    return -(-best // PAGE_MULTIPLE) * PAGE_MULTIPLE


def state_bytes(name: str, record: dict, token_capacity: int, seq_slots: int) -> int:
    if record.get("bytes_per_token"):
        return int(record["bytes_per_token"]) * token_capacity
    if record.get("bytes"):
        return int(record["bytes"])
    if record.get("bytes_per_seq"):
        return int(record["bytes_per_seq"]) * seq_slots
    raise KernccError.single(f"state `{name}` is allocated by a host engine (`host`); "
                             "the kerncc runtime owns all of its memory")


class Memory:
    """Every allocation of one stage, and the pointers launch records name."""

    def __init__(self, backend: Backend, man: m.Manifest, plan: dict,
                 token_capacity: int) -> None:
        self.backend = backend
        self.token_capacity = token_capacity
        self.seq_slots = man.seq_slots()
        self.arena_bytes = int(plan["arena"].get("bytes", 0))
        self.arena = self._allocate("the arena", self.arena_bytes)
        self.buffer_bytes = {name: int(rec["bytes"])
                             for name, rec in plan["memory"].get("buffers", {}).items()
                             if rec.get("kind") not in NOT_ALLOCATED}
        self.buffers = {name: self._allocate(f"buffer `{name}`", n)
                        for name, n in self.buffer_bytes.items()}
        self.state_bytes = {name: state_bytes(name, rec, token_capacity, self.seq_slots)
                            for name, rec in plan["memory"].get("states", {}).items()}
        self.states = {name: self._allocate(f"state `{name}`", n)
                       for name, n in self.state_bytes.items()}
        self.staging: Any = None
        self.windows: dict[str, dict] = {}

    def _allocate(self, what: str, nbytes: int) -> Any:
        """An allocation; one the backend cannot make (a manifest may declare any size) is
        the input's problem, said as such."""
        try:
            return self.backend.allocate(nbytes)
        except (MemoryError, ValueError, OverflowError, BackendError) as err:
            raise KernccError.single(f"cannot allocate {nbytes} bytes for {what} on the "
                                     f"{self.backend.name} backend: {err}") from None

    # ------------------------------------------------------------------------ staging

    def stage(self, staging: dict) -> None:
        """Allocate the derive staging and learn the source windows."""
        self.windows = {w["source"]: w for w in staging.get("windows", [])}
        self.staging = self._allocate("the derive staging", int(staging.get("total", 0)))

    def unstage(self) -> None:
        """Free the staging: sources are gone once derive programs have run."""
        self.backend.free(self.staging)
        self.staging = None

    # ------------------------------------------------------------------------ pointers

    def allocation(self, record: dict) -> tuple[Any, int, int]:
        """(allocation, base offset, allocation bytes) of a `ptr` record's memory."""
        if "arena" in record or "scratch" in record:
            return self.arena, 0, self.arena_bytes
        if "state" in record:
            name = record["state"]
            if name not in self.states:
                raise PlanError(f"state `{name}` is not in plan.json's memory")
            return self.states[name], 0, self.state_bytes[name]
        if "buffer" in record:
            return self._buffer_allocation(record["buffer"])
        raise PlanError(f"unknown pointer {record!r}")

    def _buffer_allocation(self, name: str) -> tuple[Any, int, int]:
        if name in self.buffers:
            return self.buffers[name], 0, self.buffer_bytes[name]
        window = self.windows.get(name)
        if window is not None and self.staging is not None:
            return self.staging, int(window["offset"]), int(window["offset"]) + int(window["bytes"])
        if window is not None:
            raise PlanError(f"source `{name}` is gone: derive programs ran at load")
        raise PlanError(f"buffer `{name}` is not in plan.json's memory (nor a staged source)")

    def pointer(self, record: dict, program: str) -> Any:
        allocation, base, end = self.allocation(record)
        offset = base + int(record.get("offset", 0))
        if not 0 <= offset <= end:
            raise PlanError(f"pointer {record!r} lands at byte {offset} of {end}")
        try:
            return self.backend.pointer(allocation, offset)
        except BackendError as err:
            raise PlanError(str(err)) from None

    def address(self, pointer: Any) -> int:
        return self.backend.address(pointer)

    def tensormap(self, pointer: Any, record: dict) -> bytes:
        return self.backend.tensormap(pointer, record)

    # ------------------------------------------------------------------------ bytes

    def buffer(self, name: str) -> Any:
        return self.buffers[name]
