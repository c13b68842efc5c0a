"""kerncc.serve.prefix and the pool's cache: a simulated engine over random loads of prompts
that share prefixes, with admissions, finishes, cancellations (queued, in flight) and
preemptions, bounded.

The simulated device writes each fed row's "KV" into its page slot at issue (calls run in
issue order): the tokens up to it and the kind of call that fed it. Properties: every call
finds, in every slot before its rows, the KV of its own tokens written by the kind of call
that would have fed it served alone (prompt rows by chunks, generated ones by one-row calls),
so a shared page is always the right one and nothing overwrites a page still held; the pool
balances after every step (blank + cached + in use = every page, reference counts and shared
counts match the rows, the scheduler's free pages and shared counts are the pool's); every
sequence finishes; once idle every page is free. Two prompts alike arriving together or one
after the other share their full pages, and never the last token's page.
"""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from kerncc.serve import scheduler as sch
from kerncc.serve.pack import Bounds
from kerncc.serve.pool import KVPool
from kerncc.serve.prefix import PrefixCache

STRIDE = 4
TICKS = 5000


@st.composite
def loads(draw):
    packed = draw(st.booleans())
    table = draw(st.integers(3, 6))
    limits = sch.Limits(
        stride=STRIDE, pages_per_seq=table, decode_groups=draw(st.integers(1, 4)),
        chunk=Bounds(rows=draw(st.integers(1, 8)), seqs=draw(st.integers(2, 4)) if packed else 1,
                     context=draw(st.integers(table * STRIDE, 40))),
        max_running=draw(st.integers(1, 5)), chunk_emits=draw(st.booleans()))
    width = table * STRIDE
    # two bases over a small alphabet: prompts begin alike, whole pages and parts of them
    bases = draw(st.lists(st.lists(st.integers(0, 2), min_size=width, max_size=width),
                          min_size=2, max_size=2))
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        base = bases[draw(st.integers(0, 1))]
        prompt = base[:draw(st.integers(0, width - 1))]
        prompt += draw(st.lists(st.integers(0, 2), min_size=1 if not prompt else 0,
                                max_size=width - 1 - len(prompt)))
        max_new = draw(st.integers(1, width - len(prompt)))
        arrival = draw(st.integers(0, 6))
        cancel = draw(st.none() | st.integers(0, 20))
        requests.append((prompt, max_new, arrival, cancel))
    need = max(sch.cdiv(len(p) + n, STRIDE) for p, n, _, _ in requests)
    pages = draw(st.integers(need, need + 10))
    return limits, requests, pages, draw(st.integers(1, 3))


def next_token(tokens: list[int]) -> int:
    """The simulated model's next token: a function of every token before it."""
    return hash(tuple(tokens)) % 3


class Device:
    """Page slots holding (kind of call that fed the row, the tokens up to and with it)."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, int], tuple[str, tuple[int, ...]]] = {}

    def run(self, item: sch.Item, pool: KVPool, tokens: dict[int, list[int]],
            state: sch.State, limits: sch.Limits) -> None:
        seqs = {s.id: s for s in state.running}
        for seq_id, start, rows in item.parts:
            pages, known = pool.held(seq_id), tokens[seq_id]
            chunked = seqs[seq_id].chunk_end(limits.chunk_emits)
            for pos in range(start):  # what attention reads: the pages before its rows
                kind = "chunk" if pos < chunked else "decode"
                found = self.slots.get((pages[pos // STRIDE], pos % STRIDE))
                assert found == (kind, tuple(known[:pos + 1])), \
                    f"sequence {seq_id} reads the wrong KV at {pos}: {found}"
            for pos in range(start, start + rows):
                self.slots[(pages[pos // STRIDE], pos % STRIDE)] = (item.kind,
                                                                   tuple(known[:pos + 1]))


def balanced(pool: KVPool, state: sch.State, limits: sch.Limits) -> None:
    pool.check()
    assert state.free == pool.free and state.shared == pool.shared
    assert pool.blank + pool.idle + len({p for o in pool.owners() for p in pool.held(o)}) \
        == pool.pages
    for s in state.running:
        assert len(pool.held(s.id)) == s.pages <= limits.pages_per_seq
        assert s.pages * STRIDE >= s.cached
    assert set(pool.owners()) <= {s.id for s in state.running}


class Driver:
    """What the engine does around the scheduler, over a simulated device."""

    def __init__(self, limits: sch.Limits, pages: int) -> None:
        self.limits = limits
        self.pool = KVPool(pages)
        self.cache = PrefixCache(self.pool, STRIDE)
        self.state = sch.State((), (), pages)
        self.tokens: dict[int, list[int]] = {}
        self.prompts: dict[int, list[int]] = {}
        self.device = Device()

    def add(self, seq_id: int, prompt: list[int]) -> None:
        self.prompts[seq_id], self.tokens[seq_id] = prompt, list(prompt)
        self.state = sch.add(self.state, seq_id, len(prompt))

    def step(self) -> list[sch.Item]:
        self.state = self.cache.refresh(self.state, self.limits, self.prompts.__getitem__)
        plan = sch.schedule(self.state, self.limits)
        assert sch.admits(self.state, self.limits) == bool(plan.admitted)
        reused = dict(plan.reused)
        for seq_id in plan.admitted:
            self.cache.admit(seq_id, reused.get(seq_id, 0), self.prompts[seq_id])
        for victim in plan.preempted:
            self.pool.release(victim)
            self.cache.released(victim)
        for seq_id, more in plan.grants:
            assert self.pool.take(seq_id, more) is not None
        self.state = sch.apply(self.state, plan)
        assert self.state.free <= self.pool.free, "the scheduler counted pages not freed"
        self.state = sch.synced(self.state, self.pool.free, self.pool.shared)
        for item in plan.items:
            self.device.run(item, self.pool, self.tokens, self.state, self.limits)
            self.cache.issued(item, self.prompts.__getitem__)
        return list(plan.items)

    def end(self, seq_id: int) -> None:
        self.state = sch.remove(self.state, seq_id)
        self.pool.release(seq_id)
        self.cache.released(seq_id)
        assert self.state.free <= self.pool.free
        self.state = sch.synced(self.state, self.pool.free, self.pool.shared)

    def running(self, seq_id: int) -> sch.Seq | None:
        return next((s for s in self.state.running if s.id == seq_id), None)


@settings(max_examples=150)
@given(loads())
def test_random_loads_share_the_right_pages_and_leak_none(load):
    limits, requests, pages, depth = load
    driver = Driver(limits, pages)
    targets: dict[int, int] = {}
    cancels: dict[int, list[int]] = {}
    inflight: deque[sch.Item] = deque()
    pending = sorted(enumerate(requests), key=lambda r: r[1][2])
    live: set[int] = set()
    for tick in range(TICKS):
        while pending and pending[0][1][2] <= tick:
            seq_id, (prompt, max_new, _, cancel) = pending.pop(0)
            driver.add(seq_id, prompt)
            targets[seq_id] = len(prompt) + max_new
            live.add(seq_id)
            if cancel is not None:
                cancels.setdefault(tick + cancel, []).append(seq_id)
        for seq_id in cancels.pop(tick, []):
            if seq_id in live:
                live.discard(seq_id)
                driver.end(seq_id)
        balanced(driver.pool, driver.state, limits)
        if len(inflight) < depth:
            items = driver.step()
            inflight.extend(items)
            balanced(driver.pool, driver.state, limits)
            if items:
                continue
        if not inflight:
            if not pending and not driver.state.running and not driver.state.waiting:
                break
            continue
        item = inflight.popleft()
        for seq_id, start, rows in item.parts:
            seq = driver.running(seq_id)
            if seq is None:
                continue  # cancelled or preempted after issue: its result is dropped
            token = seq_id in item.emits
            if token:
                driver.tokens[seq_id].append(next_token(driver.tokens[seq_id]))
            driver.state = sch.landed(driver.state, seq_id, token)
            if token and len(driver.tokens[seq_id]) == targets[seq_id]:
                live.discard(seq_id)
                driver.end(seq_id)
        balanced(driver.pool, driver.state, limits)
    else:
        raise AssertionError("the load did not drain: something starved or deadlocked")
    assert driver.pool.free == pages and not driver.pool.owners()
    assert driver.cache.hit <= driver.cache.queried


LIMITS = sch.Limits(stride=STRIDE, pages_per_seq=6, decode_groups=4, chunk=Bounds(8, 4, 64),
                    max_running=4, chunk_emits=True)


def drain(driver: Driver, targets: dict[int, int], issued: list[sch.Item] = (),
          ticks: int = 200) -> None:
    """Serve, a step at a time (the items `issued` first), until every sequence reached its
    target."""
    for _ in range(ticks):
        items = issued or driver.step()
        issued = []
        for item in items:
            for seq_id, _, _ in item.parts:
                token = seq_id in item.emits
                if token:
                    driver.tokens[seq_id].append(next_token(driver.tokens[seq_id]))
                driver.state = sch.landed(driver.state, seq_id, token)
                if token and len(driver.tokens[seq_id]) == targets[seq_id]:
                    driver.end(seq_id)
        balanced(driver.pool, driver.state, LIMITS)
        if not driver.state.running and not driver.state.waiting:
            return
    raise AssertionError("did not drain")


def test_a_prompt_after_another_prefills_only_past_the_shared_pages():
    driver = Driver(LIMITS, 12)
    prompt = [1, 2, 0, 1, 2, 2, 0, 0, 1, 1, 2]  # 11 tokens: 2 full pages and 3 tokens
    driver.add(0, prompt)
    drain(driver, {0: 13})
    assert driver.pool.cached == 2 and driver.pool.idle == 2  # kept, held by none
    driver.add(1, prompt + [0, 1])
    items = driver.step()
    assert [(i.kind, i.parts) for i in items] == [("chunk", ((1, 8, 5),))]
    assert driver.cache.hit == 8 and driver.cache.queried == 11 + 13
    drain(driver, {1: 15}, items)
    assert driver.pool.free == 12


def test_the_last_prompt_token_is_always_computed():
    driver = Driver(LIMITS, 12)
    prompt = [1, 2, 0, 1, 2, 2, 0, 0]  # exactly 2 pages
    driver.add(0, prompt)
    drain(driver, {0: 9})
    driver.add(1, list(prompt))
    items = driver.step()
    assert [(i.kind, i.parts, i.emits) for i in items] == [("chunk", ((1, 4, 4),), (1,))]
    drain(driver, {1: 9}, items)
    assert driver.tokens[1] == driver.tokens[0]


def test_two_prompts_alike_arriving_together_share_the_pages_one_computes():
    driver = Driver(LIMITS, 12)
    prompt = [2, 1, 0, 0, 1, 2, 2, 1, 0, 1, 1, 2, 0, 2, 1, 0, 2, 2]  # 18 tokens: 4 pages and 2
    driver.add(0, prompt)
    driver.add(1, list(prompt))
    first = driver.step()  # 8 rows of 0; 1 waits for the pages 0 computes
    assert [i.parts for i in first] == [((0, 0, 8),)]
    assert [s.id for s in driver.state.running] == [0] and driver.state.waiting[0].held
    second = driver.step()  # 0 feeds 8 more; 1 waits on, for the pages it may share
    assert [i.parts for i in second] == [((0, 8, 8),)] and driver.state.waiting[0].held
    third = driver.step()  # 1 shares 0's 4 full pages and feeds its last 2 tokens
    assert [s.id for s in driver.state.running] == [0, 1]
    assert driver.pool.held(1)[:4] == driver.pool.held(0)[:4]
    assert driver.pool.shared == {0: 4, 1: 4}
    assert [i.parts for i in third] == [((0, 16, 2), (1, 16, 2))]
    drain(driver, {0: 20, 1: 20}, first + second + third)
    assert driver.cache.hit == 16  # 4 pages: never the last token's
    assert driver.tokens[0] == driver.tokens[1]


def test_a_page_shared_by_many_counts_once_for_each_holder():
    """Sharing counts a page for its first holder when a second comes, and for each newcomer
    (one step a page, not a pass over every holder); releases count down to none."""
    pool = KVPool(6)
    pool.take(0, 3)
    for page, key in zip(pool.held(0), "abc"):
        pool.register(page, key)
    pool.share(1, pool.held(0)[:2])
    pool.share(2, pool.held(0)[:3])
    pool.share(3, pool.held(0)[:1])
    assert pool.shared == {0: 3, 1: 2, 2: 3, 3: 1}
    pool.check()
    pool.release(0)
    assert pool.shared == {1: 2, 2: 2, 3: 1}  # page c: held by 2 alone now
    pool.release(2)
    assert pool.shared == {1: 1, 3: 1}
    pool.check()
    pool.release(1)
    pool.release(3)
    assert pool.shared == {} and pool.free == 6
    pool.check()
