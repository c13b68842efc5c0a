"""The OpenAI request fields as users send them, through the official `openai` client against
`kerncc serve` on 127.0.0.1 (the tiny example on cpu, with its own tokenizer): each served
field does what it says, and nothing is silently ignored.
"""

from __future__ import annotations

import logging
import math
import time

import httpx
import numpy as np
import pytest

from kerncc.example import generate
from kerncc.kernels.logits_ref import f32_bits, log_softmax, process_logits
from kerncc.lower import lower_to_bundle
from kerncc.runtime import Chain
from reference_loop import alone
from serving import serving

openai = pytest.importorskip("openai")
pytest.importorskip("tokenizers")

MODEL = "kerncc-qwen3-tiny"
PROMPT = [5, 17, 40, 3, 9]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    manifest, _ = generate(tmp_path_factory.mktemp("tiny"), "tiny")
    return manifest


@pytest.fixture(scope="module")
def chain(model) -> Chain:
    return Chain(lower_to_bundle(model))


@pytest.fixture(scope="module")
def codec(model):
    from kerncc.hf.tokenizer import TextCodec

    return TextCodec.from_dir(model.parent)


@pytest.fixture(scope="module")
def served(chain, codec):
    with serving(chain, MODEL, codec) as (url, server):
        yield url, server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0)


def ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def greedy(chain, prompt, count) -> list[int]:
    return alone(chain, prompt, count).tokens


# ------------------------------------------------------------------------- nothing ignored


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_an_unknown_field_is_refused_naming_it(client, route):
    with pytest.raises(openai.BadRequestError) as caught:
        if route == "chat":
            client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
                {"role": "user", "content": "hi"}], extra_body={"guided_choice": ["a"]})
        else:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                      extra_body={"guided_choice": ["a"]})
    error = caught.value.body
    assert error["param"] == "guided_choice" and error["code"] == "unknown_field"
    assert "guided_choice" in error["message"]


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "required"), ("audio", {"voice": "x", "format": "mp3"}),
    ("store", True), ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "high"), ("modalities", ["text", "audio"]),
    ("chat_template_kwargs", {"enable_thinking": [False]}),
    ("response_format", {"type": "xml"}), ("top_logprobs", 2),
    ("guided_regex", "(unclosed"), ("guided_json", "{not json"),
    ("guided_grammar", "start: nowhere"),
])
def test_a_chat_field_not_served_is_a_400_naming_it(served, field, value):
    answer = httpx.post(f"{served[0]}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
        field: value})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == field


def test_lenient_accepts_an_unknown_field_and_logs_it(chain, codec, caplog):
    with serving(chain, MODEL, codec) as (url, server):
        server.lenient = True
        with caplog.at_level(logging.WARNING, logger="kerncc.serve"):
            answer = httpx.post(f"{url}/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 3, "frobnicate": 1})
    assert answer.status_code == 200, answer.text
    assert ids(openai.types.Completion.model_validate(answer.json()).choices[0]) \
        == greedy(chain, PROMPT, 3)
    assert "frobnicate" in caplog.text


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(client, served):
    server = served[1]
    chat = client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "tell"}], extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == server.engine.capacity + 1 - chat.usage.prompt_tokens
    assert chat.usage.completion_tokens > 16


def test_a_stop_string_is_counted_as_stop_in_the_metrics(client, served, chain, codec):
    text = codec.decode(greedy(chain, PROMPT, 8))
    stop = text[3:5]
    metric = 'kerncc_requests_finished_total{reason="stop"}'

    def stops() -> float:
        for line in httpx.get(f"{served[0]}/metrics", timeout=10).text.splitlines():
            if line.startswith(metric):
                return float(line.split()[-1])
        return 0.0

    before = stops()
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stop=[stop])
    assert answer.choices[0].finish_reason == "stop"
    deadline = time.monotonic() + 10  # bounded: the engine's thread counts it after the answer
    while stops() == before and time.monotonic() < deadline:
        time.sleep(0.01)  # a loaded machine may run the engine's thread late
    assert stops() == before + 1


# ------------------------------------------------------------------------- logits processing


def test_the_processing_reference_follows_its_rules():
    rng = np.random.default_rng(3)
    vocab = 70
    logits = rng.normal(0, 3, (2, vocab)).astype(np.float32)
    counts = np.zeros((2, vocab), np.int32)
    counts[0, [4, 9]] = [1, 3]
    seen = (counts > 0).astype(np.uint8)
    seen[0, 11] = 1  # a prompt token
    bias = np.zeros((2, vocab), np.float32)
    bias[1, 7] = -100
    allow = np.full((2, 3), 0xFFFFFFFF, np.uint32)
    allow[1, 1] &= ~np.uint32(1 << 1)  # token 33 masked
    words = np.zeros((2, 8), np.uint32)
    words[0, :5] = [0, f32_bits(0.5), f32_bits(1.5), f32_bits(1.3), 0]
    words[1, :6] = [1, 0, 0, f32_bits(1.0), 3, 1]  # row 1, its state in slot 1
    got = logits.copy()
    process_logits(got, words, counts, seen, bias, allow)
    want = logits.copy()
    for t in (4, 9, 11):
        want[0, t] = want[0, t] / np.float32(1.3) if want[0, t] > 0 else want[0, t] * np.float32(1.3)
    want[0, 4] -= np.float32(1.5) * 1 + np.float32(0.5)
    want[0, 9] -= np.float32(1.5) * 3 + np.float32(0.5)
    want[1, 7] -= 100
    want[1, 33] = -np.inf
    np.testing.assert_allclose(got, want, rtol=1e-6)
    lp = log_softmax(got[1])
    assert lp[33] == -np.inf and math.isclose(float(np.exp(lp).sum()), 1.0, rel_tol=1e-5)


def test_logit_bias_minus_100_never_emits_the_token(client, chain):
    banned = greedy(chain, PROMPT, 1)[0]
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, n=8,
                                       temperature=1.5, seed=11,
                                       logit_bias={str(banned): -100})
    drawn = [t for c in answer.choices for t in ids(c)]
    assert len(drawn) == 96 and banned not in drawn
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert ids(plain.choices[0]) == [banned]  # without the bias it is the greedy token


def test_logit_bias_plus_100_forces_the_token(client):
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                       logit_bias={"49": 100})
    assert ids(answer.choices[0]) == [49] * 6


def test_penalties_change_greedy_answers_and_plain_requests_keep_their_bits(client, chain):
    plain = greedy(chain, PROMPT, 24)
    assert ids(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24)
               .choices[0]) == plain
    for field in ("presence_penalty", "frequency_penalty"):
        got = ids(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                            **{field: 2.0}).choices[0])
        assert got != plain, field
        assert max(np.bincount(got)) <= max(np.bincount(plain)), field
    got = ids(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                        extra_body={"repetition_penalty": 5.0}).choices[0])
    assert got != plain


def test_stop_token_ids_end_and_min_tokens_holds_them_back(client, chain):
    first = greedy(chain, PROMPT, 1)[0]
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                        extra_body={"stop_token_ids": [first]})
    assert ids(stopped.choices[0]) == [first]
    assert stopped.choices[0].finish_reason == "stop"
    held = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                     extra_body={"stop_token_ids": [first], "min_tokens": 4})
    got = ids(held.choices[0])
    assert len(got) >= 4 and first not in got[:4]


# ------------------------------------------------------------------------- logprobs, n, echo


def test_completions_logprobs_in_openais_shape(client, codec):
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=3)
    choice = answer.choices[0]
    lp = choice.logprobs
    assert lp.tokens == [codec.decode([t]) for t in ids(choice)]
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        values = list(top.values())
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert chosen == values[0] <= 0  # greedy: the chosen is the most likely
        assert sum(math.exp(v) for v in values) <= 1 + 1e-5


def test_chat_logprobs_in_openais_shape(client):
    chat = client.chat.completions.create(model=MODEL, max_tokens=4, logprobs=True,
                                          top_logprobs=2, temperature=1.0, seed=3,
                                          messages=[{"role": "user", "content": "hi"}])
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and "".join(c.token for c in content) \
        == chat.choices[0].message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert entry.logprob <= entry.top_logprobs[0].logprob


def test_n_seeded_choices_differ_and_repeat_and_the_first_is_n_1s(client):
    ask = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.2, seed=42)
    three = client.completions.create(n=3, **ask)
    again = client.completions.create(n=3, **ask)
    one = client.completions.create(**ask)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [ids(c) for c in three.choices] == [ids(c) for c in again.choices]
    assert ids(three.choices[0]) == ids(one.choices[0])
    assert len({tuple(ids(c)) for c in three.choices}) > 1
    assert three.usage.completion_tokens == sum(len(ids(c)) for c in three.choices)


def test_best_of_returns_the_most_likely_of_its_draws(client):
    ask = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.5, seed=8)
    draws = client.completions.create(n=4, logprobs=0, **ask)
    sums = [sum(c.logprobs.token_logprobs) for c in draws.choices]
    best = client.completions.create(best_of=4, **ask)
    assert len(best.choices) == 1
    assert ids(best.choices[0]) == ids(draws.choices[int(np.argmax(sums))])
    assert best.usage.completion_tokens == draws.usage.completion_tokens  # every draw's


def test_echo_and_a_list_of_prompts(client, chain, codec):
    texts = ["the cat", "a dog"]
    answer = client.completions.create(model=MODEL, prompt=texts, max_tokens=3, n=2,
                                       echo=True)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    for i, text in enumerate(texts):
        want = greedy(chain, codec.encode(text), 3)
        for choice in answer.choices[2 * i:2 * i + 2]:
            assert ids(choice) == want
            assert choice.text == text + codec.decode(want)
    lists = client.completions.create(model=MODEL, prompt=[PROMPT, PROMPT[:2]], max_tokens=3)
    assert [ids(c) for c in lists.choices] == [greedy(chain, PROMPT, 3),
                                                greedy(chain, PROMPT[:2], 3)]
    assert lists.usage.prompt_tokens == len(PROMPT) + 2


def test_a_stream_of_several_choices_gives_what_the_whole_answer_does(client):
    ask = dict(model=MODEL, prompt=[PROMPT, PROMPT[:3]], max_tokens=6, temperature=1.0,
               seed=5, n=2, logprobs=1)
    whole = client.completions.create(**ask)
    streamed: dict[int, list[int]] = {}
    logprobs: dict[int, list[float]] = {}
    for chunk in client.completions.create(stream=True, **ask):
        for choice in chunk.choices:
            streamed.setdefault(choice.index, []).extend(choice.model_extra["token_ids"])
            if choice.logprobs is not None:
                logprobs.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs)
    assert streamed == {c.index: ids(c) for c in whole.choices}
    assert logprobs == {c.index: c.logprobs.token_logprobs for c in whole.choices}


# ------------------------------------------------------------------------- access


def test_an_api_key_guards_every_route_but_health_and_each_request_is_logged(chain, caplog):
    with serving(chain, MODEL) as (url, server):
        server.api_key = "s3cret"
        with caplog.at_level(logging.INFO, logger="kerncc.serve.access"):
            keyless = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
            with pytest.raises(openai.AuthenticationError) as caught:
                keyless.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            assert caught.value.body["code"] == "invalid_api_key"
            for path in ("/v1/models", "/metrics", "/v1/nowhere"):
                answer = httpx.get(f"{url}{path}", timeout=10)
                assert answer.status_code == 401 and answer.json()["error"]["message"], path
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
            keyed = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
            answer = keyed.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            assert ids(answer.choices[0]) == greedy(chain, PROMPT, 2)
            for _ in range(500):  # bounded (5 s): the line is written after the answer's end
                if sum(r.name == "kerncc.serve.access" for r in caplog.records) == 6:
                    break
                time.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records if r.name == "kerncc.serve.access"]
    assert len(lines) == 6
    assert "POST /v1/completions 401" in lines[0] and "POST /v1/completions 200" in lines[-1]


def test_listening_beyond_loopback_without_a_key_warns(caplog):
    from kerncc.cli.serve import warn_if_open

    with caplog.at_level(logging.WARNING, logger="kerncc.serve"):
        assert not warn_if_open("127.0.0.1", None) and not warn_if_open("::1", None)
        assert not warn_if_open("localhost", None) and not warn_if_open("0.0.0.0", "k")
        assert warn_if_open("0.0.0.0", None)
    assert "0.0.0.0 without an API key" in caplog.text


def test_serve_takes_its_key_from_the_environment_and_a_served_model_name(model):
    import os
    import re
    import subprocess
    import sys

    command = [sys.executable, "-m", "kerncc", "serve", str(model), "--port", "0",
               "--backend", "cpu", "--served-model-name", "tiny-chat"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KERNCC_API_KEY": "k3y"}
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = None
        for _ in range(100):  # bounded: the start's lines
            found = re.search(r"listening on (http://\S+)", proc.stderr.readline())
            if found:
                url = found.group(1)
                break
        assert url, "the server did not start"
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k3y", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-chat"]
        answer = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=2)
        assert len(ids(answer.choices[0])) == 2
        proc.terminate()
        assert proc.wait(15) == 0
        log = proc.stderr.read()
        assert "GET /v1/models 401" in log and "POST /v1/completions 200" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------- structured output

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}


def test_100_sampled_json_schema_answers_parse_and_validate(client):
    import json

    jsonschema = pytest.importorskip("jsonschema")
    form = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    answers = []
    for seed in range(10):
        chat = client.chat.completions.create(
            model=MODEL, n=10, temperature=1.0, seed=seed, max_tokens=80, response_format=form,
            messages=[{"role": "user", "content": "who?"}])
        answers += [c.message.content for c in chat.choices]
        assert {c.finish_reason for c in chat.choices} == {"stop"}
    assert len(answers) == 100 and len(set(answers)) > 10  # sampled, not one answer
    for text in answers:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_a_regex_constrain_the_output(client):
    import json
    import re

    chat = client.chat.completions.create(
        model=MODEL, temperature=1.0, seed=4, max_tokens=120, n=4,
        response_format={"type": "json_object"}, messages=[{"role": "user", "content": "x"}])
    for choice in chat.choices:
        if choice.finish_reason == "stop":  # an object may run past max_tokens
            assert isinstance(json.loads(choice.message.content), dict)
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, n=5,
                                     temperature=1.0, seed=2,
                                     extra_body={"guided_regex": "[a-c]{3}-[0-9]{2}"})
    for choice in text.choices:
        assert re.fullmatch("[a-c]{3}-[0-9]{2}", choice.text), choice.text
        assert choice.finish_reason == "stop"
