"""Slow clients: a header read timeout and a cap on connections waiting for a request.

uvicorn times out only an idle keep-alive connection (`timeout_keep_alive`), and that timer
stops at the first byte: a client that sends half a request line and stops, or a header a byte
every few seconds, holds its connection (a file descriptor) for ever, and a few hundred of them
starve everyone else. `protocol(...)` is uvicorn's h11 protocol with two guards:

- a connection gets `header_timeout` seconds from its start (or the end of its last response)
  to finish its request's headers; past them it is answered 408 (when it sent something) and
  closed;
- at most `max_waiting` connections wait for their headers: past that, those that have waited
  at least TRIM_AGE are closed, oldest first (a burst of new clients, whose requests are on the
  way, is never cut; connections held open by nobody are).

The body's timeout is the request's (kerncc.serve.http reads it within `body_timeout`); h11
bounds a request's headers to 16 KiB (its default `max_incomplete_event_size`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

HEADER_TIMEOUT = 10.0  # seconds to send a request's headers (--header-timeout)
MAX_WAITING = 128  # connections waiting for their headers (--max-waiting-connections)
TRIM_AGE = 1.0  # seconds a waiting connection is left alone even past the cap

_TIMEOUT_BODY = json.dumps({"error": {
    "message": "the request's headers did not arrive in time", "type": "invalid_request_error",
    "param": None, "code": "timeout"}}).encode()
_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(_TIMEOUT_BODY)).encode()
            + b"\r\n\r\n" + _TIMEOUT_BODY)


class Waiting:
    """The connections of one server waiting for a request's headers, oldest first."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.since: dict[Any, float] = {}  # connection -> when it began to wait

    def add(self, conn: Any, now: float) -> None:
        self.since.pop(conn, None)
        self.since[conn] = now

    def discard(self, conn: Any) -> None:
        self.since.pop(conn, None)

    def trim(self, now: float) -> None:
        """Close the oldest past the cap that have waited at least TRIM_AGE."""
        while len(self.since) > self.cap:
            oldest, began = next(iter(self.since.items()))
            if now - began < TRIM_AGE:
                return
            self.since.pop(oldest)
            oldest.drop()


def protocol(header_timeout: float = HEADER_TIMEOUT, max_waiting: int = MAX_WAITING) -> type:
    """uvicorn's h11 protocol class with the guards of the module docstring (one Waiting for
    every connection of the server that uses it)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    waiting = Waiting(max_waiting)

    class Guarded(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _heard = False  # bytes of the request awaited have come

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._wait()

        def data_received(self, data: bytes) -> None:
            self._heard = True
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._served()  # the headers are in: the request runs

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.transport.is_closing():
                return
            if self.cycle is None or self.cycle.response_complete:  # none pipelined behind
                self._wait()

        def connection_lost(self, exc: Exception | None) -> None:
            self._served()
            super().connection_lost(exc)

        def _wait(self) -> None:
            self._served()
            self._heard = False
            self._timer = self.loop.call_later(header_timeout, self._timed_out)
            waiting.add(self, self.loop.time())
            waiting.trim(self.loop.time())
            self.loop.call_later(TRIM_AGE, lambda: waiting.trim(self.loop.time()))

        def _served(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            waiting.discard(self)

        def _timed_out(self) -> None:
            self._timer = None
            waiting.discard(self)
            if self.transport.is_closing():
                return
            if self._heard:
                self.transport.write(_TIMEOUT)
            self.transport.close()

        def drop(self) -> None:
            """Closed to make room for others (Waiting.trim)."""
            self._served()
            if not self.transport.is_closing():
                self.transport.close()

    return Guarded
