"""The scheduler step: the sequences waiting and running -> one step's items (vLLM v1 style).

A pure function over counts, no model and no device: `schedule(state, limits)` returns a
`Plan` (who is admitted, who is preempted, which pages each sequence is granted, the items to
issue) and `apply(state, plan)` the state after it; the engine keeps the token ids and page
ids beside it. Per sequence: `tokens` known (prompt plus generated), `cached` of them fed (KV
written or being written), `pages` held, `inflight` items not yet collected.

The order of the feeding depends on the chunk program (`Limits.chunk_emits`):
* it hands back a token (spec §3.10: a chunk program whose last calls write the `tokens`
  output hands back the first token): every known token goes through chunks, and the chunk
  part that feeds a sequence's last known token hands back its next token; from then on the
  sequence goes one row at a time. The first token costs no one-row step.
* it does not (kern-serve's order, spec §6.1): all but the last known token go through the
  chunk program, the last one through a one-row step, whose token is the next.
So a step holds
* chunk items: the running sequences with prefill rows to go, packed by `pack()` (spec §6.2)
  when the chunk program takes several sequences (a `cu_seqlens` fill), else one sequence per
  call; either way at most `prefill_rows` rows per step: `chunk.rows`, and with a step budget
  (`Limits.step_tokens`) what the budget leaves once every sequence that may run has its
  decode row (never fewer than `prefill_floor`, a page's worth, so that neither starves: the
  running streams decode every step while a newcomer's prompt is fed, and the prompt
  advances however many streams run). The same rows every step, whatever decodes beside
  them, so that chunks repeat their shapes (their graphs replay) and a driver may plan them
  while the step before runs; an item lists in `emits` the sequences whose token it hands
  back;
* decode items, after them: every running sequence with only its last token to feed and no
  call in flight that will hand it a token (a chunk in flight that does not is fine: calls run
  in issue order), oldest first, `decode_groups` per call (the protocol's multi-sequence
  forward), and every recomputed sequence replaying a generated token (below). Without chunk
  tokens, a sequence whose prefill ends in this step's chunk decodes in this step.
  With chunk tokens and `Limits.hold_steps`, a sequence whose only generated token is its
  chunk's waits for its first decode row in a step that feeds prefill while the prompts
  beside it have at most that many steps of prefill rows left (`_burst_left`), for at most
  that many steps (`Seq.paused`, counted by `apply`): a burst's streams start together.
Decode rows stay in the decode program and prefill rows in the chunk program, two calls of
one step: a decode row's bits must not depend on whether a prefill rides beside it, and the
chunk program's row is not the decode program's bit for bit (issue 40's determinism
contract), so the step interleaves the two programs within its budget rather than mixing
rows in one call.

Pages (`stride` tokens each) are granted oldest first as items need them. When the pool runs
dry the newest running sequence with nothing in flight is preempted (its pages freed, its
tokens kept; it goes back to the front of the queue and is recomputed from its known tokens,
as they were first fed: its prompt through chunks, then its generated tokens one row at a
time in decode items that hand back nothing, the last one's handing back its next token; the
chunk program's rows need not have the one-row program's bits, and this way the sequence's
KV and logits are those it had). A sequence that can get no page waits for one: the oldest
always gets its pages (every sequence fits the pool alone, which the engine checks on
admission), so nothing deadlocks. Waiting sequences are admitted oldest first while fewer
than `max_running` run and the free pages cover the prompt plus one page of headroom per
running sequence.

With the prefix cache (kerncc.serve.prefix) the driver tells each waiting sequence the next
step may admit what it would take from the cache before it asks for a step (`Seq.reuse`,
`fresh`, `held`): an admitted sequence starts with its `reuse` tokens fed and their pages held
(`Plan.reused`), and needs free pages only for the rest and for cached pages no one holds; one
`held` (its next page is about to be computed ahead of it) waits, and the queue behind it. A
sequence is not preempted in the step that admits it. Pages shared by several sequences are
freed only when the last lets go: `State.shared` says how many of each sequence's pages are,
and the driver sets `free` and `shared` from the pool after each change (`synced`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal, NamedTuple

import attrs

from kerncc.serve.pack import Bounds, Waiting, pack


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Seq(NamedTuple):
    """The scheduler's view of one sequence. A named tuple, immutable as the rest of the
    state, rather than a frozen attrs class: a step rebuilds two a running sequence (it
    lands, it is fed again), 256 at 128 sequences, and a frozen class's `__init__` (a
    guarded setattr a field) cost 1.0 us each against 0.15 us for a tuple."""

    id: int
    tokens: int
    cached: int = 0
    pages: int = 0
    inflight: int = 0
    decoding: bool = False  # a call that hands it a token is in flight: that token is unknown
    # chunk tokens: its known tokens went through chunks up to the last one, whose chunk
    # handed (or will hand) back the next token; later tokens go one row at a time
    primed: bool = False
    # Its prompt's length (None: every known token is prompt). A recomputed sequence feeds
    # only its prompt through chunks and replays its generated tokens one row at a time, as
    # they were first fed: the chunk program's rows need not be the one-row program's bits.
    prompt: int | None = None
    # A waiting one's match in the prefix cache (kerncc.serve.prefix), set before each step:
    # `reuse` tokens (whole pages) it takes from the cache when admitted, `fresh` of those
    # pages held by no sequence now (they come out of the free pages), `held`: it waits for
    # a page a running sequence is about to compute, to share it.
    reuse: int = 0
    fresh: int = 0
    held: bool = False
    # steps it has waited for its first decode row while its burst's prompts were fed
    # (`_burst_left`): it waits no more than `Limits.hold_steps`
    paused: int = 0

    def chunk_end(self, chunk_emits: bool) -> int:
        """How many of its known tokens go through chunks."""
        prompt = self.tokens if self.prompt is None else self.prompt
        return prompt if chunk_emits else prompt - 1

    def prefill_left(self, chunk_emits: bool) -> int:
        if chunk_emits and self.primed:
            return 0
        return max(0, self.chunk_end(chunk_emits) - self.cached)

    def replayable(self, chunk_emits: bool) -> bool:
        """Past its chunks, a known token other than the last still to feed (one row, no
        token back: it is known)."""
        chunked = self.primed or not chunk_emits
        return chunked and self.chunk_end(chunk_emits) <= self.cached < self.tokens - 1

    def decodable(self, chunk_emits: bool) -> bool:
        # A chunk still in flight is fine: calls run in issue order on every stage.
        return ((self.primed or not chunk_emits) and self.cached == self.tokens - 1
                and not self.decoding)

    def but(self, *, tokens: int | None = None, cached: int | None = None,
            pages: int | None = None, inflight: int | None = None,
            decoding: bool | None = None, primed: bool | None = None,
            paused: int | None = None) -> Seq:
        """This sequence with the fields given changed: `_replace` at a tenth of its cost
        (the scheduler makes a few a sequence each step: 128 sequences, 128 of them a pass)."""
        return _new(Seq, (self.id, self.tokens if tokens is None else tokens,
                          self.cached if cached is None else cached,
                          self.pages if pages is None else pages,
                          self.inflight if inflight is None else inflight,
                          self.decoding if decoding is None else decoding,
                          self.primed if primed is None else primed, self.prompt, self.reuse,
                          self.fresh, self.held, self.paused if paused is None else paused))

    def matched(self, reuse: int, fresh: int, held: bool) -> Seq:
        """This waiting sequence with its match in the prefix cache (kerncc.serve.prefix)."""
        return self._replace(reuse=reuse, fresh=fresh, held=held)

    def recomputed(self) -> Seq:
        """The sequence sent back to the queue by a preemption: its known tokens, no pages."""
        return Seq(self.id, self.tokens, prompt=self.prompt)

    def admitted(self, stride: int) -> Seq:
        """The sequence once admitted: its `reuse` tokens fed already, their pages held."""
        return Seq(self.id, self.tokens, self.reuse, self.reuse // stride, prompt=self.prompt)


_new = tuple.__new__  # a Seq from its fields in order, without NamedTuple's keyword pass


@attrs.frozen
class Limits:
    """What bounds a step: page geometry, the forwards' shapes, the engine's concurrency."""

    stride: int  # tokens per page
    pages_per_seq: int  # page-table width
    decode_groups: int  # most sequences of one decode call
    chunk: Bounds  # one chunk call: rows, sequences (1: one-sequence chunks), context
    max_running: int
    chunk_emits: bool = False  # the chunk program hands back each sequence's next token
    # Most rows one step feeds, decode and prefill together (None: `chunk.rows` of prefill
    # beside every decode row): see `prefill_rows`
    step_tokens: int | None = None
    # A burst's prompts fed before its streams decode: with chunk tokens, a sequence whose
    # only generated token is its chunk's waits for its first decode row while the running
    # sequences have at most `hold_steps` steps of prefill rows left, for at most
    # `hold_steps` steps (0: it never waits)
    hold_steps: int = 0

    @property
    def prefill_floor(self) -> int:
        """Prefill rows a step feeds whatever its budget (a page's worth, at most a chunk): a
        newcomer's prompt advances every step."""
        return min(self.chunk.rows, self.stride)

    @property
    def prefill_rows(self) -> int:
        """Prefill rows a step may feed: `chunk.rows`; under a step budget what it leaves once
        each of `max_running` sequences has its decode row (a step's decode rows are one a
        running sequence at most, a chunk that ends a prompt counted), at least
        `prefill_floor`. One number, not what each step's decodes leave: chunks cut by the
        decodes beside them took a shape of their own nearly every step, each issued launch
        by launch or captured between two steps, and the streams' ITL p99 rose to 4.0-4.3x
        the step at 32 and 128 streams (the engine alone on an H100, docs/serving.md)."""
        if self.step_tokens is None:
            return self.chunk.rows
        return min(self.chunk.rows, max(self.prefill_floor, self.step_tokens - self.max_running))


@attrs.frozen
class Item:
    """One call: `decode` (one row each) or `chunk`; parts are (seq id, first row, rows)."""

    kind: Literal["decode", "chunk"]
    parts: tuple[tuple[int, int, int], ...]
    emits: tuple[int, ...] = ()  # seq ids it hands a token to (every part of a decode item)


@attrs.frozen
class Plan:
    admitted: tuple[int, ...] = ()
    preempted: tuple[int, ...] = ()
    grants: tuple[tuple[int, int], ...] = ()  # (seq id, pages more), in grant order
    items: tuple[Item, ...] = ()
    # (seq id, pages) an admitted sequence takes from the prefix cache: they come first
    reused: tuple[tuple[int, int], ...] = ()
    paused: tuple[int, ...] = ()  # seq ids that wait for their burst in this step

    @property
    def empty(self) -> bool:
        return not (self.admitted or self.preempted or self.items)


@attrs.frozen
class State:
    waiting: tuple[Seq, ...]  # oldest first (preempted ones go back to the front)
    running: tuple[Seq, ...]  # in admission order
    free: int  # free pages (blank, or cached and held by none: kerncc.serve.pool)
    # seq id -> how many of its pages another sequence holds too (a shared prefix): releasing
    # it frees the others only. The pool's count: with shared pages `apply` counts low, and
    # the driver sets `free` and `shared` from the pool after each change (`synced`).
    shared: Mapping[int, int] = attrs.field(factory=dict)


class _Draft:
    """The step being built: running sequences by id, free pages, what happened so far."""

    def __init__(self, state: State, stride: int) -> None:
        self.stride = stride
        self.shared = state.shared
        # pages admitted sequences took from the cache that a running sequence held: one a
        # preemption counts free may stay held by the newcomer (its count is the pool's)
        self.pinned = 0
        self.order = [s.id for s in state.running]
        self.seqs = {s.id: s for s in state.running}
        self.waiting = list(state.waiting)
        self.free = state.free
        self.admitted: list[int] = []
        self.preempted: list[int] = []
        self.grants: list[tuple[int, int]] = []
        self.reused: list[tuple[int, int]] = []
        self.busy: set[int] = set()  # in this step's items: not preemptable now
        self.paused: list[int] = []

    def grant(self, seq_id: int, end: int) -> bool:
        """Pages for `seq_id` to hold tokens [0, end), preempting newer sequences if needed."""
        seq = self.seqs[seq_id]
        more = cdiv(end, self.stride) - seq.pages
        while more > self.free:
            if not self._preempt_newer_than(seq_id):
                return False
        if more > 0:
            self.free -= more
            self.seqs[seq_id] = seq.but(pages=seq.pages + more)
            self.grants.append((seq_id, more))
        return True

    def _preempt_newer_than(self, seq_id: int) -> bool:
        mine = self.order.index(seq_id)
        for victim in reversed(self.order[mine + 1:]):
            seq = self.seqs[victim]
            if seq.inflight == 0 and victim not in self.busy:
                self.order.remove(victim)
                del self.seqs[victim]
                gain = seq.pages - self.shared.get(victim, 0)
                kept = min(self.pinned, gain)
                self.pinned -= kept
                self.free += gain - kept
                self.preempted.append(victim)
                self.waiting.insert(0, seq.recomputed())
                return True
        return False


def schedule(state: State, limits: Limits, fed: int = 0) -> Plan:
    """One step's plan (see the module docstring for the rules); `fed`: prefill rows of this
    step issued already (`chunks`, planned while the step before ran), which count against a
    step budget. Without one they do not: the step's plan feeds its own chunk beside them,
    and a wave of prompts is in sooner. Counting them there too spread a 128-stream wave's
    prefill over twice the steps, each a chunk beside the decodes, and the streams' ITL p99
    rose from 1.85-1.87x to 3.14-3.21x the step (the engine alone, two rounds, H100)."""
    draft = _Draft(state, limits.stride)
    _admit(draft, limits)
    # Chunks first: without chunk tokens, a sequence whose prefill ends in this step's chunk
    # decodes in this step.
    fed = fed if limits.step_tokens is not None else 0
    chunked = _chunk_items(draft, limits, fed)
    items = chunked + _decode_items(draft, limits, bool(chunked) and _burst_left(draft, limits))
    return Plan(tuple(draft.admitted), tuple(draft.preempted), tuple(draft.grants),
                tuple(items), tuple(draft.reused), tuple(draft.paused))


def chunks(state: State, limits: Limits) -> Plan:
    """The chunk items alone of the step `schedule` would plan now, admitting no one: those
    a driver issues before the step in flight has landed (their rows are prompt tokens,
    known), planning that step's decodes once their tokens are here. Chunks come first in a
    step, so they are the step's own: the same parts, grants and preemptions."""
    draft = _Draft(state, limits.stride)
    items = _chunk_items(draft, limits)
    return Plan(preempted=tuple(draft.preempted), grants=tuple(draft.grants),
                items=tuple(items))


def admits(state: State, limits: Limits) -> bool:
    """Whether the next step would admit the oldest waiting sequence (the rule `_admit`
    applies): a driver that plans a step of its own first asks this."""
    return bool(state.waiting) and _fits(state.waiting[0], len(state.running), state.free,
                                         limits)


def _fits(seq: Seq, running: int, free: int, limits: Limits) -> bool:
    """Room for `seq` beside `running` sequences: a place, and its prompt's pages (those it
    takes from the cache only if no one holds them) plus a page of headroom for each running
    one; none while it waits for a page to share."""
    pages = cdiv(seq.tokens, limits.stride) - seq.reuse // limits.stride + seq.fresh
    return not seq.held and running < limits.max_running and free >= pages + running


def _admit(draft: _Draft, limits: Limits) -> None:
    while draft.waiting:
        seq = draft.waiting[0]
        if not _fits(seq, len(draft.order), draft.free, limits):
            return
        draft.waiting.pop(0)
        draft.order.append(seq.id)
        draft.seqs[seq.id] = seq.admitted(limits.stride)
        draft.admitted.append(seq.id)
        draft.busy.add(seq.id)  # not preempted in the step that admits it
        if seq.reuse:
            pages = seq.reuse // limits.stride
            draft.reused.append((seq.id, pages))
            draft.free -= seq.fresh
            draft.pinned += pages - seq.fresh


def _decode_items(draft: _Draft, limits: Limits, waits: bool = False) -> list[Item]:
    """One row of every sequence that decodes (its token comes back) or replays a known
    token (none does), oldest first, `decode_groups` per call; `waits`: but those whose only
    generated token is their chunk's (`_burst_left`)."""
    ready: list[tuple[int, int, int]] = []
    emits: set[int] = set()
    for seq_id in list(draft.order):
        seq = draft.seqs.get(seq_id)
        if seq is None:
            continue  # preempted by an older one this step
        decodes = seq.decodable(limits.chunk_emits)
        if not (decodes or seq.replayable(limits.chunk_emits)):
            continue
        if (decodes and waits and seq.cached == seq.chunk_end(True)
                and seq.paused < limits.hold_steps):
            draft.paused.append(seq_id)  # primed in a burst still being fed: `_burst_left`
            continue
        if not draft.grant(seq_id, seq.cached + 1):
            continue
        draft.busy.add(seq_id)
        ready.append((seq_id, seq.cached, 1))
        if decodes:
            emits.add(seq_id)
    groups = limits.decode_groups
    calls = [tuple(ready[i:i + groups]) for i in range(0, len(ready), groups)]
    return [Item("decode", parts, tuple(p[0] for p in parts if p[0] in emits))
            for parts in calls]


def _burst_left(draft: _Draft, limits: Limits) -> bool:
    """Whether sequences primed by a chunk wait for their first decode row (each for at
    most `limits.hold_steps` steps, `Seq.paused`) in a step that feeds prefill rows (so that
    the prompts advance while they wait; a step whose chunks cannot be granted pages decodes
    them): prompts beside them still have prefill rows left after this step's chunks, at most
    `limits.hold_steps` steps' worth. A burst of prompts is so fed at the chunk program's pace
    and its streams start together. A decode step between a burst's chunks reads every
    weight for a part of the batch and puts a chunk into each gap of the streams that started
    early: in a wave of 128 prompts of 128 tokens, 2048-row chunks put a chunk into 1.4% of
    the wave's gaps, and the streams' ITL p99 was the chunk's (docs/design-notes.md)."""
    if not (limits.hold_steps and limits.chunk_emits):
        return False
    left, most = 0, limits.hold_steps * limits.prefill_rows
    for seq in draft.seqs.values():
        left += seq.prefill_left(True)
        if left > most:
            return False
    return left > 0


def _chunk_items(draft: _Draft, limits: Limits, fed: int = 0) -> list[Item]:
    """The step's chunk calls: at most `limits.prefill_rows` rows in all, `fed` of them issued
    already. A part that ends its sequence's chunks brings a row of the sequence into this
    step's decode (`_decode_items`) when tokens are left past them: without chunk tokens its
    last known one, and a recomputed sequence's generated ones."""
    emits = limits.chunk_emits
    budget = limits.prefill_rows
    items: list[Item] = []
    while budget > fed:
        candidates = [draft.seqs[i] for i in draft.order if draft.seqs[i].prefill_left(emits)]
        lefts = [s.prefill_left(emits) for s in candidates]
        bounds = attrs.evolve(limits.chunk, rows=budget - fed)
        plan = pack([Waiting(s.cached, left) for s, left in zip(candidates, lefts)], bounds)
        parts = _granted(draft, [(candidates[i], n) for i, n in plan], emits)
        if not parts:
            break
        tokens = tuple(i for i, start, n in parts if emits and start + n == draft.seqs[i].tokens)
        items.append(Item("chunk", tuple(parts), tokens))
        fed += sum(n for _, _, n in parts)
    return items


def _granted(draft: _Draft, planned: Iterable[tuple[Seq, int]], chunk_emits: bool
             ) -> list[tuple[int, int, int]]:
    """The planned parts whose pages could be granted, up to the first that could not; each
    granted part advances its sequence's `cached` in the draft (and primes it when the part
    feeds its last known token and the chunk hands back the next)."""
    parts = []
    for seq, n in planned:
        if seq.id not in draft.seqs or not draft.grant(seq.id, seq.cached + n):
            break
        current = draft.seqs[seq.id]
        chunked = chunk_emits and current.cached + n == current.chunk_end(chunk_emits)
        last = chunked and current.cached + n == current.tokens
        draft.seqs[seq.id] = current.but(cached=current.cached + n,
                                         primed=current.primed or chunked,
                                         decoding=current.decoding or last)
        draft.busy.add(seq.id)
        parts.append((seq.id, seq.cached, n))
    return parts


def apply(state: State, plan: Plan) -> State:
    """The state once `plan` is issued: admissions, preemptions, grants, fed rows, in flight."""
    running = [s for s in state.running if s.id not in plan.preempted]
    waiting = [s for s in state.waiting if s.id not in plan.admitted]
    by_id = {s.id: s for s in (*state.running, *state.waiting)}
    back = [by_id[i].recomputed() for i in plan.preempted]
    waiting = list(reversed(back)) + waiting
    reused = dict(plan.reused)
    running += [Seq(i, by_id[i].tokens, by_id[i].reuse, reused.get(i, 0), prompt=by_id[i].prompt)
                for i in plan.admitted if i not in plan.preempted]
    seqs = {s.id: s for s in running}
    taken = sum(n for _, n in plan.grants) + sum(by_id[i].fresh for i in reused)
    freed, pinned = 0, sum(n - by_id[i].fresh for i, n in plan.reused)
    for victim in plan.preempted:  # as the draft counted them (`_preempt_newer_than`)
        gain = by_id[victim].pages - state.shared.get(victim, 0)
        kept = min(pinned, gain)
        pinned -= kept
        freed += gain - kept
    for seq_id, more in plan.grants:
        seqs[seq_id] = seqs[seq_id].but(pages=seqs[seq_id].pages + more)
    for seq_id in plan.paused:
        seqs[seq_id] = seqs[seq_id].but(paused=seqs[seq_id].paused + 1)
    for item in plan.items:
        for seq_id, start, rows in item.parts:
            seq = seqs[seq_id]
            token = seq_id in item.emits
            # a chunk that feeds a prompt's last token primes it (only a chunk program that
            # hands back tokens feeds it), recomputed or not: a recomputed one's next token is
            # known, and replayed, so none comes back
            chunked = item.kind == "chunk" and start + rows == seq.chunk_end(True)
            seqs[seq_id] = seq.but(cached=start + rows, inflight=seq.inflight + 1,
                                   decoding=seq.decoding or token,
                                   primed=seq.primed or chunked)
    return State(tuple(waiting), tuple(seqs[s.id] for s in running),
                 state.free + freed - taken, state.shared)


def landed(state: State, seq_id: int, token: bool) -> State:
    """An item of `seq_id` was collected; `token`: it handed the sequence a new token."""
    return landed_all(state, {seq_id: token})


def landed_all(state: State, tokens: Mapping[int, bool]) -> State:
    """`landed` for every sequence of a collected call at once ({seq id: token}), in one pass
    over the running sequences."""
    if not tokens:
        return state
    running = tuple(
        seq.but(inflight=seq.inflight - 1, tokens=seq.tokens + (1 if tokens[seq.id] else 0),
                decoding=seq.decoding and not tokens[seq.id])
        if seq.id in tokens else seq for seq in state.running)
    return attrs.evolve(state, running=running)


def remove(state: State, seq_id: int) -> State:
    """`seq_id` finished, was cancelled or failed: gone, its pages free (but those another
    sequence holds too)."""
    gone = [s for s in (*state.running, *state.waiting) if s.id == seq_id]
    shared = state.shared.get(seq_id, 0)
    return State(tuple(s for s in state.waiting if s.id != seq_id),
                 tuple(s for s in state.running if s.id != seq_id),
                 state.free + sum(s.pages for s in gone) - shared, state.shared)


def synced(state: State, free: int, shared: Mapping[int, int]) -> State:
    """The state with the pool's free pages and shared counts (the driver's, after each
    change to the pool: only the pool knows which pages a release frees)."""
    if state.free == free and state.shared == shared:
        return state
    return attrs.evolve(state, free=free, shared=dict(shared))


def add(state: State, seq_id: int, tokens: int) -> State:
    """A new request (a prompt of `tokens`) joins the back of the queue."""
    return attrs.evolve(state, waiting=(*state.waiting, Seq(seq_id, tokens, prompt=tokens)))
