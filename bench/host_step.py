"""The host work per decode step, on the CPU: a backend whose launches, graph captures and
replays do nothing, so what is timed is the Python between two steps (the inputs written and
checked, the call issued, the outputs taken in).

* One prompt through the engine (`kerncc run`): for greedy decoding one step at a time it
  also times the stretch the device waits for, from a step's token in hand to the next replay;
  a step ahead (the engine's `Config.ahead`) that stretch runs while the next step is on the
  device.
* The serving engine (`--engine`): a decode step of 1, 8 and 32 sequences (the scheduler's
  plan, the call's inputs, the tokens taken in), prefill left out. The engine waits for each
  step's tokens before it plans the next, so on a GPU this time adds to every step's.
* The cost of logits processing (`--processing`): decode steps of 32 sampled sequences
  (temperature 1, seeded), plain, with penalties (presence, frequency, repetition and a
  logit_bias), with `logprobs` (5 top tokens) and with two `json_schema` grammars (llguidance's
  mask filled and followed each step), side by side with the ratio to plain sampling. The rows
  are processed where they are drawn (kerncc.runtime.processing): with the launches that do
  nothing, what is timed is the host's half (the words and masks packed and sent, the results
  heard, the grammar followed; `--profile` adds a cProfile of each); `--backend cuda` times
  whole steps on a GPU (the `small` interface's shapes on tiny widths: the processing kernels
  over a 32000-token vocabulary, the host's cost standing out; `--widths small`: the `small`
  example whole, so each workload's cost is against a real 32-sequence step, as a server pays
  it). `--step-ms MS` adds, on a simulated device whose decode
  steps take MS (bench/simulated.py), how long the device waits for the host before each
  step of each workload, a step at a time (`Config(ahead=False)`) and a step ahead: a
  grammar's step goes ahead with its draw issued once the masks are ready.

--doc docs/benchmarks.md writes the rows between the file's `host_step` markers.

    python -m bench.host_step [--tokens 400] [--engine] [--processing [--backend cuda]
                              [--widths small] [--step-ms 2]] [--profile]  # ~10-60 s
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.report import Report
from bench.simulated import Idle
from kerncc.cli.main import main as kerncc
from kerncc.example import generate
from kerncc.kernels.logits_ref import TOKEN
from kerncc.runtime import Chain
from kerncc.runtime import session as sess

REPORT = Report("host_step")
# the `small` model's decode interface (24 layers, vocab 32000, 4096 keys) on tiny widths
SHAPE = {"layers": 24, "hidden": 2048, "heads": 16, "kv_heads": 8, "head_dim": 128,
         "intermediate": 512, "vocab": 32000, "max_context": 4096, "max_tokens": 512}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.host_step",
                                     description=__doc__.splitlines()[0])
    REPORT.add_options(parser)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--profile", action="store_true", help="also cProfile one run")
    parser.add_argument("--engine", action="store_true", help="the serving engine's steps")
    parser.add_argument("--processing", action="store_true",
                        help="32 sampled sequences: plain, penalties, logprobs, json_schema")
    parser.add_argument("--backend", choices=("idle", "cuda"), default="idle",
                        help="--processing: launches that do nothing (host work) or a GPU")
    parser.add_argument("--widths", choices=("narrow", "small"), default="narrow",
                        help="--processing: the `small` interface on tiny widths (narrow: the "
                        "host's cost stands out) or the `small` example whole (a GPU: the "
                        "cost against a real step of 32 sequences)")
    parser.add_argument("--step-ms", type=float, default=None,
                        help="--processing: also the device's wait a step on a simulated "
                        "device whose decode steps take this long, ahead off and on")
    args = parser.parse_args(argv)
    if args.processing:
        processing_steps(args)
    elif args.engine:
        engine_steps(args)
    else:
        one_prompt_steps(args)
    where = "a GPU (whole steps)" if args.processing and args.backend == "cuda" else \
        "the CPU (launches that do nothing)"
    return REPORT.finish(args, where, argv)


def one_prompt_steps(args: argparse.Namespace) -> None:
    """Each greedy token's host time for one prompt through the engine, a step ahead and not."""
    from kerncc.serve.engine import serve_prompts

    root = Path(tempfile.mkdtemp())
    model, _ = generate(root / "model", "tiny", **SHAPE)
    assert kerncc(["lower", str(model), "-p", "emit", "-o", str(root / "whole")]) == 0
    backend = Idle()
    chain = Chain(root / "whole", backend=backend, graphs=True)
    prompt = list(range(1, 40))
    tokens_in_hand: list[float] = []
    result = sess.Pending.result

    def timed_result(self):
        out = result(self)
        tokens_in_hand.append(time.perf_counter())
        return out

    sess.Pending.result = timed_result
    for ahead in (False, True):
        serve_prompts(chain, [prompt], 8, 64, ahead=ahead)  # warm-up
        tokens_in_hand.clear()
        backend.replays.clear()
        start = time.perf_counter()
        serve_prompts(chain, [prompt], args.tokens, 64, ahead=ahead)
        per_token = (time.perf_counter() - start) / args.tokens * 1e6
        line = f"{'a step ahead' if ahead else 'one step at a time'}: {per_token:.1f} us of " \
               "host work a token"
        if not ahead:
            gaps = [next(r for r in backend.replays if r > t) - t for t in tokens_in_hand[:-1]
                    if any(r > t for r in backend.replays)]
            line += (f"; a token in hand to the next replay (the device waits): median "
                     f"{statistics.median(gaps) * 1e6:.1f} us over {len(gaps)} steps")
        print(line)
        REPORT.row("runner", f"{'a step ahead' if ahead else 'one step at a time'}: host work "
                   "a token, us", f"{per_token:.1f}")
    sess.Pending.result = result
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        serve_prompts(chain, [prompt], args.tokens, 64)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)


def engine_steps(args) -> None:
    """Each decode step's host time in the serving engine at 1, 8 and 32 sequences."""
    from kerncc.serve.engine import Config, Engine, Request

    root = Path(tempfile.mkdtemp())
    model, _ = generate(root / "model", "tiny", **{**SHAPE, "max_seqs": 32})
    assert kerncc(["lower", str(model), "-p", "emit", "-o", str(root / "whole")]) == 0
    chain = Chain(root / "whole", backend=Idle(), graphs=True, token_capacity=48 * 1024)
    for seqs in (1, 8, 32):
        engine = Engine(chain, Config(max_running=32, chunk=512))
        for s in range(seqs):
            engine.submit(Request([(i * 7 + s) % 31999 + 1 for i in range(128)], 300))
        while engine.calls.get("decode_batch" if seqs > 1 else "decode", 0) < 3:
            engine.tick()  # the prefill and the first steps
        steps: list[float] = []
        profile = cProfile.Profile() if args.profile and seqs == 32 else None
        if profile:
            profile.enable()
        while engine.requests and len(steps) < 200:
            start = time.perf_counter()
            engine.tick()  # issue a step
            engine.tick()  # take its tokens in
            steps.append(time.perf_counter() - start)
        if profile:
            profile.disable()
        print(f"engine, {seqs} sequences: {statistics.median(steps) * 1e6:.0f} us of host work "
              f"a decode step (median of {len(steps)})")
        REPORT.row("engine", f"{seqs} sequences: host work a decode step, us (median of "
                   f"{len(steps)})", f"{statistics.median(steps) * 1e6:.0f}")
        if profile:
            pstats.Stats(profile).sort_stats("tottime").print_stats(20)



# Two answers' shapes that run past the steps timed: an object whose string runs on (a `"`
# among 32000 tokens ends it rarely), the grammar engine's cheapest state; and a long array of
# small objects, which moves through every kind of JSON token.
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}},
          "required": ["answer"], "additionalProperties": False}
ROUNDS = 3
ITEMS = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "required": ["n", "ok"], "additionalProperties": False,
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                   "ok": {"type": "boolean"}}}}


def processing_steps(args) -> None:
    """Host time a decode step of 32 sampled sequences: plain, logprobs, two grammars."""
    from kerncc.hf.tokenizer import TextCodec
    from kerncc.serve import grammar

    if not grammar.available():
        raise SystemExit("bench.host_step --processing: the grammar rows need llguidance "
                         "(pip install 'kerncc[serve]')")
    root = Path(tempfile.mkdtemp())
    if args.widths == "small":
        model, _ = generate(root / "model", "small", max_seqs=32)
    else:
        model, _ = generate(root / "model", "tiny", **{**SHAPE, "max_seqs": 32})
    assert kerncc(["lower", str(model), "-p", "emit", "-o", str(root / "whole")]) == 0
    backend = "cuda" if args.backend == "cuda" else _idle_processing(Idle())
    chain = Chain(root / "whole", backend=backend, graphs=True, token_capacity=48 * 1024)
    codec = TextCodec.from_dir(model.parent)
    grammars = grammar.Grammars(codec, SHAPE["vocab"], min(codec.eos_token_ids))

    def form(schema: dict) -> grammar.Grammar:
        return grammars.of({"response_format": {"type": "json_schema", "json_schema": {
            "name": "a", "schema": schema}}})

    workloads = {"sampling": {}, "penalties and bias": PENALTIES,
                 "logprobs (5 top)": {"logprobs": 5},
                 "json_schema (a string)": {"grammar": form(SCHEMA)},
                 "json_schema (objects)": {"grammar": form(ITEMS)}}
    steps: dict[str, list[float]] = {name: [] for name in workloads}
    for _ in range(ROUNDS):  # the workloads take turns: a machine's load moves over a run
        for name, extra in workloads.items():
            steps[name] += _processing_steps(chain, extra, min(100, args.tokens))
    if args.profile:  # one more run of each workload, under cProfile
        for name, extra in workloads.items():
            profile = cProfile.Profile()
            profile.enable()
            _processing_steps(chain, extra, min(100, args.tokens))
            profile.disable()
            print(f"--- {name}")
            pstats.Stats(profile).sort_stats("tottime").print_stats(15)
    medians = {name: statistics.median(times) for name, times in steps.items()}
    base = medians["sampling"]
    for name, median in medians.items():
        what = "a decode step on the GPU" if args.backend == "cuda" else \
            "host work a decode step"
        print(f"32 sequences, {name}: {median * 1e6:.0f} us, {what} "
              f"({median / base:.2f}x sampling)")
        REPORT.row("processing", f"32 sampled sequences, {name}: {what}, us (x sampling)",
                   f"{median * 1e6:.0f} ({median / base:.2f}x)")
    if args.step_ms is not None and args.backend != "cuda":
        _device_waits(root, workloads, args)


def _device_waits(root: Path, workloads: dict[str, dict], args) -> None:
    """The simulated device's median wait for the host before a decode step of each
    workload, a step at a time and a step ahead (taking turns, ROUNDS times)."""
    from bench.simulated import Device

    device = _idle_processing(Device(args.step_ms))
    chain = Chain(root / "whole", backend=device, graphs=True, token_capacity=48 * 1024)
    waits: dict[tuple[str, bool], list[float]] = {}
    for _ in range(ROUNDS):
        for name, extra in workloads.items():
            for ahead in (False, True):
                _processing_steps(chain, extra, min(100, args.tokens), ahead, device)
                waits.setdefault((name, ahead), []).append(device.idle_us())
    for name in workloads:
        off, on = (statistics.median(waits[name, ahead]) for ahead in (False, True))
        print(f"32 sequences, {name}: the device waits {off:.0f} us a step a step at a time, "
              f"{on:.0f} us a step ahead ({args.step_ms:g} ms steps, simulated)")
        REPORT.row("device wait", f"32 sampled sequences, {name}: the device's wait a "
                   f"{args.step_ms:g} ms step, us, ahead off / on", f"{off:.0f} / {on:.0f}")


PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
             "logit_bias": ((13, 2.0), (17, -5.0))}


def _idle_processing(backend: Idle) -> Idle:
    """A do-nothing backend with a processor whose kernels do nothing: each step's host half
    runs (words, slots, masks packed and sent, results heard), and a grammar row's token is
    its mask's first allowed one, so the grammar is followed as on a device."""
    from kerncc.runtime import processing

    class IdleProcessor(processing.HostProcessor):
        def draw(self, session, buffer, output, params, counters, sample):
            rows, words, masks, sources = self.pack(params)
            sample(None)
            results = np.zeros((len(rows), processing.RESULT_WORDS), np.float32)
            tokens = np.zeros(len(params), np.int32)
            if masks is not None:  # the first allowed token of each masked row, all at once
                masked = np.flatnonzero(words[:, 4] & processing.HAS_STEP_MASK)
                tokens[np.asarray(rows)[masked]] = first_allowed(masks[masked])
            session.backend.upload(session.memory.buffer(output), 0, tokens.view(np.uint8))
            results.view(np.int32)[:, TOKEN] = tokens[rows]
            return processing.Heard(processing.Ready(results), sources)

    backend.logits_processor = lambda vocab: IdleProcessor(backend, vocab)
    return backend


def first_allowed(masks: np.ndarray) -> np.ndarray:
    """The lowest token each packed `allow` row lets through (a row lets one through)."""
    word = np.argmax(masks != 0, axis=1)
    bits = masks[np.arange(len(masks)), word]
    low = bits & (~bits + np.uint32(1))  # the lowest set bit alone
    return (32 * word + np.log2(low.astype(np.float64)).astype(np.int64)).astype(np.int32)


def _processing_steps(chain: Chain, extra: dict, count: int, ahead: bool = True,
                      device: Any = None) -> list[float]:
    """Host times of `count` decode steps of 32 sampled sequences with params `extra`
    (`device`: a simulated one, its waits counted from the steady decode on)."""
    from kerncc.serve.engine import Config, Engine, Request
    from kerncc.serve.sampling_hook import Params

    engine = Engine(chain, Config(max_running=32, chunk=512, ahead=ahead))
    for s in range(32):
        engine.submit(Request([(i * 7 + s) % 31999 + 1 for i in range(128)], 300,
                              Params(temperature=1.0, seed=s, **extra)))
    while engine.calls.get("decode_batch", 0) < 3:
        engine.tick()  # the prefill and the first steps
    if device is not None:
        device.reset()
    steps: list[float] = []
    while engine.requests and len(steps) < count:
        start = time.perf_counter()
        engine.tick()  # issue a step
        engine.tick()  # take its tokens in
        steps.append(time.perf_counter() - start)
    return steps


if __name__ == "__main__":
    raise SystemExit(main())
