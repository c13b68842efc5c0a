"""A grammar's token masks computed in batches (kerncc.serve.grammar: `follow` consumes a
call's tokens and computes their next masks together with llguidance's executor, `fill_all`
hands them out) are bit for bit those of one matcher at a time, the way llguidance computes
them alone; and the engine draws the same grammar-following tokens on the device as on the
host path.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kerncc.example import generate
from kerncc.kernels.logits_ref import allowed, mask_words
from kerncc.lower import lower_to_bundle
from kerncc.runtime import Chain
from kerncc.serve import grammar
from kerncc.serve.engine import Config, Engine, Request
from kerncc.serve.sampling_hook import Params

llguidance = pytest.importorskip("llguidance")
pytest.importorskip("tokenizers")
import llguidance.numpy as llnumpy  # noqa: E402 - after the skip

ITEMS = {"type": "array", "minItems": 2, "maxItems": 6, "items": {
    "type": "object", "required": ["n", "ok"], "additionalProperties": False,
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                   "ok": {"type": "boolean"}, "tag": {"type": "string", "maxLength": 5}}}}
FORMS = [
    {"guided_json": ITEMS},
    {"response_format": {"type": "json_object"}},
    {"guided_regex": "(ab|cd)+[0-9]{2,4}x?"},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    manifest, _ = generate(tmp_path_factory.mktemp("tiny"), "tiny")
    return manifest


@pytest.fixture(scope="module")
def grammars(model):
    from kerncc.hf.tokenizer import TextCodec

    codec = TextCodec.from_dir(model.parent)
    vocab = json.loads((model.parent / "config.json").read_text())["vocab_size"]
    return grammar.Grammars(codec, vocab, min(codec.eos_token_ids)), vocab


def _alone(matcher, words: int) -> np.ndarray:
    out = np.zeros((1, words), np.int32)
    llnumpy.fill_next_token_bitmask(matcher, out, 0)
    return out[0].view(np.uint32)


@pytest.mark.parametrize("form", FORMS, ids=["json_schema", "json_object", "regex"])
def test_batched_masks_are_those_of_one_matcher_at_a_time(grammars, form):
    built, vocab = grammars
    words = mask_words(vocab)
    shape = built.of(form)
    n, rng = 5, np.random.default_rng(7)
    batched = [shape.matcher() for _ in range(n)]
    alone = [llguidance.LLMatcher(built.tokenizer, shape.text) for _ in range(n)]
    order = [3, 0, 4, 1, 2]  # each matcher's row of the call's masks: not their own order
    for step in range(24):
        # matcher 1 sits out the odd steps (neither masked nor followed): its mask, computed
        # ahead, waits for it
        here = [i for i in range(n) if not (i == 1 and step % 2)]
        out = np.full((n, words), 0xA5A5A5A5, np.uint32)  # not a mask: every row is written
        grammar.fill_all([batched[i] for i in here], out, [order[i] for i in here])
        tokens = []
        for i in here:
            expected = _alone(alone[i], words)
            assert np.array_equal(out[order[i]], expected), (form, step, i)
            choices = np.flatnonzero(allowed(expected, vocab))
            token = int(rng.choice(choices)) if choices.size else 0
            if i == 4 and step == 9:
                token = int(np.flatnonzero(~allowed(expected, vocab))[0])  # refused
            tokens.append(token)
            alone[i].consume_token(token)
        grammar.follow([batched[i] for i in here], tokens)
    assert any(alone[i].is_error() for i in range(n))  # the refused token was followed too


def test_a_matcher_followed_alone_gives_the_masks_of_the_batch(grammars):
    """The host path (`Matcher.consume`, `Matcher.fill`) and the device path (`follow`,
    `fill_all`) step the same matcher state."""
    built, vocab = grammars
    words = mask_words(vocab)
    shape = built.of(FORMS[0])
    one, many = shape.matcher(), shape.matcher()
    rng = np.random.default_rng(3)
    for _ in range(16):
        a, b = np.zeros(words, np.uint32), np.zeros((1, words), np.uint32)
        one.fill(a)
        grammar.fill_all([many], b, [0])
        assert np.array_equal(a, b[0]) and a.any()
        token = int(rng.choice(np.flatnonzero(allowed(a, vocab))))
        one.consume(token)
        grammar.follow([many], [token])


def test_grammar_tokens_drawn_on_the_device_equal_the_host_path(model, grammars):
    built, _ = grammars
    chain = Chain(lower_to_bundle(model))
    params = [Params(temperature=0.9, seed=s, grammar=built.of(FORMS[s % 2]),
                     **({"logprobs": 2} if s == 1 else {})) for s in range(4)]

    def served(on_device: bool):
        engine = Engine(chain, Config(max_running=4, chunk=64, draw_on_device=on_device))
        requests = [Request([5, 17, 40, 3 + i], 12, p) for i, p in enumerate(params)]
        for request in requests:
            engine.submit(request)
        engine.run_until_idle()
        return [(r.generated, r.sampler.heard) for r in requests], engine.drawn_steps

    device, drawn = served(True)
    host, host_drawn = served(False)
    assert drawn > 0 and host_drawn == 0
    assert device == host
    assert all(len(tokens) > 1 for tokens, _ in device)
