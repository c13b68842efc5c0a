"""One stage in its own OS process: the loop that serves the head's items (process placement).

`stage_main` is what a spawned stage process runs. It loads its stage as a `Session`, says
`hello` on its control channel (kern's Hello: stage, pid, programs, token capacity, and the
NCCL ids of the links it sends on), takes the head's `table` (the ids of the links it receives
on), opens its links and answers `ready`. Then it serves `item`s in the order they come, as the
in-process Chain does for one stage: the crossing buffers of every edge into the stage are
taken from the stage that writes them (straight from that process, never through the head),
the program is issued, and the stage's crossing buffers go straight on to the stages that read
them. Each item is answered with `done` once issued, and, by the stage that hands back the
outputs, `outputs` once they are on the host (taken when no item waits, so the device is never
idle for the host's sake). A heartbeat thread says `beat` every `beat` seconds so that the head
tells a frozen process from a busy one.

An item that fails in this stage (a domain check, a launch) is answered with `error`; the
crossing buffers of a failed item go on as `poisoned` markers, so every later stage skips the
item (as in the in-process chain, where the stages after a failure never see it) and the chain
goes on with the next item. Any failure of the process itself (loading, a broken channel) ends
it: the head sees that at once.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

import attrs
import numpy as np

from kerncc.diagnostics import KernccError
from kerncc.runtime.placement import transport

STOP, ITEM, TABLE = "stop", "item", "table"
LINK_LOST = 3  # exit status of a stage whose head or neighbour went away under it


@attrs.frozen
class StageSpec:
    """What a stage process needs to load its stage (all picklable)."""

    bundle_dir: str
    stage: int
    backend: str
    device: int | None
    checkpoint: Any
    token_capacity: int
    interpret: bool
    graphs: bool | str
    allow_nonfinite: bool  # load NaN and infinite weights unrefused
    beat: float  # seconds between heartbeats
    links_in: tuple[tuple[int, str], ...]  # (from stage, transport) of links into this stage
    links_out: tuple[tuple[int, str], ...]  # (to stage, transport)


def error_message(err: BaseException, stage: int) -> tuple[str, list]:
    """(headline, diagnostics) of an error, to cross a channel and be raised again."""
    if isinstance(err, KernccError):
        return err.headline, list(err.diagnostics)
    return f"stage {stage} failed: {type(err).__name__}: {err}", []


class _Channel:
    """The control channel to the head, shared by the serving loop and the heartbeat."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def say(self, *message: Any) -> None:
        with self.lock:
            self.conn.send(message)


def _heartbeat(channel: _Channel, beat: float, stopped: threading.Event) -> None:
    while not stopped.wait(beat):
        try:
            channel.say("beat")
        except (OSError, EOFError, ValueError):
            return


def stage_main(spec: StageSpec, conn: Connection, data_in: Mapping[int, Connection],
               data_out: Mapping[int, Connection]) -> None:
    """The body of a stage process (multiprocessing, spawn start method)."""
    channel = _Channel(conn)
    stopped = threading.Event()
    threading.Thread(target=_heartbeat, args=(channel, spec.beat, stopped), daemon=True,
                     name=f"stage {spec.stage} heartbeat").start()
    try:
        worker = _Worker(spec, channel, data_in, data_out)
    except BaseException as err:  # noqa: BLE001 - every failure to load goes to the head
        _say_quietly(channel, "fatal", *error_message(err, spec.stage))
        return
    try:
        worker.serve()
    except (EOFError, OSError):
        os._exit(LINK_LOST)  # the head or a neighbour is gone: nothing is left to answer
    finally:
        stopped.set()
        worker.close()


def _say_quietly(channel: _Channel, *message: Any) -> None:
    try:
        channel.say(*message)
    except (OSError, EOFError, ValueError):
        pass


class _Worker:
    """A loaded stage and its links: serves the head's items in order."""

    def __init__(self, spec: StageSpec, channel: _Channel, data_in: Mapping[int, Connection],
                 data_out: Mapping[int, Connection]) -> None:
        from kerncc.runtime.backends import make_backend
        from kerncc.runtime.bundle import Bundle
        from kerncc.runtime.session import Session

        self.spec, self.channel, self.k = spec, channel, spec.stage
        self.bundle = Bundle(spec.bundle_dir)
        options = {"device": spec.device} if spec.backend == "cuda" else {}
        backend = make_backend(spec.backend, **options)
        self.session = Session(self.bundle, spec.stage, backend, spec.checkpoint,
                               spec.token_capacity, spec.interpret, spec.graphs,
                               spec.allow_nonfinite)
        self.edges_in = [e for e in self.bundle.edges if e["to"] == self.k]
        self.edges_out = [e for e in self.bundle.edges if e["from"] == self.k]
        self.links_in, self.links_out, ids = self._links(data_in, data_out)
        self.outstanding: deque[tuple[int, Any]] = deque()
        channel.say("hello", self.k, os.getpid(), self.session.token_capacity,
                    sorted(self.session.sites), self.session.programs, ids)
        self._open(self._table())
        channel.say("ready", self.k)

    def _links(self, data_in: Mapping[int, Connection], data_out: Mapping[int, Connection]
               ) -> tuple[dict, dict, dict]:
        links_in = {j: transport.make_link(kind, self.session, data_in[j], sender=False)
                    for j, kind in self.spec.links_in}
        links_out = {j: transport.make_link(kind, self.session, data_out[j], sender=True)
                     for j, kind in self.spec.links_out}
        ids = {j: link.unique_id() for j, link in links_out.items() if link.unique_id()}
        return links_in, links_out, ids

    def _table(self) -> dict:
        message = self.channel.conn.recv()
        if message[0] != TABLE:
            raise KernccError.single(f"stage {self.k} expected the head's table, got "
                                     f"`{message[0]}`")
        return message[1]

    def _open(self, table: dict) -> None:
        """Open every link in one global order (sender, receiver), so collective set-ups of
        neighbouring stages never wait on each other in a cycle."""
        ids = table.get("ids", {})
        ends = [((self.k, j), link, None) for j, link in self.links_out.items()]
        ends += [((j, self.k), link, ids.get((j, self.k))) for j, link in self.links_in.items()]
        for _, link, unique_id in sorted(ends, key=lambda end: end[0]):
            link.open(unique_id)

    # ------------------------------------------------------------------------ serving

    def serve(self) -> None:
        conn = self.channel.conn
        while True:
            if self.outstanding and not conn.poll(0):
                self._hand_back(*self.outstanding.popleft())
                continue
            message = conn.recv()
            if message[0] == STOP:
                while self.outstanding:
                    self._hand_back(*self.outstanding.popleft())
                self.channel.say("stopped", self.k)
                return
            if message[0] == ITEM:
                self._item(*message[1:])

    def _item(self, item: int, program: str, vars: dict[str, int],
              inputs: dict[str, np.ndarray], outputs: bool | list[str] | None) -> None:
        """Serve one item; `outputs` is None unless this stage hands back the item's outputs
        (then it is what Session.submit takes)."""
        stage_vars = {n: v for n, v in vars.items() if n in self.session.manifest.vars}
        poisoned = self._receive(item, stage_vars)
        failed, pending = poisoned, None
        if not poisoned and program in self.session.sites:
            try:
                pending = self.session.submit(program, inputs, stage_vars,
                                              outputs=False if outputs is None else outputs)
            except Exception as err:  # noqa: BLE001 - any failure of an item is the item's
                failed = True
                self.channel.say("error", item, *error_message(err, self.k))
        self._send(item, vars, failed)
        self.channel.say("done", item)
        if pending is not None and outputs is not None:
            self.outstanding.append((item, pending))

    def _receive(self, item: int, vars: dict[str, int]) -> bool:
        """Take every edge's crossing buffer into this stage; True if the item failed earlier
        (then nothing is written: the stages after a failure never see the item)."""
        arrived = []
        for edge in self.edges_in:
            link = self.links_in[edge["from"]]
            arrived.append((edge["buffer"], link, link.take(item, edge["buffer"])))
        if any(data is None for _, _, data in arrived):
            return True
        for name, link, data in arrived:
            link.land(name, data, vars)
        return False

    def _send(self, item: int, vars: dict[str, int], failed: bool) -> None:
        """Hand every crossing buffer on; once one cannot go (the item then fails here), the
        rest go poisoned, so that every later stage skips the item."""
        for edge in self.edges_out:
            target = self.bundle.stages[edge["to"]].manifest
            target_vars = {n: v for n, v in vars.items() if n in target.vars}
            nbytes = crossing_bytes(target, edge["buffer"], target_vars)
            link = self.links_out[edge["to"]]
            try:
                link.put(item, edge["buffer"], None if failed else nbytes)
            except Exception as err:  # noqa: BLE001 - a failed crossing fails the item
                failed = True
                self.channel.say("error", item, *error_message(err, self.k))
                link.put(item, edge["buffer"], None)

    def _hand_back(self, item: int, pending: Any) -> None:
        try:
            outputs = pending.result()
        except Exception as err:  # noqa: BLE001 - a failed download fails the item
            self.channel.say("error", item, *error_message(err, self.k))
            return
        self.channel.say("outputs", item, {n: np.asarray(a) for n, a in outputs.items()})

    def close(self) -> None:
        for link in (*self.links_in.values(), *self.links_out.values()):
            link.close()


def crossing_bytes(manifest: Any, name: str, vars: Mapping[str, int]) -> int:
    """Bytes of crossing buffer `name` at `vars` as its receiving stage sizes it (unset vars
    are 1, as a Session reads them)."""
    env = {v: 1 for v in manifest.vars} | dict(vars)
    return manifest.buffers[name].nbytes(env)
