"""Links: how a crossing buffer goes from one stage process straight to the next.

A link joins two stage processes (sender, receiver) by a pipe of their own; the head is never
in the way. For every item and every edge between them, in the bundle's edge order, the sender
`put`s a header (item, buffer, bytes, or `poisoned` for an item that failed before it) and the
receiver `take`s it, then `land`s the bytes in its same-named buffer before it issues the item.

* `host`: the bytes follow the header down the pipe (downloaded on the sender, uploaded on the
  receiver). Any backend; the cpu backend's only link (CI runs 2- and 3-process chains on it),
  and the cuda fallback for two stages that share one GPU (NCCL joins distinct GPUs only).
* `nccl`: the bytes go GPU to GPU by NCCL send/recv (nccl4py) on each stage's own stream, one
  two-rank communicator per link: the send is issued after the sender's launches of the item
  and before its next ones, the recv after the receiver's launches of the previous item and
  before this one's, so both are ordered by their streams like the in-process peer copies and
  no host waits for a device. Only the header crosses the pipe.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kerncc.diagnostics import KernccError

TRANSPORTS = ("auto", "host", "nccl")
NCCL_HINT = "pip install nccl4py[cu13] (or nccl4py[cu12]); or use --transport host"


def nccl_missing() -> str | None:
    """None when nccl4py imports, else why not."""
    try:
        import nccl.core  # noqa: F401
    except Exception as err:  # noqa: BLE001 - a broken install is as missing as none
        return f"nccl4py is not available ({type(err).__name__}: {err}); {NCCL_HINT}"
    return None


def link_kind(transport: str, backend: str, sender_device: int | None,
              receiver_device: int | None) -> str:
    """The link between two stages: `host` or `nccl` (`auto`: NCCL between distinct GPUs when
    nccl4py is there, else host)."""
    if transport not in TRANSPORTS:
        raise KernccError.single(f"unknown transport `{transport}` "
                                 f"(known: {', '.join(TRANSPORTS)})")
    distinct_gpus = backend == "cuda" and sender_device != receiver_device
    if transport == "host":
        return "host"
    if transport == "auto":
        return "nccl" if distinct_gpus and nccl_missing() is None else "host"
    if backend != "cuda":
        raise KernccError.single(f"--transport nccl needs the cuda backend (the stages run on "
                                 f"{backend}): use --transport host or auto")
    if not distinct_gpus:
        raise KernccError.single(f"--transport nccl joins stages on distinct GPUs, but two "
                                 f"neighbouring stages share GPU {sender_device} (NCCL takes "
                                 "one rank per GPU): give them their own --devices or use "
                                 "--transport host")
    missing = nccl_missing()
    if missing:
        raise KernccError.single(f"--transport nccl: {missing}")
    return "nccl"


def make_link(kind: str, session: Any, conn: Connection, sender: bool) -> Link:
    if kind == "nccl":
        return NcclLink(session, conn, sender)
    return HostLink(session, conn, sender)


class Link:
    """One end of a link (see the module docstring)."""

    def __init__(self, session: Any, conn: Connection, sender: bool) -> None:
        self.session, self.conn, self.sender = session, conn, sender

    def unique_id(self) -> bytes | None:
        """What the receiver needs to join the link (sender side), if anything."""
        return None

    def open(self, unique_id: bytes | None) -> None:
        """Set the link up (both ends, in the chain's one global order)."""

    def put(self, item: int, name: str, nbytes: int | None) -> None:
        """Send buffer `name`'s first `nbytes` bytes for `item`; None: the item failed. What
        can fail (a download, a size check) fails before the header goes, so that the caller
        can still send a poisoned header instead."""
        payload = self._prepare(name, nbytes) if nbytes else None
        self.conn.send((item, name, nbytes))
        if nbytes:
            self._send_bytes(payload)

    def take(self, item: int, name: str) -> Any:
        """The next crossing of this link, which must be `name` of `item`; None: poisoned."""
        got_item, got_name, nbytes = self.conn.recv()
        if (got_item, got_name) != (item, name):
            raise KernccError.single(f"stage {self.session.stage.index} expected `{name}` of "
                                     f"item {item}, but `{got_name}` of item {got_item} came")
        if nbytes is None:
            return None
        return self._recv_bytes(nbytes) if nbytes else _Empty()

    def land(self, name: str, data: Any, vars: dict[str, int]) -> None:
        """Write what `take` gave into buffer `name` (before the item's launches)."""

    def close(self) -> None:
        self.conn.close()

    def _prepare(self, name: str, nbytes: int) -> Any:
        raise NotImplementedError

    def _send_bytes(self, payload: Any) -> None:
        raise NotImplementedError

    def _recv_bytes(self, nbytes: int) -> Any:
        raise NotImplementedError


class _Empty:
    nbytes = 0


class HostLink(Link):
    """Bytes down the pipe: a download on the sender, an upload on the receiver."""

    def _prepare(self, name: str, nbytes: int) -> Any:
        s = self.session
        s.backend.activate()
        return s.backend.download(s.memory.buffer(name), 0, nbytes)

    def _send_bytes(self, payload: Any) -> None:
        self.conn.send_bytes(payload)

    def _recv_bytes(self, nbytes: int) -> Any:
        data = self.conn.recv_bytes()
        if len(data) != nbytes:
            raise KernccError.single(f"stage {self.session.stage.index}: {len(data)} bytes "
                                     f"arrived where {nbytes} were announced")
        return data

    def land(self, name: str, data: Any, vars: dict[str, int]) -> None:
        if isinstance(data, _Empty):
            return
        s = self.session
        s.backend.activate()
        s.backend.upload(s.memory.buffer(name), 0, np.frombuffer(data, dtype=np.uint8))


class _DeviceBytes:
    """`nbytes` bytes of device memory as a CUDA Array Interface (what nccl4py takes)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "strides": None,
                                         "stream": None}


class NcclPeer:
    """One end of a two-rank NCCL communicator between two stages: sends and receives a
    buffer's first bytes on the stage's stream (process and Ray placements both use it)."""

    SENDER_RANK, RECEIVER_RANK = 0, 1

    def __init__(self, session: Any, sender: bool) -> None:
        from nccl import core as nccl  # checked by the head (link_kind) before it got here

        self._nccl, self.session, self.sender = nccl, session, sender
        self.id = nccl.get_unique_id().as_bytes if sender else None
        self.comm: Any = None

    def open(self, unique_id: bytes | None) -> None:
        """Join the communicator (a collective: the other end joins at the same time)."""
        raw = self.id if self.sender else unique_id
        if raw is None:
            raise KernccError.single(f"stage {self.session.stage.index}: no NCCL id came for "
                                     "a link it receives on")
        self.session.backend.activate()
        rank = self.SENDER_RANK if self.sender else self.RECEIVER_RANK
        uid = self._nccl.UniqueId.from_bytes(raw)
        self.comm = self._nccl.Communicator.init(nranks=2, rank=rank, unique_id=uid)

    def _view(self, name: str, nbytes: int) -> _DeviceBytes:
        allocation = self.session.memory.buffer(name)
        if nbytes > allocation.nbytes:
            raise KernccError.single(f"stage {self.session.stage.index}: {nbytes} bytes of "
                                     f"`{name}` cross, but it holds {allocation.nbytes}")
        return _DeviceBytes(allocation.ptr, nbytes)

    def send(self, name: str, nbytes: int, view: _DeviceBytes | None = None) -> None:
        """Issue the send of `name`'s first bytes on the stream (after the item's launches)."""
        backend = self.session.backend
        backend.activate()
        backend.stream_joined()  # NCCL's work on the stream
        self.comm.send(view or self._view(name, nbytes), self.RECEIVER_RANK,
                       stream=int(backend.stream_handle))

    def recv(self, name: str, nbytes: int) -> None:
        """Issue the receive into `name` on the stream (before the item's launches)."""
        backend = self.session.backend
        backend.activate()
        backend.stream_joined()  # NCCL's work on the stream
        self.comm.recv(self._view(name, nbytes), self.SENDER_RANK,
                       stream=int(backend.stream_handle))


class NcclLink(Link):
    """Bytes by NCCL send/recv on the stages' streams; only the header crosses the pipe.

    No ncclCommDestroy at close: it is a collective that hangs on a dead peer, and the stage
    process is about to end, which frees the communicator anyway."""

    def __init__(self, session: Any, conn: Connection, sender: bool) -> None:
        super().__init__(session, conn, sender)
        self.peer = NcclPeer(session, sender)

    def unique_id(self) -> bytes | None:
        return self.peer.id

    def open(self, unique_id: bytes | None) -> None:
        self.peer.open(unique_id)

    def _prepare(self, name: str, nbytes: int) -> Any:
        return name, nbytes, self.peer._view(name, nbytes)

    def _send_bytes(self, payload: Any) -> None:
        self.peer.send(*payload)

    def _recv_bytes(self, nbytes: int) -> Any:
        return nbytes  # the bytes come by NCCL in `land`, on the stream

    def land(self, name: str, data: Any, vars: dict[str, int]) -> None:
        if not isinstance(data, _Empty):
            self.peer.recv(name, int(data))
