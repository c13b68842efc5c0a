"""Greedy decoding one step ahead of the host (the engine's `Config.ahead`, one prompt served
alone as `kerncc run` serves it), on the cpu backend: step k + 1 is issued before the host has step k's token, its token input written on
the device from step k's token output (`Session.feed`).

What must hold: the same tokens, logits, runs and streamed tokens as one step at a time, whole
and in 2 stages, at every chunk size and wherever a stop token ends generation (the step issued
past it leaves no trace, and every page comes back); the feeds really happen; and a stage that
cannot prove the fed values fit the token input's domain (the library's argmax over at most
the vocabulary writes the output) decodes one step at a time. On the GPU the same calls go in
the same order on one stream (tests/test_generate_lookahead_cuda.py).
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bundles import whole_and_two
from kerncc.runtime import Chain
from kerncc.runtime.model_runner import ModelRunner
from kerncc.runtime.sampling import SamplingParams
from kerncc.runtime.session import Session
from kerncc.serve.engine import Config, Engine
from tests.random_manifests import examples
from reference_loop import Generation, alone

PROMPTS = [[5], [5, 6, 7], list(range(1, 40)), [(i * 37) % 250 + 1 for i in range(70)]]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict:
    return whole_and_two(tmp_path_factory.mktemp("lookahead"))


def run(chain: Chain, lookahead: bool, *args, **kwargs) -> tuple[Generation, list]:
    """One prompt served alone (every page back: `alone`), the tokens its listener heard."""
    streamed: list[int] = []

    class Heard:
        def token(self, request, token):
            streamed.append(token)

        def done(self, request):
            pass

    return alone(chain, *args, ahead=lookahead, listener=Heard(), **kwargs), streamed


def same(a: Generation, b: Generation) -> None:
    assert a.tokens == b.tokens
    assert a.steps == b.steps
    np.testing.assert_array_equal(a.logits.view(np.uint32), b.logits.view(np.uint32))


@pytest.fixture
def feeds(monkeypatch) -> list:
    """Every device-side feed (input, output), counted."""
    made: list = []
    feed = Session.feed

    def counted(self, name, source, output, vars=None, kept=None):
        made.append((name, output))
        return feed(self, name, source, output, vars, kept)

    monkeypatch.setattr(Session, "feed", counted)
    return made


@pytest.mark.parametrize("bundle", ["whole", "two"])
@pytest.mark.parametrize("chunk", [1, 16, 64])
def test_a_step_ahead_gives_one_step_at_a_times_tokens_logits_and_runs(bundles, bundle, chunk,
                                                                        feeds):
    g = Chain(bundles[bundle])
    for prompt in PROMPTS:
        for max_new in (1, 2, 3, 11):
            feeds.clear()
            ahead, streamed = run(g, True, prompt, max_new, chunk)
            assert len(feeds) == max(0, max_new - 2), "every step but the first two was fed"
            one, streamed_alone = run(g, False, prompt, max_new, chunk)
            same(ahead, one)
            assert streamed == streamed_alone == ahead.tokens


@pytest.mark.parametrize("bundle", ["whole", "two"])
def test_a_stop_token_drops_the_step_issued_past_it(bundles, bundle, feeds):
    g = Chain(bundles[bundle])
    prompt = PROMPTS[2]
    full = run(g, False, prompt, 12, 16)[0].tokens
    assert len(set(full)) > 3, "a stop token must be told apart from the others"
    for at in (0, 1, 2, 5, 11):
        stop = full[at]
        first = full.index(stop)  # generation ends at the first time the stop token comes
        ahead, _ = run(g, True, prompt, 12, 16, stop={stop})
        one, _ = run(g, False, prompt, 12, 16, stop={stop})
        same(ahead, one)
        assert ahead.tokens == full[:first + 1]
    assert feeds, "the steps went ahead"


@pytest.fixture(scope="module")
def generators(bundles) -> dict:
    return {name: Chain(path) for name, path in bundles.items()}


@settings(max_examples=examples(25, 400), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(1, 255), min_size=1, max_size=90),
       max_new=st.integers(1, 40), chunk=st.integers(1, 64), stop_pick=st.integers(0, 45),
       bundle=st.sampled_from(["whole", "two"]))
def test_any_request_gives_one_step_at_a_times_tokens_ahead(generators, prompt, max_new, chunk,
                                                            stop_pick, bundle):
    """Random prompts, lengths, chunk sizes and stop tokens (the stop_pick-th token the
    request generates, when it gets that far): a step ahead gives one step at a time's
    tokens, runs and logits, and every page comes back."""
    g = generators[bundle]
    one, _ = run(g, False, prompt, max_new, chunk)
    stop = one.tokens[stop_pick] if stop_pick < len(one.tokens) else None
    until = () if stop is None else {stop}
    ahead, streamed = run(g, True, prompt, max_new, chunk, stop=until)
    want, _ = run(g, False, prompt, max_new, chunk, stop=until)
    same(ahead, want)
    assert streamed == ahead.tokens


def test_sampled_decoding_goes_ahead_with_the_tokens_of_steps_one_at_a_time(bundles, feeds):
    """A sampled token is drawn on the device (Session.sample_into) and fed like a greedy
    one: the tokens, logits and runs of the steps one at a time."""
    g = Chain(bundles["whole"])
    params = SamplingParams(temperature=0.8, seed=3)
    ahead, _ = run(g, True, PROMPTS[1], 8, 16, sampling=params)
    assert feeds, "the sampled decode went ahead"
    one, _ = run(g, False, PROMPTS[1], 8, 16, sampling=params)
    same(ahead, one)


def test_the_feed_needs_the_librarys_argmax_within_the_token_domain(bundles, monkeypatch):
    """The fed bytes pass no host check, so the lookahead needs a proof that they fit: the
    step program's last launch touching its token output is the library's argmax_f32, whose
    vocabulary is within the token input's domain."""
    chain = Chain(bundles["whole"])
    session = chain.sessions[0]
    step = ModelRunner(chain).step_program

    def feeder():  # worked out afresh (a runner works it out once)
        return ModelRunner(chain).feeder(step, 1)

    assert feeder() is not None
    sites = session.sites["decode"]
    at = next(i for i, s in enumerate(sites) if s.entry == "argmax_f32")
    vocab = int(sites[at].args[3])
    assert session.token_range("decode", step.emits) == (0, vocab - 1)
    larger = attrs.evolve(sites[at], args=(*sites[at].args[:3], np.int32(vocab + 1)))
    foreign = attrs.evolve(sites[at], module="0" * 64)
    after = attrs.evolve(sites[at], entry="embedding_gather_bf16")  # touches it after argmax
    for changed in ([*sites[:at], larger, *sites[at + 1:]],
                    [*sites[:at], foreign, *sites[at + 1:]],
                    [*sites, after]):
        monkeypatch.setitem(session.sites, "decode", changed)
        assert feeder() is None
    monkeypatch.setitem(session.sites, "decode", sites)
    assert feeder() is not None
    assert Engine(chain).ahead and not Engine(chain, Config(ahead=False)).ahead


def test_an_input_is_fed_only_from_a_buffer_of_its_type(bundles):
    from kerncc.diagnostics import KernccError

    session = Chain(bundles["whole"]).sessions[0]
    with pytest.raises(KernccError, match="cannot feed input `token_ids`"):
        session.feed("token_ids", session, "logits", {"tokens": 1})
    assert not session.fits_domain("token_ids", -1, 3)
    assert not session.fits_domain("logits", 0, 3)  # not an input
