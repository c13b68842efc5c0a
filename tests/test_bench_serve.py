"""bench/serve.py's load generator and bench/simulated.py's device, on the CPU: the hand-written HTTP/1.1
client reads every streamed token of the server's answer (and the server's refusal as an
error), and the simulated device queues its steps as a stream does, makes a download wait for
the work before it, and counts only the time it waited for the host."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from bench.gpu import greedy
from bench.serve import level, one, start_server
from bench.simulated import Device
from kerncc.example import generate
from kerncc.lower import lower_to_bundle
from kerncc.runtime import Chain


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    manifest, _ = generate(tmp_path_factory.mktemp("tiny"), "tiny")
    bundle = lower_to_bundle(manifest)
    chain = Chain(bundle)
    model = bundle.stages[0].manifest.model
    url, uv = start_server(chain, 4, model)
    yield url, model, Chain(bundle)  # a chain of the test's own for the tokens alone
    uv.should_exit = True


def test_one_request_s_tokens_are_all_read_and_timed(served):
    url, model, alone = served
    prompt = [5, 17, 3, 250, 9]
    ttft, gaps, tokens = asyncio.run(one(url, model, prompt, 7))
    assert tokens == 7 == len(greedy(alone, prompt, 7)[0])
    assert len(gaps) == 6 and min(gaps) >= 0 and ttft > 0


def test_a_level_counts_every_request_and_token(served):
    url, model, _ = served
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 9, 1, 14, 6)]
    row = asyncio.run(level(url, model, 2, prompts, 4, budget=60))
    assert row["requests"] == 5 and row["tokens"] == 20
    assert row["tok_s"] > 0 and row["itl_p50"] >= 0 and row["ttft_p99"] >= row["ttft_p50"]


def test_a_refused_request_is_an_error_not_a_silent_zero(served):
    url, model, _ = served
    with pytest.raises(RuntimeError, match="400"):
        asyncio.run(one(url, model, [100_000], 3))  # past the vocabulary


def test_the_simulated_device_queues_steps_and_counts_only_its_waits():
    device = Device(step_ms=5.0)
    data = np.arange(16, dtype=np.uint8)
    device.replay(None)
    device.replay(None)  # queued behind the first: the device never waited
    ready = device.busy_until  # integer nanoseconds: the sums below are exact
    assert ready - device.replays[0] >= 2 * 5_000_000  # two steps of 5 ms, one after the other
    out = device.download_async(data, 0, 16).result()
    assert time.perf_counter_ns() >= ready and np.array_equal(out, data)
    time.sleep(0.003)  # the host keeps the device waiting
    device.replay(None)
    assert device.gaps[0] == 0 and device.gaps[1] >= 3_000_000
    assert device.idle_us() >= 1500  # the median of 0 and at least 3000 us
    device.reset()
    assert np.isnan(device.idle_us()) and device.busy_until == 0
