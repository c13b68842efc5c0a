"""bench/serve.py's load generator and bench/simulated.py's device, on the CPU: the hand-written HTTP/1.1
client reads every streamed token of the server's answer (and the server's refusal as an
error), and the simulated device queues its steps as a stream does, makes a download wait for
the work before it, and counts only the time it waited for the host; with a cost a row, a
prefill chunk takes time by its rows; and a tiny `--prefix --prefix-cache ab` run prints and
writes its rounds and ratios, its "on" rounds taking the shared prefix from the cache."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import time

import numpy as np
import pytest

from bench.gpu import greedy
from bench.serve import level, main, one, start_server
from bench.simulated import Device, Timed
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


def test_a_ramp_starts_the_first_requests_apart(served):
    url, model, _ = served
    prompts = [[5, 17, 3], [9, 1], [4, 4, 4]]
    started = time.perf_counter()
    row = asyncio.run(level(url, model, 3, prompts, 2, budget=60, ramp=0.6))
    assert row["requests"] == 3 and row["tokens"] == 6
    assert time.perf_counter() - started >= 0.4  # the third began 0.4 s in


def test_a_ramp_spreads_the_first_wave_when_more_requests_wait_behind_it(monkeypatch):
    """The first `concurrency` requests start over the ramp even with more behind them (these
    took the places the ramped ones left free while they waited, and the whole first wave
    started at once); the rest start as places free."""
    import bench.serve as bench_serve

    started: dict[int, float] = {}

    async def fake(url, model, prompt, max_tokens, sampled=None, first=None):
        started[prompt[0]] = time.perf_counter()
        await asyncio.sleep(0.05)
        return 0.01, [], 1

    monkeypatch.setattr(bench_serve, "one", fake)
    begun = time.perf_counter()
    row = asyncio.run(level("url", "model", 4, [[i] for i in range(8)], 1, budget=60,
                            ramp=0.4))
    assert row["requests"] == 8
    first = [started[i] - begun for i in range(4)]
    assert first[0] < 0.05 and all(b - a >= 0.08 for a, b in itertools.pairwise(first))
    assert min(started[i] for i in range(4, 8)) - begun >= 0.05  # they wait for a place


def test_newcomers_arrive_beside_streams_that_decode_not_beside_their_prefill(monkeypatch):
    """--newcomers: the first comes one interval after every stream of the first wave has its
    first token (sent with the wave, it waited for the wave's prefill), then one an interval."""
    import bench.serve as bench_serve

    begun = time.perf_counter()
    sent: list[float] = []

    async def fake(url, model, prompt, max_tokens, sampled=None, first=None):
        if first is None:  # a newcomer
            sent.append(time.perf_counter() - begun)
            return 0.01, [], 1
        await asyncio.sleep(0.3 if prompt[0] else 0.1)  # the wave's prefill
        first.set()
        await asyncio.sleep(0.4)
        return 0.01, [0.002], 2

    monkeypatch.setattr(bench_serve, "one", fake)
    row = asyncio.run(level("url", "model", 2, [[0], [1]], 2, budget=60,
                            newcomers=bench_serve.Newcomers(10, 0.1, 100)))
    assert row["requests"] == 2 and row["newcomers"] == len(sent) >= 2
    assert sent[0] >= 0.3 + 0.1  # the later stream's first token, then an interval
    assert all(b - a >= 0.09 for a, b in itertools.pairwise(sent))


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


def test_with_a_cost_a_row_a_call_costs_its_prefill_rows_replayed_or_not():
    device = Device(step_ms=1.0, row_us=10.0)
    start = time.perf_counter_ns()
    with device.call(300):
        device.stream_joined()  # a stage's run begins: charged, 1 ms + 300 x 10 us
        first = device.busy_until
        device.replay(None)  # its replay is not charged again
        assert device.busy_until == first and len(device.replays) == 1
    assert first - start >= 4_000_000 and device.gaps == []
    with device.call(0):  # a decode step, queued behind: the step alone, exactly
        device.stream_joined()
    assert device.busy_until == first + 1_000_000 and device.gaps == [0]
    plain = Device(step_ms=1.0)  # no cost a row: as before, replays alone take time
    plain.stream_joined()
    assert plain.busy_until == 0
    with pytest.raises(ValueError, match="row_us"):
        plain.call(3).__enter__()


def test_a_timed_chain_tells_the_device_the_rows_of_prefill_calls_only(tmp_path):
    manifest, _ = generate(tmp_path, "tiny")
    device = Device(step_ms=1.0, row_us=5.0)
    chain = Timed(lower_to_bundle(manifest), backend=device, graphs=True, token_capacity=512)
    assert chain.prefill  # the example's chunk program takes rows as fed
    told = []
    device.call = lambda rows, call=device.call: told.append(rows) or call(rows)
    program = sorted(chain.prefill)[0]
    chain.submit(program, vars={"tokens": 7}, rows=7, outputs=False)
    other = next(p for p in chain.sessions[0].programs if p not in chain.prefill
                 and not chain.sessions[0].manifest.programs[p].once
                 and not chain.sessions[0].manifest.programs[p].derive)
    chain.submit(other, rows=3, outputs=False)
    assert told == [7, 0]


def test_a_prefix_cache_ab_run_prints_both_rounds_and_hits_the_cache(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["--size", "tiny", "--backend", "sim", "--step-ms", "0.5", "--row-us", "5",
                 "--prefix", "48,5", "--prefix-cache", "ab", "--levels", "2",
                 "--requests-per-level", "2", "--max-tokens", "4", "--max-seqs", "4",
                 "--budget", "20", "--dir", str(tmp_path / "models"), "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert printed.count("prefix cache off\n") == 2 and printed.count("prefix cache on\n") == 2
    assert "prompt 53 (48 shared + 5 own)" in printed
    assert "| concurrency | TTFT p50 ms on / off | x lower | TTFT p99 ms on / off | x lower " \
           "| tokens/s on / off | x higher |" in printed
    assert re.search(r"^\| 2 \| [\d.]+ / [\d.]+ \| [\d.]+x \| [\d.]+ / [\d.]+ \| [\d.]+x "
                     r"\| [\d.]+ / [\d.]+ \| [\d.]+x \|$", printed, re.MULTILINE)
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["prefix_cache"] for r in runs] == [False, True, False, True]
    for run in runs:
        counts = run["prefix_cache_counts"]
        (conc, row), = run["rows"]
        assert conc == 2 and row["requests"] == 4 and row["tokens"] == 16
        assert counts["queried_tokens"] == 4 * 53
        # on: every prompt's 3 full shared pages (48 tokens) from the cache, the warm-up
        # having kept them; off: none
        assert counts["hit_tokens"] == (4 * 48 if run["prefix_cache"] else 0)
    hits = re.findall(r"^prefix cache over the levels \(/metrics\): hit rate ([\d.]+)%",
                      printed, re.MULTILINE)
    assert [float(h) for h in hits] == [pytest.approx(100 * 48 / 53, abs=0.1)] * 2


def test_a_prefix_that_does_not_fit_the_example_gets_a_longer_context(tmp_path):
    from bench.serve import example

    args = type("Args", (), {"size": "tiny", "max_seqs": 4, "prompt_len": 300,
                             "max_tokens": 20, "dir": str(tmp_path)})()
    manifest = example(args)
    assert manifest.parent.name == "tiny-4-context320"
    limits = json.loads((manifest.parent / "config.json").read_text())
    assert limits["max_position_embeddings"] == 320


def test_a_model_too_short_for_the_prefix_is_refused_before_any_request(tmp_path, capsys):
    # the folder the bench would use, holding a model of the tiny size's own context, 256
    generate(tmp_path / "tiny-4-context336", "tiny", max_seqs=4)
    with pytest.raises(SystemExit, match="holds at most 256 tokens, fewer than a prompt of 308"):
        main(["--size", "tiny", "--backend", "sim", "--prefix", "300,8", "--max-tokens", "20",
              "--max-seqs", "4", "--levels", "1", "--dir", str(tmp_path),
              "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()  # nothing half-written


@pytest.mark.parametrize("flags, message", [
    (["--prefix", "5"], "expected N,M"),
    (["--prefix", "0,3"], "at least 1 token each"),
    (["--row-us", "-1"], "expected 0 <= microseconds"),
    (["--backend", "cpu", "--row-us", "3"], "--row-us is the simulated device's"),
    (["--ahead", "ab", "--prefix-cache", "ab"], "one A/B at a time"),
    (["--ramp-ms", "-5"], "expected 0 <= milliseconds"),
    (["--ramp-ms", "soon"], "expected milliseconds"),
    (["--backend", "sim", "--invariant", "off"], "the cuda backend's, not sim's"),
    (["--backend", "cuda", "--invariant", "ab", "--split", "ab"], "one A/B at a time"),
    (["--max-running", "0"], "--max-running 0: at least 1 sequence at once"),
    (["--newcomers", "2000"], "expected N,MS"),
    (["--newcomers", "2000,100,3"], "expected N,MS"),
    (["--newcomers", "0,100"], "expected N >= 1 tokens and 1 <= MS <= 60000"),
    (["--newcomers", "20,0"], "expected N >= 1 tokens and 1 <= MS <= 60000"),
    (["--step-tokens", "0"], "--step-tokens 0: at least 1 row a step"),
    (["--api-workers", "0"], "expected 1 to 16 front ends, got `0`"),
    (["--api-workers", "two"], "expected 1 to 16 front ends, got `two`"),
    (["--api-workers", "4"], "--api-workers 4: front ends apart from the core need --split on"),
    (["--trace", "/nonexistent-folder/trace.jsonl"], "--trace /nonexistent-folder/trace.jsonl: "
                                                      "cannot append to it"),
])
def test_bad_prefix_flags_are_refused_with_their_reason(flags, message, capsys):
    with pytest.raises(SystemExit):
        main(flags)
    assert message in capsys.readouterr().err


def test_a_trace_report_times_each_stage_from_the_one_before(tmp_path):
    """bench/serve_trace.py: stamps joined by the prompt, each stage's median gap from the
    stage before, requests sent before `since` left out, and the prefill steps listed."""
    from bench import serve_trace

    path = tmp_path / "trace.jsonl"
    serve_trace.open_trace(str(path))
    try:
        for prompt, base in (([1, 2, 3], 10.0), ([4, 5, 6], 20.0), ([7, 8, 9], 1.0)):
            for stage, after in (("sent", 0.0), ("app", 0.002), ("admitted", 0.005),
                                 ("token", 0.015), ("first", 0.020)):
                serve_trace.stamp(stage, prompt, base + after)
        serve_trace.stamp("step", None, 10.006, chunk=300, decode=0, waiting=0, admitted=1,
                          calls=1)
    finally:
        serve_trace.close_trace()
    text = serve_trace.report(str(path), since=5.0)
    assert text.startswith("2 requests;")
    assert "| app | 2.00 | 2.00 | 2.00 |" in text
    assert "| token | 10.00 | 10.00 | 15.00 |" in text
    assert "| first | 5.00 | 5.00 | 20.00 |" in text
    assert "rows a step: 300" in text


def test_a_traced_run_prints_where_the_first_token_s_time_goes(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    code = main(["--size", "tiny", "--backend", "sim", "--step-ms", "0.5", "--levels", "2",
                 "--requests-per-level", "1", "--max-tokens", "3", "--max-seqs", "4",
                 "--budget", "20", "--split", "on", "--dir", str(tmp_path / "models"),
                 "--trace", str(trace)])
    printed = capsys.readouterr().out
    assert code == 0 and "trace, concurrency 2:\n2 requests;" in printed
    for stage in ("app", "parsed", "out", "in", "admitted", "chunked", "token", "told",
                  "heard", "written", "first"):
        assert re.search(rf"^\| {stage} \| [\d.-]+ \| [\d.-]+ \| [\d.-]+ \|$", printed,
                         re.MULTILINE), stage


def test_several_front_ends_beside_the_core_answer_every_request(tmp_path, capsys):
    code = main(["--size", "tiny", "--backend", "sim", "--step-ms", "0.5", "--levels", "4",
                 "--requests-per-level", "2", "--max-tokens", "5", "--max-seqs", "4",
                 "--budget", "20", "--split", "on", "--api-workers", "2",
                 "--dir", str(tmp_path / "models")])
    printed = capsys.readouterr().out
    assert code == 0 and "front end apart from the core (2 of them)" in printed
    assert re.search(r"^\| 4 \| 8 \| [\d.]+ \|", printed, re.MULTILINE), printed


def test_each_level_is_held_against_its_decode_step(tmp_path, capsys):
    """On the sim the step is --step-ms; the ratios are the row's own numbers over it."""
    out = tmp_path / "out"
    code = main(["--size", "tiny", "--backend", "sim", "--step-ms", "0.5", "--levels", "2,4",
                 "--requests-per-level", "1", "--max-tokens", "6", "--max-seqs", "4",
                 "--budget", "20", "--dir", str(tmp_path / "models"), "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["decode_step_ms"] == {"2": 0.5, "4": 0.5}
    for conc, row in run["rows"]:
        found = re.search(rf"^\| {conc} \| 0.500 \| ([\d.]+)x \| ([\d.]+)x \| ([\d.]+)x \|$",
                          printed, re.MULTILINE)
        assert found, printed
        assert float(found.group(1)) == pytest.approx(row["tok_s"] * 0.5 / 1e3 / conc, abs=0.01)
        assert float(found.group(3)) == pytest.approx(row["itl_p99"] * 1e3 / 0.5, abs=0.01)


def test_newcomers_beside_the_streams_are_timed_against_their_ttft_alone(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["--size", "tiny", "--backend", "sim", "--step-ms", "0.5", "--row-us", "5",
                 "--levels", "2", "--requests-per-level", "2", "--max-tokens", "8",
                 "--max-seqs", "4", "--budget", "20", "--newcomers", "40,5",
                 "--step-tokens", "16", "--dir", str(tmp_path / "models"), "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "a 40-token prompt every 5 ms beside the streams" in printed
    found = re.search(r"^\| 2 \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \| ([\d.]+) \| "
                      r"([\d.]+)x \| ([\d.]+)x \| ([\d.]+)x \|$", printed, re.MULTILINE)
    assert found, printed
    newcomers, alone, p50, x50, p99 = (float(found.group(i)) for i in range(1, 6))
    # the streams' 4 requests of 8 tokens at 0.5 ms a step take several ms: newcomers came
    assert 1 <= newcomers <= 1000 and alone > 0 and p99 >= p50 > 0
    assert x50 == pytest.approx(p50 / alone, rel=0.05, abs=0.01)
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    (conc, row), = run["rows"]
    # the newcomers' tokens and TTFTs are theirs: the streams' row counts the streams only
    assert conc == 2 and row["requests"] == 4 and row["tokens"] == 32
    assert row["newcomers"] == newcomers and row["new_alone"] > 0


def test_streams_spread_over_client_processes_count_as_one_level(monkeypatch, tmp_path):
    """`spread_level` (--clients): every request read once, by the processes between them,
    the same TTFTs and ITLs as one process's, and the first wave's ramp kept across the
    processes (request i starts at i x ramp / concurrency whichever process sends it)."""
    import bench.serve as bench_serve

    log = tmp_path / "starts"

    async def fake(url, model, prompt, max_tokens, sampled=None, first=None):
        with open(log, "a") as out:  # one line a request, appended from every process
            out.write(f"{prompt[0]} {time.perf_counter()} {os.getpid()}\n")
        await asyncio.sleep(0.01 * (1 + prompt[0] % 3))
        return 0.01 * (prompt[0] + 1), [0.001 * (prompt[0] + 1)] * (max_tokens - 1), max_tokens

    monkeypatch.setattr(bench_serve, "one", fake)
    prompts = [[i] for i in range(12)]
    alone = asyncio.run(level("url", "model", 6, prompts, 3, budget=60))
    log.unlink()
    row = bench_serve.spread_level("url", "model", 6, prompts, 3, budget=60, ramp=0.5,
                                   clients=3)
    assert row["requests"] == alone["requests"] == 12 and row["tokens"] == 36
    for key in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"):
        assert row[key] == alone[key], key
    starts = {int(n): (float(t), int(pid)) for n, t, pid in
              (line.split() for line in log.read_text().splitlines())}
    assert sorted(starts) == list(range(12))
    assert len({pid for _, pid in starts.values()} - {os.getpid()}) == 3
    first = [starts[i][0] for i in range(6)]
    assert all(b - a >= 0.06 for a, b in itertools.pairwise(first))  # 0.5 / 6 apart
    with pytest.raises(SystemExit):
        main(["--clients", "0"])


def test_a_flag_the_engine_refuses_ends_the_bench_with_its_message(tmp_path):
    """--chunk past the chunk program's rows bound: the server's process says why and the
    bench exits with that line, rather than a traceback there and a wait here."""
    with pytest.raises(SystemExit, match=r"chunk 100000 is outside \[1, 64\]"):
        main(["--size", "tiny", "--backend", "cpu", "--dir", str(tmp_path), "--levels", "1",
              "--max-tokens", "2", "--chunk", "100000", "--out", str(tmp_path / "out")])
