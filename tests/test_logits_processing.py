"""Logits processing where the tokens are drawn (kerncc.runtime.processing, kernels/logits.cu and
its numpy reference kernels/logits_ref.py).

* The engine on the cpu backend gives the same tokens, logprobs, top tokens and best_of scores,
  bit for bit, whether a decode call's processed rows are drawn "on the device" (the reference
  kernels in the session's processor, state kept there) or on the host from the logits rows
  (kerncc.serve.logits.draw, the path every processed request took before); plain requests
  batched with processed ones keep their bits.
* The reference kernels follow their rules over random vocabularies, penalties, biases, masks
  and state slots (hypothesis), against a scalar oracle, and their logprobs are those of
  `log_softmax` with a stable sort.
* On a GPU (`gpu`): the cubin's kernels against the reference (processing and counts bitwise,
  top ids equal, logprobs within 2e-6 relative + 1e-6), and the cuda engine's processed
  greedy tokens equal with and without drawing on the device.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kerncc.example import generate
from kerncc.kernels import logits_ref as ref
from kerncc.kernels.logits_ref import (HAS_BIAS, HAS_LOGPROBS, HAS_MASK, HAS_STEP_MASK,
                                       LOGIT_WORDS, RESULT_WORDS, TOP_IDS, TOP_LOGPROBS,
                                       f32_bits)
from kerncc.lower import lower_to_bundle
from kerncc.runtime import Chain
from kerncc.runtime.backends.probe import cuda_devices
from kerncc.serve.engine import Config, Engine, Request
from kerncc.serve.sampling_hook import Params

PROMPTS = [[5, 17, 40, 3, 9], [7, 7, 7, 2], [100, 101, 3, 3, 50, 60], [1, 2, 3]]
PROCESSED = [
    Params(presence_penalty=0.7, frequency_penalty=0.9, logprobs=3),
    Params(temperature=0.8, seed=7, repetition_penalty=1.3, logit_bias=((12, 4.0), (40, -3.0)),
           logprobs=5),
    Params(temperature=1.0, seed=11, min_tokens=5, suppress=frozenset({12, 49}),
           frequency_penalty=-0.5, ranked=True),
    Params(repetition_penalty=0.8, logprobs=0, prompt=(7, 2)),
]
PLAIN = [Params(), Params(temperature=0.9, seed=3)]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    manifest, _ = generate(tmp_path_factory.mktemp("tiny"), "tiny")
    return lower_to_bundle(manifest)


def served(chain, params, on_device: bool, max_new: int = 10):
    """Each request's (tokens, heard, best_of score) and the engine."""
    engine = Engine(chain, Config(max_running=len(params), chunk=64, draw_on_device=on_device))
    requests = [Request(list(PROMPTS[i % len(PROMPTS)]), max_new, p)
                for i, p in enumerate(params)]
    for request in requests:
        engine.submit(request)
    engine.run_until_idle()
    return [(r.generated, list(getattr(r.sampler, "heard", [])),
             getattr(r.sampler, "cumulative", None)) for r in requests], engine


def test_drawn_on_the_device_equals_the_host_path_bit_for_bit(bundle):
    chain = Chain(bundle)
    device, engine = served(chain, PROCESSED + PLAIN, on_device=True)
    host, host_engine = served(chain, PROCESSED + PLAIN, on_device=False)
    assert engine.drawn_steps > 0 and host_engine.drawn_steps == 0
    assert device == host  # floats compared exactly
    heard = device[1][1]
    assert len(heard) == 10 and all(len(h.top) == 5 for h in heard)
    assert all(h.top[0][1] >= h.logprob for h in heard) and heard[0].logprob < 0
    assert device[2][2] < 0  # best_of's score summed
    assert not set(device[2][0][:5]) & {12, 49}  # min_tokens held the stop ids back


def test_plain_requests_keep_their_bits_beside_processed_ones(bundle):
    chain = Chain(bundle)
    mixed, _ = served(chain, PROCESSED + PLAIN, on_device=True)
    alone, _ = served(chain, [Params()] * len(PROCESSED) + PLAIN, on_device=True)
    assert [m[0] for m in mixed[-2:]] == [a[0] for a in alone[-2:]]


def test_a_processor_slot_is_given_back_with_its_request(bundle):
    chain = Chain(bundle)
    for _ in range(3):  # three rounds of four processed requests reuse the same slots
        served(chain, PROCESSED, on_device=True, max_new=3)
    processors = [s._processor for s in chain.sessions if getattr(s, "_processor", None)]
    assert processors and all(p.capacity == 8 and not p.slots for p in processors)


# ------------------------------------------------------------------------ the reference


def oracle(x: np.float32, presence, frequency, repetition, count, seen, bias, allowed):
    """One token's processed logit, one scalar f32 operation at a time."""
    f32 = np.float32
    if repetition != f32(1) and seen:
        x = x / repetition if x > 0 else x * repetition
    if frequency != 0 or presence != 0:
        x = x - (frequency * f32(count) + presence * f32(count > 0))
    if bias is not None:
        x = x + bias
    return x if allowed else f32(-np.inf)


@st.composite
def calls(draw):
    vocab = draw(st.integers(2, 90))
    n = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    slots = n + draw(st.integers(0, 3))
    penalty = st.sampled_from([0.0, 0.5, -1.25, 2.0])
    words = np.zeros((n, LOGIT_WORDS), np.uint32)
    order = rng.permutation(slots)[:n]
    for b in range(n):
        flags = draw(st.integers(0, 15))
        words[b, :7] = [n - 1 - b, f32_bits(draw(penalty)), f32_bits(draw(penalty)),
                        f32_bits(draw(st.sampled_from([1.0, 1.3, 0.7]))), flags, order[b],
                        draw(st.integers(0, 20))]
    logits = rng.normal(0, 4, (n, vocab)).astype(np.float32)
    counts = rng.integers(0, 4, (slots, vocab)).astype(np.int32)
    seen = rng.integers(0, 2, (slots, vocab)).astype(np.uint8)
    bias = rng.normal(0, 2, (slots, vocab)).astype(np.float32)
    allow = rng.integers(0, 2**32, (slots, ref.mask_words(vocab)), dtype=np.uint32)
    step = rng.integers(0, 2**32, (n, ref.mask_words(vocab)), dtype=np.uint32)
    allow[:, 0] |= 1  # token 0 always allowed: a row keeps a finite logit
    step[:, 0] |= 1
    return logits, words, counts, seen, bias, allow, step


@given(calls())
def test_the_reference_processes_each_token_as_the_scalar_rules_say(call):
    logits, words, counts, seen, bias, allow, step = call
    got = logits.copy()
    ref.process_logits(got, words, counts, seen, bias, allow, step)
    vocab = counts.shape[1]
    for b, w in enumerate(words):
        row, s, flags = int(w[0]), int(w[5]), int(w[4])
        f = np.asarray(w[1:4], np.uint32).view(np.float32)
        ok = np.ones(vocab, bool)
        if flags & HAS_MASK:
            ok &= ref.allowed(allow[s], vocab)
        if flags & HAS_STEP_MASK:
            ok &= ref.allowed(step[b], vocab)
        want = [oracle(logits[row, t], f[0], f[1], f[2], counts[s, t], seen[s, t],
                       bias[s, t] if flags & HAS_BIAS else None, ok[t]) for t in range(vocab)]
        assert np.array_equal(got[row].view(np.uint32), np.asarray(want, np.float32).view(
            np.uint32))


@given(calls())
def test_the_reference_logprobs_are_log_softmax_and_a_stable_sort(call):
    logits, words, counts, seen, bias, allow, step = call
    n, vocab = logits.shape
    words[:, 4] |= HAS_LOGPROBS
    results = np.zeros((n, RESULT_WORDS), np.float32)
    ref.logprobs(logits, words, results, vocab)
    tokens = np.asarray([(b * 7) % vocab for b in range(n)], np.int32)
    before = counts.copy()
    ref.accept(logits, words, tokens, counts, seen, results)
    for b, w in enumerate(words):
        row, k = int(w[0]), min(int(w[6]), ref.TOP_MAX, vocab)
        logp = ref.log_softmax(logits[row])
        best = np.argsort(-logp, kind="stable")[:k]
        assert results.view(np.int32)[b, TOP_IDS:TOP_IDS + k].tolist() == best.tolist()
        assert np.array_equal(results[b, TOP_LOGPROBS:TOP_LOGPROBS + k], logp[best])
        assert results[b, ref.CHOSEN] == logp[tokens[row]]
        assert results.view(np.int32)[b, ref.TOKEN] == tokens[row]
        assert counts[int(w[5]), tokens[row]] == before[int(w[5]), tokens[row]] + 1
        assert seen[int(w[5]), tokens[row]] == 1


# ------------------------------------------------------------------------ on a GPU


def gpu_ready() -> bool:
    return bool(cuda_devices())


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 151936])
def test_the_cubin_matches_the_reference(vocab):
    if not gpu_ready():
        pytest.skip("no CUDA device")
    from kerncc.runtime.backends.cuda import CudaBackend
    from kerncc.runtime.processing import CudaProcessor

    rng = np.random.default_rng(vocab)
    n, slots = 6, 8
    backend = CudaBackend(0)
    proc = CudaProcessor(backend, vocab)
    proc._grow(slots)
    counts = rng.integers(0, 3, (slots, vocab)).astype(np.int32)
    seen = rng.integers(0, 2, (slots, vocab)).astype(np.uint8)
    bias = rng.normal(0, 1, (slots, vocab)).astype(np.float32)
    allow = rng.integers(0, 2**32, (slots, ref.mask_words(vocab)), dtype=np.uint32)
    for s in range(slots):
        proc._write_slot(s, counts[s], seen[s], bias[s], allow[s])
    masks = rng.integers(0, 2**32, (n, ref.mask_words(vocab)), dtype=np.uint32)
    words = np.zeros((n, LOGIT_WORDS), np.uint32)
    order = rng.permutation(slots)[:n]
    for b in range(n):
        words[b, :7] = [b, f32_bits(0.4 * b), f32_bits(0.3), f32_bits(1.0 + 0.1 * b),
                        [0, 1, 2, 4, 15, 9][b] | HAS_LOGPROBS, order[b], [0, 1, 5, 20, 20, 3][b]]
    # distinct logits (a permutation of a grid): no two logprobs tie, so the ids are defined
    logits = (rng.permutation(vocab).reshape(1, -1).astype(np.float32) * np.float32(1e-3)
              + rng.normal(0, 1e-5, (n, vocab)).astype(np.float32))
    x = backend.allocate(logits.nbytes)
    backend.upload(x, 0, logits.view(np.uint8))
    tokens = backend.allocate(4 * n)
    want = logits.copy()
    ref.process_logits(want, words, counts, seen, bias, allow, masks)
    chosen = want.argmax(axis=1).astype(np.int32)
    got = proc.issue(x, vocab, tokens, words, masks,
                     lambda: backend.upload(tokens, 0, chosen.view(np.uint8))).result()
    got = np.asarray(got).view(np.float32).reshape(n, RESULT_WORDS)
    processed = backend.download(x, 0, logits.nbytes).view(np.float32).reshape(n, vocab)
    assert np.array_equal(processed.view(np.uint32), want.view(np.uint32))  # bitwise
    results = np.zeros((n, RESULT_WORDS), np.float32)
    ref.logprobs(want, words, results, vocab)
    ref.accept(want, words, chosen, counts, seen, results)
    ids, got_ids = results.view(np.int32), got.view(np.int32)
    assert np.array_equal(got_ids[:, ref.TOKEN], ids[:, ref.TOKEN])
    assert np.array_equal(got_ids[:, TOP_IDS:TOP_LOGPROBS], ids[:, TOP_IDS:TOP_LOGPROBS])
    np.testing.assert_allclose(got[:, TOP_LOGPROBS:], results[:, TOP_LOGPROBS:], rtol=2e-6,
                               atol=1e-6)
    np.testing.assert_allclose(got[:, ref.CHOSEN], results[:, ref.CHOSEN], rtol=2e-6,
                               atol=1e-6)
    counted = backend.download(proc.state["counts"], 0, counts.nbytes).view(np.int32)
    assert np.array_equal(counted.reshape(slots, vocab), counts)


@pytest.mark.gpu
def test_the_cuda_engine_draws_processed_greedy_tokens_as_the_host_path(bundle):
    if not gpu_ready():
        pytest.skip("no CUDA device")
    chain = Chain(bundle, backend="cuda")
    greedy = [Params(presence_penalty=0.7, frequency_penalty=0.9, logprobs=3),
              Params(repetition_penalty=1.3, logit_bias=((12, 4.0),), logprobs=5),
              Params(min_tokens=5, suppress=frozenset({12, 49})), Params()]
    device, engine = served(chain, greedy, on_device=True)
    host, _ = served(chain, greedy, on_device=False)
    assert engine.drawn_steps > 0
    assert [d[0] for d in device] == [h[0] for h in host]
    for (_, got, _), (_, want, _) in zip(device, host):
        assert [h.token for h in got] == [h.token for h in want]
        np.testing.assert_allclose([h.logprob for h in got], [h.logprob for h in want],
                                   rtol=2e-6, atol=1e-6)


@given(calls())
def test_the_pointer_entries_run_the_reference(call):
    """kernels/reference.py's entries (the cpu backend's, by the cubin's argument list) give
    what the reference functions give on the same arrays."""
    from kerncc.kernels.reference import KERNELS

    logits, words, counts, seen, bias, allow, step = call
    n, vocab = logits.shape
    words[:, 4] |= HAS_LOGPROBS
    want, got = logits.copy(), logits.copy()
    want_counts, want_seen = counts.copy(), seen.copy()
    results = np.zeros((n, RESULT_WORDS), np.float32)
    ref.process_logits(want, words, want_counts, want_seen, bias, allow, step)
    ref.logprobs(want, words, results, vocab)
    tokens = want.argmax(axis=1).astype(np.int32)
    ref.accept(want, words, tokens, want_counts, want_seen, results)
    raw = {name: a.reshape(-1).view(np.uint8) for name, a in dict(
        x=got, w=words, c=counts, s=seen, b=bias, a=allow, m=step, t=tokens,
        r=np.zeros((n, RESULT_WORDS), np.float32)).items()}
    KERNELS["logits_process_f32"](None, raw["x"], raw["w"], raw["c"], raw["s"], raw["b"],
                                  raw["a"], raw["m"], n, vocab, vocab)
    KERNELS["logits_logprobs_f32"](None, raw["x"], raw["w"], raw["r"], n, vocab, vocab)
    KERNELS["logits_accept_f32"](None, raw["x"], raw["w"], raw["t"], raw["c"], raw["s"],
                                 raw["r"], n, vocab, vocab)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(raw["r"].view(np.uint32), results.reshape(-1).view(np.uint32))
    assert np.array_equal(counts, want_counts) and np.array_equal(seen, want_seen)
