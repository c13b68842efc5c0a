"""kerncc.serve.scheduler and pool: a simulated engine over random loads, bounded.

Properties: every item respects the forwards' bounds and the page tables' width; pages are
never granted twice nor leaked (the pool balances at every step and is full again at the end);
every sequence finishes (nothing starves or deadlocks), whatever the pool size, the depth of
the pipeline and the arrival order; a preempted sequence is recomputed from its known tokens.
With a chunk program that hands back tokens, no known token goes through a one-row call and
every token comes from the call that fed the token before it. A preempted sequence is
recomputed as it was first fed: its prompt through chunks, its generated tokens one row at a
time.
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kerncc.serve import scheduler as sch
from kerncc.serve.pack import Bounds
from kerncc.serve.pool import KVPool

STRIDE = 4


@st.composite
def loads(draw):
    packed = draw(st.booleans())
    table = draw(st.integers(3, 6))
    limits = sch.Limits(
        stride=STRIDE, pages_per_seq=table,
        decode_groups=draw(st.integers(1, 4)),
        chunk=Bounds(rows=draw(st.integers(1, 8)), seqs=draw(st.integers(2, 4)) if packed else 1,
                     context=draw(st.integers(table * STRIDE, 40))),
        max_running=draw(st.integers(1, 5)), chunk_emits=draw(st.booleans()),
        step_tokens=draw(st.none() | st.integers(1, 12)), hold_steps=draw(st.integers(0, 3)))
    width = limits.pages_per_seq * STRIDE
    requests = draw(st.lists(st.tuples(st.integers(1, width - 1), st.integers(1, width - 1)),
                             min_size=1, max_size=8))
    requests = [(p, min(n, width - p)) for p, n in requests]  # prompt + max_new fits a table
    need = max(sch.cdiv(p + n, STRIDE) for p, n in requests)
    pages = draw(st.integers(need, need + 12))
    arrivals = draw(st.lists(st.integers(0, 3), min_size=len(requests), max_size=len(requests)))
    depth = draw(st.integers(1, 3))
    return limits, requests, pages, arrivals, depth


def check_item(item: sch.Item, limits: sch.Limits, state: sch.State) -> None:
    rows = sum(n for _, _, n in item.parts)
    ids = [i for i, _, _ in item.parts]
    assert len(ids) == len(set(ids)), "a sequence appears once per call"
    if item.kind == "decode":
        assert all(n == 1 for _, _, n in item.parts)
        assert 1 <= len(ids) <= limits.decode_groups
        return
    assert 1 <= len(ids) <= limits.chunk.seqs and 1 <= rows <= limits.chunk.rows
    assert sum(start + n for _, start, n in item.parts) <= limits.chunk.context


def check_budget(plan: sch.Plan, limits: sch.Limits) -> None:
    """A step's prefill rows keep to what a decode row for every sequence that may run leaves
    of the step budget (at least the prefill floor), so to what its own decode rows leave,
    and to the chunk bound."""
    chunk = sum(n for item in plan.items if item.kind == "chunk" for _, _, n in item.parts)
    decodes = sum(len(item.parts) for item in plan.items if item.kind == "decode")
    assert chunk <= limits.chunk.rows and decodes <= limits.max_running
    if limits.step_tokens is not None:
        assert chunk <= max(limits.prefill_floor, limits.step_tokens - limits.max_running)
        assert chunk <= max(limits.prefill_floor, limits.step_tokens - decodes)


# Without chunk tokens, two prompts whose prefills both end in one step's chunks bring two
# decode rows into it: a budget of 5 rows once fed 5 chunk rows and those 2.
BOTH_END = (sch.Limits(stride=4, pages_per_seq=3, decode_groups=1,
                       chunk=Bounds(rows=5, seqs=1, context=12), max_running=2,
                       chunk_emits=False, step_tokens=5), [(1, 1), (2, 1), (5, 1)], 3, [0, 1, 0], 1)


# A preempted sequence's prompt goes through chunks, then its generated tokens one row at a
# time: the chunk that ends its prompt brings its first replayed row into the step.
REPLAY = (sch.Limits(stride=4, pages_per_seq=3, decode_groups=1,
                     chunk=Bounds(rows=5, seqs=2, context=12), max_running=2,
                     chunk_emits=True, step_tokens=5), [(5, 5), (5, 3)], 4, [0, 0], 1)


@settings(max_examples=100)
@given(loads())
@example(BOTH_END)
@example(REPLAY)
def test_a_simulated_engine_finishes_everything_without_leaking_pages(load):
    limits, requests, pages, arrivals, depth = load
    pool = KVPool(pages)
    state = sch.State((), (), pages)
    targets, generated, fed, prompts = {}, {}, {}, {}
    inflight: deque[sch.Item] = deque()
    pending = list(enumerate(requests))
    for tick in range(5000):
        while pending and arrivals[pending[0][0]] <= tick:
            seq_id, (prompt, max_new) = pending.pop(0)
            targets[seq_id] = prompt + max_new
            prompts[seq_id] = prompt
            generated[seq_id] = 0
            state = sch.add(state, seq_id, prompt)
        if len(inflight) < depth:
            plan = sch.schedule(state, limits)
            # what a driver asks before it plans a step of its own (kerncc.serve.engine)
            assert sch.admits(state, limits) == bool(plan.admitted)
            for victim in plan.preempted:
                pool.release(victim)
            for seq_id, more in plan.grants:
                assert pool.take(seq_id, more) is not None
            for item in plan.items:
                check_item(item, limits, state)
            check_budget(plan, limits)
            state = sch.apply(state, plan)
            inflight.extend(plan.items)
            if not plan.empty:
                continue
        if not inflight:
            if not pending and not state.running and not state.waiting:
                break
            continue
        item = inflight.popleft()
        assert set(item.emits) <= {i for i, _, _ in item.parts}
        for seq_id, start, rows in item.parts:
            if not any(s.id == seq_id for s in state.running):
                continue  # preempted after issue: its result is dropped
            fed.setdefault(seq_id, []).append((start, rows))
            token = seq_id in item.emits
            seq = next(s for s in state.running if s.id == seq_id)
            # a decode part of a recomputed sequence short of its last token replays a known
            # token: none comes back
            assert token == (start + rows == seq.tokens
                             and (item.kind == "decode" or limits.chunk_emits))
            if limits.chunk_emits and item.kind == "decode":
                assert start >= prompts[seq_id], "a prompt token went through a one-row call"
            if item.kind == "chunk":  # generated tokens go back as they first went: one row
                assert start + rows <= prompts[seq_id] - (0 if limits.chunk_emits else 1), \
                    "a generated token went through a chunk"
            if token:
                assert start + rows == seq.tokens, "a token from a call short of the last"
            state = sch.landed(state, seq_id, token)
            seq = next(s for s in state.running if s.id == seq_id)
            if token and seq.tokens == targets[seq_id]:
                state = sch.remove(state, seq_id)
                pool.release(seq_id)
        pool.check()
        held = sum(s.pages for s in state.running)
        assert state.free + held == pages and state.free == pool.free
        for s in state.running:
            assert s.pages <= limits.pages_per_seq and s.pages * STRIDE >= s.cached
            assert len(pool.held(s.id)) == s.pages
    else:
        raise AssertionError("the load did not drain: something starved or deadlocked")
    assert pool.free == pages and not pool.owners()
    assert sorted(fed) == list(range(len(requests)))


def test_a_full_pool_preempts_the_newest_and_recomputes_it():
    limits = sch.Limits(stride=4, pages_per_seq=4, decode_groups=4,
                        chunk=Bounds(8, 4, 64), max_running=2)
    # two sequences of 4 known tokens, each with 4 pages' worth of room, a pool of 5 pages
    a = sch.Seq(0, tokens=8, cached=7, pages=2)
    b = sch.Seq(1, tokens=12, cached=11, pages=3)
    state = sch.State((), (a, b), free=0)
    plan = sch.schedule(sch.State((), (a.but(tokens=9, cached=8), b), 0), limits)
    assert plan.preempted == (1,)
    assert plan.grants == ((0, 1),)
    after = sch.apply(sch.State((), (a.but(tokens=9, cached=8), b), 0), plan)
    assert after.waiting == (sch.Seq(1, 12),) and after.free == 2
    assert [p for item in plan.items for p in item.parts] == [(0, 8, 1)]
    assert state.free == 0


def attrs_evolve(seq: sch.Seq, **changes) -> sch.Seq:
    import attrs

    return attrs.evolve(seq, **changes)


def test_packed_prefill_takes_several_sequences_in_one_call():
    limits = sch.Limits(stride=16, pages_per_seq=4, decode_groups=4,
                        chunk=Bounds(8, 3, 64), max_running=4)
    state = sch.State(tuple(sch.Seq(i, 4) for i in range(4)), (), 16)
    plan = sch.schedule(state, limits)
    assert plan.admitted == (0, 1, 2, 3)
    assert [(i.kind, i.parts) for i in plan.items] == [
        ("chunk", ((0, 0, 3), (1, 0, 3), (2, 0, 2))),
        ("decode", ((0, 3, 1), (1, 3, 1)))]  # their prefill ends in this step's chunk
    one = attrs_evolve(limits, chunk=Bounds(8, 1, 64))
    plan = sch.schedule(state, one)
    assert [i.parts for i in plan.items if i.kind == "chunk"] == [
        ((0, 0, 3),), ((1, 0, 3),), ((2, 0, 2),)]


def test_a_chunk_that_hands_back_tokens_feeds_the_whole_prompt():
    """With chunk tokens the chunk takes every prompt token and hands back the first token of
    the sequences it finishes: no one-row call in the step, and the next step decodes them."""
    limits = sch.Limits(stride=16, pages_per_seq=4, decode_groups=4,
                        chunk=Bounds(8, 3, 64), max_running=4, chunk_emits=True)
    state = sch.State(tuple(sch.Seq(i, 4) for i in range(4)), (), 16)
    plan = sch.schedule(state, limits)
    assert [(i.kind, i.parts, i.emits) for i in plan.items] == [
        ("chunk", ((0, 0, 4), (1, 0, 4)), (0, 1))]
    state = sch.apply(state, plan)
    assert [(s.cached, s.primed, s.decoding) for s in state.running[:2]] == [(4, True, True)] * 2
    plan = sch.schedule(state, limits)  # 2 and 3 prefill; 0 and 1 wait for their tokens
    assert [(i.kind, i.parts, i.emits) for i in plan.items] == [
        ("chunk", ((2, 0, 4), (3, 0, 4)), (2, 3))]
    state = sch.apply(state, plan)
    for seq_id in (0, 1):
        state = sch.landed(state, seq_id, token=True)
    plan = sch.schedule(state, limits)
    assert [(i.kind, i.parts, i.emits) for i in plan.items] == [
        ("decode", ((0, 4, 1), (1, 4, 1)), (0, 1))]


@settings(max_examples=60)
@given(running=st.integers(1, 6), prompt=st.integers(2, 60), rows=st.integers(1, 8),
       budget=st.none() | st.integers(1, 16), groups=st.integers(1, 4),
       chunk_emits=st.booleans(), packed=st.booleans())
def test_decodes_keep_going_while_a_long_prompt_is_fed_within_the_step_budget(
        running, prompt, rows, budget, groups, chunk_emits, packed):
    """A newcomer's long prompt beside running streams (pages to spare): every step decodes
    every running stream (none stalls while the prompt is in flight), feeds the prompt at
    least the prefill floor (it never starves, however many streams decode) and keeps its
    prefill rows within what the decodes leave of the budget; decode rows go through decode
    items only, prefill rows through chunk items only."""
    limits = sch.Limits(stride=STRIDE, pages_per_seq=32, decode_groups=groups,
                        chunk=Bounds(rows, 3 if packed else 1, 32 * STRIDE * 3),
                        max_running=running + 1, chunk_emits=chunk_emits, step_tokens=budget)
    state = sch.State((), (), 1000)
    streams = list(range(running))
    for seq_id in streams:  # running streams, prompts fed, decoding
        state = sch.add(state, seq_id, 2)
    for _ in range(20):
        if all(s.decodable(chunk_emits) for s in state.running) and len(state.running) == running:
            break
        plan = sch.schedule(state, limits)
        state = sch.apply(state, plan)
        for item in plan.items:
            state = sch.landed_all(state, {i: i in item.emits for i, _, _ in item.parts})
    state = sch.add(state, running, prompt)
    newcomer_left = prompt - (0 if chunk_emits else 1)
    for _ in range(200):  # bounded: the prompt takes at most prompt / floor steps
        plan = sch.schedule(state, limits)
        decoded = {i for item in plan.items if item.kind == "decode" for i, _, _ in item.parts}
        fed = sum(n for item in plan.items if item.kind == "chunk"
                  for i, _, n in item.parts if i == running)
        assert set(streams) <= decoded, "a running stream stalled while a prompt was fed"
        check_budget(plan, limits)
        assert fed >= min(limits.prefill_floor, newcomer_left), "the prompt starved"
        newcomer_left -= fed
        state = sch.apply(state, plan)
        for item in plan.items:  # every call lands before the next step (depth 1)
            state = sch.landed_all(state, {i: i in item.emits for i, _, _ in item.parts})
        if newcomer_left == 0:
            break
    else:
        raise AssertionError("the prompt was never fed")


@pytest.mark.parametrize("hold, starts", [(0, [1, 2, 3, 4]), (1, [1, 3, 3, 4]),
                                          (8, [3, 3, 3, 4])])
def test_a_bursts_streams_decode_once_its_prompts_are_fed(hold, starts):
    """Four prompts of one chunk each arrive together (chunk tokens): a stream primed while
    the others are fed waits for its first decode row while at most `hold_steps` steps of
    prefill are left (after the step's chunks), then decodes in the step of the last chunk;
    a stream that has decoded never waits. `starts`: the step of each one's first decode."""
    limits = sch.Limits(stride=4, pages_per_seq=8, decode_groups=4,
                        chunk=Bounds(rows=8, seqs=1, context=64), max_running=4,
                        chunk_emits=True, hold_steps=hold)
    state = sch.State((), (), 32)
    for seq_id in range(4):
        state = sch.add(state, seq_id, 8)
    first: dict[int, int] = {}
    for step in range(8):
        plan = sch.schedule(state, limits)
        decoded = [i for item in plan.items if item.kind == "decode" for i, _, _ in item.parts]
        assert set(first) <= set(decoded), "a stream that had decoded waited"
        for seq_id in decoded:
            first.setdefault(seq_id, step)
        state = sch.apply(state, plan)
        for item in plan.items:  # every call lands before the next step
            state = sch.landed_all(state, {i: i in item.emits for i, _, _ in item.parts})
    assert [first[i] for i in range(4)] == starts


@pytest.mark.parametrize("hold", [1, 2, 3])
def test_a_stream_waits_for_its_burst_no_more_than_hold_steps_while_prompts_keep_coming(hold):
    """A prompt of one chunk arrives every step, so a chunk's worth of prefill is always left
    beside the streams: each waits `hold_steps` steps (`Seq.paused`) and then decodes,
    rather than for as long as prompts keep coming."""
    limits = sch.Limits(stride=4, pages_per_seq=8, decode_groups=16,
                        chunk=Bounds(rows=8, seqs=1, context=64), max_running=16,
                        chunk_emits=True, hold_steps=hold)
    state = sch.add(sch.add(sch.State((), (), 256), 0, 8), 1, 8)
    primed: dict[int, int] = {}
    first: dict[int, int] = {}
    for step in range(12):
        if step:
            state = sch.add(state, step + 1, 8)
        plan = sch.schedule(state, limits)
        for item in plan.items:
            for seq_id, _, _ in item.parts:
                (first if item.kind == "decode" else primed).setdefault(seq_id, step)
        assert all(state.running[i].paused < hold for i in range(len(state.running))
                   if state.running[i].id in plan.paused)
        state = sch.apply(state, plan)
        for item in plan.items:  # every call lands before the next step
            state = sch.landed_all(state, {i: i in item.emits for i, _, _ in item.parts})
    assert [first[i] - primed[i] for i in range(6)] == [1 + hold] * 6


@pytest.mark.parametrize("budget", [None, 10])
def test_rows_fed_early_count_against_a_step_budget_only(budget):
    """`schedule(..., fed)`: the step's chunks planned while the step before ran leave the
    budget's prefill rows the less; without a budget the step still feeds a whole chunk."""
    limits = sch.Limits(stride=4, pages_per_seq=8, decode_groups=4,
                        chunk=Bounds(rows=6, seqs=1, context=32), max_running=2,
                        chunk_emits=True, step_tokens=budget)
    state = sch.add(sch.State((), (), 16), 0, 20)
    plan = sch.schedule(state, limits)
    rows = sum(n for item in plan.items for _, _, n in item.parts)
    assert rows == limits.prefill_rows == 6
    state = sch.apply(state, plan)
    later = sch.schedule(state, limits, fed=5)
    rows = sum(n for item in later.items for _, _, n in item.parts)
    assert rows == (6 if budget is None else 1)
