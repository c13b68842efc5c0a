"""Backends for timing the host on the CPU: launches that compute nothing, and a simulated
device whose work takes time on its own timeline while the host goes on, as a GPU's stream.

* `Idle`: the cpu backend with launches that do nothing and graphs that replay nothing (and
  tokens drawn on the device that are not drawn), so what is timed is the Python between
  two steps (bench/host_step.py).
* `Device(step_ms)`: `Idle` whose graph replays each keep the device busy `step_ms` after
  the work before them, queued as on a stream. The host does not wait at the replay; it waits
  when it takes an output (`download_async(...).result()`) for the device to finish what was
  issued before that download. The device's idle time between replays (`idle`) is what the
  host's work between a step's outputs and the next replay costs every step, as a GPU
  would pay it: serving on the CPU with `Device` measures it (bench/serve.py --backend sim).
  It includes how late a sleep wakes on this machine (`wake_us`, measured at the start), which
  a GPU's wait does not pay. Its timeline is kept in integer nanoseconds, so that two steps
  queued back to back end exactly two steps after the first began (in float seconds the sums
  round, and a test of that read 0.00999 for 0.01).
* `Device(step_ms, row_us)` under a `Timed` chain: a cost model in which prefill costs what it
  feeds. Every call the chain issues keeps the device busy, replayed or issued launch by
  launch (a chunk size seen once is not replayed yet): a call of a program that takes rows as
  fed (a prefill chunk, packed or not) `step_ms + rows x row_us` on each stage, any other call
  (a decode step) `step_ms` on each stage. So prefill the prefix cache skips shows as a
  shorter TTFT (bench/serve.py --prefix-cache ab). Without `row_us` a device is as above: only
  replays take time, `step_ms` each, whatever their rows.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from kerncc.protocol import model as proto
from kerncc.runtime import Chain
from kerncc.runtime.backends.cpu import CpuBackend
from kerncc.runtime.model_runner import chain_protocol


class Idle(CpuBackend):
    """The cpu backend with launches that do nothing and graphs that replay nothing."""

    graphs = True

    def __init__(self) -> None:
        self.replays: list[float] = []

    def launch_kernel(self, geometry, args) -> None:
        pass

    def launch_extern(self, name, args) -> None:
        pass

    def capture(self, issue):
        return object()

    def replay(self, graph) -> None:
        self.replays.append(time.perf_counter())

    def sample_into(self, session, buffer, output, params, counters) -> None:
        """Tokens drawn on the device (kerncc.runtime.sampling.sample_into): a launch that
        computes nothing, as every other one here (on a GPU a kernel after the step)."""


class _Later:
    """A download that is on the host once the device is done with what came before it."""

    def __init__(self, value: np.ndarray, ready_ns: int) -> None:
        self.value, self.ready_ns = value, ready_ns

    def result(self) -> np.ndarray:
        # as a wait on a stream: the interpreter lock free all the while; the sleep wakes
        # late by `Device.wake_us`, which the idle time then counts too
        left = self.ready_ns - time.perf_counter_ns()
        if left > 0:
            time.sleep(left / 1e9)
        return self.value


class Device(Idle):
    """`Idle` whose replays take `step_ms` of a device timeline (see the module doc), or, with
    `row_us` under a `Timed` chain, whose calls take `step_ms` plus `row_us` a prefill row.
    Times are `time.perf_counter_ns()` integers: `replays`, `busy_until`, `step` and `row`."""

    def __init__(self, step_ms: float, row_us: float | None = None) -> None:
        super().__init__()
        self.step = round(step_ms * 1e6)
        self.row = None if row_us is None else round(row_us * 1e3)
        self._rows: int | None = None  # prefill rows of the call `Timed` issues; None: none
        self.busy_until = 0  # when the device finishes what was issued so far
        self.gaps: list[int] = []  # nanoseconds the device waited for the host before a replay
        self._lock = threading.Lock()
        self.wake_us = self._wake_late() / 1e3

    def _wake_late(self) -> float:
        """How late a sleep of a step wakes here, in ns (median of 9): part of every idle gap."""
        late = []
        for _ in range(9):
            start = time.perf_counter_ns()
            time.sleep(self.step / 1e9)
            late.append(time.perf_counter_ns() - start - self.step)
        return float(np.median(late))

    def replay(self, graph) -> None:
        now = time.perf_counter_ns()
        if self._rows is None:  # else the call's run was charged as it began
            self._busy(now, self.step)
        self.replays.append(now)

    def _busy(self, now: int, ns: int) -> None:
        """`ns` of work queued behind what was issued before, issued at `now`."""
        with self._lock:
            if self.busy_until:
                self.gaps.append(max(0, now - self.busy_until))
            self.busy_until = max(now, self.busy_until) + ns

    @contextlib.contextmanager
    def call(self, rows: int) -> Iterator[None]:
        """While a chain issues a call of `rows` prefill rows (0: a decode step): each stage's
        run of it costs `step + rows x row`, replayed or not (`stream_joined`)."""
        if self.row is None:
            raise ValueError("a Device without row_us has no cost a row")
        self._rows = rows
        try:
            yield
        finally:
            self._rows = None

    def stream_joined(self) -> None:
        """A stage's run of a program begins (Session._execute): in a call, charge it."""
        if self._rows is not None and self.row is not None:
            self._busy(time.perf_counter_ns(), self.step + self._rows * self.row)

    def download_async(self, allocation: Any, offset: int, nbytes: int) -> Any:
        return _Later(self.download(allocation, offset, nbytes), self.busy_until)

    def idle_us(self) -> float:
        """The device's median wait for the host before a replay, in microseconds (the
        median: a pause in the load, no work to do, is no cost of the host's)."""
        with self._lock:
            return float(np.median(self.gaps)) / 1e3 if self.gaps else float("nan")

    def reset(self) -> None:
        with self._lock:
            self.gaps, self.busy_until = [], 0


class Timed(Chain):
    """A chain on one `Device` with `row_us` that tells it, for every call, the rows fed to a
    program that takes rows as fed (a prefill chunk; 0 for a decode step's programs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device = self.sessions[0].backend
        if not isinstance(self.device, Device) or self.device.row is None:
            raise ValueError("a Timed chain runs on a Device with row_us")
        protocol = chain_protocol([s.manifest for s in self.sessions])
        self.prefill = {f.name for f in protocol.forwards if f.rows == proto.VAR_ROWS}

    def submit(self, program: str, inputs: Any = None, vars: Any = None,
               rows: int | None = None, outputs: Any = True) -> Any:
        fed = (rows or 0) if program in self.prefill else 0
        with self.device.call(fed):
            return super().submit(program, inputs, vars, rows=rows, outputs=outputs)
