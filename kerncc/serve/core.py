"""The engine core: an Engine (kerncc.serve.engine) behind ZeroMQ sockets, for front ends in
other processes (kerncc.serve.client; `kerncc serve --api-workers N`).

The engine's loop runs on the calling thread (`Core.run`) and owns scheduling, the KV pool and
the model runner as in one process; the core adds two things around it:

- a receiving thread that reads the front ends' messages (kerncc.serve.wire) off one PULL
  socket and queues them into the engine (`Engine.submit` never blocks); a request the engine
  refuses (queue full, stopping, a field out of bounds) is answered at once from this thread,
  as are `hello` (the model's bounds) and, every HEARTBEAT seconds, the engine's counters;
- after every turn of the engine's loop, what the listeners heard in that turn (every
  request's new tokens, logprobs and ends) goes out as one `step` message per front end that
  has news, with the counters.

Requests are keyed by (worker, the front end's id) and their news go back to the worker that
sent them. A message that is not of the format is logged and dropped; a front end that says
`hello` again (restarted) has its old requests cancelled.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import attrs
import zmq

from kerncc.diagnostics import KernccError
from kerncc.runtime.backends.fingerprint import of_runner
from kerncc.serve import grammar, wire
from kerncc.serve.engine import Engine, QueueFull, Request, Stopped, refusal_of

LOG = logging.getLogger("kerncc.serve")
POLL_MS = 100  # the receiving thread's wait for a message before it looks at the clock
HEARTBEAT = 0.1  # seconds between counters sent while nothing else goes out
LINGER_MS = 2000  # the last messages' time to leave when the core closes


class _Sink:
    """One request's listener in the core: its news wait in the core's outbox for the end of
    the engine's turn."""

    def __init__(self, core: Core, worker: int, fid: int) -> None:
        self.core, self.worker, self.fid = core, worker, fid
        self.told = 0  # tokens sent so far (the index of the next one's logprobs)

    def _record(self) -> list[Any]:
        news = self.core._news.setdefault(self.worker, {})
        return news.setdefault(self.fid, [self.fid, [], [], None])

    def token(self, request: Request, token: int) -> None:
        record = self._record()
        record[1].append(int(token))
        heard = getattr(request.sampler, "heard", None)
        if heard and len(heard) > self.told:
            h = heard[self.told]
            record[2].append([int(h.token), float(h.logprob), [[int(t), float(lp)]
                                                                for t, lp in h.top]])
        self.told += 1

    def done(self, request: Request) -> None:
        score = float(getattr(request.sampler, "cumulative", 0.0))
        self._record()[3] = [request.finish or "cancelled", request.error, None, score]
        self.core._forget(self.worker, self.fid)


class Core:
    """An engine served to front ends over ZeroMQ (see the module docstring): `inbox` the
    address it binds for their messages, `outboxes[i]` worker i's address; `text` the
    tokenizer grammars are built for."""

    def __init__(self, engine: Engine, inbox: str, outboxes: list[str], text: Any = None,
                 context: zmq.Context | None = None) -> None:
        self.engine, self.text = engine, text
        self.context = context or zmq.Context.instance()
        self.pull = self.context.socket(zmq.PULL)
        self.pull.bind(inbox)
        # one pair of sockets to each worker: the engine's thread sends on `steps`, the
        # receiving thread on `replies` (a ZeroMQ socket belongs to one thread)
        self.steps = [self._push(address) for address in outboxes]
        self.replies = [self._push(address) for address in outboxes]
        self._news: dict[int, dict[int, list[Any]]] = {}
        self._owned: dict[tuple[int, int], Request] = {}
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._grammars: grammar.Grammars | None = None
        self.dropped = 0  # messages refused as not of the format (tests read it)
        self._receiver = threading.Thread(target=self._receive, name="kerncc-core-inbox",
                                          daemon=True)

    def _push(self, address: str) -> zmq.Socket:
        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.connect(address)
        return sock

    # ------------------------------------------------------------------------ the loop

    def run(self) -> None:
        """Serve until `stop` (the engine's loop, on this thread); the sockets close after."""
        self._receiver.start()
        try:
            self.engine.run_forever(after=self._flush)
        finally:
            self._done.set()
            self._receiver.join(5)
            for sock in (*self.steps, *self.replies, self.pull):
                sock.close()

    def stop(self) -> None:
        """Cancel every request and leave `run` (any thread)."""
        self.engine.stop()

    def stats(self) -> dict[str, Any]:
        engine = self.engine
        return {"running": engine.running, "waiting": engine.waiting,
                "free": engine.pool.free, "pages": engine.pool.pages,
                "ahead_steps": engine.ahead_steps, "cached": engine.pool.cached,
                "hit_rate": float(engine.prefix.hit_rate), "queried": engine.prefix.queried,
                "hit": engine.prefix.hit, "evictions": engine.pool.evictions,
                "fault": engine.fault}

    def info(self) -> dict[str, Any]:
        """What a front end checks requests against before it sends them."""
        model = self.engine.model
        return {"capacity": self.engine.capacity, "stride": self.engine.stride,
                "vocab": model.vocab, "limits": attrs.asdict(model.limits),
                "stats": self.stats(),
                "fingerprint": of_runner(model.runner)}

    def _flush(self) -> None:
        """The engine's turn is over: one `step` message to each worker with news."""
        if not self._news:
            return
        news, self._news = self._news, {}
        stats = self.stats()
        for worker, records in news.items():
            self._send(self.steps, worker, ["step", list(records.values()), stats])

    def _send(self, socks: list[zmq.Socket], worker: int, message: list[Any]) -> None:
        try:
            socks[worker].send(wire.encode(message), zmq.NOBLOCK)
        except zmq.Again:  # the worker is gone and its queue full: its requests end unheard
            LOG.warning("front end %d does not take messages: one dropped", worker)

    def _forget(self, worker: int, fid: int) -> None:
        with self._lock:
            self._owned.pop((worker, fid), None)

    # ------------------------------------------------------------------------ receiving

    def _receive(self) -> None:
        last = 0.0
        while not self._done.is_set():
            try:
                raw = self.pull.recv(zmq.NOBLOCK) if self.pull.poll(POLL_MS) else None
            except zmq.ZMQError as err:  # out of file descriptors, say: waited out
                LOG.warning("receiving from the front ends: %s", err)
                time.sleep(POLL_MS / 1000)
                raw = None
            if raw is not None:
                self._take(raw)
            now = time.monotonic()
            if now - last >= HEARTBEAT:
                last = now
                stats = ["stats", self.stats()]
                for worker in range(len(self.replies)):
                    self._send(self.replies, worker, stats)

    def _take(self, raw: bytes) -> None:
        """One message from a front end: applied, or logged and dropped."""
        try:
            message = wire.decode(raw, ("hello", "add", "cancel"))
            if message[1] >= len(self.replies):
                raise wire.WireError(f"worker {message[1]}: there are {len(self.replies)}")
        except wire.WireError as err:
            self.dropped += 1
            LOG.warning("refused a message from a front end: %s", err)
            return
        kind, worker = message[0], message[1]
        if kind == "hello":
            self._hello(worker)
        elif kind == "add":
            refused = [r for r in (self._add(worker, item) for item in message[2]) if r]
            if refused:
                self._send(self.replies, worker, ["step", refused, self.stats()])
        else:
            with self._lock:
                doomed = [self._owned.get((worker, fid)) for fid in message[2]]
            for request in doomed:
                if request is not None:
                    self.engine.cancel(request)

    def _hello(self, worker: int) -> None:
        """A front end (re)started: what its last life asked is cancelled; it hears the
        model's bounds."""
        with self._lock:
            old = [r for (w, _), r in self._owned.items() if w == worker]
        for request in old:
            self.engine.cancel(request)
        self._send(self.replies, worker, ["info", self.info()])

    def _add(self, worker: int, item: list[Any]) -> list[Any] | None:
        """Queue one request; its refusal record, or None."""
        fid, prompt, max_new, raw_params, stop_ids = item
        try:
            params = wire.params_in(raw_params, self._grammar)
        except wire.WireError as err:
            return [fid, [], [], ["invalid", str(err), "/sampling", 0.0]]
        sink = _Sink(self, worker, fid)
        request = Request(prompt, max_new, params, frozenset(stop_ids), sink)
        with self._lock:
            if (worker, fid) in self._owned:
                return [fid, [], [], ["invalid", f"request {fid} is already served", None, 0.0]]
            self._owned[(worker, fid)] = request
        try:
            self.engine.submit(request)
            return None
        except (QueueFull, Stopped, KernccError) as err:
            why, message, pointer = refusal_of(err)
        self._forget(worker, fid)
        return [fid, [], [], [why, message, pointer, 0.0]]

    def _grammar(self, text: str) -> grammar.Grammar:
        """A grammar's text (already checked by the front end) for this core's tokenizer."""
        if self._grammars is None:
            self._grammars = grammar.for_text(self.text, self.engine.model.vocab)
        if self._grammars is None:
            raise wire.WireError("params.grammar: this core has no tokenizer for grammars")
        return self._grammars.grammar(text)
