"""The front end apart from the engine core (kerncc.serve.core, kerncc.serve.client,
kerncc.serve.wire): several front ends on one core get their own requests' bits, each as it
would alone; a core that dies answers every request in flight 500 and ends the server with a
nonzero exit; a message not of the format is refused and logged, never acted on or a crash."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from kerncc.diagnostics import KernccError
from kerncc.example import generate
from kerncc.lower import lower_to_bundle
from kerncc.runtime import Chain
from kerncc.serve import wire
from kerncc.serve.engine import Config, Engine, Request
from reference_loop import reference
from serving import core_apart, serving

MODEL = "kerncc-qwen3-tiny"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    manifest, _ = generate(tmp_path_factory.mktemp("tiny"), "tiny")
    return manifest


@pytest.fixture(scope="module")
def chain(model) -> Chain:
    return Chain(lower_to_bundle(model))


def prompts(count: int, seed: int = 11) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, int(rng.integers(2, 20))).tolist() for _ in range(count)]


class _Heard:
    """A listener that keeps what it heard, and says when the end came."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.ended = threading.Event()

    def token(self, request: Request, token: int) -> None:
        self.tokens.append(token)

    def done(self, request: Request) -> None:
        self.ended.set()


def test_two_front_ends_on_one_core_each_hear_their_own_requests_as_alone(chain):
    """Two clients of one core, 8 requests each at once: every request's tokens come back to
    the front end that sent it, each the tokens it gets served alone."""
    asks = prompts(16)
    alone = [reference(chain, p, 6).tokens for p in asks]
    engine = Engine(chain, Config(max_running=8, max_queue=64))
    with core_apart(engine, workers=2) as apart:
        threads = [threading.Thread(target=c.run_forever, daemon=True) for c in apart.clients]
        for thread in threads:
            thread.start()
        heard = [_Heard() for _ in asks]
        requests = [apart.clients[i % 2].submit(Request(p, 6, listener=h))
                    for i, (p, h) in enumerate(zip(asks, heard))]
        for h in heard:
            assert h.ended.wait(60), "every request ends"
        for client in apart.clients:
            client.stop()
        for thread in threads:
            thread.join(10)
    assert [r.finish for r in requests] == ["length"] * 16
    assert [r.generated for r in requests] == alone
    assert [h.tokens for h in heard] == alone
    assert apart.core.dropped == 0


class _Watched(threading.Event):
    """The engine's wake-up, watched: counts the idle waits, and those begun while the core
    still held news (tokens, ends) that no front end had been sent."""

    def __init__(self) -> None:
        super().__init__()
        self.core = None
        self.waits = 0
        self.stale = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        if self.core is not None and self.core._news:
            self.stale += 1
        return super().wait(timeout)


def test_the_core_sends_what_a_turn_told_before_the_engine_waits_for_work(chain):
    """A request's last token and its end are told in a turn with nothing else to do: they
    leave the core before the engine waits for work, never after the idle bound."""
    engine = Engine(chain, Config(max_running=4))
    engine._wake = watched = _Watched()
    with core_apart(engine) as apart:
        watched.core = apart.core  # before any request: no news yet
        client = apart.clients[0]
        thread = threading.Thread(target=client.run_forever, daemon=True)
        thread.start()
        served = []
        for asks in (prompts(1, seed=5), prompts(4, seed=6), prompts(1, seed=7)):
            heard = [_Heard() for _ in asks]
            served += [(client.submit(Request(p, 5, listener=h)), p)
                       for p, h in zip(asks, heard)]
            for h in heard:
                assert h.ended.wait(30), "every request ends"
        client.stop()
        thread.join(10)
    assert [r.generated for r, _ in served] == [reference(chain, p, 5).tokens
                                                for _, p in served]
    assert watched.waits > 0, "the engine went idle between the rounds"
    assert watched.stale == 0


def served_apart(engine: Engine, asks: list[list[int]], max_new: int, cores: list
                 ) -> list[Request]:
    """`asks` served through `engine` in a core apart with one front end, every request
    ended; `cores` gets the core before any request is sent."""
    with core_apart(engine) as apart:
        cores.append(apart.core)
        client = apart.clients[0]
        thread = threading.Thread(target=client.run_forever, daemon=True)
        thread.start()
        heard = [_Heard() for _ in asks]
        served = [client.submit(Request(p, max_new, listener=h)) for p, h in zip(asks, heard)]
        for h in heard:
            assert h.ended.wait(30), "every request ends"
        client.stop()
        thread.join(10)
    return served


def test_with_the_core_apart_tokens_leave_before_the_next_step_is_planned(chain):
    """Apart, telling is cheap (the core batches what its listeners hear into one message),
    so the tokens a turn collects go out in that turn: the next turn's plan, whose host work
    grows with the prompts it admits, never holds tokens back."""
    engine = Engine(chain, Config(max_running=4))
    held, cores = [], []

    def watch(method):
        def watched(*args):
            if engine._told or (cores and cores[0]._news):
                held.append(method.__name__)
            return method(*args)
        return watched

    engine._issue, engine._go_ahead = watch(engine._issue), watch(engine._go_ahead)
    asks = prompts(6, seed=9)
    served = served_apart(engine, asks, 7, cores)
    assert [r.generated for r in served] == [reference(chain, p, 7).tokens for p in asks]
    assert not held, f"plans begun with tokens held back: {held[:5]}"


def start(model, *flags: str, group: bool = False) -> tuple[subprocess.Popen, str, int]:
    """`kerncc serve` on 127.0.0.1 in a process of its own (`group`: leading a process group
    of its own, as a shell's job does): it, its URL, its core's pid."""
    command = [sys.executable, "-m", "kerncc", "serve", str(model), "--port", "0",
               "--backend", "cpu", "--api-workers", "1", *flags]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=group,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for _ in range(100):  # bounded: the lines before it are few
        line = proc.stderr.readline()
        found = re.search(r"engine core pid (\d+), .* listening on (http://\S+)", line)
        if found:
            return proc, found.group(2), int(found.group(1))
    proc.kill()
    proc.wait()
    raise AssertionError("the server did not start")


def end(proc: subprocess.Popen, group: bool = False) -> None:
    if group:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the core and the front ends too
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_sigterm_to_the_whole_group_drains_the_stream_in_flight_and_exits_0(model):
    """What `kill -TERM -PGID` (or a supervisor stopping the group) does: the core waits for
    the watcher's order, so the stream in flight ends as asked and the server exits 0."""
    proc, url, _ = start(model, "--max-seqs", "1", group=True)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={
                "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 240, "ignore_eos": True,
                "stream": True}, timeout=30) as answer:
            lines = answer.iter_lines()
            next(lines)
            os.killpg(proc.pid, signal.SIGTERM)
            rest = [line for line in lines if line]
        assert proc.wait(30) == 0
        log = proc.stderr.read()
    finally:
        end(proc, group=True)
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
    assert "stopped" in log and "died" not in log


def test_kerncc_serve_with_two_api_workers_answers_concurrent_requests_as_alone(model, chain):
    asks = prompts(24, seed=3)
    alone = [reference(chain, p, 6).tokens for p in asks]
    proc, url, _ = start(model, "--api-workers", "2")
    try:
        async def all_at_once() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(client.post(
                    f"{url}/v1/completions", json={"model": MODEL, "prompt": p,
                                                   "max_tokens": 6}) for p in asks))

        answers = asyncio.run(all_at_once())
        assert [a.status_code for a in answers] == [200] * 24
        assert [a.json()["choices"][0]["token_ids"] for a in answers] == alone
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        end(proc)


def test_a_server_killed_outright_leaves_no_core_behind(model):
    """SIGKILL to `kerncc serve` (no handler runs): its engine core and front end end too,
    rather than live on holding the port."""
    proc, url, core = start(model)
    try:
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 20
        while _running(core):
            assert time.monotonic() < deadline, "the engine core outlived its server"
            time.sleep(0.05)
        deadline = time.monotonic() + 20
        while _answers(url):
            assert time.monotonic() < deadline, "a front end outlived its server"
            time.sleep(0.05)
    finally:
        end(proc)
        with contextlib.suppress(ProcessLookupError):
            os.kill(core, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _answers(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=1)
    except httpx.TransportError:
        return False
    return True


def waited_for(url: str, line: str, seconds: float = 10.0) -> None:
    """Until /metrics shows `line` (bounded: the stream must still be running then)."""
    deadline = time.monotonic() + seconds
    while line not in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        assert time.monotonic() < deadline, f"/metrics never showed {line!r}"
        time.sleep(0.005)


def test_a_killed_core_answers_every_request_in_flight_500_and_the_server_exits(model):
    proc, url, core = start(model, "--max-seqs", "1")
    try:
        plain: list[httpx.Response] = []
        with httpx.stream("POST", f"{url}/v1/completions", json={
                "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 240, "ignore_eos": True,
                "stream": True}, timeout=30) as answer:
            lines = answer.iter_lines()
            next(lines)
            queued = threading.Thread(target=lambda: plain.append(httpx.post(
                f"{url}/v1/completions", json={"model": MODEL, "prompt": [4, 5],
                                               "max_tokens": 200, "ignore_eos": True},
                timeout=30)))
            queued.start()
            waited_for(url, "kerncc_requests_waiting 1.0")  # the queued one is at the core
            os.kill(core, signal.SIGKILL)
            rest = [line for line in lines if line]
        queued.join(30)
        assert proc.wait(30) == 1
        log = proc.stderr.read()
    finally:
        end(proc)
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["code"] == "engine_fault" and "engine core is gone" in error["message"]
    assert [a.status_code for a in plain] == [500]
    assert plain[0].json()["error"]["code"] == "engine_fault"
    assert "the engine core died (signal 9)" in log and "Traceback" not in log


GARBLED = [
    b"\xc1 not msgpack",
    msgpack.packb({"kind": "add"}),
    msgpack.packb(["launch", 0]),
    msgpack.packb(["add", 0, [["one", [1], 2, {}, []]]]),  # an id of the wrong type
    msgpack.packb(["add", 7, [[0, [1, 2], 2, {}, []]]]),  # a worker there is not
    msgpack.packb(["cancel", 0, "all"]),
    msgpack.packb(["hello"]),
]


def test_a_garbled_message_to_the_core_is_refused_and_it_serves_on(chain, caplog):
    engine = Engine(chain, Config(max_running=4))
    with core_apart(engine) as apart:
        client = apart.clients[0]
        thread = threading.Thread(target=client.run_forever, daemon=True)
        thread.start()
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(apart.inbox)
        for raw in GARBLED:
            push.send(raw)
        for _ in range(500):  # bounded (5 s): the core has read them
            if apart.core.dropped == len(GARBLED):
                break
            time.sleep(0.01)
        push.close()
        assert apart.core.dropped == len(GARBLED)
        heard = _Heard()
        request = client.submit(Request([5, 6, 7], 4, listener=heard))
        assert heard.ended.wait(30)
        client.stop()
        thread.join(10)
    assert request.generated == reference(chain, [5, 6, 7], 4).tokens
    assert "refused a message from a front end" in caplog.text


@pytest.mark.parametrize("prompt, max_new, pointer", [
    ([1, 256, 3], 3, "/prompt/1"), ([4, -2], 3, "/prompt/1"), ([1.5], 3, "/prompt/0"),
    ([1] * 200, 100, "/max_tokens"), ([1, 2], 0, "/max_tokens"), ([], 3, "/prompt")])
def test_a_front_end_refuses_what_the_engine_refuses_in_its_words(chain, prompt, max_new,
                                                                  pointer):
    """The front end checks by the limits the core sent (no weights of its own): the same
    rule, message and pointer as the engine's own check, before anything is sent."""
    engine = Engine(chain, Config(max_running=4))
    with pytest.raises(KernccError) as alone:
        engine.check(Request(prompt, max_new))
    with core_apart(engine) as apart:
        client = apart.clients[0]
        assert client.limits == engine.model.limits and client.limits.token_high == 255
        with pytest.raises(KernccError) as apart_err:
            client.submit(Request(prompt, max_new))
        assert not client.requests
    assert apart_err.value.headline == alone.value.headline
    assert apart_err.value.diagnostics[0].location.pointer == pointer
    assert pointer.split("/")[1] in alone.value.headline


def test_a_request_with_bad_params_is_refused_by_the_core_with_the_field(chain):
    """A request whose params are not of the format (past the front end's checks) ends
    refused, naming it; the core serves on."""
    engine = Engine(chain, Config(max_running=4))
    with core_apart(engine) as apart:
        client = apart.clients[0]
        thread = threading.Thread(target=client.run_forever, daemon=True)
        thread.start()
        heard = _Heard()
        request = client.submit(Request([5, 6, 7], 4, listener=heard))
        client._send(["add", 0, [[99, [1, 2], 3, {"temperature": "hot"}, []]]])
        client.requests[99] = odd = Request([1, 2], 3, listener=_Heard())
        odd.id = 99
        odd.sampler = type(request.sampler)()
        assert heard.ended.wait(30) and odd.listener.ended.wait(30)
        client.stop()
        thread.join(10)
    assert odd.finish == "refused"
    assert client.refusal(odd)[0] == "invalid" and "params.temperature" in odd.error
    assert request.finish == "length"


def test_a_garbled_message_to_a_front_end_is_refused_and_it_serves_on(chain, caplog):
    with serving(chain, MODEL) as (url, server):
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(server.engine.pull.getsockopt(zmq.LAST_ENDPOINT).decode())
        for raw in (b"\xc1", msgpack.packb(["step", [["x"]], {}]),
                    msgpack.packb(["stats", {"running": "many"}])):
            push.send(raw)
        push.close()
        answer = httpx.post(f"{url}/v1/completions", json={
            "model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4}, timeout=60)
        assert answer.status_code == 200
        assert answer.json()["choices"][0]["token_ids"] == reference(chain, [5, 6, 7], 4).tokens
        for _ in range(500):  # bounded (5 s): the three were read
            if caplog.text.count("refused a message from the engine core") == 3:
                break
            time.sleep(0.01)
    assert caplog.text.count("refused a message from the engine core") == 3


@given(st.binary(max_size=200))
def test_decode_takes_any_bytes_and_refuses_what_is_not_a_message(raw):
    try:
        message = wire.decode(raw, ("hello", "add", "cancel", "info", "step", "stats"))
    except wire.WireError:
        return
    assert isinstance(message, list) and message[0] in ("hello", "add", "cancel", "info",
                                                        "step", "stats")


@given(st.lists(st.one_of(st.integers(-(1 << 70), 1 << 70), st.booleans(), st.floats()),
                max_size=12))
def test_a_list_of_ids_is_taken_as_each_id_would_be(items):
    """wire's one-pass check of a list of ids answers as its item-by-item check."""
    each = all(isinstance(t, int) and not isinstance(t, bool) and -wire.INT64 <= t < wire.INT64
               for t in items)
    try:
        wire._ints(items, "ids")
    except wire.WireError:
        assert not each
    else:
        assert each


def test_params_go_over_the_wire_and_back_unchanged():
    from kerncc.serve.sampling_hook import Params

    params = Params(temperature=0.7, top_k=5, top_p=0.9, seed=(1 << 64) - 1,
                    presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                    logit_bias=((3, -100.0), (7, 2.5)), min_tokens=2,
                    suppress=frozenset({0, 9}), prompt=(1, 2, 3), logprobs=2, ranked=True)
    raw = wire.encode(["add", 0, [[0, [1], 1, wire.params_out(params), []]]])
    assert wire.params_in(wire.decode(raw, ("add",))[2][0][3]) == params


def test_a_server_in_one_process_still_serves(chain):
    """`--api-workers 0`: the Engine in the front end's process, as before the split."""
    with serving(chain, MODEL, split=False) as (url, server):
        assert isinstance(server.engine, Engine)
        answer = httpx.post(f"{url}/v1/completions", json={
            "model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4}, timeout=60)
    assert answer.json()["choices"][0]["token_ids"] == reference(chain, [5, 6, 7], 4).tokens


def test_api_workers_must_be_a_count(model):
    done = subprocess.run([sys.executable, "-m", "kerncc", "serve", str(model),
                           "--api-workers", "-1"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2 and "--api-workers" in done.stderr
    assert "at least 0" in done.stderr


