"""Serving at the device's pace (issue 40): sampled requests drawn on the device and fed to
the next step like greedy ones, prefill chunks interleaved with the running decodes within a
step's token budget, and the step after planned while the device runs the step before.

Every property is checked on the cpu backend against the steps one at a time (ahead off, the
tokens drawn on the host), tokens and logits bit for bit, and structurally on the simulated
device (bench/simulated.py): never by a timing.
"""

from __future__ import annotations

import numpy as np
import pytest

from kerncc.example import generate
from kerncc.lower import lower_to_bundle
from kerncc.runtime import Chain
from kerncc.runtime.sampling import SamplingParams, sample_logits
from kerncc.serve import sampling_hook
from kerncc.serve.engine import Config, Engine, Request
from reference_loop import reference

SAMPLED = (sampling_hook.Params(temperature=0.8, top_p=0.95, seed=11),
           sampling_hook.Params(temperature=1.3, top_k=5, seed=12),
           sampling_hook.Params(temperature=0.6, top_k=40, top_p=0.9, seed=2**63 + 5))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    manifest, _ = generate(tmp_path_factory.mktemp("tiny"), "tiny")
    return manifest


@pytest.fixture(scope="module")
def whole(model) -> Chain:
    return Chain(lower_to_bundle(model))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(40)
    return [rng.integers(0, 256, n).tolist() for n in (3, 17, 9, 30, 1, 12)]


def served(runner, prompts, params, max_new=24, stops=(), **config):
    """Every prompt with its params, all admitted at once; the requests and the engine."""
    engine = Engine(runner, Config(max_running=len(prompts), logits=True, **config))
    requests = [engine.submit(Request(p, max_new, q, frozenset(stops)))
                for p, q in zip(prompts, params)]
    engine.run_until_idle()
    assert all(r.finish in ("length", "stop") for r in requests)
    assert engine.pool.free == engine.pool.pages
    return requests, engine


def mixed(n: int) -> list[sampling_hook.Params]:
    """Every other request samples (three kinds of params), the rest are greedy."""
    return [SAMPLED[i // 2 % 3] if i % 2 else sampling_hook.Params() for i in range(n)]


def test_sampled_requests_go_ahead_with_the_tokens_of_steps_one_at_a_time(whole, prompts):
    """Greedy and sampled sequences in one batch: drawn on the device and fed to the next
    step, the tokens and logits of the steps one at a time with host draws, bit for bit;
    the steady decode goes ahead (without the device draw and feed it cannot)."""
    params = mixed(len(prompts))
    one, _ = served(whole, prompts, params, ahead=False, draw_on_device=False)
    stops = [one[1].generated[7], one[4].generated[12]]  # a sampled and a greedy one stop
    one, _ = served(whole, prompts, params, stops=stops, ahead=False, draw_on_device=False)
    ahead, engine = served(whole, prompts, params, stops=stops)
    assert engine.ahead_steps >= 10, "the sampled batch went ahead"
    assert [r.finish for r in one] == [r.finish for r in ahead]
    for a, b in zip(one, ahead):
        assert a.generated == b.generated
        assert np.array_equal(np.stack(a.logits).view(np.uint32),
                              np.stack(b.logits).view(np.uint32))
    greedy = reference(whole, prompts[1], 24).tokens
    assert ahead[1].generated[:len(greedy)] != greedy[:len(ahead[1].generated)], \
        "sampling at temperature 0.8 changes something"


def test_a_token_drawn_on_the_cpu_device_is_the_host_draw_for_its_counter(whole, prompts):
    """The cpu backend draws on the device with the numpy reference of the kernel's ABI:
    every sampled token equals `sample_logits` over the step's logits row with the counter
    (0, its index), the host draw; greedy tokens are the argmax."""
    params = mixed(4)
    requests, engine = served(whole, prompts[:4], params, max_new=16)
    assert engine.ahead_steps > 0
    for request, p in zip(requests, params):
        native = sampling_hook.prepare(p) or SamplingParams()
        rows = np.stack(request.logits)
        for step, token in enumerate(request.generated):
            host = sample_logits(rows, [step], [native], [(0, step)])
            assert token == int(host[0]), (request.id, step)


def test_the_device_draw_is_the_one_run_a_step_at_a_time_with_the_draw_on_it(whole, prompts):
    """Ahead off, the draw on the device: the same tokens as ahead on (the feed changes no
    token) and as the host draw."""
    params = mixed(len(prompts))
    host, _ = served(whole, prompts, params, ahead=False, draw_on_device=False)
    device, engine = served(whole, prompts, params, ahead=False)
    assert engine.ahead_steps == 0
    assert [r.generated for r in host] == [r.generated for r in device]


@pytest.mark.parametrize("extra", [dict(presence_penalty=0.5), dict(logit_bias=((3, 2.0),)),
                                   dict(logprobs=2)])
def test_a_processed_request_is_drawn_on_the_device_and_goes_ahead(whole, prompts, extra):
    """Penalties, a logit bias and logprobs are processed where the tokens are drawn
    (kerncc.runtime.processing, their state kept there): a batch holding such a request goes
    ahead, and its tokens are those of the host draw a step at a time."""
    params = [sampling_hook.Params(temperature=0.8, seed=5, **extra), SAMPLED[0]]
    ahead, engine = served(whole, prompts[:2], params, max_new=10)
    one, _ = served(whole, prompts[:2], params, max_new=10, ahead=False,
                    draw_on_device=False)
    assert engine.ahead_steps > 0 and engine.drawn_steps > 0
    assert [r.generated for r in one] == [r.generated for r in ahead]


def test_draws_on_the_host_keep_sampled_steps_one_at_a_time(whole, prompts):
    """Config(draw_on_device=False): the tokens come back before the next step is issued."""
    _, engine = served(whole, prompts[:2], [SAMPLED[0], sampling_hook.Params()], max_new=12,
                       draw_on_device=False)
    assert engine.ahead_steps == 0


def test_a_sampled_first_token_is_drawn_on_the_device_too(whole, prompts, monkeypatch):
    """A chunk's first token of a sampled request is drawn on the device as a decode step's
    are (on the host each row cost ~0.5 ms over a 32k vocab while the device waited): over
    prompts in several chunks, packed, no sampled token is drawn on the host, and every
    token is the host draw's a step at a time."""
    params = mixed(len(prompts))
    one, _ = served(whole, prompts, params, chunk=8, ahead=False, draw_on_device=False)
    on_host = []
    host_tokens = sampling_hook.tokens

    def counted(outputs, emits, logits, natives, steps):
        on_host.extend(n for n in natives if n is not None)
        return host_tokens(outputs, emits, logits, natives, steps)

    monkeypatch.setattr(sampling_hook, "tokens", counted)
    device, engine = served(whole, prompts, params, chunk=8)
    assert on_host == [] and engine.drawn_steps > 0
    assert [r.generated for r in one] == [r.generated for r in device]


def test_a_step_token_budget_changes_no_token(whole, prompts):
    """Config(step_tokens): prefill chunks interleaved with the running decodes within the
    budget give every request the tokens and logits of the steps without one."""
    params = mixed(len(prompts))
    free, _ = served(whole, prompts, params, chunk=8, ahead=False, draw_on_device=False)
    tight, engine = served(whole, prompts, params, chunk=8, step_tokens=3)
    for a, b in zip(free, tight):
        assert a.generated == b.generated
        assert np.array_equal(np.stack(a.logits).view(np.uint32),
                              np.stack(b.logits).view(np.uint32))
    with pytest.raises(Exception, match="step_tokens 0"):
        Engine(whole, Config(step_tokens=0))


class Watched:
    """bench/simulated.py's device that logs, in order, every replay (a step issued) and
    every output read (`result()` of a download: which step's, and how many steps had been
    issued when it was read)."""

    def __new__(cls, step_ms: float):
        from bench.simulated import Device

        class _Watched(Device):
            def __init__(self) -> None:
                super().__init__(step_ms)
                self.reads: list[tuple[int, int]] = []  # (step read, steps issued by then)

            def download_async(self, allocation, offset, nbytes):
                later, step, device = super().download_async(allocation, offset, nbytes), \
                    len(self.replays), self

                class _Read:
                    def result(self):
                        device.reads.append((step, len(device.replays)))
                        return later.result()

                return _Read()

        return _Watched()


@pytest.mark.parametrize("params", ["greedy", "sampled", "mixed"])
@pytest.mark.parametrize("ahead", [True, False])
def test_on_the_simulated_device_each_decode_step_is_issued_before_the_last_is_read(
        model, prompts, params, ahead):
    """The structure behind `bench.serve --backend sim`'s device wait: in the steady decode
    of greedy, sampled and mixed batches, step k + 1 is issued before step k's outputs are
    read, so the device never waits for the host to read them (ahead off, the control:
    every step is read before the next is issued). No timing is asserted."""
    device = Watched(0.2)
    chain = Chain(lower_to_bundle(model), backend=device, graphs=True)
    kinds = {"greedy": [sampling_hook.Params()] * 4, "sampled": list(SAMPLED) + [SAMPLED[0]],
             "mixed": mixed(4)}[params]
    engine = Engine(chain, Config(max_running=4, ahead=ahead))
    requests = [engine.submit(Request(p, 20, q)) for p, q in zip(prompts[:4], kinds)]
    engine.run_until_idle()
    assert all(r.finish == "length" and len(r.generated) == 20 for r in requests)
    steps = len(device.replays)
    # the steady decode: past the prefill and the first decode step, short of the last two
    steady = [(step, issued) for step, issued in device.reads
              if steps - 2 > step > steps - 17]
    assert len(steady) >= 14
    if ahead:
        assert all(issued > step for step, issued in steady), steady
        assert engine.ahead_steps >= 15
    else:
        assert all(issued == step for step, issued in steady), steady


@pytest.mark.gpu
def test_on_a_gpu_sampled_tokens_are_drawn_on_the_device(model, prompts):
    """On cuda the sampling kernel draws a sampled batch's tokens into the token output: every
    decode flight of the batch is drawn there, and the tokens are the host draw's for the same
    counters (the kernel matches the reference but for rare near-ties: at least 99%)."""
    from bundles import close_chains, cuda_chain

    chain = cuda_chain(lower_to_bundle(model))
    try:
        params = mixed(len(prompts))
        host, _ = served(chain, prompts, params, ahead=False, draw_on_device=False)
        device, engine = served(chain, prompts, params, ahead=False)
        assert engine.drawn_steps > 0, "the sampled decode steps were drawn on the device"
        pairs = [(a, b) for h, d in zip(host, device) for a, b in zip(h.generated, d.generated)]
        assert sum(a == b for a, b in pairs) >= 0.99 * len(pairs)
    finally:
        close_chains(chain)


@pytest.mark.gpu
def test_on_a_gpu_a_sampled_batch_goes_ahead(model, prompts):
    """On cuda a mixed batch that one decode step holds (four sequences: the tiny model's
    `decode_batch` takes four), and one of six that takes two calls a step (each call's
    drawn tokens kept on the device for the same call of the step after), is drawn on the
    device and fed to the next step ahead of its tokens."""
    from bundles import close_chains, cuda_chain

    chain = cuda_chain(lower_to_bundle(model))
    try:
        for count in (4, 6):
            _, engine = served(chain, prompts[:count], mixed(count))
            assert engine.drawn_steps >= 10, "the sampled decode steps were drawn on the device"
            assert engine.ahead_steps >= 10, "the sampled batch went ahead"
    finally:
        close_chains(chain)


@pytest.fixture(scope="module")
def long_prompts() -> list[list[int]]:
    """Prompts of several chunks of 8, two sharing their first 16 tokens (the prefix cache)."""
    rng = np.random.default_rng(41)
    found = [rng.integers(0, 256, n).tolist() for n in (40, 23, 33, 5, 28, 19)]
    found[4][:16] = found[0][:16]
    return found


def same_bits(one, other) -> None:
    assert [r.finish for r in one] == [r.finish for r in other]
    for a, b in zip(one, other):
        assert a.generated == b.generated
        assert np.array_equal(np.stack(a.logits).view(np.uint32),
                              np.stack(b.logits).view(np.uint32))


@pytest.mark.parametrize("chunk, step_tokens", [(8, None), (8, 1000), (32, 32)])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_prefill_chunks_go_ahead_with_the_bits_of_steps_one_at_a_time(
        whole, long_prompts, chunk, step_tokens, prefix_cache):
    """The next step's prefill chunks are issued while the step before runs (`_chunk_ahead`):
    greedy and sampled rows, stop tokens, prefix caching; the tokens and logits of the steps
    one at a time, bit for bit, with a step budget too (its prefill rows do not depend on the
    decodes beside them: 32 rows and a budget of 32 leave a page's worth)."""
    params = mixed(len(long_prompts))
    config = dict(chunk=chunk, step_tokens=step_tokens, prefix_cache=prefix_cache)
    one, _ = served(whole, long_prompts, params, ahead=False, draw_on_device=False, **config)
    stops = [one[1].generated[5], one[2].generated[9]]
    one, _ = served(whole, long_prompts, params, stops=stops, ahead=False,
                    draw_on_device=False, **config)
    ahead, engine = served(whole, long_prompts, params, stops=stops, **config)
    same_bits(one, ahead)
    assert engine.early_steps > 0
    assert any(r.finish == "stop" for r in ahead)


@pytest.mark.parametrize("chunk, step_tokens", [(8, 1000), (64, 70)])
def test_under_a_step_budget_chunks_planned_early_are_their_steps_prefill_not_more(
        whole, long_prompts, monkeypatch, chunk, step_tokens):
    """Under a step budget a step's prefill rows hold its chunks planned while the step
    before ran (`_chunk_ahead`): between two decode calls the device is handed at most a
    step's prefill rows (`Limits.prefill_rows`), early or not. (The step's own plan once took
    a full step's more beside them: twice the budget's prefill between two decode steps.)
    The streams decode as soon as they are primed (`hold_steps=0`): held, every chunk of
    these prompts would come before the first decode call."""
    issued: list[tuple[str, int]] = []
    submit = Engine._submit

    def recorded(self, item, *args, **kwargs):
        issued.append((item.kind, sum(n for _, _, n in item.parts)))
        return submit(self, item, *args, **kwargs)

    monkeypatch.setattr(Engine, "_submit", recorded)
    params = mixed(len(long_prompts))
    requests, engine = served(whole, long_prompts + long_prompts[:2], params + params[:2],
                              chunk=chunk, step_tokens=step_tokens, hold_steps=0)
    assert engine.early_steps > 0
    rows, between = engine.limits.prefill_rows, []
    first = next(i for i, (kind, _) in enumerate(issued) if kind == "decode")
    fed = 0
    for kind, n in issued[first + 1:]:  # before the first decode no stream waits
        if kind == "decode":
            between.append(fed)
            fed = 0
        else:
            fed += n
    assert 0 < max(between) <= rows, (rows, between)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_bursts_streams_wait_for_its_prompts_with_the_bits_of_each_decoding_at_once(
        whole, long_prompts, monkeypatch, prefix_cache):
    """Prompts arriving together (a burst, chunks of 8 rows): held (`hold_steps` as many as
    the burst's prefill steps), no decode
    call is issued between the burst's first chunk and its last, and the tokens and logits,
    greedy and sampled, are those of each stream decoding as soon as its chunk has primed it
    (`hold_steps=0`, whose decode calls come between the chunks), bit for bit."""
    issued: list[str] = []
    submit = Engine._submit

    def recorded(self, item, *args, **kwargs):
        issued.append(item.kind)
        return submit(self, item, *args, **kwargs)

    monkeypatch.setattr(Engine, "_submit", recorded)
    params = mixed(len(long_prompts))
    config = dict(chunk=8, prefix_cache=prefix_cache)
    at_once, _ = served(whole, long_prompts, params, hold_steps=0, **config)
    between = issued[:len(issued) - issued[::-1].index("chunk")]
    assert "decode" in between  # the streams decoded while the burst was fed
    issued.clear()
    steps = -(-sum(map(len, long_prompts)) // 8)  # the burst's prefill steps
    held, _ = served(whole, long_prompts, params, hold_steps=steps, **config)
    assert "decode" not in issued[:len(issued) - issued[::-1].index("chunk")]
    same_bits(at_once, held)


def test_a_request_cancelled_while_its_early_chunk_runs_leaves_the_others_bits(
        whole, long_prompts):
    """A request cancelled once a chunk of its prompt was issued early: its pages come back,
    it hears nothing more, and every other request has the tokens and logits of the steps
    one at a time."""
    params = mixed(len(long_prompts))
    one, _ = served(whole, long_prompts, params, chunk=8, ahead=False, draw_on_device=False)
    engine = Engine(whole, Config(max_running=len(long_prompts), logits=True, chunk=8))
    requests = [engine.submit(Request(p, 24, q)) for p, q in zip(long_prompts, params)]
    victim = None
    for _ in range(2000):  # far more ticks than this load needs
        if victim is None and engine.early_steps:
            early = [f for f in engine.inflight if f.early]
            victim = early[-1].requests[-1]
            engine.cancel(victim)
        if not engine.tick() and not engine.requests:
            break
    else:
        raise AssertionError("the engine did not drain")
    assert victim is not None and victim.finish == "cancelled"
    assert engine.pool.free == engine.pool.pages
    kept = [(a, b) for a, b in zip(one, requests) if b is not victim]
    same_bits([a for a, _ in kept], [b for _, b in kept])


def test_a_newcomer_admitted_beside_a_decode_step_has_the_next_decodes_run_behind_its_chunks(
        whole, long_prompts):
    """Prompts that arrive while others decode: a newcomer's chunks, planned beside a decode
    step in flight, are the next step's, and that step's decodes are issued behind them
    before they land (`_chunks_behind`: the device does not wait for the host between the
    chunks and the decodes); every request has the tokens and logits of the steps one at a
    time, bit for bit."""
    params = mixed(len(long_prompts))
    one, _ = served(whole, long_prompts, params, chunk=8, ahead=False, draw_on_device=False)
    engine = Engine(whole, Config(max_running=len(long_prompts), logits=True, chunk=8))
    requests = [engine.submit(Request(p, 24, q))
                for p, q in zip(long_prompts[:2], params[:2])]
    behind = 0  # turns that found decodes issued behind chunks still in flight
    for turn in range(4000):  # far more turns than this load needs
        if turn % 40 == 39 and len(requests) < len(long_prompts):
            i = len(requests)
            requests.append(engine.submit(Request(long_prompts[i], 24, params[i])))
        # a newcomer's first chunk (it starts at 0) came with its admission beside the decodes
        newcomers = {r.id for r in requests[2:]}
        first = [i for i, f in enumerate(engine.inflight) if f.early and any(
            start == 0 and seq_id in newcomers for seq_id, start, _ in f.item.parts)]
        behind += bool(first) and any(f.item.kind == "decode"
                                      for f in list(engine.inflight)[first[0]:])
        if not engine.tick() and len(requests) == len(long_prompts) and not engine.requests:
            break
    else:
        raise AssertionError("the engine did not drain")
    assert behind > 0, "no decode step was issued behind a newcomer's chunks"
    assert engine.pool.free == engine.pool.pages
    same_bits(one, requests)
