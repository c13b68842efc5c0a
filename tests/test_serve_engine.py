"""kerncc.serve.engine on the tiny example (cpu backend): several prompts served together give
each prompt's tokens alone; a cut bundle gives the whole's; pages come back; faults end cleanly.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

from kerncc.cli.main import main
from kerncc.diagnostics import KernccError
from kerncc.example import generate
from kerncc.lower import lower_to_bundle
from kerncc.runtime import Bundle, Chain
from kerncc.runtime.model_runner import ModelRunner
from reference_loop import reference
from kerncc.serve import sampling_hook
from kerncc.serve.engine import Config, Engine, Request, Stopped, serve_prompts

LENGTHS = (1, 2, 5, 9, 17, 30, 3, 12)
MAX_NEW = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    manifest, _ = generate(tmp_path_factory.mktemp("tiny"), "tiny")
    return manifest


@pytest.fixture(scope="module")
def whole(model) -> Chain:
    return Chain(lower_to_bundle(model))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def alone(whole, prompts) -> list[list[int]]:
    return [reference(whole, p, MAX_NEW).tokens for p in prompts]


def same_bits(one: list[Request], ahead: list[Request]) -> None:
    """Each request got the same tokens and logits, bit for bit, in both runs."""
    assert len(one) == len(ahead)
    for a, b in zip(one, ahead):
        assert a.generated == b.generated
        assert np.array_equal(np.stack(a.logits).view(np.uint32),
                              np.stack(b.logits).view(np.uint32))


@pytest.mark.parametrize("chunk, running", [(8, 3), (5, 8), (64, 1)])
def test_prompts_served_together_give_each_prompt_alone(whole, prompts, alone, chunk, running):
    requests, engine = serve_prompts(whole, prompts, MAX_NEW, chunk=chunk, max_running=running)
    assert [r.generated for r in requests] == alone
    assert all(r.finish == "length" for r in requests)
    assert engine.pool.free == engine.pool.pages
    engine.pool.check()
    if running > 1:
        assert engine.calls["decode_batch"] > 0, "decodes went together"
        assert engine.packed > 0, "prefill chunks packed several sequences"


@pytest.mark.parametrize("ahead", [False, True])
def test_decode_calls_send_only_what_the_device_does_not_hold(model, prompts, monkeypatch,
                                                              ahead):
    """While a decode call runs the engine stages the same sequences' next positions, slots
    and lengths; a call sends only the inputs that differ from what the device holds (at
    steady decode: the tokens; a step issued ahead has its tokens fed on the device, and
    sends nothing). The tokens and logits are those of an engine that sends every input with
    every call, as sequences join, finish and take pages."""
    from kerncc.runtime import model_runner

    runner = Chain(lower_to_bundle(model))
    sent: list[tuple[str, tuple]] = []
    real_submit, real_stage = runner.submit, runner.stage_inputs

    def submit(program, inputs=None, vars=None, *args, **kwargs):
        sent.append((program, tuple(sorted(inputs or {}))))
        return real_submit(program, inputs, vars, *args, **kwargs)

    def stage(inputs, vars=None):
        sent.append(("stage", tuple(sorted(inputs))))
        return real_stage(inputs, vars)

    monkeypatch.setattr(runner, "submit", submit)
    monkeypatch.setattr(runner, "stage_inputs", stage)
    config = dict(chunk=8, max_running=3, logits=True, ahead=ahead)
    staged, _ = serve_prompts(runner, prompts, MAX_NEW, **config)
    decodes = [names for program, names in sent if program.startswith("decode")]
    # decode calls after decode calls of the same sequences send their tokens alone (or, a
    # step ahead, nothing); after a prefill chunk (it writes the same input buffers) a decode
    # call sends what changed
    assert (() if ahead else ("token_ids",)) in decodes, "steady decode calls send the least"
    assert any(program == "stage" for program, _ in sent)
    monkeypatch.setattr(model_runner, "_plain_inputs", lambda sessions: frozenset())
    plain, _ = serve_prompts(runner, prompts, MAX_NEW, **config)
    assert [r.generated for r in staged] == [r.generated for r in plain]
    for a, b in zip(staged, plain):
        np.testing.assert_array_equal(np.stack(a.logits), np.stack(b.logits))


def test_a_cut_bundle_serves_the_same_batch_as_the_whole(model, whole, prompts, tmp_path):
    target = tmp_path / "two"
    assert main(["lower", str(model), "-p", "cut{at=12},slice-derive,emit", "-o",
                 str(target)]) == 0
    staged = Chain(Bundle(target))
    a, _ = serve_prompts(whole, prompts, MAX_NEW, chunk=8, max_running=4, logits=True)
    b, engine = serve_prompts(staged, prompts, MAX_NEW, chunk=8, max_running=4, logits=True)
    assert [r.generated for r in a] == [r.generated for r in b]
    for x, y in zip(a, b):  # every token's logits, bit for bit
        assert len(x.logits) == MAX_NEW
        assert np.array_equal(np.stack(x.logits).view(np.uint32),
                              np.stack(y.logits).view(np.uint32))
    assert engine.depth == 2


def test_batched_logits_equal_each_prompt_alone_bit_for_bit(whole, prompts):
    requests, _ = serve_prompts(whole, prompts, MAX_NEW, chunk=5, max_running=8, logits=True)
    for request, prompt in zip(requests, prompts):
        alone = reference(whole, prompt, MAX_NEW).logits  # the chunk's row, then steps
        assert np.array_equal(np.stack(request.logits).view(np.uint32),
                              alone[-MAX_NEW:].view(np.uint32))


def test_the_command_line_serves_every_prompt(model, capsys):
    args = ["run", str(model), "--backend", "cpu", "--max-new", "4"]
    assert main(args + ["--prompt", "1,2,3"]) == 0
    first = capsys.readouterr().out.strip().splitlines()[-1]
    assert main(args + ["--prompt", "4,5,6,7,8"]) == 0
    second = capsys.readouterr().out.strip().splitlines()[-1]
    assert main(args + ["--prompt", "1,2,3", "--prompt", "4,5,6,7,8"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-2:] == [first, second]


def test_a_small_pool_preempts_and_still_finishes_everything(model, prompts):
    # 6 pages of 16 tokens: the longer prompts cannot all be cached at once
    chain = Chain(lower_to_bundle(model), token_capacity=96)
    requests, engine = serve_prompts(chain, prompts, 20, chunk=8, max_running=8)
    assert all(r.finish == "length" and len(r.generated) == 20 for r in requests)
    assert engine.pool.free == engine.pool.pages == 6
    assert engine.preemptions > 0


def test_a_preempted_request_gives_its_tokens_and_logits_alone_bit_for_bit(model):
    """3 pages of 16 tokens, two sequences growing to 23 and 27: the newer is preempted and
    recomputed. Its generated tokens must go back through the one-row program, as they first
    went (the chunk program's attention sums in another order: its rows are not the decode's
    bits), so its logits and a seeded sampler's draws are those it gets alone."""
    chain = Chain(lower_to_bundle(model), token_capacity=48)
    rng = np.random.default_rng(26)
    prompts = [rng.integers(1, 256, n).tolist() for n in (3, 7)]
    requests, engine = serve_prompts(chain, prompts, 20, chunk=8, logits=True)
    assert engine.preemptions > 0
    for request, prompt in zip(requests, prompts):
        alone = reference(chain, prompt, 20)
        assert request.generated == alone.tokens
        assert np.array_equal(np.stack(request.logits).view(np.uint32),
                              alone.logits[-20:].view(np.uint32))
    from kerncc.runtime.sampling import SamplingParams

    rng = np.random.default_rng(286)
    prompts = [rng.integers(1, 256, n).tolist() for n in (3, 7)]
    engine = Engine(chain, Config(max_running=2, chunk=8))
    seeded = sampling_hook.Params(temperature=1.0, seed=286)
    requests = [engine.submit(Request(p, 20, seeded)) for p in prompts]
    engine.run_until_idle()
    assert engine.preemptions > 0
    native = SamplingParams(temperature=1.0, seed=286)
    assert [r.generated for r in requests] == [
        reference(chain, p, 20, sampling=native).tokens for p in prompts]


def test_bad_requests_are_refused_before_any_work(whole):
    engine = Engine(whole)
    with pytest.raises(KernccError, match="empty"):
        engine.submit(Request([], 3))
    with pytest.raises(KernccError, match=r"prompt position 1: token id 256 is outside 0\.\.255 .*the vocabulary"):
        engine.submit(Request([1, 256], 3))
    with pytest.raises(KernccError, match="max_tokens 100: the prompt's 200 tokens and 100 new "
                       "ones need 299 positions, but a sequence holds at most 256"):
        engine.submit(Request([1] * 200, 100))
    with pytest.raises(KernccError, match=r"prompt position 1: 1.5 is not a whole number"):
        engine.submit(Request([3, 1.5], 3))  # ran as token 1
    with pytest.raises(KernccError, match=r"max_tokens 2.5: expected a whole number"):
        engine.submit(Request([3, 1], 2.5))  # gave 3 tokens
    # the one-pass checks of plain ints find the same token the scans name
    with pytest.raises(KernccError, match=r"prompt position 2: True is not a whole number"):
        engine.submit(Request([3, 1, True], 3))
    with pytest.raises(KernccError, match=r"prompt position 2: token id -1 is outside 0\.\.255"):
        engine.submit(Request([3, 1, -1, 7], 3))
    assert not engine.requests and engine.waiting == 0
    assert engine.submit(Request([np.int64(3), 1], 3)).id >= 0  # numpy ints are whole too


def test_cancelling_frees_the_pages_at_once(whole, prompts):
    engine = Engine(whole, Config(max_running=4))
    requests = [engine.submit(Request(p, 50)) for p in prompts[:4]]
    for _ in range(6):
        engine.tick()
    assert engine.pool.free < engine.pool.pages
    for request in requests:
        engine.cancel(request)
    engine.tick()
    assert engine.pool.free == engine.pool.pages
    assert all(r.finish == "cancelled" for r in requests)
    engine.run_until_idle()  # items still in flight are dropped
    engine.pool.check()


class Heard:
    """A listener that keeps what it hears."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.ends: list[str | None] = []

    def token(self, request: Request, token: int) -> None:
        self.tokens.append(token)

    def done(self, request: Request) -> None:
        self.ends.append(request.finish)


def test_a_request_queued_before_stop_is_told_it_was_cancelled(whole):
    """`stop` right after `submit`, before the loop's next turn: the request still ends (a
    server's handler waits for its listener's `done`), and nothing is left waiting."""
    engine = Engine(whole)
    heard = Heard()
    request = engine.submit(Request([1, 2, 3], 4, listener=heard))
    engine.stop()
    engine.run_forever()
    assert request.finish == "cancelled" and heard.ends == ["cancelled"]
    assert engine.waiting == 0 and not engine.requests
    assert engine.pool.free == engine.pool.pages


def test_steps_issued_ahead_give_the_tokens_and_logits_of_steps_one_at_a_time(whole, prompts):
    """Greedy decode steps issued a step ahead (Config.ahead), their tokens fed on the device:
    the same tokens and logits, bit for bit, as steps one at a time, with sequences that stop
    on a token while the step after is already issued (its row is dropped), that cross into
    new pages on a step issued ahead, and that end by length."""
    four = prompts[:4]
    quiet, _ = serve_prompts(whole, four, 40, max_running=4, logits=True, ahead=False)
    stops = [quiet[0].generated[9], quiet[2].generated[25]]  # two sequences stop early
    one, _ = serve_prompts(whole, four, 40, max_running=4, logits=True, ahead=False,
                           stop_ids=stops)
    ahead, engine = serve_prompts(whole, four, 40, max_running=4, logits=True, ahead=True,
                                  stop_ids=stops)
    assert engine.ahead_steps >= 20, "the steady decode went ahead"
    assert [r.finish for r in one] == [r.finish for r in ahead]
    assert {r.finish for r in one} == {"stop", "length"}
    same_bits(one, ahead)
    assert engine.pool.free == engine.pool.pages
    engine.pool.check()


def test_steps_of_two_decode_calls_go_ahead(whole, prompts, monkeypatch):
    """Six sequences over the tiny model's four-sequence decode program: a step is two
    decode calls, which both write the one token output, and it goes ahead call for call,
    each call fed from the copy of its call's output kept right after it (Session.keep),
    never from the output the other call overwrote. All six run to the end together, so
    without that no step would go ahead; the tokens and logits are a step at a time's."""
    from kerncc.runtime.session import Session

    assert Engine(whole).limits.decode_groups == 4
    six = prompts[:6]
    slots: list = []  # what each device feed read: a kept copy's slot, or None
    real_feed = Session.feed

    def feed(self, name, source, output, vars=None, kept=None):
        slots.append(kept)
        return real_feed(self, name, source, output, vars, kept)

    monkeypatch.setattr(Session, "feed", feed)
    one, _ = serve_prompts(whole, six, 30, logits=True, ahead=False)
    ahead, engine = serve_prompts(whole, six, 30, logits=True, ahead=True)
    assert engine.ahead_steps >= 20, "the two-call steady decode went ahead"
    assert slots and None not in slots, "every feed read a kept copy"
    assert {call for _, call in slots} == {0, 1}, "both calls of a step were fed"
    assert all(r.finish == "length" for r in ahead)
    same_bits(one, ahead)


def test_two_call_steps_ahead_drop_the_rows_of_sequences_that_end(whole, prompts):
    """Six sequences, two calls a step, with sequences ending on a stop token while the step
    after is already issued (their rows dropped; once four or fewer run, one call a step),
    crossing into new pages on steps issued ahead, and ending by length: the same tokens
    and logits, bit for bit, as steps one at a time."""
    six = prompts[:6]
    quiet, _ = serve_prompts(whole, six, 40, logits=True, ahead=False)
    stops = [quiet[0].generated[9], quiet[5].generated[33]]
    one, _ = serve_prompts(whole, six, 40, logits=True, ahead=False, stop_ids=stops)
    ahead, engine = serve_prompts(whole, six, 40, logits=True, ahead=True, stop_ids=stops)
    assert engine.ahead_steps >= 20
    assert [r.finish for r in one] == [r.finish for r in ahead]
    assert {r.finish for r in one} == {"stop", "length"}
    same_bits(one, ahead)
    assert engine.pool.free == engine.pool.pages
    engine.pool.check()


def test_a_sampled_request_drawn_on_the_host_keeps_the_steps_one_at_a_time(whole, prompts):
    """A sampled token drawn on the host (Config(draw_on_device=False)): nothing can be fed
    on the device, so a batch holding a sampled request does not go ahead (drawn on the
    device it does: tests/test_serve_engine_pace.py)."""
    engine = Engine(whole, Config(max_running=2, draw_on_device=False))
    greedy = engine.submit(Request(prompts[1], 12))
    sampled = engine.submit(Request(prompts[2], 12, sampling_hook.Params(temperature=0.7,
                                                                         seed=1)))
    engine.run_until_idle()
    assert greedy.finish == sampled.finish == "length"
    assert engine.ahead_steps == 0


class Logged:
    """A listener that logs what it hears into a log it shares with the runner's calls."""

    def __init__(self, log: list) -> None:
        self.log = log

    def token(self, request: Request, token: int) -> None:
        self.log.append(("token", request.id, token))

    def done(self, request: Request) -> None:
        self.log.append(("done", request.id, request.finish))


def test_listeners_hear_a_step_s_tokens_once_the_next_step_is_issued(model, prompts,
                                                                      monkeypatch):
    """The device is not kept waiting on the listeners: they hear a call's tokens while a
    call issued after it runs, never while the device has nothing to do and the engine has
    more to issue. Every token is still heard, in order, each request's end last, and they
    are the tokens of an engine with no listeners."""
    runner = Chain(lower_to_bundle(model))
    quiet, _ = serve_prompts(runner, prompts[:6], MAX_NEW, chunk=8, max_running=4)
    log: list[tuple] = []
    real_submit = runner.submit

    def submit(program, *args, **kwargs):
        log.append(("submit", program))
        pending = real_submit(program, *args, **kwargs)
        real_result = pending.result

        def result():
            log.append(("collect", program))
            return real_result()

        pending.result = result
        return pending

    monkeypatch.setattr(runner, "submit", submit)
    engine = Engine(runner, Config(max_running=4, chunk=8))
    requests = [engine.submit(Request(p, MAX_NEW, listener=Logged(log))) for p in prompts[:6]]
    engine.run_until_idle()
    for request, alone in zip(requests, quiet):
        heard = [e for e in log if e[0] in ("token", "done") and e[1] == request.id]
        assert [e[2] for e in heard[:-1]] == request.generated == alone.generated
        assert heard[-1] == ("done", request.id, "length")
    last_submit = max(i for i, e in enumerate(log) if e[0] == "submit")
    running, heard_running = 0, 0
    for i, event in enumerate(log[:last_submit]):
        running += {"submit": 1, "collect": -1}.get(event[0], 0)
        if event[0] in ("token", "done"):
            assert running > 0, f"{event} heard with the device idle and calls to come"
            heard_running += 1
    assert heard_running > len(requests) * (MAX_NEW - 2)


class Broken:
    """A runner whose decode_batch fails as a launch would."""

    def __init__(self, chain: Chain) -> None:
        self.chain = chain

    def __getattr__(self, name):
        return getattr(self.chain, name)

    def submit(self, program, *args, **kwargs):
        if program == "decode_batch":
            raise KernccError.single("stage 0, program `decode_batch` call 3: the launch failed")
        return self.chain.submit(program, *args, **kwargs)


def test_a_stage_fault_fails_its_requests_and_stops_admission(whole, prompts, monkeypatch):
    engine = Engine(whole, Config(max_running=4))
    monkeypatch.setattr(engine.model, "runner", Broken(whole))
    requests = [engine.submit(Request(p, 4)) for p in prompts[:3]]
    with pytest.raises(KernccError, match="decode_batch"):
        engine.run_until_idle()
    assert all(r.finish == "error" and "decode_batch" in r.error for r in requests)
    assert engine.pool.free == engine.pool.pages
    with pytest.raises(Stopped):
        engine.submit(Request([1, 2], 2))


@pytest.mark.gpu
def test_on_a_gpu_stages_equal_the_whole_for_the_same_batch(model, prompts, tmp_path, capsys):
    """Whole vs 2 stages bitwise for the same batch on cuda; how many prompts served together
    agree with each prompt alone is printed, not asserted (batch-shaped GEMM tiling)."""
    target = tmp_path / "two"
    assert main(["lower", str(model), "-p", "cut{at=12},slice-derive,emit", "-o",
                 str(target)]) == 0
    whole = Chain(lower_to_bundle(model), backend="cuda")
    staged = Chain(Bundle(target), backend="cuda")
    a, engine = serve_prompts(whole, prompts, MAX_NEW, chunk=8, max_running=4, logits=True)
    b, _ = serve_prompts(staged, prompts, MAX_NEW, chunk=8, max_running=4, logits=True)
    assert [r.generated for r in a] == [r.generated for r in b]
    for x, y in zip(a, b):  # every token's logits, bit for bit
        assert np.array_equal(np.stack(x.logits).view(np.uint32),
                              np.stack(y.logits).view(np.uint32))
    assert engine.packed > 0
    alone = [reference(whole, p, MAX_NEW).tokens for p in prompts]
    agree = sum(r.generated == t for r, t in zip(a, alone))
    with capsys.disabled():
        print(f"\ncuda: {agree} of {len(prompts)} prompts served together equal them alone")


@pytest.mark.gpu
def test_on_a_gpu_steps_issued_ahead_give_the_bits_of_steps_one_at_a_time(model, prompts,
                                                                          tmp_path):
    """On cuda the tokens of a step issued ahead are fed device to device (Session.feed,
    across the stages of a cut bundle too): the tokens and every logit, bit for bit, of the
    same steps one at a time (the same batches: every request admitted at once, all ending
    by length)."""
    target = tmp_path / "two"
    assert main(["lower", str(model), "-p", "cut{at=12},slice-derive,emit", "-o",
                 str(target)]) == 0
    for chain in (Chain(lower_to_bundle(model), backend="cuda"),
                  Chain(Bundle(target), backend="cuda")):
        one, _ = serve_prompts(chain, prompts[:4], 24, max_running=4, logits=True,
                               ahead=False)
        ahead, engine = serve_prompts(chain, prompts[:4], 24, max_running=4, logits=True,
                                      ahead=True)
        assert engine.ahead_steps > 0
        same_bits(one, ahead)


@pytest.mark.gpu
def test_on_a_gpu_two_call_steps_issued_ahead_give_the_bits_of_steps_one_at_a_time(
        model, prompts, tmp_path):
    """On cuda, six sequences over the four-sequence decode program: each call of a two-call
    step has its token output kept on the device (Session.keep, cuMemcpyDtoDAsync on the
    stream) and the same call of the step after is fed from that copy, across the stages of
    a cut bundle too (one call deep, so that the scheduler does not stagger the calls). The
    tokens and every logit, bit for bit, of the same steps one at a time."""
    target = tmp_path / "two"
    assert main(["lower", str(model), "-p", "cut{at=12},slice-derive,emit", "-o",
                 str(target)]) == 0

    def serve(chain: Chain, ahead: bool) -> tuple[list[Request], Engine]:
        engine = Engine(chain, Config(max_running=6, depth=1, logits=True, ahead=ahead))
        requests = [engine.submit(Request(p, 24)) for p in prompts[:6]]
        engine.run_until_idle()
        assert all(r.finish == "length" for r in requests)
        return requests, engine

    for chain in (Chain(lower_to_bundle(model), backend="cuda"),
                  Chain(Bundle(target), backend="cuda")):
        one, _ = serve(chain, False)
        ahead, engine = serve(chain, True)
        assert engine.ahead_steps >= 10, "the two-call steps went ahead"
        same_bits(one, ahead)


def test_a_seeded_request_draws_the_same_tokens_whatever_it_is_batched_with(whole, prompts):
    params = sampling_hook.Params(temperature=0.8, top_p=0.9, seed=7)

    def serve(batch: list[list[int]]) -> list[int]:
        engine = Engine(whole, Config(max_running=4))
        requests = [engine.submit(Request(p, 8, params if i == 0 else sampling_hook.Params()))
                    for i, p in enumerate(batch)]
        engine.run_until_idle()
        return requests[0].generated

    alone = serve([prompts[3]])
    assert serve([prompts[3], *prompts[4:7]]) == alone
    greedy = reference(whole, prompts[3], 8).tokens
    assert alone != greedy, "a temperature of 0.8 changes something in 8 tokens"
    # the reference draws the first token from the same chunk's logits with the same counter
    from kerncc.runtime.sampling import SamplingParams

    native = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    assert reference(whole, prompts[3], 8, sampling=native).tokens == alone


def test_a_chunk_past_the_rows_bound_is_refused_as_one_prompt_refuses_it(whole, capsys, model):
    """The engine cut a --chunk past the rows bound down to it without a word (kerncc serve
    --chunk, run with several prompts), where one prompt's run refuses it."""
    rows = ModelRunner(whole).protocol.rows.max
    with pytest.raises(KernccError, match=rf"chunk {rows + 1} is outside \[1, {rows}\]"):
        Engine(whole, Config(chunk=rows + 1))
    Engine(whole, Config(chunk=rows))
    for prompts in (["--prompt", "1,2"], ["--prompt", "1,2", "--prompt", "3"]):
        assert main(["run", str(model), *prompts, "--chunk", str(rows + 1)]) == 1
        out, err = capsys.readouterr()
        assert f"chunk {rows + 1} is outside [1, {rows}]" in err and out == ""


def test_the_server_runs_as_many_sequences_as_the_decode_step_takes_unless_told(whole):
    """`kerncc serve` without --max-seqs (Config.max_running None) runs as many sequences
    at once as one decode call takes (the tiny example: 4), where it once ran 8 whatever the
    bundle; a number given is kept, past the decode bound too (several calls a step)."""
    import argparse

    from kerncc.cli.serve import make_engine

    decode = ModelRunner(whole).protocol.max_groups(1)
    assert decode == 4
    gc.unfreeze()
    try:
        engine = make_engine(argparse.Namespace(max_seqs=None, max_queue=8, chunk=None,
                                                prefix_cache=True, step_tokens=None,
                                                hold_steps=8), whole)
        # what the server holds from its start on left the cyclic collector
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # as kerncc's main() does when a command ends
    assert engine.limits.max_running == decode and engine.limits.step_tokens is None
    assert Engine(whole, Config(max_running=6)).limits.max_running == 6


def test_the_command_line_step_budget_and_hold_reach_the_scheduler(whole):
    """`kerncc serve --step-tokens N` bounds the rows a step feeds: with 4 sequences at most
    running a budget of 20 leaves 16 rows of prefill, a budget below that a page's worth;
    `--hold-steps N` is the scheduler's hold (0 included), and a negative one is refused."""
    import argparse

    from kerncc.cli.serve import make_engine

    engine = make_engine(argparse.Namespace(max_seqs=4, max_queue=8, chunk=None,
                                            prefix_cache=True, step_tokens=20, hold_steps=3),
                         whole)
    limits = engine.limits
    assert limits.step_tokens == 20 and limits.max_running == 4 and limits.hold_steps == 3
    assert limits.prefill_rows == min(limits.chunk.rows, 16)
    tight = make_engine(argparse.Namespace(max_seqs=4, max_queue=8, chunk=None,
                                           prefix_cache=True, step_tokens=5, hold_steps=0),
                        whole).limits
    assert tight.hold_steps == 0
    with pytest.raises(KernccError, match="hold_steps -1"):
        Engine(whole, Config(hold_steps=-1))
    assert tight.prefill_rows == tight.prefill_floor == min(tight.chunk.rows, tight.stride)


def test_a_page_table_follows_pages_that_grow_in_place_and_is_never_written_in_place(whole):
    """The runner hands back the last page-table matrix itself while the same sequences hold
    the same pages (no stacking, no comparing with the device's copy), a new one as soon as a
    sequence's page list grows (the pool appends to it in place), and never changes an array
    it handed back: the device's copy is compared against it."""
    from kerncc.runtime.model_runner import Rows

    runner = ModelRunner(whole)
    table = runner.protocol.page_tables[0].name
    pages = [[3, 1], [2]]
    rows = [Rows(0, [7] * 20, [], pages[0], 4, 1), Rows(1, [9] * 20, [], pages[1], 2, 1)]
    first = runner.inputs(rows)[table]
    assert runner.inputs(rows)[table] is first
    pages[1].append(5)
    grown = runner.inputs(rows)[table]
    assert grown is not first
    assert grown[1, :2].tolist() == [2, 5] and grown[0, :2].tolist() == [3, 1]
    assert first[1, :2].tolist() == [2, 0], "the array handed back before is unchanged"
    assert not grown[:, 2:].any()


def test_a_run_time_error_is_said_of_its_program_with_its_diagnostics_once():
    """An input outside its domain at run time (what a pool of too few slots once gave): the
    failure names the program once and keeps the runtime's located diagnostics as they are,
    rather than one diagnostic repeating the whole text."""
    from types import SimpleNamespace

    from kerncc.diagnostics import Diagnostic, Location
    from kerncc.serve.engine import _item_error

    err = KernccError("input `block_table` is outside its domain:",
                      [Diagnostic("element [0, 0] is 0, above -1", Location("/buffers/x"))])
    failure = _item_error(err, SimpleNamespace(name="prefill"), [])
    assert failure.headline == "program `prefill`: input `block_table` is outside its domain:"
    assert failure.messages() == ["element [0, 0] is 0, above -1"]
    assert str(failure).count("outside its domain") == 1
    again = _item_error(failure, SimpleNamespace(name="prefill"), [])
    assert again.headline == failure.headline  # named already: not twice
    plain = _item_error(ValueError("bad"), SimpleNamespace(name="decode"), [])
    assert plain.headline == "program `decode`: ValueError: bad"
