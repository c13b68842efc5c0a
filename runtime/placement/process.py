"""Process placement: every stage of a bundle in its own OS process, driven by the head.

`ProcessChain` is a `Chain` to its callers (the serving engine): `submit`, `run`, `sync`,
`sessions` (one `StageView` per stage: manifest, stage, token capacity) and `programs`. The
head keeps the scheduler and the only pool, as kern's head does (spec §6.1), and runs no stage.
Each stage process is spawned (no fork of a process that holds a GPU) with a control pipe of its
own; neighbouring stages get a data link (kerncc.runtime.placement.transport). The set-up
(hello, table, ready), the items and the faults (a receiver thread reads every channel and
watches every process) are docs/runtime.md's "Placements".
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import queue
import signal
import threading
import time
import weakref
from collections.abc import Collection, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from kerncc.diagnostics import KernccError
from kerncc.runtime.bundle import Bundle, Stage
from kerncc.runtime.chain import Chain, stage_devices
from kerncc.runtime.memory import chain_token_capacity
from kerncc.runtime.placement.transport import link_kind
from kerncc.runtime.placement.worker import (ITEM, LINK_LOST, STOP, TABLE, StageSpec,
                                             stage_main)
from kerncc.runtime.session import open_bundle
from kerncc.runtime.weights import CheckpointLike

DEFAULT_TIMEOUT = 60.0  # seconds a stage may be silent or stuck (kern: 60 s)
START_TIMEOUT = 600.0  # seconds every stage has to load (weights can be large)
STOP_TIMEOUT = 5.0  # seconds a stage has to stop before it is killed


class StageView:
    """What the head knows of one stage process: what the Generator and the serving engine
    read off a Session (manifest, stage, token capacity, programs), and its pid."""

    def __init__(self, stage: Stage, token_capacity: int, sites: Sequence[str],
                 programs: Sequence[str], pid: int, backend: str, device: int | None) -> None:
        self.stage, self.manifest = stage, stage.manifest
        self.token_capacity = token_capacity
        self.sites = frozenset(sites)
        self.programs = list(programs)
        self.pid, self.backend_name, self.device = pid, backend, device

    def __repr__(self) -> str:
        where = self.backend_name if self.device is None else f"{self.backend_name}:{self.device}"
        return f"StageView(stage {self.stage.index}, pid {self.pid}, {where})"


class RemotePending:
    """A submitted item: `result()` waits for the last stage's outputs, or raises the error
    of the stage that failed it (a fault included)."""

    def __init__(self, chain: ProcessChain, item: int) -> None:
        self._chain, self.item = chain, item
        self._event = threading.Event()
        self._outputs: dict[str, np.ndarray] | None = None
        self._error: KernccError | None = None

    def _finish(self, outputs: dict[str, np.ndarray] | None = None,
                error: KernccError | None = None) -> None:
        if self._event.is_set():
            return
        self._outputs, self._error = outputs, error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def result(self) -> dict[str, np.ndarray]:
        # The receiver thread ends every item within the timeout; the loop only guards a dead
        # receiver thread (a bug), so that nothing ever waits forever.
        while not self._event.wait(0.5):
            self._chain._check_receiver()
        if self._error is not None:
            raise self._error
        return self._outputs or {}


class _Flight:
    """The head's record of one item in flight."""

    def __init__(self, pending: RemotePending, last: int, stages: int) -> None:
        self.pending, self.last = pending, last
        self.sent = time.monotonic()
        self.done_at: dict[int, float] = {}
        self.waiting = set(range(stages))
        self.failed = False

    def finished(self) -> bool:
        return not self.waiting and self.pending.done()

    def ready_at(self, k: int) -> float | None:
        """When stage k could work on this item (every earlier stage issued it)."""
        if any(j not in self.done_at for j in range(k)):
            return None
        return max([self.sent, *(self.done_at[j] for j in range(k))])


class ProcessChain(Chain):
    """Every stage of a bundle in its own process (see the module docstring)."""

    in_process = False  # inputs go with each item: none staged ahead or fed on the device

    def __init__(self, bundle: Bundle | str | os.PathLike, backend: str = "cpu",
                 checkpoint: CheckpointLike = None, token_capacity: int | None = None,
                 interpret: bool = False, devices: Sequence[int] | None = None,
                 graphs: bool | str = "auto", trace: Any = None, transport: str = "auto",
                 timeout: float = DEFAULT_TIMEOUT, start_timeout: float = START_TIMEOUT,
                 allow_nonfinite: bool = False) -> None:
        if trace is not None:
            raise KernccError.single("--trace is not recorded with --placement process yet "
                                     "(trace the thread placement)")
        if not isinstance(backend, str):
            raise KernccError.single("process placement takes a backend by name (cpu, cuda)")
        if not timeout > 0:
            raise KernccError.single(f"the stage timeout must be positive, got {timeout}")
        self.bundle = open_bundle(bundle)
        self.trace, self.items, self.timeout = None, 0, float(timeout)
        self.backend_name = backend
        stages = len(self.bundle.stages)
        self.devices = _stage_devices(backend, devices, stages)
        self.token_capacity = chain_token_capacity((s.manifest for s in self.bundle.stages),
                                                   token_capacity)
        self.kinds = {(e["from"], e["to"]): link_kind(transport, backend, self.devices[e["from"]],
                                                      self.devices[e["to"]])
                      for e in self.bundle.edges}
        self.fault: str | None = None
        self._flights: dict[int, _Flight] = {}
        self._lock = threading.Lock()
        self._closing = False
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._outboxes: list[queue.SimpleQueue] = []
        self._heard: list[float] = []
        self._progress: list[float] = []
        self._ended: set[int] = set()  # stages whose channel has closed
        _live.add(self)
        try:
            self._spawn(backend, checkpoint, interpret, graphs, allow_nonfinite)
            self.sessions = self._handshake(start_timeout)
        except BaseException:
            self.fault = "it did not start"
            self.close()
            raise
        self._receiver = threading.Thread(target=self._receive_loop, daemon=True,
                                          name="process chain receiver")
        self._receiver.start()

    def __repr__(self) -> str:
        where = sorted({f"{self.backend_name}:{d}" if d is not None else self.backend_name
                        for d in self.devices})
        links = sorted(set(self.kinds.values()))
        return (f"ProcessChain({self.bundle!r}, {len(self._procs)} processes, {', '.join(where)}"
                + (f", {'/'.join(links)} links" if links else "") + ")")

    # ------------------------------------------------------------------------ start

    def _spawn(self, backend: str, checkpoint: CheckpointLike, interpret: bool,
               graphs: bool | str, allow_nonfinite: bool) -> None:
        context = multiprocessing.get_context("spawn")
        stages = len(self.bundle.stages)
        data: dict[tuple[int, int], tuple[Connection, Connection]] = {
            pair: context.Pipe(duplex=False) for pair in sorted(self.kinds)}
        beat = min(1.0, self.timeout / 4)
        for k in range(stages):
            spec = StageSpec(str(self.bundle.dir), k, backend, self.devices[k],
                             picklable(self.bundle.checkpoint if checkpoint is None
                                        else checkpoint),
                             self.token_capacity, interpret, graphs, allow_nonfinite,
                             beat,
                             tuple((j, self.kinds[(j, t)]) for j, t in sorted(self.kinds)
                                   if t == k),
                             tuple((t, self.kinds[(f, t)]) for f, t in sorted(self.kinds)
                                   if f == k))
            ours, theirs = context.Pipe(duplex=True)
            data_in = {j: data[(j, t)][0] for j, t in data if t == k}
            data_out = {t: data[(f, t)][1] for f, t in data if f == k}
            proc = context.Process(target=stage_main, args=(spec, theirs, data_in, data_out),
                                   name=f"kerncc stage {k}", daemon=True)
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(ours)
            self._outboxes.append(queue.SimpleQueue())
        for reader, writer in data.values():  # the stages hold their own ends now
            reader.close()
            writer.close()
        now = time.monotonic()
        self._heard = [now] * stages
        self._progress = [now] * stages

    def _handshake(self, start_timeout: float) -> list[StageView]:
        hellos = self._await_all("hello", start_timeout)
        ids = {(k, j): uid for k, hello in hellos.items() for j, uid in hello[5].items()}
        for k, conn in enumerate(self._conns):
            incoming = {pair: uid for pair, uid in ids.items() if pair[1] == k}
            conn.send((TABLE, {"ids": incoming}))
        self._await_all("ready", start_timeout)
        for k in range(len(self._conns)):
            threading.Thread(target=self._send_loop, args=(k,), daemon=True,
                             name=f"process chain sender {k}").start()
        return [StageView(self.bundle.stages[k], hello[2], hello[3], hello[4],
                          self._procs[k].pid, self.backend_name, self.devices[k])
                for k, hello in sorted(hellos.items())]

    def _await_all(self, kind: str, start_timeout: float) -> dict[int, tuple]:
        """The `kind` message of every stage (heartbeats skipped); a stage that fails to load
        or dies fails the chain with its error."""
        got: dict[int, tuple] = {}
        deadline = time.monotonic() + start_timeout
        while len(got) < len(self._conns):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(len(self._conns))) - set(got))
                raise KernccError.single(f"stage {missing[0]} did not load within "
                                         f"{start_timeout:g} s")
            for k, message in self._poll(min(left, 0.5)):
                if message[0] == "fatal":
                    raise KernccError(message[1], message[2])
                if message[0] == kind:
                    got[k] = message[1:]
        # Silence counts from here: a stage is still importing before its first heartbeat.
        self._heard = [time.monotonic()] * len(self._conns)
        return got

    def _poll(self, timeout: float) -> list[tuple[int, tuple]]:
        """Messages that arrived within `timeout`. A dead stage raises a KernccError: the
        error it said before it ended (a failed load), else how it ended."""
        sentinels = {p.sentinel: k for k, p in enumerate(self._procs)}
        open_conns = [c for k, c in enumerate(self._conns) if k not in self._ended]
        by_conn = {id(c): k for k, c in enumerate(self._conns)}
        ready = wait([*open_conns, *sentinels], timeout)
        out: list[tuple[int, tuple]] = []
        for obj in ready:
            if isinstance(obj, Connection):
                out += self._drain(by_conn[id(obj)], obj)
        dead = sorted(sentinels[obj] for obj in ready if not isinstance(obj, Connection))
        if not dead:
            return out
        for k in dead:  # what a dead stage said last is still in its channel
            if k not in self._ended:
                out += self._drain(k, self._conns[k])
        fatal = next((m for _, m in out if m[0] == "fatal"), None)
        if fatal is not None:
            raise KernccError(fatal[1], fatal[2])
        raise KernccError.single(self._blame(dead))

    def _blame(self, dead: list[int]) -> str:
        """Why the chain is down: the first stage that died of its own accord, not one that
        ended because a neighbour's link closed under it (LINK_LOST)."""
        deaths = {k: self._death(k) for k in dead}
        cause = [k for k in dead if self._procs[k].exitcode != LINK_LOST] or dead
        return deaths[cause[0]]

    def _drain(self, k: int, conn: Connection) -> list[tuple[int, tuple]]:
        """Every message waiting on stage k's channel; at its end the channel is left out of
        later waits (the process's sentinel says how it ended)."""
        out = []
        try:
            while conn.poll(0):
                out.append((k, conn.recv()))
        except (EOFError, OSError):
            self._ended.add(k)
        if out:
            self._heard[k] = time.monotonic()
        return out

    def _death(self, k: int) -> str:
        proc = self._procs[k]
        proc.join(1.0)
        code = proc.exitcode
        if code is None:
            how = "closed its channel"
        elif code == LINK_LOST:
            how = "lost a link to a neighbouring stage"
        elif code < 0:
            how = f"was killed by {_signal_name(-code)}"
        else:
            how = f"exited with status {code}"
        return f"stage {k} (pid {proc.pid}) {how}"

    def _check_silence(self) -> None:
        now = time.monotonic()
        silence, k = max((now - heard, k) for k, heard in enumerate(self._heard))
        if silence >= self.timeout:  # the longest silent, should a busy machine delay others
            raise KernccError.single(
                f"stage {k} (pid {self._procs[k].pid}) stopped answering: no word for "
                f"{silence:.1f} s (timeout {self.timeout:g} s)")

    # ------------------------------------------------------------------------ serving

    def submit(self, program: str, inputs: Mapping[str, Any] | None = None,
               vars: Mapping[str, int] | None = None, rows: int | None = None,
               outputs: bool | Collection[str] = True) -> RemotePending:
        """Send `program` to every stage in order without waiting; `result()` waits for the
        outputs of the last stage that runs it (see Chain.submit)."""
        self._raise_if_down()
        inputs, vars = dict(inputs or {}), dict(vars or {})
        self._check_names(inputs, vars)
        check_vars(self.sessions, vars)
        runs = running_stages(self.sessions, program, self.programs)
        wanted = outputs if outputs is True or outputs is False else sorted(outputs)
        hosts = [{n: np.asarray(v) for n, v in inputs.items() if n in view.stage.host_inputs}
                 for view in self.sessions]
        with self._lock:  # one order of items for every stage, whatever thread submits
            item, self.items = self.items, self.items + 1
            pending = RemotePending(self, item)
            self._flights[item] = _Flight(pending, runs[-1], len(self.sessions))
            for k, host in enumerate(hosts):
                self._outboxes[k].put((ITEM, item, program, vars, host,
                                       wanted if k == runs[-1] else None))
        return pending

    def sync(self) -> None:
        """Wait until every item submitted so far is answered (or the chain is down)."""
        with self._lock:
            flights = list(self._flights.values())
        for flight in flights:
            try:
                flight.pending.result()
            except KernccError:
                pass
        self._raise_if_down()

    def _raise_if_down(self) -> None:
        if self.fault is not None:
            raise KernccError.single(f"the process chain is down: {self.fault}")
        if self._closing:
            raise KernccError.single("the process chain is closed")

    def _check_receiver(self) -> None:
        if not self._receiver.is_alive() and self.fault is None and not self._closing:
            self._fail("the head's receiver thread ended")

    # ------------------------------------------------------------------------ the threads

    def _send_loop(self, k: int) -> None:
        """Stage k's sender: a frozen stage blocks this thread, never `submit`."""
        conn, outbox = self._conns[k], self._outboxes[k]
        while True:
            message = outbox.get()
            if message is None:
                return
            try:
                conn.send(message)
            except (OSError, ValueError):
                return  # the stage is gone; the receiver reports how

    def _receive_loop(self) -> None:
        poll = min(0.5, self.timeout / 8)
        while not self._closing and self.fault is None:
            try:
                for k, message in self._poll(poll):
                    self._handle(k, message)
                self._check_silence()
                self._check_progress()
            except KernccError as err:
                self._fail(err.headline)
            except Exception as err:  # noqa: BLE001 - the receiver must never die silently
                self._fail(f"the head's receiver failed: {type(err).__name__}: {err}")

    def _handle(self, k: int, message: tuple) -> None:
        kind = message[0]
        if kind in ("beat", "stopped", "ready", "hello"):
            return
        item = message[1]
        with self._lock:
            flight = self._flights.get(item)
        if flight is None:
            return
        now = time.monotonic()
        if kind == "done":
            flight.waiting.discard(k)
            flight.done_at[k] = now
            self._progress[k] = now
        elif kind == "outputs":
            self._progress[k] = now
            flight.pending._finish(outputs=message[2])
        elif kind == "error":
            flight.failed = True
            flight.pending._finish(error=KernccError(message[2], message[3]))
        if flight.failed and not flight.waiting:
            flight.pending._finish()
        if flight.finished():
            with self._lock:
                self._flights.pop(item, None)

    def _check_progress(self) -> None:
        """A stage that could work on an item and makes no progress for `timeout` seconds."""
        now = time.monotonic()
        with self._lock:
            flights = sorted(self._flights.items())
        stuck: list[tuple[int, int, float]] = []
        for k in range(len(self._procs)):
            for item, flight in flights:
                if k in flight.waiting:
                    ready = flight.ready_at(k)
                elif k == flight.last and not flight.pending.done():
                    ready = flight.done_at.get(k)
                else:
                    continue
                if ready is not None:
                    since = now - max(ready, self._progress[k])
                    if since >= self.timeout:
                        stuck.append((k, item, since))
                break  # only the oldest item a stage owes counts
        if stuck:
            k, item, since = max(stuck)  # a stage waiting on a stuck later one is not blamed
            raise KernccError.single(f"stage {k} (pid {self._procs[k].pid}) made no progress "
                                     f"on item {item} for {since:.1f} s (timeout "
                                     f"{self.timeout:g} s)")

    # ------------------------------------------------------------------------ faults, close

    def _fail(self, message: str) -> None:
        """The chain is down: every stage dies, then every item in flight fails with `message`
        (in that order, so a caller who sees the error finds no stage process left)."""
        if self.fault is not None:
            return
        self.fault = message
        self._kill_all()
        with self._lock:
            flights = list(self._flights.values())
            self._flights.clear()
        for flight in flights:
            flight.pending._finish(error=KernccError.single(message))

    def _kill_all(self) -> None:
        """Kill and reap every stage process (the channels stay open: only `close`, with the
        receiver thread ended, closes them, so no thread ever reads a closed descriptor)."""
        for outbox in self._outboxes:
            outbox.put(None)
        for proc in self._procs:
            if proc.exitcode is None:
                proc.kill()  # SIGKILL ends a stopped (SIGSTOP) process too
        for proc in self._procs:
            proc.join(STOP_TIMEOUT)

    def close(self) -> None:
        """Stop every stage (each answers what it owes first), then reap the processes."""
        if self._closing:
            return
        if self.fault is None:
            for outbox in self._outboxes:
                outbox.put((STOP,))
                outbox.put(None)
            deadline = time.monotonic() + STOP_TIMEOUT
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        self._closing = True
        receiver = getattr(self, "_receiver", None)
        if receiver is not None and receiver is not threading.current_thread():
            receiver.join(STOP_TIMEOUT)
        self._kill_all()
        for conn in self._conns:
            conn.close()
        _live.discard(self)
        with self._lock:
            flights = list(self._flights.values())
            self._flights.clear()
        for flight in flights:
            flight.pending._finish(error=KernccError.single("the process chain was closed"))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]


def check_vars(sessions: Sequence[StageView], vars: Mapping[str, int]) -> None:
    """Var bounds, checked by the head so that a bad var fails at `submit` as in a Chain."""
    for view in sessions:
        for name, value in vars.items():
            var = view.manifest.vars.get(name)
            if var is None:
                continue
            if isinstance(value, bool) or int(value) != value or not 1 <= value <= var.max:
                raise KernccError.single(f"var `{name}` = {value} is outside [1, {var.max}]")


def running_stages(sessions: Sequence[StageView], program: str, programs: list[str]
                   ) -> list[int]:
    """The stages that run `program` (the last one hands back its outputs)."""
    runs = [k for k, view in enumerate(sessions) if program in view.sites]
    if not runs or program not in programs:
        known = ", ".join(f"`{p}`" for p in programs)
        raise KernccError.single(f"no stage has program `{program}` (they have {known})")
    return runs


def _stage_devices(backend: str, devices: Sequence[int] | None, stages: int
                   ) -> list[int | None]:
    """The GPU of every stage process, as a Chain spreads them (each stage in its own process;
    device 0 without --devices); None on the cpu backend."""
    placed = stage_devices(backend, devices, stages)
    return placed if placed is not None else [0 if backend == "cuda" else None] * stages


def picklable(checkpoint: CheckpointLike) -> Any:
    """The checkpoint as a stage process can open it (paths as strings)."""
    if isinstance(checkpoint, os.PathLike):
        return os.fspath(checkpoint)
    if isinstance(checkpoint, (list, tuple)):
        return [os.fspath(p) if isinstance(p, os.PathLike) else p for p in checkpoint]
    return checkpoint


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# Every live chain's stages are killed when the head exits, however it exits normally.
_live: weakref.WeakSet[ProcessChain] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for chain in list(_live):
        try:
            chain.close()
        except Exception:  # noqa: BLE001, S110 - the interpreter is going away
            pass
