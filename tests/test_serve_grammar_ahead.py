"""Grammar rows go a step ahead (kerncc.serve.engine `_draw_ahead`): a decode step holding a
request that follows a grammar has its forward issued before the step before it has landed
(its token input fed on the device), and its draw (the masks, processing and sampling) once
that step's tokens are here and each grammar has followed its token.

Properties, on the cpu backend with the tiny example: a batch holding grammar rows goes
ahead; every request gets the tokens, logits rows and logprobs it gets a step at a time
(`Config(ahead=False)`), bit for bit, whatever it is batched with (greedy, seeded sampling,
penalties, logit_bias, logprobs, json_schema, json_object and regex grammars), whenever it
arrives; a grammar that completes ends its request on the eos (or, eos no stop, runs on to
its length as a step at a time does), and a request cancelled mid-flight (as a stop string
cancels it) gets a prefix of its tokens, its row's token dropped.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kerncc.example import generate
from kerncc.lower import lower_to_bundle
from kerncc.runtime import Chain
from kerncc.serve import grammar
from kerncc.serve.engine import Config, Engine, Request
from kerncc.serve.sampling_hook import Params
from tests.random_manifests import examples

pytest.importorskip("llguidance")
pytest.importorskip("tokenizers")

TICKS = 2000  # far more than any load here needs: a loop that does not drain is a bug
ITEMS = {"type": "array", "minItems": 2, "maxItems": 6, "items": {
    "type": "object", "required": ["n", "ok"], "additionalProperties": False,
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                   "ok": {"type": "boolean"}}}}
FORMS = {"json_schema": {"guided_json": ITEMS},
         "json_object": {"response_format": {"type": "json_object"}},
         "regex": {"guided_regex": "(ab|cd)+[0-9]{2,4}x?"},
         "short": {"guided_regex": "[0-9]{2}"}}  # complete after two digits: then the eos


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    manifest, _ = generate(tmp_path_factory.mktemp("tiny"), "tiny")
    return manifest


@pytest.fixture(scope="module")
def chain(model) -> Chain:
    return Chain(lower_to_bundle(model))


@pytest.fixture(scope="module")
def shapes(model) -> tuple[dict[str, grammar.Grammar], int]:
    """The grammars by name, and the eos that ends a complete one."""
    from kerncc.hf.tokenizer import TextCodec

    codec = TextCodec.from_dir(model.parent)
    vocab = json.loads((model.parent / "config.json").read_text())["vocab_size"]
    built = grammar.Grammars(codec, vocab, min(codec.eos_token_ids))
    return {name: built.of(form) for name, form in FORMS.items()}, built.eos


def kinds(shapes: dict[str, grammar.Grammar]) -> list[Params]:
    """Every kind of row a decode step may hold, grammars among them."""
    return [Params(), Params(temperature=0.9, seed=4),
            Params(presence_penalty=0.6, logit_bias=((12, 3.0), (40, -2.0)), logprobs=2),
            Params(temperature=1.1, seed=9, frequency_penalty=0.4, logprobs=0),
            Params(grammar=shapes["json_schema"]),
            Params(temperature=0.8, seed=3, grammar=shapes["json_object"], logprobs=3),
            Params(temperature=1.0, seed=7, grammar=shapes["regex"]),
            Params(temperature=0.7, seed=1, grammar=shapes["short"], min_tokens=1,
                   suppress=frozenset({2}))]


def outcome(request: Request) -> tuple:
    """What a request was given: its tokens, logits bits, logprobs heard, best_of score,
    finish."""
    logits = np.stack(request.logits).view(np.uint32).tobytes() if request.logits else b""
    return (request.generated, logits, list(getattr(request.sampler, "heard", [])),
            getattr(request.sampler, "cumulative", None), request.finish)


def served(chain: Chain, specs: list[tuple], ahead: bool, max_running: int = 8
           ) -> tuple[list[Request], Engine]:
    """Drive an engine tick by tick: request i (prompt, max_new, params, stops, arrival tick,
    cancel delay or None) arrives at its tick and is cancelled that many ticks later."""
    engine = Engine(chain, Config(max_running=max_running, chunk=64, logits=True,
                                  ahead=ahead))
    requests = [Request(list(p), n, q, frozenset(s)) for p, n, q, s, _, _ in specs]
    cancels: dict[int, list[Request]] = {}
    for tick in range(TICKS):
        for request, (_, _, _, _, arrival, cancel) in zip(requests, specs):
            if arrival == tick:
                engine.submit(request)
                if cancel is not None:
                    cancels.setdefault(tick + cancel, []).append(request)
        for request in cancels.pop(tick, []):
            engine.cancel(request)
        busy = engine.tick()
        if not busy and tick > max(s[4] for s in specs) and not cancels:
            break
    else:
        raise AssertionError(f"the engine did not drain in {TICKS} ticks")
    assert not engine.requests and not engine.inflight
    assert engine.pool.free == engine.pool.pages
    return requests, engine


@pytest.mark.parametrize("group, eos_stops", [((2, 4, 5, 7), True), ((0, 1, 3, 6), False)])
def test_a_batch_with_grammar_rows_goes_ahead_with_the_bits_of_steps_one_at_a_time(
        chain, shapes, group, eos_stops):
    """Four rows (the tiny model's decode call takes four), one or more following grammars
    all along: the steady decode goes ahead, with the bits of the steps one at a time."""
    forms, eos = shapes
    params = kinds(forms)
    stops = {eos} if eos_stops else ()
    specs = [([5 + i, 17, 40, 3 * i + 1], 16, params[i], stops, 0, None) for i in group]
    one, before = served(chain, specs, ahead=False)
    ahead, engine = served(chain, specs, ahead=True)
    assert before.ahead_steps == 0
    assert engine.ahead_steps >= 8, "the batch holding grammar rows went ahead"
    assert [outcome(r) for r in ahead] == [outcome(r) for r in one]
    short = [r for r in ahead if r.params.grammar is forms["short"]]
    for r in short:
        assert r.finish == "stop" and len(r.generated) == 3 and r.generated[-1] == eos, \
            "the short grammar completed on its third token (the others ran on)"
    assert max(len(r.generated) for r in ahead) == 16


def test_grammar_rows_prefilled_in_chunks_planned_early_keep_the_bits(chain, shapes):
    """Prompts of several chunks of 64: the next step's chunks go while the step before runs
    (`Engine._chunk_ahead`), a grammar's first token drawn under its first mask as it is a
    step at a time; every outcome is the steps one at a time's."""
    forms, eos = shapes
    params = kinds(forms)
    specs = [([(7 * j + i) % 200 + 1 for j in range(n)], 12, params[i], {eos}, 0, None)
             for i, n in zip((4, 5, 1, 6, 7, 2), (150, 90, 130, 70, 140, 100))]
    one, _ = served(chain, specs, ahead=False)
    ahead, engine = served(chain, specs, ahead=True)
    assert engine.early_steps > 0, "prefill chunks were planned while a step ran"
    assert [outcome(r) for r in ahead] == [outcome(r) for r in one]


def test_a_complete_grammar_without_an_eos_stop_runs_on_as_a_step_at_a_time(chain, shapes):
    """Its eos is no stop token: the grammar done, its masks let nothing more through; the
    request runs to its length, the same tokens ahead or not (never a hang)."""
    forms, _ = shapes
    specs = [([9, 8, 7], 10, Params(temperature=0.9, seed=2, grammar=forms["short"]), (), 0,
              None), ([3, 4], 10, Params(temperature=0.9, seed=5), (), 0, None)]
    one, _ = served(chain, specs, ahead=False)
    ahead, engine = served(chain, specs, ahead=True)
    assert engine.ahead_steps > 0
    assert [outcome(r) for r in ahead] == [outcome(r) for r in one]
    assert ahead[0].finish == "length" and len(ahead[0].generated) == 10


@pytest.mark.parametrize("grammar_row", [False, True])
def test_a_request_that_stops_under_a_step_ahead_hears_only_its_tokens(chain, shapes,
                                                                     grammar_row):
    """A processed request (logprobs, best_of's score) that stops on a token while the step
    after it is issued: that step's row is dropped, its logprob and top tokens with it (its
    logprobs, one a token, and its score are a step at a time's); with a grammar row beside
    it, the draw that comes later too."""
    forms, _ = shapes
    params = [Params(temperature=0.9, seed=1, logprobs=1, ranked=True),
              Params(temperature=0.8, seed=2, grammar=forms["json_schema"]) if grammar_row
              else Params(temperature=0.8, seed=2)]
    specs = [([5, 6, 7], 12, params[0], (), 0, None), ([5, 6, 8], 12, params[1], (), 0, None)]
    first, _ = served(chain, specs, ahead=False)
    stop = (first[0].generated[4],)
    specs[0] = (*specs[0][:3], stop, 0, None)
    one, _ = served(chain, specs, ahead=False)
    ahead, engine = served(chain, specs, ahead=True)
    assert engine.ahead_steps >= 3
    assert [outcome(r) for r in ahead] == [outcome(r) for r in one]
    stopped = ahead[0]
    assert stopped.finish == "stop" and len(stopped.generated) <= 5
    assert len(stopped.sampler.heard) == len(stopped.generated)
    assert stopped.sampler.cumulative == sum(h.logprob for h in stopped.sampler.heard)


@st.composite
def loads(draw, count: int):
    """Requests (prompt, max_new, kind index, eos a stop, arrival tick, cancel delay)."""
    made = []
    for _ in range(draw(st.integers(1, 6))):
        prompt = draw(st.lists(st.integers(1, 255), min_size=1, max_size=12))
        made.append((prompt, draw(st.integers(1, 14)), draw(st.integers(0, count - 1)),
                     draw(st.booleans()), draw(st.integers(0, 8)),
                     draw(st.none() | st.integers(1, 24))))
    return made, draw(st.integers(1, 4))


def test_a_grammar_row_in_a_step_of_two_decode_calls_keeps_the_bits_of_steps_one_at_a_time(
        chain, shapes):
    """Six sequences over the tiny example's 4-sequence decode program make steps of two
    calls, which share one logits buffer: a grammar's row keeps such a step a step at a time
    (its draw cannot wait past the next call), and once the grammar's request ends the
    greedy rest go ahead again. Either way the bits of steps one at a time."""
    forms, eos = shapes
    params = kinds(forms)
    specs = [([5 + i, 9, 13], 3 if i == 0 else 14, params[4 if i == 0 else 0], (), 0, None)
             for i in range(6)]
    alone, _ = served(chain, specs, ahead=False, max_running=6)
    ahead, engine = served(chain, specs, ahead=True, max_running=6)
    assert engine.limits.decode_groups < 6
    assert engine.ahead_steps > 0
    assert [outcome(r) for r in ahead] == [outcome(r) for r in alone]
    assert len(ahead[0].generated) == 3 and all(len(r.generated) == 14 for r in ahead[1:])


@settings(max_examples=examples(25, 300))
@given(load=loads(count=8))
def test_random_mixes_with_grammar_rows_get_the_tokens_of_steps_one_at_a_time(
        chain, shapes, load):
    """Random batches of every kind of row, arriving over time, some cancelled mid-flight:
    a request not cancelled gets what it gets a step at a time with everyone at once (tokens,
    logits, logprobs and finish, bit for bit); a cancelled one a prefix of its tokens."""
    forms, eos = shapes
    params = kinds(forms)
    given_load, max_running = load
    specs = [(p, n, params[k], {eos} if stop else (), arrival, cancel)
             for p, n, k, stop, arrival, cancel in given_load]
    alone, _ = served(chain, [(*s[:4], 0, None) for s in specs], ahead=False)
    ahead, _ = served(chain, specs, ahead=True, max_running=max_running)
    for got, want, spec in zip(ahead, alone, specs):
        if spec[5] is None:
            assert outcome(got) == outcome(want)
            continue
        n = len(got.generated)
        assert got.finish in ("cancelled", want.finish)
        assert got.generated == want.generated[:n]
        assert outcome(got)[1] == outcome(want)[1][:n * len(want.logits[0]) * 4]
        assert outcome(got)[2] == outcome(want)[2][:n], "a dropped row's logprobs not heard"


@pytest.mark.gpu
def test_on_a_gpu_grammar_rows_go_ahead_with_the_bits_of_steps_one_at_a_time(model, shapes):
    """On cuda the draw issued after the step's forward (the grammar masks uploaded then, the
    logits cubin's kernels and the sampler on that step's logits) gives the tokens, logits
    and logprobs of the steps one at a time, and the batch goes ahead."""
    from bundles import close_chains, cuda_chain

    forms, eos = shapes
    params = kinds(forms)
    specs = [([5 + i, 17, 40, 3 * i + 1], 16, params[i], {eos}, 0, None)
             for i in (2, 4, 5, 7)]
    chain = cuda_chain(lower_to_bundle(model))
    try:
        one, _ = served(chain, specs, ahead=False)
        ahead, engine = served(chain, specs, ahead=True)
        assert engine.ahead_steps >= 8, "the batch holding grammar rows went ahead"
        assert engine.drawn_steps > 0
        assert [outcome(r) for r in ahead] == [outcome(r) for r in one]
    finally:
        close_chains(chain)
