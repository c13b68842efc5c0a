"""`kerncc serve` over real HTTP on 127.0.0.1 (uvicorn in a thread, the tiny example on cpu):
the official openai client, concurrency, streaming, bad requests, cancellation, faults, SIGTERM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from kerncc.diagnostics import KernccError
from kerncc.example import generate
from kerncc.lower import lower_to_bundle
from kerncc.runtime import Chain
from reference_loop import reference
from serving import serving as serve_on_loopback

MODEL = "kerncc-qwen3-tiny"
LETTERS = "abcdefghijklmnopqrstuvwxyz .,!?"


class Letters:
    """A toy tokenizer: token id i is LETTERS[i % len(LETTERS)] (encode takes the first ids)."""

    eos_token_ids = ()
    has_chat_template = True

    def encode(self, text: str) -> list[int]:
        if any(c not in LETTERS for c in text):  # as TextCodec refuses what it cannot encode
            raise KernccError.single(f"tokenizer.json: cannot encode {text!r}")
        return [LETTERS.index(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(LETTERS[i % len(LETTERS)] for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
        return "".join(f"{m['role'][0]} {m['content']}." for m in messages) + "a "


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    manifest, _ = generate(tmp_path_factory.mktemp("tiny"), "tiny")
    return manifest


@pytest.fixture(scope="module")
def chain(model) -> Chain:
    return Chain(lower_to_bundle(model))


def serving(chain, text=None, runner=None, **config):
    """The loopback server of tests/serving.py, as this module's tests call it."""
    return serve_on_loopback(chain, MODEL, text, runner, **config)


@pytest.fixture(scope="module")
def base(chain):
    with serving(chain, text=Letters()) as (url, _):
        yield url


def prompts(count: int) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, 256, int(rng.integers(1, 20))).tolist() for _ in range(count)]


def complete(base: str, **body) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json={"model": MODEL, **body}, timeout=60)


def metric(base: str, name: str, missing: float | None = None) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    if found is None and missing is not None:
        return missing
    return float(found.group(1))


def test_24_requests_at_once_each_get_their_prompt_alone(base, chain):
    asks = prompts(24)
    alone = [reference(chain, p, 6).tokens for p in asks]

    async def all_at_once():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(
                f"{base}/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 6})
                for p in asks))

    answers = asyncio.run(all_at_once())
    assert [a.status_code for a in answers] == [200] * 24
    assert [a.json()["choices"][0]["token_ids"] for a in answers] == alone
    usage = answers[0].json()["usage"]
    assert usage == {"prompt_tokens": len(asks[0]), "completion_tokens": 6,
                     "total_tokens": len(asks[0]) + 6}
    assert metric(base, "kerncc_tokens_generated_total") >= 24 * 6
    assert metric(base, "kerncc_kv_pages_free") == metric(base, "kerncc_kv_pages_total")


def test_a_lone_greedy_request_decodes_a_step_ahead(base, model):
    """The engine's steps ahead (tokens fed on the device) show on /metrics, and the tokens
    are the request's alone (on a chain of their own: the server's stays the engine's)."""
    ask = prompts(1)[0]
    alone = reference(Chain(lower_to_bundle(model)), ask, 12).tokens
    before = metric(base, "kerncc_decode_steps_ahead")
    answer = complete(base, prompt=ask, max_tokens=12)
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["token_ids"] == alone
    assert metric(base, "kerncc_decode_steps_ahead") >= before + 5


def test_the_openai_client_streams_what_it_gets_whole(base):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    whole = client.completions.create(model=MODEL, prompt="hello world", max_tokens=7)
    chunks = list(client.completions.create(model=MODEL, prompt="hello world", max_tokens=7,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    streamed = [t for c in chunks for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
    assert streamed == whole.choices[0].model_extra["token_ids"]
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "length"
    assert len(whole.choices[0].text) == 7
    chat = client.chat.completions.create(model=MODEL, max_tokens=5, messages=[
        {"role": "user", "content": "hi there"}])
    assert len(chat.choices[0].message.content) == 5


def test_streaming_token_ids_equal_the_whole_answer(base):
    ask = {"prompt": [7, 8, 9, 10], "max_tokens": 9}
    whole = complete(base, **ask).json()["choices"][0]
    with httpx.stream("POST", f"{base}/v1/completions", json={"model": MODEL, "stream": True,
                                                              **ask}, timeout=60) as answer:
        lines = [line for line in answer.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == whole["token_ids"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_a_stop_string_ends_the_text_before_it(base):
    free = complete(base, prompt="abc", max_tokens=12).json()["choices"][0]
    stop = free["text"][4:6]
    got = complete(base, prompt="abc", max_tokens=12, stop=[stop]).json()["choices"][0]
    assert got["finish_reason"] == "stop"
    assert got["text"] == free["text"][:free["text"].find(stop)]


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": [1, 2], "max_tokens": "3"}, 400, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": True}, 400, "max_tokens"),
    ({"prompt": [], "max_tokens": 3}, 400, "prompt"),
    ({"prompt": [1, "2"], "max_tokens": 3}, 400, "prompt"),
    ({"prompt": [1, 256], "max_tokens": 3}, 400, "prompt"),
    ({"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [1] * 200, "max_tokens": 100}, 400, "max_tokens"),
    ({"prompt": [1, 2], "n": 17}, 400, "n"),
    ({"prompt": [1, 2], "n": 3, "best_of": 2}, 400, "best_of"),
    ({"prompt": [1, 2], "best_of": 3, "stream": True}, 400, "best_of"),
    ({"prompt": [1, 2], "frobnicate": 1}, 400, "frobnicate"),  # unknown: never ignored
    ({"prompt": [1, 2], "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": [1, 2], "frequency_penalty": "1"}, 400, "frequency_penalty"),
    ({"prompt": [1, 2], "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": [1, 2], "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"prompt": [1, 2], "logit_bias": {"256": 1}}, 400, "logit_bias"),  # past the vocabulary
    ({"prompt": [1, 2], "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"prompt": [1, 2], "stop_token_ids": [1.5]}, 400, "stop_token_ids"),
    ({"prompt": [1, 2], "max_tokens": 3, "min_tokens": 4}, 400, "min_tokens"),
    ({"prompt": [1, 2], "ignore_eos": 1}, 400, "ignore_eos"),
    ({"prompt": [1, 2], "suffix": "x"}, 400, "suffix"),
    ({"prompt": [1, 2], "user": 5}, 400, "user"),
    ({"prompt": [[1, 2], [1] * 200], "max_tokens": 100}, 400, "max_tokens"),  # the second
    ({"prompt": [[1, 2], "x"] * 33}, 400, "prompt"),  # past 64 prompts
    ({"prompt": [1, 2], "temperature": -1}, 400, "temperature"),
    ({"prompt": [1, 2], "stop": 5}, 400, "stop"),
    ({"prompt": "abc", "stop": ["a", "b" * 5000]}, 400, "stop"),  # would stall the event loop
    ({"prompt": [1, 2], "model": "gpt-4"}, 404, "model"),
    ({"prompt": "héllo", "max_tokens": 3}, 400, "prompt"),
    ({"prompt": [1, 2], "echo": True, "logprobs": 1}, 400, "echo"),  # the prompt's logprobs
    ({"prompt": [1, 2], "logprobs": 21}, 400, "logprobs"),
    ({"prompt": [1, 2], "logprobs": True}, 400, "logprobs"),
    ({"prompt": [1, 2], "best_of": True}, 400, "best_of"),
    ({"prompt": [1, 2], "top_p": 0}, 400, "top_p"),
    ({"prompt": [1, 2], "top_k": -1}, 400, "top_k"),
    (b'{"prompt": [1, 2], "temperature": 1' + b"0" * 400 + b"}", 400, "temperature"),
    (b'{"prompt": [1, 2], "top_p": 1' + b"0" * 400 + b"}", 400, "top_p"),
    (b'{"prompt": [1, 2], "temperature": NaN}', 400, "temperature"),
    ({"prompt": [1, 2], "temperature": 1e300}, 400, "temperature"),  # past float32: inf
    (b"[" * 100_000, 400, None),
    (b'{"prompt": "\xed\xa0\x80"}', 400, None),  # a surrogate, UTF-8-encoded
    pytest.param(b'{"prompt": "abc", "model": "\\ud800"}', 400, "model", id="lone-surrogate"),
])
def test_a_bad_request_gets_an_openai_error_and_the_server_keeps_serving(base, body, status,
                                                                         param):
    if isinstance(body, bytes):
        answer = httpx.post(f"{base}/v1/completions", content=body, timeout=10)
    else:
        answer = complete(base, **body) if "model" not in body else httpx.post(
            f"{base}/v1/completions", json=body, timeout=10)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert complete(base, prompt=[1, 2], max_tokens=2).status_code == 200


def test_an_eos_token_ends_the_answer_and_leaves_no_text(chain):
    class WithEos(Letters):
        eos_token_ids = ()

    with serving(chain, text=Letters()) as (url, _):
        free = complete(url, prompt="abc", max_tokens=6).json()["choices"][0]
    WithEos.eos_token_ids = (free["token_ids"][2],)
    with serving(chain, text=WithEos()) as (url, _):
        got = complete(url, prompt="abc", max_tokens=6).json()["choices"][0]
    first = free["token_ids"].index(WithEos.eos_token_ids[0])  # 2, or earlier if repeated
    assert got["finish_reason"] == "stop"
    assert got["token_ids"] == free["token_ids"][:first + 1]
    assert got["text"] == free["text"][:first]


def test_unknown_routes_and_health(base):
    assert httpx.get(f"{base}/nowhere", timeout=10).status_code == 404
    assert httpx.get(f"{base}/nowhere", timeout=10).json()["error"]["type"] == "not_found_error"
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200


def test_text_needs_a_tokenizer(chain):
    with serving(chain) as (url, _):
        answer = complete(url, prompt="hello", max_tokens=2)
        assert answer.status_code == 400
        assert "model has no tokenizer" in answer.json()["error"]["message"]
        chat = httpx.post(f"{url}/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
        assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]


def test_a_lone_surrogate_is_refused_before_the_tokenizer_sees_it(chain, model):
    # JSON may escape half a UTF-16 pair; the tokenizers library then raises a TypeError.
    pytest.importorskip("tokenizers")
    from kerncc.hf.tokenizer import TextCodec

    with serving(chain, text=TextCodec.from_dir(model.parent)) as (url, _):
        answer = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "a\\ud800"}',
                            timeout=10)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "prompt"
        assert "/prompt" in answer.json()["error"]["message"]
        chat = httpx.post(f"{url}/v1/chat/completions", content=b'{"messages": [{"role": '
                          b'"user", "content": "\\udfff"}]}', timeout=10)
        assert chat.status_code == 400, chat.text
        assert "/messages/0/content" in chat.json()["error"]["message"]
        assert complete(url, prompt="hello", max_tokens=2).status_code == 200


def test_a_wrong_method_gets_405_in_openai_shape(base):
    answer = httpx.get(f"{base}/v1/completions", timeout=10)
    assert answer.status_code == 405
    assert "POST" in answer.headers["allow"]
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_chat_names_max_completion_tokens_when_that_was_given(base):
    answer = httpx.post(f"{base}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 0}, timeout=10)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "max_completion_tokens"


def test_a_body_cut_short_by_the_client_logs_no_traceback(chain):
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("uvicorn.error")  # after uvicorn set its logging up
    try:
        with serving(chain) as (url, _):
            log.addHandler(handler)
            port = int(url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
                raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                            b"Content-Length: 1000\r\n\r\n{\"prompt\": [1,")
                time.sleep(0.2)
            for _ in range(50):  # bounded (1 s): the server hears the disconnect
                if records:
                    break
                time.sleep(0.02)
            assert complete(url, prompt=[1, 2], max_tokens=2).status_code == 200
    finally:
        log.removeHandler(handler)
    assert not records, records[0].getMessage()


@pytest.mark.parametrize("make", [False, True], ids=["missing", "without-tokenizer-json"])
def test_serve_refuses_a_tokenizer_folder_without_a_tokenizer(model, tmp_path, make):
    folder = tmp_path / "tokenizer"
    if make:
        folder.mkdir()
    # bounded: before the fix the server started and served on
    done = subprocess.run([sys.executable, "-m", "kerncc", "serve", str(model), "--port", "0",
                           "--backend", "cpu", "--tokenizer", str(folder)],
                          capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 1, done.stderr
    assert f"--tokenizer {folder}" in done.stderr
    assert "Traceback" not in done.stderr


def _stage_processes() -> list:
    """This process's live stage processes (active_children reaps the ended ones)."""
    import multiprocessing

    return [p for p in multiprocessing.active_children() if p.name.startswith("kerncc stage")]


@pytest.mark.parametrize("placement", ["thread", "process"])
def test_a_port_already_taken_is_said_plainly_and_leaves_no_stage_running(model, capsys,
                                                                         placement):
    """The port was bound after the stages had started, and nothing closed them: with
    --placement process the stage processes outlived the failed start."""
    from kerncc.cli.main import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", str(model), "--backend", "cpu", "--placement", placement,
                     "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in err
    assert "Traceback" not in err and "listening on" not in err
    assert _stage_processes() == []


def test_a_start_that_fails_after_the_stages_started_closes_them(model, capsys, monkeypatch):
    from kerncc.cli.main import main
    from kerncc.runtime.placement.process import ProcessChain
    from kerncc.serve import engine

    started: list[ProcessChain] = []

    def refuse(runner, config):  # as an engine that cannot serve the stages refuses them
        started.append(runner)
        assert _stage_processes(), "the stages had started"
        raise KernccError.single("the engine cannot serve these stages")

    monkeypatch.setattr(engine, "Engine", refuse)
    # in this process (--api-workers 0), where the test sees the stages' processes
    code = main(["serve", str(model), "--backend", "cpu", "--placement", "process",
                 "--port", "0", "--api-workers", "0"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "the engine cannot serve these stages" in err and "Traceback" not in err
    assert len(started) == 1 and _stage_processes() == []


def test_a_core_that_fails_to_start_is_said_plainly_and_leaves_no_process(model, capsys,
                                                                        monkeypatch):
    """The engine core's process (--api-workers 1) refuses the stages: its error is the
    server's, exit 1, and no core or front end is left (the core closed its stages)."""
    import multiprocessing

    from kerncc.cli.main import main
    from kerncc.serve import engine

    def refuse(runner, config):
        raise KernccError.single("the engine cannot serve these stages")

    monkeypatch.setattr(engine, "Engine", refuse)
    code = main(["serve", str(model), "--backend", "cpu", "--placement", "process",
                 "--port", "0", "--api-workers", "1"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "the engine cannot serve these stages" in err and "Traceback" not in err
    assert "listening on" not in err
    assert [p for p in multiprocessing.active_children() if p.name.startswith("kerncc-")] == []


class Gated:
    """A runner whose calls wait until the test opens the gate (the engine stays busy)."""

    def __init__(self, chain: Chain) -> None:
        self.chain, self.gate, self.entered = chain, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.chain, name)

    def submit(self, *args, **kwargs):
        self.entered.set()
        self.gate.wait(30)
        return self.chain.submit(*args, **kwargs)


def test_a_full_queue_answers_429_at_once(chain):
    gated = Gated(chain)
    with serving(chain, runner=gated, max_running=1, max_queue=2) as (url, server):
        def ask():
            with contextlib.suppress(httpx.HTTPError):
                complete(url, prompt=[1, 2, 3], max_tokens=2)

        threads = [threading.Thread(target=ask, daemon=True) for _ in range(3)]
        threads[0].start()
        assert gated.entered.wait(30), "the first request reached the model"
        for thread in threads[1:]:
            thread.start()
        for _ in range(1000):  # bounded: the two others queue up behind the busy engine
            if server.engine.waiting == 2:
                break
            time.sleep(0.01)
        assert server.engine.waiting == 2
        answer = complete(url, prompt=[4, 5], max_tokens=2)  # answered while the engine is busy
        assert answer.status_code == 429
        assert answer.json()["error"]["code"] == "queue_full"
        gated.gate.set()
        for thread in threads:
            thread.join(30)
        assert complete(url, prompt=[4, 5], max_tokens=2).status_code == 200


def test_a_client_that_goes_away_frees_its_pages(base):
    total = metric(base, "kerncc_kv_pages_total")
    cancelled = 'kerncc_requests_finished_total{reason="cancelled"}'
    before = metric(base, cancelled, 0.0)
    with httpx.stream("POST", f"{base}/v1/completions", json={
            "model": MODEL, "prompt": list(range(40)), "max_tokens": 210, "stream": True},
            timeout=60) as answer:
        lines = answer.iter_lines()
        for _ in range(3):
            next(lines)
        held = metric(base, "kerncc_kv_pages_free")
        assert held < total, f"{held} of {total} pages free while streaming"
        assert metric(base, "kerncc_requests_running") == 1
    # bounded (30 s): the front end counts the answer cancelled as its client leaves; the
    # pages come back once the cancel reaches the engine core, a step or so later
    for _ in range(1500):
        if (metric(base, cancelled, 0.0) > before
                and metric(base, "kerncc_kv_pages_free") == total):
            break
        time.sleep(0.02)
    assert metric(base, cancelled, 0.0) == before + 1, "the request was cancelled"
    assert metric(base, "kerncc_kv_pages_free") == total
    assert metric(base, "kerncc_requests_running") == 0


def test_a_stream_whose_client_leaves_before_its_first_token_is_never_served(chain):
    """A streaming request queued behind a busy engine, whose client closes the connection
    before any token: the handler sees it go (it polls until the first piece) and cancels the
    request, so the engine never prefills it. (It used to notice only when the first token
    could not be written, after the prefill.)"""

    class Counting(Gated):
        rows: list[int] = []

        def submit(self, program, inputs=None, vars=None, *args, **kwargs):
            self.rows.append(int((vars or {}).get("tokens", 0)))
            return super().submit(program, inputs, vars, *args, **kwargs)

    gated = Counting(chain)
    with serving(chain, runner=gated, max_running=1) as (url, server):
        cancels: list = []
        cancel = server.engine.cancel
        server.engine.cancel = lambda request: (cancels.append(request), cancel(request))
        busy = threading.Thread(target=complete, args=(url,), kwargs={
            "prompt": [1, 2, 3], "max_tokens": 2}, daemon=True)
        busy.start()
        assert gated.entered.wait(30), "the first request reached the model"
        body = json.dumps({"model": MODEL, "prompt": list(range(30)), "max_tokens": 4,
                           "stream": True}).encode()
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                         b"Content-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            for _ in range(1000):  # bounded (10 s): the stream's request is queued
                if server.engine.waiting == 1:
                    break
                time.sleep(0.01)
            assert server.engine.waiting == 1
        for _ in range(1000):  # bounded (10 s): the handler hears the client go
            if cancels:
                break
            time.sleep(0.01)
        assert [len(r.prompt) for r in cancels] == [30], "the stream was cancelled unserved"
        gated.gate.set()
        busy.join(30)
        for _ in range(1000):  # bounded (10 s): the engine drains
            if server.engine.waiting == 0 and server.engine.running == 0:
                break
            time.sleep(0.01)
        assert server.engine.waiting == 0 and server.engine.running == 0
        assert 30 not in gated.rows, "the cancelled stream's prompt was never prefilled"
        assert cancels[0].generated == [] and cancels[0].finish == "cancelled"


class Broken:
    """A runner whose decode fails as a launch would."""

    def __init__(self, chain: Chain) -> None:
        self.chain = chain

    def __getattr__(self, name):
        return getattr(self.chain, name)

    def submit(self, program, *args, **kwargs):
        if program.startswith("decode"):
            raise KernccError.single(f"stage 0, program `{program}` call 3 (op `rmsnorm`): "
                                     "the launch failed: out of bounds")
        return self.chain.submit(program, *args, **kwargs)


def test_a_stage_fault_answers_500_and_stops_admission(chain):
    with serving(chain, runner=Broken(chain)) as (url, _):
        answer = complete(url, prompt=[1, 2, 3], max_tokens=3)
        assert answer.status_code == 500
        assert "stage 0, program `decode" in answer.json()["error"]["message"]
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        assert complete(url, prompt=[1, 2], max_tokens=2).status_code == 503


def test_seeded_sampling_is_reproducible(base):
    ask = {"prompt": [3, 1, 4, 1, 5], "max_tokens": 8, "temperature": 0.9, "top_p": 0.95,
           "seed": 1234}
    first = complete(base, **ask).json()["choices"][0]["token_ids"]
    assert complete(base, **ask).json()["choices"][0]["token_ids"] == first
    other = complete(base, **{**ask, "seed": 4321}).json()["choices"][0]["token_ids"]
    assert other != first


def test_the_server_accepts_the_moment_it_says_it_listens(model):
    """A client that connects the instant `listening on` appears is accepted (the line used to
    come before uvicorn called listen(), so such a client was refused: 5 of 5 tries)."""
    command = [sys.executable, "-m", "kerncc", "serve", str(model), "--port", "0",
               "--backend", "cpu"]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        found = None
        for _ in range(100):  # bounded: the lines before it are few
            found = re.search(r"listening on http://([^:]+):(\d+)", proc.stderr.readline())
            if found:
                break
        assert found, "the server did not start"
        with socket.create_connection((found.group(1), int(found.group(2))), timeout=10) as raw:
            raw.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
            raw.settimeout(30)
            assert raw.recv(64).startswith(b"HTTP/1.1 200")
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_server(model, *flags: str, preexec=None) -> tuple[subprocess.Popen, str]:
    """`kerncc serve` in a process of its own on 127.0.0.1, and its URL once it listens."""
    command = [sys.executable, "-m", "kerncc", "serve", str(model), "--port", "0",
               "--backend", "cpu", *flags]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, preexec_fn=preexec,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for _ in range(100):  # bounded: the lines before it are few
        found = re.search(r"listening on (http://\S+)", proc.stderr.readline())
        if found:
            return proc, found.group(1)
    proc.kill()
    proc.wait()
    raise AssertionError("the server did not start")


def end_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_sigterm_lets_a_running_stream_finish_and_exits(model):
    proc, url = start_server(model)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={
                "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 240, "stream": True},
                timeout=30) as answer:
            lines = answer.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert proc.wait(15) == 0
        assert rest[-1] == "data: [DONE]"  # a quarter second of work: within the drain
        last = json.loads(rest[-2][len("data: "):])
        assert last["choices"][0]["finish_reason"] in ("stop", "length") and "error" not in last
        assert "stopped" in proc.stderr.read()
    finally:
        end_server(proc)


def test_sigterm_drains_then_ends_every_request_left_in_openai_shape(model):
    """Streams left after --drain-timeout end with an error event and [DONE], plain and
    queued requests with a 503 in OpenAI's shape, new ones are refused 503 meanwhile; no
    traceback, exit 0 (streams were cut bare after 3 s, the others got a text/plain 500)."""
    proc, url = start_server(model, "--max-seqs", "1", "--drain-timeout", "1")
    plain: list[httpx.Response] = []
    try:
        # one sequence at a time: 8 choices of 250 tokens hold the engine for ~2 s
        with httpx.stream("POST", f"{url}/v1/completions", json={
                "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 250, "n": 8,
                "ignore_eos": True, "stream": True}, timeout=30) as answer:
            lines = answer.iter_lines()
            next(lines)
            queued = threading.Thread(target=lambda: plain.append(complete(
                url, prompt=[4, 5], max_tokens=250, ignore_eos=True)))
            queued.start()
            time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)  # within the drain: still listening, not admitting
            refused = complete(url, prompt=[1, 2], max_tokens=2)
            health = httpx.get(f"{url}/health", timeout=10)
            rest = [line for line in lines if line]
        queued.join(30)
        assert proc.wait(20) == 0
        log = proc.stderr.read()
    finally:
        end_server(proc)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == \
        "service_unavailable"
    assert health.status_code == 503
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: "):])["error"]["code"] == "cancelled"
    assert plain and plain[0].status_code == 503, plain
    assert plain[0].json()["error"]["code"] == "cancelled"
    assert "Traceback" not in log and "cancelled" in log and "stopped" in log


class Counting(Letters):
    """Letters, remembering how many ids each decode was handed."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def decode(self, ids) -> str:
        self.sizes.append(len(ids))
        return super().decode(ids)


def test_a_long_generation_decodes_a_window_a_token_not_everything():
    """Decoding every token's whole text cost the square of the length on the event loop."""
    from kerncc.serve.http import _Detok
    from kerncc.serve.text import Text

    codec = Counting()
    detok = _Detok(Text(codec), ("zz!",))
    ids = [(i * 7) % 25 for i in range(3000)]  # letters only: never the stop
    text = "".join(detok.add(t) for t in ids) + detok.rest()
    assert text == Letters().decode(ids)
    assert max(codec.sizes) <= 4


@pytest.mark.parametrize("stops", [("c d",), ("xyz", "fg"), ("q",), ()])
def test_pieces_and_stops_are_those_of_the_whole_text(stops):
    from kerncc.serve.http import _Detok
    from kerncc.serve.text import Text

    rng = np.random.default_rng(len(stops))
    for _ in range(20):
        ids = rng.integers(0, len(LETTERS), 200).tolist()
        whole = Letters().decode(ids)
        cuts = [i for i in (whole.find(s) for s in stops) if i >= 0]
        detok, pieces = _Detok(Text(Letters()), stops), []
        for t in ids:
            pieces.append(detok.add(t))
            if detok.stopped:
                break
        if not detok.stopped:
            pieces.append(detok.rest())
        assert "".join(pieces) == (whole[:min(cuts)] if cuts else whole)
        assert detok.stopped == bool(cuts)


@pytest.mark.parametrize("stops", [("c d",), ("q",), ()])
def test_tokens_queued_behind_one_go_out_as_one_piece_with_the_same_text(stops):
    """A stream's loop that fell behind the engine catches up in one event (`_catch_up`):
    the pieces, joined, are the text and ids of one token a piece, cut at the same stop; a
    stop token or the end (None) ends the piece where it stands."""
    from kerncc.serve.engine import Request
    from kerncc.serve.http import _catch_up, _Detok
    from kerncc.serve.text import Text

    rng = np.random.default_rng(7)
    ids = rng.integers(0, len(LETTERS), 60).tolist()
    whole = Letters().decode(ids)
    cuts = [i for i in (whole.find(s) for s in stops) if i >= 0]

    async def drain(batches: list[int]) -> list:
        queue: asyncio.Queue = asyncio.Queue()
        detok, request, pieces, rest = _Detok(Text(Letters()), stops), Request([1], 60), [], ids
        for size in batches:
            for t in rest[:size]:
                queue.put_nowait(t)
            rest = rest[size:]
            if not rest:
                queue.put_nowait(None)
            piece, ended = _catch_up(queue.get_nowait(), queue, request, detok)
            pieces.append(piece)
            if ended:
                return pieces + ([] if piece.finish == "stop" else [detok.rest()])
        raise AssertionError("the generation did not end")

    pieces = asyncio.run(drain([1, 5, 1, 20, 3, 30]))
    text = "".join(p if isinstance(p, str) else p.text for p in pieces)
    assert text == (whole[:min(cuts)] if cuts else whole)
    got = [t for p in pieces if not isinstance(p, str) for t in p.token_ids]
    assert got == (ids[:len(got)] if cuts else ids)
    assert max(len(p.token_ids) for p in pieces if not isinstance(p, str)) > 1
    if cuts:
        assert pieces[-1].finish == "stop"
    else:
        assert isinstance(pieces[-1], str)  # the end came: what the detok held back


@pytest.mark.parametrize("body, param, code", [
    ({"prompt": [1] * 200, "max_tokens": 100}, "max_tokens", "context_length_exceeded"),
    ({"prompt": [1] * 300, "max_tokens": 1}, "prompt", "context_length_exceeded"),
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens", None),
])
def test_a_sequence_past_the_context_gets_openais_code(base, body, param, code):
    error = complete(base, **body).json()["error"]
    assert (error["param"], error["code"]) == (param, code)


def test_the_model_is_retrieved_by_its_id(base):
    """What the openai client's `models.retrieve` asks for."""
    got = httpx.get(f"{base}/v1/models/{MODEL}", timeout=10)
    assert got.status_code == 200 and got.json()["id"] == MODEL
    assert got.json() == httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]
    missing = httpx.get(f"{base}/v1/models/gpt-4", timeout=10)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def test_the_event_loop_answers_while_a_prompt_is_tokenized(chain):
    """Tokenizing (and decoding the JSON of, and templating) a request runs off the event
    loop: while one prompt's encode is stuck, /health and other requests still answer."""
    import threading

    entered, release = threading.Event(), threading.Event()

    class Slow(Letters):
        def encode(self, text):
            if text == "slow":
                entered.set()
                release.wait(30)
            return super().encode(text)

    with serving(chain, text=Slow()) as (url, _):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stuck = pool.submit(complete, url, prompt="slow", max_tokens=2)
            assert entered.wait(10)
            try:
                assert httpx.get(f"{url}/health", timeout=10).status_code == 200
                assert complete(url, prompt=[1, 2], max_tokens=2).status_code == 200
            finally:
                release.set()
            assert stuck.result(timeout=30).status_code == 200


def test_chat_renders_abandoned_by_their_clients_stop_and_leave_room(chain, tmp_path,
                                                                     monkeypatch):
    """A client that leaves while its chat template renders stops the render: more abandoned
    renders than the worker threads used to hold every thread for good, and every request
    after them waited forever while /health said 200."""
    pytest.importorskip("tokenizers")
    from kerncc.hf import tokenizer
    from kerncc.hf.tokenizer import TextCodec

    monkeypatch.setattr(tokenizer, "MAX_STEPS", 10**12)  # only the client's leaving ends it
    monkeypatch.setattr(tokenizer, "RENDER_SECONDS", 600.0)
    generate(tmp_path, "tiny")
    (tmp_path / "chat_template.jinja").write_text(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    codec = TextCodec.from_dir(tmp_path)
    workers = min(32, (os.cpu_count() or 1) + 4) + 2  # asyncio.to_thread's pool, and more

    def abandon() -> None:
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(f"{url}/v1/chat/completions", timeout=0.5, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})

    with serving(chain, text=codec) as (url, _):
        clients = [threading.Thread(target=abandon) for _ in range(workers)]
        for client in clients:
            client.start()
        for client in clients:
            client.join(30)
        answer = httpx.post(f"{url}/v1/completions", timeout=10, json={
            "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
        assert answer.status_code == 200, answer.text


def half_sent(url: str, data: bytes) -> socket.socket:
    """A connection to the server that sent `data` and then nothing more."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    raw = socket.create_connection((host, int(port)), timeout=10)
    raw.sendall(data)
    return raw


def read_all(raw: socket.socket, seconds: float) -> bytes:
    """What the server writes before it closes the connection, within `seconds`."""
    raw.settimeout(seconds)
    got = b""
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while chunk := raw.recv(4096):
            got += chunk
    return got


@pytest.mark.parametrize("data, flag, what", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n", "--header-timeout", "headers"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\ncontent-type: application/json\r\n"
     b"content-length: 100\r\n\r\n{\"prompt\"", "--body-timeout", "body"),
])
def test_a_half_sent_request_is_answered_408_and_closed(model, data, flag, what):
    """Neither the headers nor the body had a read timeout: a client that stopped mid-request
    held its connection for ever."""
    proc, url = start_server(model, flag, "1")
    try:
        with half_sent(url, data) as raw:
            began = time.monotonic()
            answer = read_all(raw, 10)
            took = time.monotonic() - began
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "timeout"
        assert 0.9 < took < 5, took
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # still serving
    finally:
        end_server(proc)


def test_half_sent_requests_do_not_starve_the_others(model):
    """300 half-sent requests against a process of 256 file descriptors: those waiting past
    --max-waiting-connections are closed, and a normal request is answered (it waited in the
    backlog for ever: no header timeout, no cap)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 400:
        if hard != resource.RLIM_INFINITY and hard < 400:
            pytest.skip("this test process needs 400 file descriptors for its clients")
        resource.setrlimit(resource.RLIMIT_NOFILE, (400, hard))

    def few_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    proc, url = start_server(model, "--max-waiting-connections", "32", preexec=few_descriptors)
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True)
    reader.start()  # the log never fills its pipe and stalls the server
    held: list[socket.socket] = []
    try:
        for _ in range(300):
            held.append(half_sent(url, b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"))
        began = time.monotonic()
        answer = httpx.get(f"{url}/health", timeout=15)
        assert answer.status_code == 200 and time.monotonic() - began < 15
    finally:
        for raw in held:
            raw.close()
        end_server(proc)


def test_token_id_completions_are_parsed_on_the_loop_and_the_rest_on_a_thread(
        chain, monkeypatch):
    """A small completions request of token ids is parsed on the event loop (the hop to a
    thread and back cost more than its parse when 32 came at once); one that asks for the
    prompt's text (`echo`) or is chat still goes to a thread, and both answer alike."""
    from kerncc.serve import http as served

    where: list[tuple[bool, bool]] = []  # (chat, on the event loop's thread)
    parse = served.Server.parse

    def parse_here(self, body, chat, stop=None):
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        where.append((chat, on_loop))
        return parse(self, body, chat, stop)

    monkeypatch.setattr(served.Server, "parse", parse_here)
    with serving(chain, text=Letters()) as (url, _):
        asked = {"model": MODEL, "prompt": [3, 1, 4, 1, 5], "max_tokens": 3}
        quick = httpx.post(f"{url}/v1/completions", timeout=30, json=asked)
        echoed = httpx.post(f"{url}/v1/completions", timeout=30, json={**asked, "echo": True})
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        bad = httpx.post(f"{url}/v1/completions", timeout=30, content=b'{"prompt": [1,')
    assert [r.status_code for r in (quick, echoed, chat)] == [200, 200, 200]
    assert where == [(False, True), (False, False), (True, False)]
    ids = quick.json()["choices"][0]["token_ids"]
    assert ids == echoed.json()["choices"][0]["token_ids"] and len(ids) == 3
    assert echoed.json()["choices"][0]["text"].startswith(Letters().decode([3, 1, 4, 1, 5]))
    assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]


def test_a_token_id_prompt_is_decoded_only_for_echo(chain):
    """The prompt's text is decoded for `echo` alone (else the tokenizer ran over every
    prompt on the front end for nothing)."""
    from kerncc.serve.engine import Config, Engine
    from kerncc.serve.http import Server
    from kerncc.serve.text import Text

    decoded: list[list[int]] = []

    class Counting(Letters):
        def decode(self, ids) -> str:
            decoded.append(list(ids))
            return super().decode(ids)

    server = Server(Engine(chain, Config()), MODEL, Text(Counting()))
    plain = server.parse({"model": MODEL, "prompt": [7, 8, 9]}, chat=False)
    assert plain.texts == ("",) and decoded == []
    echoed = server.parse({"model": MODEL, "prompt": [7, 8, 9], "echo": True}, chat=False)
    assert echoed.texts == (Letters().decode([7, 8, 9]),) and decoded == [[7, 8, 9]]
