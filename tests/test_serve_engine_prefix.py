"""Prefix caching in kerncc.serve.engine on the tiny example (cpu backend), whole and cut:
prompts that share a system prompt, arriving together or one after another, give the tokens
and logits they give with the cache off, bit for bit, while their shared pages are computed
once; a prefill that starts past cached pages (a chunk at a nonzero position, the earlier
positions read only through the KV pages another sequence wrote) gives a whole prefill's
logits; the pages come back.
"""

from __future__ import annotations

import numpy as np
import pytest

from kerncc.cli.main import main
from kerncc.example import generate
from kerncc.lower import lower_to_bundle
from kerncc.runtime import Bundle, Chain
from kerncc.serve.engine import Config, Engine, Request
from reference_loop import reference

SYSTEM = 40  # tokens of the shared prompt: 2 full pages of 16 and 8 tokens
MAX_NEW = 6


@pytest.fixture(scope="module")
def chains(tmp_path_factory) -> dict[str, Chain]:
    model, _ = generate(tmp_path_factory.mktemp("tiny"), "tiny")
    target = tmp_path_factory.mktemp("two") / "out"
    assert main(["lower", str(model), "-p", "cut{at=12},slice-derive,emit", "-o",
                 str(target)]) == 0
    return {"whole": Chain(lower_to_bundle(model)), "cut": Chain(Bundle(target))}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    system = rng.integers(1, 256, SYSTEM).tolist()
    return [system + rng.integers(1, 256, n).tolist() for n in (3, 11, 0, 20, 7)]


def serve(chain: Chain, prompts: list[list[int]], cache: bool, together: bool,
          max_running: int = 4) -> tuple[list[Request], Engine]:
    """Serve the prompts on one engine: all submitted at once, or each after the one before
    finished (its pages cached by then)."""
    engine = Engine(chain, Config(max_running=max_running, logits=True, prefix_cache=cache,
                                  chunk=16))
    requests = [Request(list(p), MAX_NEW) for p in prompts]
    for request in requests:
        engine.submit(request)
        if not together:
            idle(engine)
    idle(engine)
    assert engine.pool.free == engine.pool.pages and not engine.pool.owners()
    engine.pool.check()
    return requests, engine


def idle(engine: Engine, ticks: int = 2000) -> None:
    """Serve until nothing is left, the cache kept (`run_until_idle` forgets it first: the
    runner may have run other work)."""
    for _ in range(ticks):
        if not engine.tick():
            assert engine.fault is None and not engine.requests
            return
    raise AssertionError("the engine did not drain")


def same_bits(a: list[Request], b: list[Request]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.finish == y.finish == "length"
        assert x.generated == y.generated
        assert np.array_equal(np.stack(x.logits).view(np.uint32),
                              np.stack(y.logits).view(np.uint32))


@pytest.mark.parametrize("name", ["whole", "cut"])
@pytest.mark.parametrize("together", [True, False])
def test_the_cache_gives_the_bits_it_gives_off_and_computes_the_shared_pages_once(
        chains, prompts, name, together):
    on, engine = serve(chains[name], prompts, cache=True, together=together)
    off, plain = serve(chains[name], prompts, cache=False, together=together)
    same_bits(on, off)
    shared = 2 * 16 * (len(prompts) - 1)  # every prompt but the first takes 2 pages
    assert engine.prefix.hit == shared and plain.prefix.hit == 0
    assert engine.prefix.queried == plain.prefix.queried == sum(map(len, prompts))
    # rows issued ahead for a sequence that ended by length before they landed are fed too
    fed = sum(engine.rows.values()) - engine.dropped - MAX_NEW * len(prompts)
    assert fed == sum(plain.rows.values()) - plain.dropped - MAX_NEW * len(prompts) - shared
    assert engine.pool.cached > 0 and plain.pool.cached == 0


def test_a_prefill_past_cached_pages_gives_a_whole_prefills_logits(chains, prompts):
    """The second prompt's first chunk starts at position 32, its earlier positions read
    through pages the first prompt's chunks wrote; its logits are a whole prefill's alone
    (the reference loop on the same chain, tests/reference_loop.py), bit for bit."""
    chain = chains["cut"]
    want = reference(chain, prompts[1], MAX_NEW)
    served, engine = serve(chain, prompts[:2], cache=True, together=False)
    starts = [start for item_starts in engine_starts(chain, prompts[:2]) for start in item_starts]
    assert 32 in starts, starts
    assert served[1].generated == want.tokens
    rows = want.logits[-len(want.tokens):]
    assert np.array_equal(np.stack(served[1].logits).view(np.uint32), rows.view(np.uint32))
    assert engine.prefix.hit == 32


def engine_starts(chain: Chain, prompts: list[list[int]]) -> list[list[int]]:
    """The first rows of every chunk call's parts, serving the prompts one after another."""
    engine = Engine(chain, Config(chunk=16))
    starts: list[list[int]] = []
    real = engine._submit

    def submit(item, *args, **kwargs):
        if item.kind == "chunk":
            starts.append([start for _, start, _ in item.parts])
        return real(item, *args, **kwargs)

    engine._submit = submit
    for prompt in prompts:
        engine.submit(Request(list(prompt), 1))
        idle(engine)
    return starts


@pytest.mark.parametrize("name", ["whole", "cut"])
def test_a_preempted_sequence_that_shares_pages_gets_its_bits_and_frees_only_its_own(
        chains, prompts, name):
    """A pool of 5 pages: two prompts sharing 2 pages each grow to 5 pages, so the newer is
    preempted while the older still holds the shared ones, and recomputed from the cache."""
    chain = Chain(chains[name].bundle, token_capacity=80)
    pair = [prompts[0][:36], prompts[0][:32] + [9, 8, 7, 6, 5]]
    engines = {}
    for cache in (True, False):
        engine = Engine(chain, Config(max_running=2, logits=True, prefix_cache=cache))
        requests = [engine.submit(Request(list(p), 40)) for p in pair]
        for _ in range(2000):
            if not engine.tick():
                break
            engine.pool.check()
            assert engine.state.free == engine.pool.free
            assert engine.state.shared == engine.pool.shared
        engines[cache] = engine, requests
    (on, served), (off, plain) = engines[True], engines[False]
    assert on.preemptions > 0 and on.prefix.hit >= 32
    same_bits(served, plain)
    assert on.pool.free == on.pool.pages


def test_a_small_pool_evicts_cached_pages_least_recently_released_first(chains, prompts):
    """A pool of 6 pages: each prompt needs 4, so the cached ones go as new prompts come."""
    chain = Chain(chains["whole"].bundle, token_capacity=96)
    rng = np.random.default_rng(11)
    others = [rng.integers(1, 256, 50).tolist() for _ in range(3)]
    order = [prompts[0], others[0], prompts[1], others[1], others[2], prompts[3]]
    on, engine = serve(chain, order, cache=True, together=False)
    off, _ = serve(chain, order, cache=False, together=False)
    same_bits(on, off)
    assert engine.pool.evictions > 0
    assert engine.pool.cached <= engine.pool.pages


def test_metrics_count_the_tokens_found_and_the_pages_kept(chains, prompts):
    pytest.importorskip("prometheus_client")
    from kerncc.serve.metrics import Metrics

    _, engine = serve(chains["whole"], prompts, cache=True, together=False)
    text = Metrics(engine).render().decode()
    found = dict(line.split(" ") for line in text.splitlines()
                 if line.startswith("kerncc_prefix"))
    queried = sum(map(len, prompts))
    assert float(found["kerncc_prefix_cache_queried_tokens_total"]) == queried
    assert float(found["kerncc_prefix_cache_hit_tokens_total"]) == 128
    assert float(found["kerncc_prefix_cache_hit_rate"]) == pytest.approx(128 / queried)
    assert float(found["kerncc_prefix_cache_pages"]) == engine.pool.cached > 0
    assert float(found["kerncc_prefix_cache_evictions_total"]) == 0


def test_serve_takes_no_prefix_cache():
    from kerncc.cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "x"]).prefix_cache is True
    assert parser.parse_args(["serve", "x", "--no-prefix-cache"]).prefix_cache is False
