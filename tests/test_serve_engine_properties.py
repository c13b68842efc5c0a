"""kerncc.serve.engine under adversarial but legal use (the tiny example, cpu backend), with
hypothesis: random prompts, lengths, chunk sizes, concurrency, pipeline depth, arrival order,
cancellations at random points (queued, prefilling, decoding), stop tokens, seeded sampling,
a full queue, a cut bundle, pools too small for every sequence at once, and decode steps
issued a step ahead or not, steps of several decode calls (more sequences running than one
decode call takes) among them.

Properties: every request that is not cancelled generates exactly what it generates alone
(the reference loop on the same chain, tests/reference_loop.py), tokens and logits bit for bit, a cancelled one a prefix of
it; the loop always drains (no deadlock, no spin); the pool balances after every step and a
cancelled request's pages are free before the next; a refused request leaves no trace; once
idle, every page is free and nothing runs or waits.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kerncc.cli.main import main
from kerncc.diagnostics import KernccError
from kerncc.example import generate
from kerncc.lower import lower_to_bundle
from kerncc.runtime import Bundle, Chain
from reference_loop import Generation, reference
from kerncc.runtime.sampling import SamplingParams
from kerncc.serve import sampling_hook
from kerncc.serve.engine import Config, Engine, QueueFull, Request
from tests.random_manifests import examples

VOCAB = 256
TICKS = 3000  # far more than any load here needs: a loop that does not drain is a bug


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    manifest, _ = generate(tmp_path_factory.mktemp("tiny"), "tiny")
    return manifest


@pytest.fixture(scope="module")
def chains(model, tmp_path_factory) -> dict[str, Chain]:
    """The whole model with the default pool and with pools of 3, 5 and 9 pages of 16 tokens;
    two stages (a pipeline two calls deep) with the default pool and with 4 pages."""
    bundle = lower_to_bundle(model)
    target = tmp_path_factory.mktemp("two") / "out"
    assert main(["lower", str(model), "-p", "cut{at=12},slice-derive,emit", "-o",
                 str(target)]) == 0
    return {"whole": Chain(bundle), "3 pages": Chain(bundle, token_capacity=48),
            "5 pages": Chain(bundle, token_capacity=80),
            "9 pages": Chain(bundle, token_capacity=144), "cut": Chain(Bundle(target)),
            "cut, 4 pages": Chain(Bundle(target), token_capacity=64)}


def alone(chain: Chain, prompt: list[int], max_new: int, stop_ids: frozenset[int] = frozenset(),
          params: sampling_hook.Params = sampling_hook.Params(), cache: dict = {}  # noqa: B006
          ) -> Generation:
    """What a request generates served alone on `chain` (cached across examples)."""
    key = (id(chain), tuple(prompt), max_new, stop_ids, params)
    if key not in cache:
        native = None if params.greedy else SamplingParams(
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
            seed=params.seed)
        cache[key] = reference(chain, prompt, max_new, stop=stop_ids, sampling=native)
    return cache[key]


SAMPLED = st.builds(sampling_hook.Params, temperature=st.sampled_from([0.7, 1.0, 2.0]),
                    top_k=st.sampled_from([0, 5]), top_p=st.sampled_from([1.0, 0.9]),
                    seed=st.integers(0, 2**16))


@st.composite
def loads(draw, capacity: int, longest: int = 24, shared: bool = False):
    """Requests (prompt, max_new, sampling, stop pick, arrival tick, cancel delay or None)
    that each fit a sequence of `capacity` tokens (at most `longest` new), and the engine's
    settings. A stop pick i makes the i-th token the request generates alone a stop token.
    `shared`: prompts begin with a part of one of two system prompts (the prefix cache's
    pages are then shared)."""
    count = draw(st.integers(1, 7))
    requests = []
    tokens = st.integers(0, VOCAB - 1)
    systems = draw(st.lists(st.lists(tokens, min_size=40, max_size=40).filter(any),
                            min_size=2, max_size=2))
    for _ in range(count):
        length = draw(st.integers(1, min(40, capacity)))
        begun = draw(st.integers(min(length, 17), length)) if shared else 0
        prompt = systems[draw(st.integers(0, 1))][:begun] + draw(
            st.lists(tokens, min_size=length - begun, max_size=length - begun))
        if not any(prompt):
            prompt[-1] = 1
        max_new = draw(st.integers(1, min(longest, capacity + 1 - length)))
        params = draw(st.just(sampling_hook.Params()) | SAMPLED)
        stop = draw(st.none() | st.integers(0, max_new - 1))
        arrival = draw(st.integers(0, 12))
        cancel = draw(st.none() | st.integers(0, 30))
        requests.append((prompt, max_new, params, stop, arrival, cancel))
    config = Config(max_running=draw(st.integers(1, 6)), max_queue=draw(st.integers(1, 8)),
                    chunk=draw(st.integers(1, 64)), depth=draw(st.integers(1, 3)),
                    logits=True, ahead=draw(st.booleans()),
                    prefix_cache=draw(st.booleans()) if not shared else True)
    return requests, config


@st.composite
def crowds(draw):
    """5 to 8 requests (as `loads` gives them, but for their sizes) arriving within two
    ticks, allowed to run more at once than the tiny model's decode program takes (4
    sequences): steps of two decode calls issued ahead, mostly one pipeline call deep
    (deeper, the scheduler staggers the calls itself), with stops, cancels, sampling, page
    crossings and newcomers. Each takes 21 to 48 tokens (2 or 3 pages): in a pool of 9 pages
    five running sequences preempt one."""
    requests = []
    for _ in range(draw(st.integers(5, 8))):
        length = draw(st.integers(1, 16))
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=length, max_size=length))
        if not any(prompt):
            prompt[-1] = 1
        max_new = draw(st.integers(20, 32))
        params = draw(st.just(sampling_hook.Params()) | SAMPLED)
        stop = draw(st.none() | st.none() | st.integers(0, max_new - 1))
        cancel = draw(st.none() | st.none() | st.integers(0, 40))
        requests.append((prompt, max_new, params, stop, draw(st.integers(0, 1)), cancel))
    config = Config(max_running=draw(st.integers(5, 8)), max_queue=8,
                    chunk=draw(st.integers(1, 64)),
                    depth=draw(st.just(1) | st.just(1) | st.integers(2, 3)), logits=True,
                    ahead=True, prefix_cache=draw(st.booleans()))
    return requests, config


def check_balanced(engine: Engine) -> None:
    engine.pool.check()
    assert engine.state.free == engine.pool.free
    for seq in engine.state.running:
        assert len(engine.pool.held(seq.id)) == seq.pages
    assert set(engine.pool.owners()) <= {s.id for s in engine.state.running}


def requests_of(chain: Chain, specs: list) -> list[tuple[Request, int, int | None]]:
    """The requests, their arrival ticks and cancel delays, in arrival order. Stop tokens are
    picked before the engine serves: nothing else may write the runner's inputs meanwhile."""
    made = []
    for prompt, max_new, params, pick, arrival, cancel in specs:
        stop = frozenset()
        if pick is not None:
            stop = frozenset([alone(chain, prompt, max_new, params=params).tokens[pick]])
        made.append((Request(list(prompt), max_new, params, stop), arrival, cancel))
    return sorted(made, key=lambda made: made[1])


def serve(chain: Chain, load) -> tuple[Engine, list[Request], set[int]]:
    """Drive an engine tick by tick: arrivals and cancellations at their ticks, the pool
    checked after every tick; the requests admitted and the ids of those cancelled."""
    specs, config = load
    pending = requests_of(chain, specs)
    engine = Engine(chain, config)
    admitted: list[Request] = []
    cancelled: set[int] = set()
    cancels: dict[int, list[Request]] = {}
    for tick in range(TICKS):
        while pending and pending[0][1] <= tick:
            request, _, cancel = pending.pop(0)
            if not submit(engine, request):
                continue
            admitted.append(request)
            if cancel is not None:
                cancels.setdefault(tick + cancel, []).append(request)
        for request in cancels.pop(tick, []):
            engine.cancel(request)
            if request.finish is None:
                cancelled.add(request.id)
        busy = engine.tick()
        check_balanced(engine)
        for request in admitted:
            if request.id in cancelled:
                assert request.finish is not None, "a cancel is applied before the next step"
                assert not engine.pool.held(request.id), "a cancelled request holds pages"
        if not busy and not pending and not cancels:
            break
    else:
        raise AssertionError(f"the engine did not drain in {TICKS} ticks")
    return engine, admitted, cancelled


def submit(engine: Engine, request: Request) -> bool:
    """Submit; a full queue refuses at once and leaves nothing behind."""
    before = (engine.waiting, engine.running, dict(engine.requests), engine.pool.free)
    try:
        engine.submit(request)
    except QueueFull:
        engine.tick()  # the refused request is not in the commands either
        assert request.id == -1 and request.finish is None
        assert all(r is not request for r in engine.requests.values())
        return False
    assert before[0] < engine.max_queue
    return True


def check_idle(engine: Engine) -> None:
    assert not engine.requests and not engine.inflight
    assert not engine.state.running and not engine.state.waiting and engine.waiting == 0
    assert engine.pool.free == engine.pool.pages == engine.state.free
    assert not engine.pool.owners()
    engine.pool.check()


def check_tokens(chain: Chain, admitted: list[Request], cancelled: set[int]) -> None:
    """Each request's tokens and logits are those it gets alone (a prefix, if cancelled)."""
    for request in admitted:
        want = alone(chain, request.prompt, request.max_new, request.stop_ids, request.params)
        if request.id in cancelled:
            assert request.finish in ("cancelled", "stop", "length")
        else:
            assert request.finish in ("stop", "length"), request.error
            assert len(request.generated) == len(want.tokens)
        assert request.generated == want.tokens[:len(request.generated)], request
        if request.generated:  # the reference's last rows are its tokens' logits
            rows = want.logits[-len(want.tokens):][:len(request.generated)]
            assert np.array_equal(np.stack(request.logits).view(np.uint32),
                                  rows.view(np.uint32)), f"request {request.id}'s logits"


@settings(max_examples=examples(30, 400))
@given(load=loads(capacity=256), name=st.sampled_from(["whole", "cut"]))
def test_random_loads_give_each_request_its_tokens_alone(chains, load, name):
    engine, admitted, cancelled = serve(chains[name], load)
    check_idle(engine)
    check_tokens(chains[name], admitted, cancelled)


@settings(max_examples=examples(40, 400))
@given(load=loads(capacity=48, longest=48),
       name=st.sampled_from(["3 pages", "5 pages", "cut, 4 pages"]))
def test_small_pools_preempt_or_wait_and_give_each_request_its_tokens(chains, load, name):
    engine, admitted, cancelled = serve(chains[name], load)
    check_idle(engine)
    check_tokens(chains[name], admitted, cancelled)


@settings(max_examples=examples(10, 300))
@given(prompt=st.lists(st.integers(-3, VOCAB + 3), max_size=300),
       max_new=st.integers(-2, 300))
def test_a_refused_request_leaves_no_trace(chains, prompt, max_new):
    engine = Engine(chains["3 pages"], Config(max_queue=2))
    try:
        engine.submit(Request(prompt, max_new))
    except KernccError:
        assert not engine.requests and engine.waiting == 0
        engine.run_until_idle()
        check_idle(engine)
        return
    engine.run_until_idle()
    check_idle(engine)


@settings(max_examples=examples(30, 400))
@given(load=loads(capacity=48, longest=48, shared=True),
       name=st.sampled_from(["cut", "3 pages", "5 pages", "cut, 4 pages"]))
def test_prompts_sharing_cached_pages_give_each_request_its_tokens_alone(chains, load, name):
    """With the prefix cache on, prompts that begin alike share their full pages (computed
    once, kept, evicted, shared while queued or running, preempted, cancelled): each request's
    tokens and logits are still those it gets alone, bit for bit."""
    engine, admitted, cancelled = serve(chains[name], load)
    check_idle(engine)
    check_tokens(chains[name], admitted, cancelled)
    assert engine.prefix.hit <= engine.prefix.queried


@settings(max_examples=examples(25, 300))
@given(load=crowds(), name=st.sampled_from(["9 pages", "whole", "cut"]))
def test_more_sequences_than_a_decode_call_takes_go_ahead_with_their_tokens_alone(
        chains, load, name):
    """More sequences running than one decode call takes (the tiny model's takes 4): steps
    of several decode calls go ahead call for call, each fed from the copy of its call's
    token output; every request still gets its tokens and logits alone, bit for bit, with
    stop tokens, cancels, sampled requests drawn on the device, ends by length, pages
    granted at page boundaries, preemption in a small pool and newcomers admitted."""
    engine, admitted, cancelled = serve(chains[name], load)
    check_idle(engine)
    check_tokens(chains[name], admitted, cancelled)
