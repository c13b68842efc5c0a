"""The engine: sequences served together over a Session or Chain (ARCHITECTURE §9), one or many:
`kerncc serve` and `kerncc run` alike.

One loop, one thread: take new requests and cancellations, ask the scheduler for a step
(kerncc.serve.scheduler: decode for every running sequence at once through the protocol's
multi-sequence forward, prefill chunks packed across sequences when the chunk program takes
several), grant pages from the one pool (kerncc.serve.pool), issue the step's items through
the model runner (kerncc.runtime.model_runner: every input of a call, the page geometry, the
limits, the device feed), collect the oldest item's outputs, turn them into tokens (kerncc.serve.sampling_hook), finish and free.
It keeps up to `depth` items in flight (by default one per stage: a cut pipeline stays full,
since `Chain.submit` returns once issued) and waits only for the oldest.

Decoding goes a step ahead (`Config.ahead`, on): when the next step is the decode step in
flight again, the engine issues it before that step's tokens are here, its token input written
on the device from that step's token output (`ModelRunner.feeder`), so the device goes from
step to step without waiting for the host (`_go_ahead`; a grammar's row: `_draw_ahead`; the
scheduler hears of it in `_adopt_ahead`). A step's prefill chunks go ahead too: their rows are
prompt tokens, known on the host (`_chunk_ahead`, `_chunks_behind`). The tokens and logits
are a step at a time's (tests/test_serve_engine.py, the property tests,
tests/test_serve_grammar_ahead.py, tests/test_serve_engine_pace.py).

`submit`, `cancel` and `stop` may be called from any thread: they only queue a command; the
loop (`run_forever` on its own thread, or `run_until_idle` for the command line) applies it
before its next step. A request's `listener` hears each token and the end, on the engine's
thread, in order; a step's tokens once the next step is issued, so that the device does not
wait on the listeners (`tick`). A runtime error in a stage fails the requests its item
touched with a message that names the stage and the program, every other request with it,
and stops the engine (`fault` says why; no more admissions).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

import attrs
import numpy as np

from kerncc import protocol as proto
from kerncc.diagnostics import KernccError
from kerncc.runtime.backends.fingerprint import of_runner
from kerncc.runtime.chain import Chain
from kerncc.runtime.domains import is_whole
from kerncc.runtime.model_runner import (FIELDS, FLAGS, LOGITS, Feed, Limits, ModelRunner, Names,
                                         Rows, check_whole, token_ids)
from kerncc.runtime.model_runner import check_request as check_limits
from kerncc.runtime.session import Session
from kerncc.serve import sampling_hook
from kerncc.serve import scheduler as sch
from kerncc.serve.pack import Bounds
from kerncc.serve.pool import KVPool
from kerncc.serve.prefix import PrefixCache


class Listener(Protocol):
    def token(self, request: Request, token: int) -> None: ...
    def done(self, request: Request) -> None: ...


@attrs.define(eq=False)
class Request:
    """One sequence to serve: its prompt, how many tokens to generate, where they go."""

    prompt: list[int]
    max_new: int
    params: sampling_hook.Params = attrs.field(factory=sampling_hook.Params)
    stop_ids: frozenset[int] = frozenset()
    listener: Listener | None = None
    id: int = -1
    generated: list[int] = attrs.field(factory=list)
    finish: str | None = None  # stop | length | cancelled | error
    error: str | None = None
    sampler: Any = None  # the params sampling_hook.prepare made (None: greedy)
    logits: list[np.ndarray] = attrs.field(factory=list)  # with Config(logits=True)
    arrived: float = attrs.field(factory=time.perf_counter)
    token_times: list[float] = attrs.field(factory=list)
    # with Config(runs=True): (program, rows, last-row logits or None) of every call that fed
    # it, in order (the logits with Config(logits=True))
    runs: list[tuple[str, int, np.ndarray | None]] = attrs.field(factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated


class QueueFull(Exception):
    """The admission queue is at its bound: the request is refused at once."""


class Stopped(Exception):
    """The engine is stopping or stopped after a fault: no new requests."""


@attrs.frozen
class Config:
    # sequences decoded together (None: as many as one call of the decode forward takes;
    # more go in several calls a step)
    max_running: int | None = 8
    max_queue: int = 256  # requests waiting for admission before new ones are refused
    chunk: int | None = None  # prefill rows per step; default: the rows bound
    # most rows a step feeds, decodes and prefill chunks together (scheduler.Limits): None,
    # `chunk` rows of prefill beside every decode
    step_tokens: int | None = None
    # a burst's streams decode once its prompts are fed, if that is at most this many steps
    # of prefill away (scheduler.Limits.hold_steps; 0: each decodes as soon as it is primed)
    hold_steps: int = 8
    depth: int | None = None  # items in flight; default: one per stage
    logits: bool = False  # keep every token's logits row on its request (tests, debugging)
    ahead: bool = True  # decode steps issued a step ahead, tokens fed on the device
    # plain sampled requests of a decode call drawn on the device (else on the host, a step
    # at a time): the same tokens either way
    draw_on_device: bool = True
    prefix_cache: bool = True  # full prompt pages kept for later prompts (kerncc.serve.prefix)
    runs: bool = False  # keep every call that fed a request on it (`Request.runs`)


@attrs.define
class _Flight:
    item: sch.Item
    forward: proto.Forward
    pending: Any
    requests: list[Request]
    drawn: bool = False  # its sampled tokens were drawn on the device into its token output
    # the index of the call in a step of several decode calls, whose token output was kept
    # right after it for the same call of the step after (`_go_ahead`); None: not kept
    kept: int | None = None
    later: bool = False  # issued ahead, its draw still to come (`_draw_ahead`)
    early: bool = False  # prefill chunks planned while the step before ran (`_chunk_ahead`)


class Engine:
    """Continuous batching over the protocol's forwards (see the module docstring)."""

    def __init__(self, runner: Session | Chain, config: Config = Config()) -> None:
        self.model = ModelRunner(runner)
        self.pool = KVPool(self.model.pages)
        self.prefix = PrefixCache(self.pool, self.model.stride, config.prefix_cache)
        self.limits = self._limits(config)
        # positions a sequence may hold: a row issued ahead past them cannot be fed
        self._reach = min(b for b in (self.capacity, self.model.limits.context,
                                      self.limits.pages_per_seq * self.stride) if b)
        self.depth = config.depth or len(self.model.sessions)
        self.max_queue = config.max_queue
        self.keep_logits, self.keep_runs = config.logits, config.runs
        self.draw_on_device = config.draw_on_device
        self.state = sch.State((), (), self.pool.pages)
        self.requests: dict[int, Request] = {}
        self.inflight: deque[_Flight] = deque()
        self.fault: str | None = None
        self.preemptions = 0
        self.packed = 0  # chunk calls that held several sequences
        self.calls: Counter[str] = Counter()  # calls per program (counts: a server runs long)
        self.rows: Counter[str] = Counter()  # rows fed per program
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._queued = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._stopping = False
        # (request, token, or None for its end) that its listener has not heard yet (`tick`)
        self._told: deque[tuple[Request, int | None]] = deque()
        # a step ahead (`_go_ahead`): the calls the scheduler has not heard of yet
        self.ahead = config.ahead and self.model.keeps_inputs
        self.ahead_steps = 0  # decode steps issued ahead (counts: a server runs long)
        # rows issued ahead for a sequence that ended before they landed (by length, a stop
        # token, a cancel): fed, their tokens dropped
        self.dropped = 0
        self.drawn_steps = 0  # calls whose sampled tokens were drawn on the device
        self._ahead: tuple[_Flight, ...] = ()  # its calls, in issue order
        # prefill chunks planned while the step before runs (`_chunk_ahead`): a step's
        # chunks take the same rows whatever decodes ride beside them (sch.Limits.prefill_rows)
        self._early = 0  # such chunk calls in flight
        # their rows, which the step they were planned for has fed already: under a step
        # budget its own plan takes only what the budget leaves (sch.schedule)
        self._fed = 0
        self.early_steps = 0  # chunk steps planned so (counts: a server runs long)
        self._after: Callable[[], None] | None = None  # run_forever's
        # every decode batch size's graph now, not at its first step (a capture between two
        # steps stalls every stream running)
        self.model.capture_graphs(self.limits.max_running)

    # ------------------------------------------------------------------------ limits

    def _limits(self, config: Config) -> sch.Limits:
        model, protocol = self.model, self.model.protocol
        rows = protocol.rows.max
        chunk_rows = rows if config.chunk is None else config.chunk
        if not 1 <= chunk_rows <= rows:  # cut down to the bound, it would be a flag ignored
            raise KernccError.single(f"chunk {config.chunk} is outside [1, {rows}] "
                                     f"(`{protocol.rows.var}` <= {rows})")
        chunk = model.chunk_program
        packs = chunk is not None and chunk.groups > 1 and protocol.any("cu_seqlens")
        seqs = chunk.groups if packs else 1
        if chunk is None:  # prefill one row at a time through the one-row program
            chunk_rows = 1
        if config.step_tokens is not None and not (is_whole(config.step_tokens)
                                                   and config.step_tokens >= 1):
            raise KernccError.single(f"step_tokens {config.step_tokens!r}: expected a whole "
                                     "number >= 1 (rows a step feeds)")
        if not (is_whole(config.hold_steps) and config.hold_steps >= 0):
            raise KernccError.single(f"hold_steps {config.hold_steps!r}: expected a whole "
                                     "number >= 0 (steps of prefill)")
        # Without a context var nothing bounds a call's summed context but the sequences'.
        context = protocol.context.max if protocol.context else self.capacity * seqs
        decode_groups = max(1, protocol.max_groups(1)) if model.step_program else 1
        return sch.Limits(stride=model.stride, pages_per_seq=model.width or self.pool.pages,
                          decode_groups=decode_groups,
                          chunk=Bounds(chunk_rows, seqs, context),
                          max_running=max(1, config.max_running or decode_groups),
                          chunk_emits=model.chunk_emits, step_tokens=config.step_tokens,
                          hold_steps=config.hold_steps)

    @property
    def fingerprint(self) -> str:
        """The system that computes this engine's bits (`system_fingerprint`)."""
        return of_runner(self.model.runner)

    @property
    def capacity(self) -> int:
        """Most tokens one sequence may hold (page-table width, and the pool)."""
        return self.model.capacity

    @property
    def stride(self) -> int:
        """Tokens per KV page."""
        return self.model.stride

    # ------------------------------------------------------------------------ commands

    def check(self, request: Request, names: Names = FIELDS) -> None:
        """Refuse a request the engine could never serve (a KernccError naming the field as
        `names` says), and fix its sampler (its seed, for the whole sequence)."""
        check_request(request, self.model.limits, names)

    def submit(self, request: Request) -> Request:
        """Queue `request` (checked first); raises KernccError, QueueFull or Stopped."""
        self.check(request)
        with self._lock:
            if self.fault is not None or self._stopping:
                raise Stopped(self.fault or "the engine is stopping")
            waiting = self._queued + len(self.state.waiting)
            if waiting >= self.max_queue:
                raise QueueFull(f"{waiting} requests are waiting (--max-queue "
                                f"{self.max_queue})")
            self._queued += 1
            request.id = next(self._ids)
            # Queued under the lock: once `stop` holds it, every admitted request's command
            # is in the queue, and run_forever's last drain ends it.
            self._commands.put(("add", request))
        self._wake.set()
        return request

    def cancel(self, request: Request) -> None:
        """Stop serving `request` and free its pages (before the engine's next step)."""
        self._commands.put(("cancel", request))
        self._wake.set()

    def stop(self) -> None:
        """Cancel everything and leave `run_forever`."""
        with self._lock:
            self._stopping = True
        self._commands.put(("stop", None))
        self._wake.set()

    @property
    def waiting(self) -> int:
        """Requests not yet admitted (queued commands and the scheduler's queue)."""
        return len(self.state.waiting) + self._queued

    @property
    def running(self) -> int:
        return len(self.state.running)

    # ------------------------------------------------------------------------ the loop

    def run_forever(self, idle: float = 0.05, after: Callable[[], None] | None = None
                    ) -> None:
        """Serve until `stop` (or a fault, after which every request has been failed);
        `after` is called after every turn, before any wait for work (kerncc.serve.core sends
        what the listeners heard in the turn as one message); with it, a turn's tokens are
        told in that turn (`tick`)."""
        self.model.reset()  # the runner may have run other work since the engine last served
        self.prefix.forget()  # and written the pages it keeps
        self._after = after
        while not self._stopping or self.requests:
            self._wake.clear()  # before the tick: a command queued during it wakes the wait
            busy = self.tick()
            # What the turn told goes out before any wait: an idle turn still tells the
            # tokens (and ends) the turn before collected, and they must not sit out `idle`.
            if after is not None:
                after()
            if not busy:
                self._wake.wait(idle)
            if self._stopping and self.fault is None and self.requests:
                self._cancel_all()
        self._apply_commands()  # requests queued just before `stop` end too (cancelled)
        self._notify()
        self._after = None
        if after is not None:
            after()

    def run_until_idle(self) -> None:
        """Serve what was submitted until nothing is left (the command line's loop)."""
        self.model.reset()  # the runner may have run other work since the engine last served
        self.prefix.forget()  # and written the pages it keeps
        while self.tick():
            pass
        self._notify()
        if self.fault is not None:
            raise KernccError.single(self.fault)

    def tick(self) -> bool:
        """One turn of the loop; False when there was nothing to do. Listeners hear what
        happened before the turn ends, but the tokens a collect lands are told only after the
        next turn has issued the next step (`_notify`): the device is not kept waiting for
        the listeners. With the core apart (`run_forever(after=...)`) telling is one message,
        so they are told at once: the next turn's plan does not hold them back."""
        self._apply_commands()
        if self.fault is not None:
            self._notify()
            return False
        try:
            self._refresh_prefixes()
            if self._room():
                plan = sch.schedule(self.state, self.limits, self._fed)
                self._fed = 0
                if not plan.empty:
                    behind = bool(self.inflight)
                    self._issue(plan)
                    if behind:
                        self._chunks_behind(plan)
                    self._notify()
                    return True
            if self._go_ahead() or self._chunk_ahead():
                self._notify()
                return True
            self._notify()
            if self.inflight:
                flight = self.inflight.popleft()
                self._early -= flight.early
                self._collect(flight)  # told at the next turn, or now with the core apart
                if self._ahead and self.inflight and self.inflight[0] is self._ahead[0]:
                    self._draw_ahead()  # the last call of the step before it has landed
                    self._adopt_ahead()
                if self._after is not None:  # apart, telling is one message: tell at once
                    self._notify()
                return True
        except KernccError as err:
            self._fail(str(err), getattr(err, "requests", []))
            return True
        except Exception as err:  # noqa: BLE001 - a failure must end requests, never hang them
            self._fail(f"internal error: {type(err).__name__}: {err}", [])
            return True
        return False

    def _room(self) -> bool:
        """Whether the scheduler plans a step now: none issued ahead that it has not heard of
        yet, and fewer items in flight than `depth`, or, when steps go ahead, one more while
        someone waits who can be admitted (steps ahead keep the device a step busier: the
        newcomer's prefill then waits no longer than without them)."""
        if self._ahead:
            return False
        busy = len(self.inflight) - self._early  # chunks planned early are the next step's
        if busy < self.depth:
            return True
        return (self.ahead and busy == self.depth
                and sch.admits(self.state, self.limits))

    def _notify(self) -> None:
        """Tell the listeners what they have not heard yet, in the order it happened."""
        while self._told:
            request, token = self._told.popleft()
            if token is None:
                request.listener.done(request)
            else:
                request.listener.token(request, token)

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, request = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                with self._lock:
                    self._queued -= 1
                if self.fault is not None:
                    self._end(request, "error", f"the engine stopped: {self.fault}")
                    continue
                if self._stopping:
                    self._end(request, "cancelled")
                    continue
                self.requests[request.id] = request
                self.state = sch.add(self.state, request.id, len(request.prompt))
            elif kind == "cancel" and request.id in self.requests:
                self._end(request, "cancelled")

    def _cancel_all(self) -> None:
        for request in list(self.requests.values()):
            self._end(request, "cancelled")

    # ------------------------------------------------------------------------ issuing

    def _issue(self, plan: sch.Plan) -> None:
        self._share_prefixes(plan)  # before any take: a take may evict a cached page
        for victim in plan.preempted:  # recomputed later from its known tokens
            self.pool.release(victim)
            self.prefix.released(victim)
            self.preemptions += 1
        for seq_id, more in plan.grants:
            if self.pool.take(seq_id, more) is None:
                raise AssertionError("the scheduler granted pages the pool does not have")
        self.state = sch.apply(self.state, plan)
        self._sync_pool()
        kept = self.ahead and len(plan.items) > 1 and all(_full_decode(i) for i in plan.items)
        for call, item in enumerate(plan.items):
            self.inflight.append(self._submit(item, call=call if kept else None))
            self.prefix.issued(item, self._prompt_of)

    # ------------------------------------------------------------------------ prefix cache

    def _refresh_prefixes(self) -> None:
        """Tell the waiting sequences the next step may admit what the cache holds for them
        (kerncc.serve.prefix.PrefixCache.refresh)."""
        if self.state.waiting:
            self.state = self.prefix.refresh(self.state, self.limits, self._prompt_of)

    def _share_prefixes(self, plan: sch.Plan) -> None:
        """The admitted sequences hold the cached pages the plan gave them."""
        reused = dict(plan.reused)
        for seq_id in plan.admitted:
            self.prefix.admit(seq_id, reused.get(seq_id, 0), self.requests[seq_id].prompt)

    def _prompt_of(self, seq_id: int) -> list[int]:
        return self.requests[seq_id].prompt

    def _sync_pool(self) -> None:
        """The scheduler's free pages and shared counts, the pool's (only the pool knows
        which pages a release frees when prompts share pages)."""
        self.state = sch.synced(self.state, self.pool.free, self.pool.shared)

    def _submit(self, item: sch.Item, feed: Feed | None = None, call: int | None = None,
                later: bool = False) -> _Flight:
        """Issue `item`; `feed`: its token input is written on the device from the call
        before it (`_go_ahead`), not sent from the host. `call`: `item` is that call of a
        step of several decode calls, whose token output is kept for the same call of the
        step after (`ModelRunner.feeder`), where the device can feed it. `later`: its
        forward alone, its tokens drawn on the device by `_draw_ahead` (never with `call`:
        the copy is taken after the draw)."""
        requests = [self.requests[seq_id] for seq_id, _, _ in item.parts]
        rows = [Rows(r.id, r.prompt, r.generated, self.pool.held(r.id), start, n)
                for r, (_, start, n) in zip(requests, item.parts)]
        forward = self.model.forward(item.kind, len(rows))
        draws = None if later else self._draws(item, forward, requests)
        drawn = later or draws is not None
        wanted = {forward.emits} if forward.emits and item.emits else set()
        if (self.keep_logits and (item.emits or self.keep_runs)) or (
                item.emits and not drawn and any(r.sampler is not None for r in requests)):
            wanted.add(LOGITS)
        keeper = None if call is None else self.model.feeder(forward, len(rows), call)
        try:
            pending = self.model.submit(forward, rows, wanted, feed, draws, later)
            if keeper is not None:  # after the call and its draw: its tokens, as they land
                keeper.keep()
        except Exception as err:  # noqa: BLE001 - any failure of a stage fails its requests
            raise _item_error(err, forward, requests) from None
        if item.kind == "decode":
            self.model.stage_next(rows)
        self.calls[forward.name] += 1
        self.rows[forward.name] += sum(r.n for r in rows)
        self.packed += item.kind == "chunk" and len(rows) > 1
        self.drawn_steps += drawn
        return _Flight(item, forward, pending, requests, drawn,
                       kept=None if keeper is None else call, later=later)

    def _draws(self, item: sch.Item, forward: proto.Forward, requests: list[Request],
               every: bool = False) -> Any:
        """How an item's sampled tokens are drawn on the device (sampling_hook.device_draws),
        or None: on the host, or all greedy (`every`: drawn all the same). A decode step's
        rows and a chunk's first tokens alike (a chunk part short of its last prompt token,
        or a sequence no longer served because it ended while the item was issued ahead, is
        drawn greedily: its token is dropped). The counter of the token a part's last row
        (at start + n - 1) draws is its index among the generated ones, start + n - prompt,
        which the host knows before the tokens before it are here."""
        if (not item.emits or not self.draw_on_device
                or all(r.sampler is None for r in requests)
                or not self.model.draws_on_device(forward)):
            return None
        emits, served = _emits(item), self.requests
        return sampling_hook.device_draws(
            [r.sampler if r.id in emits and served.get(r.id) is r else None
             for r in requests],
            [start + n - len(r.prompt) for r, (_, start, n) in zip(requests, item.parts)],
            every)

    # ------------------------------------------------------------------------ a step ahead

    def _go_ahead(self) -> bool:
        """Issue the decode step after the one in flight before its tokens are here, each
        sequence's token fed on the device from that step's token output, when that step
        is all the scheduler would plan next: every running sequence in it, its tokens
        greedy or drawn on the device, no row past what its sequence may hold, nobody it
        would admit (a sequence that ends by length on that step's token rides along beside
        one that does not, its row's token dropped, as below). A step of several decode
        calls goes ahead call for call, each fed from the copy of its call's token output
        kept right after it (`_Flight.kept`: the calls of a step all write one output). A
        sequence whose next row starts a page gets the page now. With a grammar's row, a
        one-call step's draw waits for the one before to land (`_draw_ahead`). The
        scheduler hears of the step once the one before has landed (`_adopt_ahead`); a
        sequence that ends on that one's token (a stop token, a cancel) has its row's token
        dropped. False when it cannot go ahead."""
        if not self.ahead or self._ahead or not self.inflight:
            return False
        flights = list(self.inflight)
        if not _one_step(flights) or not all(_full_decode(f.item) for f in flights):
            return False
        requests = [r for f in flights for r in f.requests]
        parts = [p for f in flights for p in f.item.parts]
        if len(self.state.running) != len(parts) or sch.admits(self.state, self.limits):
            return False  # the scheduler would plan more than this step
        grants = []
        if any(not f.drawn and any(r.sampler is not None for r in f.requests)
               for f in flights):
            return False  # some token is drawn on the host: nothing to feed on the device
        # a grammar's next mask needs this step's token on the host: the draw comes later,
        # in a step of one call that keeps no copy (a copy is taken after the draw, and the
        # calls of a step share one logits buffer)
        later = any(sampling_hook.follows_tokens(r.sampler) for r in requests)
        if later and (len(flights) > 1 or flights[0].kept is not None):
            return False
        # A sequence that ends by length on the step in flight rides along: its row's token
        # is dropped, as a stop token's is (refusing made every step of a batch whose
        # sequences end at different steps wait for the host); only a row past what a
        # sequence may hold cannot be fed, and a step whose every sequence ends is not worth
        # a step of the device.
        served, reach, stride = self.requests, self._reach, self.stride
        held = self.pool.held
        if all(len(r.generated) + 2 > r.max_new for r in requests):
            return False
        for request, (seq_id, start, _) in zip(requests, parts):
            if served.get(seq_id) is not request or start + 2 > reach:
                return False
            if start + 1 >= len(held(seq_id)) * stride:
                grants.append((seq_id, 1))
        feeds = [self.model.feeder(f.forward, len(f.item.parts), f.kept) for f in flights]
        if None in feeds or len(grants) > self.pool.free:
            return False
        for seq_id, more in grants:
            self.pool.take(seq_id, more)
        self.state = sch.apply(self.state, sch.Plan(grants=tuple(grants)))
        ahead = []
        for flight, feed in zip(flights, feeds):
            nxt = sch.Item("decode", tuple((seq_id, start + 1, 1)
                                           for seq_id, start, _ in flight.item.parts),
                           flight.item.emits)
            ahead.append(self._submit(nxt, feed, flight.kept, later))
            self.inflight.append(ahead[-1])
        self._ahead = tuple(ahead)
        self.ahead_steps += 1
        return True

    def _chunk_ahead(self) -> bool:
        """Issue the next step's prefill chunks while the step in flight runs, when they are
        all the scheduler would plan now: their rows are prompt tokens, known on the host, so
        the device goes from this step to them without waiting, and the host plans the rest
        of the next step (the decodes, fed the tokens of the step before) while they run.
        They are the chunks `sch.schedule` would plan now (`sch.chunks`), applied at once (the
        scheduler knows them as issued), cut where the steps one at a time would cut them
        (a step's prefill rows do not depend on the decodes beside them:
        `sch.Limits.prefill_rows`). Not while someone waits (an admission would change the
        packing), a chunk planned so is in flight (one step ahead at most), the chunks would
        preempt, or their pages would leave fewer free than a page a running sequence (the
        decodes of the step after must not be starved of theirs). False when none go."""
        state = self.state
        if (not self.ahead or self._early or self._ahead or not self.inflight
                or state.waiting):
            return False
        emits = self.limits.chunk_emits
        if not any(s.prefill_left(emits) for s in state.running):
            return False
        plan = sch.chunks(state, self.limits)
        if (not plan.items or plan.preempted
                or sum(n for _, n in plan.grants) + len(state.running) > state.free):
            return False
        self._issue(plan)  # its signature kept: bench/serve_trace.py wraps it
        self._mark_early(len(plan.items))
        return True

    def _chunks_behind(self, plan: sch.Plan) -> None:
        """A plan of chunks alone, issued while a step runs (a newcomer admitted beside a
        decode step in flight), is the next step's, as `_chunk_ahead`'s chunks are: the
        decodes of that step are planned once the step in flight lands, and run right after
        the chunks, instead of after the chunks have landed and the host has heard them."""
        if (self.ahead and not self._early
                and all(item.kind == "chunk" for item in plan.items)):
            self._mark_early(len(plan.items))

    def _mark_early(self, count: int) -> None:
        for flight in itertools.islice(reversed(self.inflight), count):
            flight.early = True
            self._fed += sum(n for _, _, n in flight.item.parts)
        self._early = count
        self.early_steps += 1

    def _draw_ahead(self) -> None:
        """The step issued ahead of its draw (a grammar's row in it) is drawn now that the
        step before it has landed: each grammar has followed its token, so its mask for this
        step can be computed. Nothing was issued since its forward (its logits are the
        buffer's), and the step after, fed from its token output, is issued after this."""
        for ahead in self._ahead:
            if not ahead.later:
                continue
            ahead.later = False
            draws = self._draws(ahead.item, ahead.forward, ahead.requests, every=True)
            try:
                ahead.pending = self.model.draw(ahead.forward, ahead.pending, draws)
            except Exception as err:  # noqa: BLE001 - any failure of a stage fails its requests
                raise _item_error(err, ahead.forward, ahead.requests) from None

    def _adopt_ahead(self) -> None:
        """The step issued ahead, told to the scheduler now that the step before it has
        landed: as if it had planned it, for the sequences still served."""
        ahead, self._ahead = self._ahead, ()
        items = []
        for flight in ahead:
            parts = tuple(p for p, r in zip(flight.item.parts, flight.requests)
                          if self.requests.get(r.id) is r)
            self.dropped += len(flight.item.parts) - len(parts)
            if parts:
                items.append(sch.Item("decode", parts, tuple(seq_id for seq_id, _, _ in parts)))
        if items:
            self.state = sch.apply(self.state, sch.Plan(items=tuple(items)))

    # ------------------------------------------------------------------------ collecting

    def _collect(self, flight: _Flight) -> None:
        try:
            outputs = flight.pending.result()
        except Exception as err:  # noqa: BLE001 - any failure of a stage fails its requests
            raise _item_error(err, flight.forward, flight.requests) from None
        item = flight.item
        if self.keep_runs:
            self._record(flight, outputs)
        emits = _emits(item)
        served = self.requests
        self.state = sch.landed_all(self.state, {  # the chunk parts that hand back no token
            r.id: False for r in flight.requests
            if r.id not in emits and served.get(r.id) is r})
        if not emits:
            return
        # a row of the outputs per sequence of the call (a chunk's: its last row's token)
        drawn = sampling_hook.tokens(outputs, flight.forward.emits, LOGITS,
                                     [r.sampler if r.id in emits and not flight.drawn
                                      else None for r in flight.requests],
                                     [len(r.generated) for r in flight.requests])
        now = time.perf_counter()
        rows = np.asarray(outputs[LOGITS]).reshape(len(drawn), -1) \
            if self.keep_logits and LOGITS in outputs else None
        # cancelled while in flight, or a chunk part short of its last token: no token
        given = [(i, r) for i, r in enumerate(flight.requests)
                 if served.get(r.id) is r and r.id in emits]
        self.state = sch.landed_all(self.state, {r.id: True for _, r in given})
        for i, request in given:
            if rows is not None:
                request.logits.append(rows[i].copy())
            self._add_token(request, drawn[i], now)

    def _record(self, flight: _Flight, outputs: dict[str, Any]) -> None:
        """The call on each of its requests still served (`Request.runs`), with its
        sequence's last row of logits when they came back."""
        found = outputs.get(LOGITS)
        rows = None
        if found is not None:
            found = np.asarray(found)
            rows = found.reshape(-1, found.shape[-1])[-len(flight.requests):]
        for i, (request, (_, _, n)) in enumerate(zip(flight.requests, flight.item.parts)):
            if self.requests.get(request.id) is request:
                row = None if rows is None else rows[i].copy()
                request.runs.append((flight.forward.name, n, row))

    def _add_token(self, request: Request, token: int, now: float) -> None:
        """A token the scheduler has already counted (`sch.landed_all`) reaches `request`."""
        request.generated.append(token)
        request.token_times.append(now)
        if request.listener is not None:
            self._told.append((request, token))
        if token in request.stop_ids:
            self._end(request, "stop")
        elif len(request.generated) >= request.max_new:
            self._end(request, "length")

    def _end(self, request: Request, reason: str, error: str | None = None) -> None:
        """Finish `request`: off the scheduler, pages back, its listener told."""
        self.requests.pop(request.id, None)
        self.model.forget(request.id)
        self.state = sch.remove(self.state, request.id)
        self.pool.release(request.id)
        self.prefix.released(request.id)
        self._sync_pool()
        sampling_hook.ended(request.sampler)  # a row still in flight hears nothing more
        request.finish, request.error = reason, error
        if request.listener is not None:
            self._told.append((request, None))

    def _fail(self, message: str, touched: Sequence[Request]) -> None:
        """A stage failed: its requests fail with `message`, every other one after them."""
        self.fault = message
        for request in list(self.requests.values()):
            why = message if request in touched else f"the engine stopped: {message}"
            self._end(request, "error", why)
        self.inflight.clear()
        self._ahead = ()
        self._early = self._fed = 0


def _emits(item: sch.Item) -> frozenset[int]:
    """The sequences `item` hands a token to, as a set: a 128-sequence step asked the tuple
    once per sequence (16k comparisons a step)."""
    return frozenset(item.emits)


def _full_decode(item: sch.Item) -> bool:
    """A decode call that hands every sequence in it its next token."""
    return item.kind == "decode" and len(item.emits) == len(item.parts)


def _one_step(flights: Sequence[_Flight]) -> bool:
    """Whether the device can feed a step after `flights` (all in flight, oldest first) call
    for call: one call, which wrote the token output last, or calls that each kept their
    token output under a slot of their own, none overwritten since (a slot is kept only at
    issue, and every flight issued after them is still in flight)."""
    kept = [f.kept for f in flights]
    return len(flights) == 1 or (None not in kept and len(set(kept)) == len(kept))


def check_request(request: Request, limits: Limits, names: Names = FIELDS) -> None:
    """Refuse a request an engine of these `limits` could never serve (model_runner's rules,
    naming fields as `names` says: the HTTP API's, with pointers, by default), and fix its
    sampler (its seed, for the whole sequence): the engine's check, and a front end's before
    it sends the request to the core (kerncc.serve.client)."""
    check_limits(limits, request.prompt, request.max_new, names)
    request.sampler = sampling_hook.prepare(request.params)


def refusal_of(err: QueueFull | Stopped | KernccError) -> tuple[str, str, str | None]:
    """Why `submit` refused a request, as (why, message, pointer): why is `queue_full`,
    `unavailable` or `invalid` (kerncc.serve.wire's refusals), pointer the field's."""
    if isinstance(err, QueueFull):
        return "queue_full", str(err), None
    if isinstance(err, Stopped):
        return "unavailable", str(err), None
    pointer = err.diagnostics[0].location.pointer if err.diagnostics else None
    return "invalid", err.headline, pointer


def _item_error(err: Exception, forward: proto.Forward, requests: list[Request]
                ) -> KernccError:
    """A runtime error, said of the program it ran (the stage is in the runtime's text)."""
    said = "" if f"`{forward.name}`" in str(err) else f"program `{forward.name}`: "
    if isinstance(err, KernccError):  # its diagnostics kept as they are, printed once
        failure = KernccError(said + err.headline, err.diagnostics)
    else:
        failure = KernccError.single(f"{said}{type(err).__name__}: {err}")
    failure.requests = requests  # type: ignore[attr-defined]
    return failure


def serve_prompts(runner: Session | Chain, prompts: Sequence[Sequence[int]], max_new: int,
                  chunk: int | None = None, max_running: int | None = None,
                  logits: bool = False, stop_ids: Collection[int] = (), ahead: bool = True,
                  params: sampling_hook.Params = sampling_hook.Params(),
                  listener: Listener | None = None, runs: bool = False,
                  prefix_cache: bool = True) -> tuple[list[Request], Engine]:
    """Serve every prompt together through an Engine; the finished requests, in prompt order
    (each one's `generated`, ending at one of `stop_ids` or after `max_new`, its `logits`
    rows with `logits` and its `runs` with `runs`), and the engine (its `calls` and `rows`);
    every request samples by `params` and is heard by `listener`; `ahead` and `prefix_cache`:
    Config's. Every prompt is checked before any is served."""
    _check_kinds(max_new, chunk, params, stop_ids, listener)
    engine = Engine(runner, Config(max_running=max_running or len(prompts), chunk=chunk,
                                   max_queue=max(1, len(prompts)), logits=logits,
                                   ahead=ahead, runs=runs, prefix_cache=prefix_cache))
    stops = frozenset(int(t) for t in stop_ids)
    requests = [Request(token_ids(p), max_new, params, stops, listener) for p in prompts]
    for number, request in enumerate(requests, 1):
        try:
            engine.check(request, FLAGS)
        except KernccError as err:  # said in the command line's words
            raise KernccError.single(f"--prompt {number} (of {len(prompts)}): "
                                     f"{err.headline}") from None
    for request in requests:
        engine.submit(request)
    engine.run_until_idle()
    return requests, engine


def _check_kinds(max_new: Any, chunk: Any, params: Any, stop_ids: Any, listener: Any) -> None:
    """serve_prompts' arguments are of their kind (else they fail mid-run, deep inside, or
    mean something else: chunk 2.5)."""
    check_whole(max_new, "max_new")
    if chunk is not None:
        check_whole(chunk, "chunk")
    if not isinstance(params, sampling_hook.Params):
        raise KernccError.single(f"params: expected sampling_hook.Params, got "
                                 f"{type(params).__name__}")
    if not isinstance(stop_ids, Collection) or not all(is_whole(t) for t in stop_ids):
        raise KernccError.single(f"stop_ids: expected token ids, got {stop_ids!r}")
    if listener is not None and not all(callable(getattr(listener, name, None))
                                        for name in ("token", "done")):
        raise KernccError.single(f"listener: expected a Listener (token and done), got "
                                 f"{type(listener).__name__}")
