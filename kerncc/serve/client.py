"""A front end's engine: the engine core in another process (kerncc.serve.core), reached over
ZeroMQ with the messages of kerncc.serve.wire.

`CoreClient` stands where kerncc.serve.http's Server has an Engine: `submit`, `cancel`, `stop`,
`fault`, `capacity`, `model.vocab`, the counters /metrics reads, and `run_forever`, here the
loop that receives the core's messages (on the Server's engine thread) and tells each request's
listener its tokens and end, as the engine's thread does in one process. The requests are the
front end's own `Request`s: the client fills their `generated`, `token_times`, `finish`,
`error`, and a `sampler` that holds what the core's drawer heard (logprobs, the score).

Requests are checked here (kerncc.serve.engine.check_request, against the model runner's
limits the core sent) before they leave, so a bad one is refused at once; the core checks again and may
refuse one (queue full, stopping): that request ends with finish `refused` and its reason in
`refusal(request)`. Adds and cancels made in one turn of the event loop leave as one message.

Nothing waits for ever: every receive is bounded (POLL_MS), and between them `alive()` is asked
whether the core is still there; when it is not, every request ends with an error (a 500) and
`fault` says why.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from kerncc.diagnostics import KernccError
from kerncc.runtime.model_runner import Limits
from kerncc.serve import wire
from kerncc.serve.engine import Request, Stopped, check_request
from kerncc.serve.logits import Heard

LOG = logging.getLogger("kerncc.serve")
POLL_MS = 50  # a receive's bound before the core's liveness is looked at
HELLO_TIMEOUT = 60.0  # seconds the core has to answer a front end's hello


class _Heard:
    """A request's drawer as the front end sees it: what the core's heard, and its score."""

    def __init__(self) -> None:
        self.heard: list[Heard] = []
        self.cumulative = 0.0


class CoreClient:
    """The engine core, seen from front end `worker` (see the module docstring): `inbox` the
    core's address, `outbox` this worker's; `alive()` False once the core is gone."""

    def __init__(self, inbox: str, outbox: str, worker: int = 0,
                 alive: Callable[[], bool] = lambda: True,
                 context: zmq.Context | None = None, hello_timeout: float = HELLO_TIMEOUT
                 ) -> None:
        self.worker, self.alive = worker, alive
        self.context = context or zmq.Context.instance()
        self.pull = self.context.socket(zmq.PULL)
        self.pull.bind(outbox)
        self.push = self.context.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 1000)
        self.push.connect(inbox)
        self.fault: str | None = None
        self.requests: dict[int, Request] = {}
        self._refusals: dict[int, tuple[str, str, str | None]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # the PUSH socket and the batch are shared by threads
        self._batch: dict[str, list[Any]] = {"add": [], "cancel": []}
        self._flush_at: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._stats: dict[str, Any] = {}
        self.pool = types.SimpleNamespace(free=0, pages=0, cached=0, evictions=0)
        self.prefix = types.SimpleNamespace(hit_rate=0.0, queried=0, hit=0)
        self._hello(hello_timeout)

    def _hello(self, timeout: float) -> None:
        """Say hello and wait (bounded, and while the core lives) for the model's bounds."""
        self._send(["hello", self.worker])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.alive():
            if not self.pull.poll(POLL_MS):
                continue
            try:
                message = wire.decode(self.pull.recv(), ("info", "stats", "step"))
            except wire.WireError as err:
                LOG.warning("refused a message from the engine core: %s", err)
                continue
            if message[0] == "info":
                info = message[1]
                self.capacity, self.stride = info["capacity"], info["stride"]
                self.model = types.SimpleNamespace(vocab=info["vocab"])
                self.fingerprint = info["fingerprint"]  # the core's system (system_fingerprint)
                self.limits = Limits(**info["limits"])  # what the core checks requests by
                self._take_stats(info["stats"])
                return
        self.close()
        raise KernccError.single("the engine core did not answer (it is gone, or took "
                                 f"{timeout:g} s)")

    def close(self) -> None:
        self.pull.close(0)
        with self._lock:
            self.push.close()

    # ------------------------------------------------------------------------ the Engine's face

    @property
    def running(self) -> int:
        return int(self._stats.get("running", 0))

    @property
    def waiting(self) -> int:
        return int(self._stats.get("waiting", 0))

    @property
    def ahead_steps(self) -> int:
        return int(self._stats.get("ahead_steps", 0))

    def check(self, request: Request) -> None:
        check_request(request, self.limits)

    def submit(self, request: Request) -> Request:
        """Check `request` and send it (with the others of this turn); raises KernccError, or
        Stopped once the core is gone or this front end stops."""
        self.check(request)
        if self.fault is not None or self._stopping:
            raise Stopped(self.fault or "the server is stopping")
        request.sampler = _Heard()
        with self._lock:
            request.id = next(self._ids)
            self.requests[request.id] = request
        self._queue("add", [request.id, _plain(request.prompt), request.max_new,
                            wire.params_out(request.params), sorted(request.stop_ids)])
        return request

    def cancel(self, request: Request) -> None:
        if request.id in self.requests:
            self._queue("cancel", request.id)

    def stop(self) -> None:
        """Cancel this front end's requests and leave `run_forever` once they have ended."""
        self._stopping = True
        for request in list(self.requests.values()):
            self.cancel(request)
        self._flush()

    def refusal(self, request: Request) -> tuple[str, str, str | None]:
        """(why, message, pointer) of a request the core refused (finish `refused`)."""
        return self._refusals.get(request.id, ("unavailable", "refused", None))

    # ------------------------------------------------------------------------ sending

    def _queue(self, kind: str, item: Any) -> None:
        """Batch `item` with the others of this turn of the event loop (sent when the turn
        is over); at once off the event loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            self._batch[kind].append(item)
            if loop is not None and self._flush_at is loop:
                return
            self._flush_at = loop
        if loop is None:
            self._flush()
        else:
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        with self._lock:
            batch, self._batch = self._batch, {"add": [], "cancel": []}
            self._flush_at = None
            for kind in ("add", "cancel"):  # adds first: a cancel may name one of them
                if batch[kind]:
                    self._send_locked([kind, self.worker, batch[kind]])

    def _send(self, message: list[Any]) -> None:
        with self._lock:
            self._send_locked(message)

    def _send_locked(self, message: list[Any]) -> None:
        try:
            self.push.send(wire.encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as err:  # the core is not taking messages: the liveness check ends it
            LOG.warning("the engine core does not take messages: %s", err)

    # ------------------------------------------------------------------------ receiving

    def run_forever(self, idle: float = 0.05) -> None:
        """Tell the listeners what the core sends until `stop` (every request ended) or the
        core is gone."""
        while not (self._stopping and not self.requests):
            raw = self._receive()
            if raw is not None:
                self._take(raw)
            elif not self.alive():
                self._lost("the engine core is gone")
                return

    def _receive(self) -> bytes | None:
        """The next message, or None after POLL_MS; a socket error (the process out of file
        descriptors, say) is logged and waited out, not the end of the front end."""
        try:
            return self.pull.recv(zmq.NOBLOCK) if self.pull.poll(POLL_MS) else None
        except zmq.ZMQError as err:
            LOG.warning("receiving from the engine core: %s", err)
            time.sleep(POLL_MS / 1000)
            return None

    def _take(self, raw: bytes) -> None:
        try:
            message = wire.decode(raw, ("info", "stats", "step"))
        except wire.WireError as err:
            LOG.warning("refused a message from the engine core: %s", err)
            return
        if message[0] == "step":
            now = time.perf_counter()
            for record in message[1]:
                self._record(record, now)
            self._take_stats(message[2])
        elif message[0] == "stats":
            self._take_stats(message[1])

    def _take_stats(self, stats: dict[str, Any]) -> None:
        self._stats = stats
        for name in ("free", "pages", "cached", "evictions"):
            setattr(self.pool, name, stats[name])
        self.prefix.hit_rate, self.prefix.queried, self.prefix.hit = \
            stats["hit_rate"], stats["queried"], stats["hit"]
        if stats.get("fault") and self.fault is None:
            self.fault = stats["fault"]

    def _record(self, record: list[Any], now: float) -> None:
        fid, tokens, heard, end = record
        request = self.requests.get(fid)
        if request is None:  # ended here already (the core was lost), or not ours
            return
        for h in heard:
            request.sampler.heard.append(Heard(int(h[0]), float(h[1]),
                                               tuple((int(t), float(lp)) for t, lp in h[2])))
        if tokens:
            request.generated.extend(tokens)
            request.token_times.extend([now] * len(tokens))
            told = getattr(request.listener, "tokens_at_once", None)
            if told is not None:  # one call for the step's tokens: one hand-over to the loop
                told(request, tokens)
            elif request.listener is not None:
                for token in tokens:
                    request.listener.token(request, token)
        if end is not None:
            finish, error, pointer, score = end
            request.sampler.cumulative = float(score)
            if finish in wire.REFUSALS:
                self._refusals[fid] = (finish, error or finish, pointer)
                finish = "refused"
            self._end(request, finish, error)

    def _end(self, request: Request, finish: str, error: str | None) -> None:
        self.requests.pop(request.id, None)
        request.finish, request.error = finish, error
        if request.listener is not None:
            request.listener.done(request)

    def _lost(self, why: str) -> None:
        """The core is gone: every request fails (a 500), and nothing more is admitted."""
        self.fault = why
        LOG.error("%s: %d request(s) fail", why, len(self.requests))
        for request in list(self.requests.values()):
            self._end(request, "error", f"the engine stopped: {why}")


def _plain(prompt: Sequence[int]) -> list[int]:
    """`prompt` as a list of Python ints (what msgpack packs): as it is when it is one (what
    JSON gives; a check of builtins, where converting every id took 0.4 ms a 2,100-token
    prompt), else each converted."""
    if type(prompt) is list and set(map(type, prompt)) <= {int}:
        return prompt
    return [int(t) for t in prompt]
