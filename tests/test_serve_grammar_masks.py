"""A call's grammar masks computed in one batch (kerncc.serve.grammar.fill_all: llguidance's
executor over the cores, or one after another on a machine of few) are bit for bit those of
one matcher at a time, the way llguidance computes them alone; and the engine draws the same
grammar-following tokens on the device as on the host path.
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


@pytest.mark.parametrize("parallel", [True, False], ids=["executor", "one-by-one"])
@pytest.mark.parametrize("form", FORMS, ids=["json_schema", "json_object", "regex"])
def test_batched_masks_are_those_of_one_matcher_at_a_time(grammars, form, parallel,
                                                           monkeypatch):
    monkeypatch.setattr(grammar, "PARALLEL", parallel)
    built, vocab = grammars
    monkeypatch.setattr(built, "threads", parallel)  # the example's tokenizer alone has none
    words = mask_words(vocab)
    shape = built.of(form)
    n, rng = 5, np.random.default_rng(7)
    batched = [shape.matcher() for _ in range(n)]
    alone = [llguidance.LLMatcher(built.tokenizer, shape.text) for _ in range(n)]
    order = [3, 0, 4, 1, 2]  # each matcher's row of the call's masks: not their own order
    for step in range(24):
        here = [i for i in range(n) if not (i == 1 and step % 2)]  # 1 sits out odd steps
        out = np.full((n, words), 0xA5A5A5A5, np.uint32)  # not a mask: every row is written
        grammar.fill_all([batched[i] for i in here], out, [order[i] for i in here])
        for i in here:
            expected = _alone(alone[i], words)
            assert np.array_equal(out[order[i]], expected), (form, step, i)
            choices = np.flatnonzero(allowed(expected, vocab))
            token = int(rng.choice(choices)) if choices.size else 0
            if i == 4 and step == 9:
                token = int(np.flatnonzero(~allowed(expected, vocab))[0])  # refused
            alone[i].consume_token(token)
            batched[i].consume(token)
    assert alone[4].is_error() and batched[4].matcher.is_error()


@pytest.mark.parametrize("parallel", [True, False], ids=["executor", "one-by-one"])
def test_grammar_tokens_drawn_on_the_device_equal_the_host_path(model, grammars, parallel,
                                                                 monkeypatch):
    monkeypatch.setattr(grammar, "PARALLEL", parallel)
    built, _ = grammars
    monkeypatch.setattr(built, "threads", parallel)
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


def test_the_tokenizer_callback_encodes_each_string_once_and_as_the_codec_does(model):
    """llguidance asks the example's tokenizer (a decoder it cannot read natively) for the
    same forced strings over and over while it computes masks: each distinct string is
    encoded once, and every answer is the codec's own."""
    from kerncc.hf.tokenizer import TextCodec

    codec = TextCodec.from_dir(model.parent)
    seen: list[str] = []
    encode = codec.encode

    def counted(text, add_special_tokens=True):
        seen.append(text)
        return encode(text, add_special_tokens=add_special_tokens)

    codec.encode = counted
    tokens = grammar._Tokens(codec, 256, min(codec.eos_token_ids))
    texts = ['{"n":', ', "ok": true}', "the end", '{"n":', "the end", '{"n":']
    answers = [tokens(text) for text in texts]
    assert answers == [encode(text, add_special_tokens=False) for text in texts]
    assert all(answers) and sorted(seen) == sorted(set(texts))
    answers[0].append(-1)  # a caller's list is its own: the next answer is unchanged
    assert tokens('{"n":') == encode('{"n":', add_special_tokens=False)


def test_masks_go_to_the_executor_only_with_a_tokenizer_llguidance_reads_natively(grammars):
    """A byte-level BPE tokenizer is read natively: its matchers may share llguidance's
    threads. The example's (a decoder llguidance does not know) calls back into Python, and
    its matchers' masks are computed one at a time."""
    from types import SimpleNamespace

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    built, _ = grammars
    assert built.threads is False and built.of(FORMS[1]).matcher().threads is False
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    native = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    native.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    native.decoder = decoders.ByteLevel()
    native.add_special_tokens([AddedToken("<|end|>", special=True)])
    size = native.get_vocab_size(with_added_tokens=True)
    threaded = grammar.Grammars(SimpleNamespace(tokenizer=native), size, size - 1)
    assert threaded.threads is True and threaded.of(FORMS[1]).matcher().threads is True
