"""The GPU numbers of issue 8, measured side by side in one run; a table is printed last.

    python tests/bench/gpu_bench.py [--out DIR] [--sizes tiny,small] [--skip torch,...]

Sections (each guarded: a failing section is reported and the others still run):
  correctness  whole manifest vs 2-stage bundle, on one GPU in sequence and on two GPUs:
               bitwise equal logits and tokens for 7 prompts, two chunk sizes, 8 decode
               steps; on tiny also cuda vs the cpu backend (bf16 tolerance).
  launch       the small model's decode step: graph replay time vs the sum of its kernels'
               own times (CUDA events, the stream held until every launch is queued), and
               what an eager launch costs (host issue time and step time per launch).
  torch        decode step latency vs a PyTorch eager reference on the same weights
               (tests/bench/torch_ref.py), and the 8192-token prefill TTFT ratio.
  pipeline     TTFT of 513 / 2049 / 8192-token prompts: the whole model on one GPU against
               2 stages on 2 GPUs cut at the middle layer (chunked prefill pipelined), with
               the share of time spent in transfers (from the run's trace).
Everything is written under --out (default $OUT or ./gpu-bench): results.json, the trace of
the pipelined 8192-token run, and the log.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from kerncc.cli.main import main as kerncc
from kerncc.example import generate
from kerncc.runtime import Chain
from kerncc.runtime.generate import Generator
from kerncc.runtime.trace import Timeline

SMALL_CONTEXT = 8448  # 8192-token prompts plus decode steps; a multiple of the 16-token page
RESULTS: dict = {}
TABLE: list[tuple[str, str, str]] = []  # (section, what, value)


def say(*parts) -> None:
    print(*parts, flush=True)


def row(section: str, what: str, value: str) -> None:
    TABLE.append((section, what, value))
    say(f"  [{section}] {what}: {value}")


class DocError(Exception):
    """A --doc file the rows cannot go into (missing, or its markers broken)."""


def write_rows(doc: Path, name: str, rows: list[tuple[str, str, str]], header: str,
               anchor: str | None = None) -> None:
    """The run's rows as a markdown table in `doc` between the markers of `name`: what stood
    between them is replaced, else the block goes before the line `anchor` (or at the end).
    `header` (the command, commit, device, date) heads the table. The file is rewritten whole
    (a temporary file renamed over it), so a failure leaves it as it was."""
    begin = f"<!-- {name} rows: begin (written by the bench; edit the bench, not these lines) -->"
    end = f"<!-- {name} rows: end -->"
    try:
        text = doc.read_text()
    except OSError as err:
        raise DocError(f"{doc}: {err.strerror or err}") from None
    table = "\n".join([begin, header, "", "| section | measure | value |", "| --- | --- | --- |",
                       *(f"| {sec} | {what} | {value} |" for sec, what, value in rows), end])
    starts, ends = text.count(begin), text.count(end)
    if (starts, ends) == (1, 1) and text.index(begin) < text.index(end):
        head, rest = text.split(begin, 1)
        text = head + table + rest.split(end, 1)[1]
    elif (starts, ends) != (0, 0):
        raise DocError(f"{doc}: the `{name}` markers are broken ({starts} begin, {ends} end); "
                       "fix them by hand, nothing was written")
    elif anchor is not None and f"\n{anchor}\n" in text:
        head, rest = text.split(f"\n{anchor}\n", 1)
        text = f"{head}\n{table}\n\n{anchor}\n{rest}"
    else:
        text = text.rstrip("\n") + "\n\n" + table + "\n"
    temporary = doc.with_name(f".{doc.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text)
        os.replace(temporary, doc)
    except OSError as err:
        temporary.unlink(missing_ok=True)
        raise DocError(f"{doc}: {err.strerror or err}") from None


@contextlib.contextmanager
def section(name: str, limit: float = 240):
    say(f"== {name}")
    started = time.perf_counter()
    faulthandler.dump_traceback_later(limit, exit=False)  # a stuck section shows where
    try:
        yield
    except Exception as err:  # noqa: BLE001 - a bench reports and goes on
        traceback.print_exc()
        row(name, "FAILED", f"{type(err).__name__}: {err}"[:300])
    finally:
        faulthandler.cancel_dump_traceback_later()
    say(f"== {name} took {time.perf_counter() - started:.1f} s")


# ---------------------------------------------------------------------------------- models


def build(root: Path, size: str) -> dict:
    """Generate the model and lower it whole and cut at the middle layer."""
    model_dir = root / size
    overrides = {"max_context": SMALL_CONTEXT} if size == "small" else {}
    manifest, weights = generate(model_dir, size, **overrides)
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    out = {"manifest": manifest, "weights": weights, "layers": layers, "dir": model_dir}
    for name, pipeline in (("whole", "emit"),
                           ("two", f"cut{{at-label=l{layers // 2}.input_norm}},slice-derive,emit")):
        target = model_dir / name
        if kerncc(["lower", str(manifest), "-p", pipeline, "-o", str(target)]) != 0:
            raise RuntimeError(f"lowering {size} with {pipeline} failed")
        out[name] = target
    return out


def prompts(size: str, vocab: int) -> list[list[int]]:
    lengths = [1, 3, 17, 64, 65, 130, 200] if size == "tiny" else [1, 7, 64, 65, 513, 700, 1000]
    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(1, vocab, n)] for n in lengths]


def serve(chain: Chain, prompt: list[int], chunk: int, max_new: int):
    result = Generator(chain).generate(prompt, max_new, chunk)
    return result.tokens, result.logits


def device_count() -> int:
    from cuda.core import Device

    return len(Device.get_all_devices())


# ---------------------------------------------------------------------------------- sections


class SyncChain(Chain):
    """A chain that waits for every item: no overlap between the GPUs (a diagnostic)."""

    def submit(self, *args, **kwargs):
        pending = super().submit(*args, **kwargs)
        self.sync()
        return pending


def correctness(model: dict, size: str, gpus: int) -> None:
    vocab = json.loads((model["dir"] / "config.json").read_text())["vocab_size"]
    chunks = (64, 5) if size == "tiny" else (512, 64)
    configs = {"2 stages, 1 GPU": dict(bundle=model["two"])}
    if gpus >= 2:
        configs["2 stages, 2 GPUs"] = dict(bundle=model["two"], devices=[0, 1])
    whole = Chain(model["whole"], backend="cuda")
    chains = {name: Chain(c["bundle"], backend="cuda", devices=c.get("devices"))
              for name, c in configs.items()}
    if gpus >= 2:
        chains["2 stages, 2 GPUs, waiting after each item"] = SyncChain(
            model["two"], backend="cuda", devices=[0, 1])
        chains["whole on GPU 1"] = Chain(model["whole"], backend="cuda", devices=[1])
    expected = {}
    for chunk in chunks:
        for prompt in prompts(size, vocab):
            tokens, logits = serve(whole, prompt, chunk, 9)
            assert np.abs(logits).max() > 0, "all-zero logits"
            expected[chunk, len(prompt)] = (prompt, tokens, logits)
    for repeat in ("", ", again"):
        for name, chain in chains.items():
            same = 0
            for (chunk, n), (prompt, tokens, logits) in expected.items():
                tokens2, logits2 = serve(chain, prompt, chunk, 9)
                if tokens == tokens2 and logits.tobytes() == logits2.tobytes():
                    same += 1
                    continue
                steps = [i for i in range(len(logits))
                         if logits[i].tobytes() != logits2[i].tobytes()]
                say(f"    differs: {name}, prompt {n}, chunk {chunk}: tokens equal "
                    f"{tokens == tokens2}, steps differing {steps}, max |diff| "
                    f"{np.abs(logits - logits2).max():.3e}")
            row(f"correct/{size}", f"whole vs {name}{repeat}, bitwise (prompts x chunks {chunks})",
                f"{same}/{len(expected)} identical")
            RESULTS.setdefault("correctness", {})[f"{size}: {name}{repeat}"] = [same, len(expected)]
    if size == "tiny":
        cpu = Chain(model["whole"], backend="cpu")
        worst, agree, total = 0.0, 0, 0
        for prompt in prompts(size, vocab):
            tokens, logits = serve(whole, prompt, 64, 9)
            tokens2, logits2 = serve(cpu, prompt, 64, 9)
            worst = max(worst, float(np.abs(logits - logits2).max() / np.abs(logits2).max()))
            agree += sum(a == b for a, b in zip(tokens, tokens2))
            total += len(tokens)
        row("correct/tiny", "cuda vs cpu: max |diff| / max |logit|", f"{worst:.2e}")
        row("correct/tiny", "cuda vs cpu: tokens equal", f"{agree}/{total}")
        RESULTS["cuda_vs_cpu"] = {"max_rel": worst, "tokens_equal": [agree, total]}


class Busy:
    """Puts tens of milliseconds of GEMMs on a stream before what is to be timed, so the
    timed launches queue up behind them and run back to back: event timings then measure the
    GPU's own work, not the pace at which the host issues (no host flag that could deadlock)."""

    n = 8192

    def __init__(self, backend) -> None:
        self.backend = backend
        size = self.n * self.n * 2
        self.a, self.w, self.c = (backend.allocate(size) for _ in range(3))

    def __enter__(self):
        for _ in range(24):  # 24 x 1.1 TFLOP: ~40 ms on an H200
            self.backend.blas.gemm("cublaslt_bf16_tn", self.a.ptr, self.w.ptr, self.c.ptr,
                                   self.n, self.n, self.n)
        return self

    def __exit__(self, *exc) -> None:
        pass


def backend_check(result):
    from kerncc.runtime.backends.cuda import check

    return check(result, "bench")


def launch_overhead(model: dict) -> None:
    chain = Chain(model["whole"], backend="cuda")
    session, backend = chain.sessions[0], chain.sessions[0].backend
    Generator(chain).generate(list(range(1, 101)), 2, 512)  # a 100-token context in the cache
    env = dict(session.last_vars)
    program = "decode"
    backend.sync()

    say("  prefilled; timing eager launches")
    before = backend.launches
    session._issue_program(program, env)
    backend.sync()
    per_step = backend.launches - before

    issue, step = [], []
    for _ in range(20):
        t0 = time.perf_counter()
        session._issue_program(program, env)
        t1 = time.perf_counter()
        backend.sync()
        issue.append(t1 - t0)
        step.append(time.perf_counter() - t0)

    say("  timing each kernel behind a busy stream")
    busy = Busy(backend)
    kernels = []
    originals = dict(session._launchers)
    try:
        marks: list[tuple] = []

        def timed(launcher):
            def launch(grid, shared, scalars):
                start = backend.mark()
                launcher(grid, shared, scalars)
                marks.append((start, backend.mark()))
            return launch

        session._launchers = {n: timed(fn) for n, fn in originals.items()}
        for _ in range(5):
            marks.clear()
            with busy:
                session._issue_program(program, env)
            backend.sync()
            kernels.append(sum(backend.elapsed_ms(a, b) for a, b in marks))
    finally:
        session._launchers = originals
    queued = []
    for _ in range(5):  # the same launches queued back to back, events only around them all
        with busy:
            start = backend.mark()
            session._issue_program(program, env)
            end = backend.mark()
        queued.append(backend.elapsed_ms(start, end))

    say("  capturing and replaying the graph")
    graph = backend.capture(lambda: session._issue_program(program, env))
    backend.replay(graph)
    backend.sync()
    replays = 200
    with busy:
        start = backend.mark()
        for _ in range(replays):
            backend.replay(graph)
        end = backend.mark()
    graph_ms = backend.elapsed_ms(start, end) / replays
    kernel_ms = statistics.median(kernels)
    row("launch", "decode step launches", str(per_step))
    row("launch", "sum of kernel times (events), ms", f"{kernel_ms:.3f}")
    row("launch", "graph replay per step, ms", f"{graph_ms:.3f}")
    row("launch", "graph replay / kernel sum (gate <= 1.1)", f"{graph_ms / kernel_ms:.3f}")
    queued_ms = statistics.median(queued)
    row("launch", "same kernels queued back to back (no events between), ms", f"{queued_ms:.3f}")
    row("launch", "graph replay / back-to-back kernels", f"{graph_ms / queued_ms:.3f}")
    eager_ms = statistics.median(step) * 1e3
    row("launch", "eager step (issue + run), ms", f"{eager_ms:.3f}")
    row("launch", "eager host issue per launch, us",
        f"{statistics.median(issue) / per_step * 1e6:.2f}")
    row("launch", "eager cost per launch over graph, us",
        f"{(eager_ms - graph_ms) / per_step * 1e3:.2f}")
    RESULTS["launch"] = {"launches": per_step, "kernel_sum_ms": kernel_ms, "graph_ms": graph_ms,
                         "queued_ms": queued_ms,
                         "eager_ms": eager_ms,
                         "issue_us_per_launch": statistics.median(issue) / per_step * 1e6}


def timed_generate(run, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_step_s(generate_fn, prompt: list[int], steps: int = 32) -> float:
    """Seconds per decode step: generating steps+1 tokens minus generating 1, over steps."""
    generate_fn(prompt, steps + 1)  # warm-up (graph capture, allocator, heuristics)
    long = timed_generate(lambda: generate_fn(prompt, steps + 1))
    short = timed_generate(lambda: generate_fn(prompt, 1))
    return (long - short) / steps


def against_torch(model: dict) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from torch_ref import TorchQwen

    prompt = [int(t) for t in np.random.default_rng(3).integers(1, 32000, 100)]
    chain = Chain(model["whole"], backend="cuda")
    generator = Generator(chain)
    ours = decode_step_s(lambda p, n: generator.generate(p, n, 512).tokens, prompt)
    eager = Chain(model["whole"], backend="cuda", graphs=False)
    eager_gen = Generator(eager)
    ours_eager = decode_step_s(lambda p, n: eager_gen.generate(p, n, 512).tokens, prompt)
    ref = TorchQwen(model["dir"], "cuda")

    def torch_generate(p, n):
        ref.reset()
        out = ref.generate(p, n)
        torch.cuda.synchronize()
        return out

    theirs = decode_step_s(torch_generate, prompt)
    from torch_ref import decode_step_ms
    _, theirs_graph = decode_step_ms(ref, prompt)
    ours_graph = kerncc_graph_ms(chain)
    row("torch", "decode step, kerncc graphs, ms", f"{ours * 1e3:.3f}")
    row("torch", "decode step, kerncc eager, ms", f"{ours_eager * 1e3:.3f}")
    row("torch", "decode step, torch eager, ms", f"{theirs * 1e3:.3f}")
    row("torch", "kerncc / torch decode (gate <= 0.5)", f"{ours / theirs:.3f}")
    row("torch", "decode step GPU time: kerncc graph replay / torch eager in one CUDA graph, "
        "ms", f"{ours_graph:.3f} / {theirs_graph:.3f} = {ours_graph / theirs_graph:.2f}x")
    ours_tokens = generator.generate(prompt, 9, 512).tokens
    theirs_tokens = torch_generate(prompt, 9)
    equal = sum(a == b for a, b in zip(ours_tokens, theirs_tokens))
    row("torch", "greedy tokens equal to torch (9; a near-tie may flip)", f"{equal}/9")
    # Whether a flip is a near-tie: the first token's logits side by side, and torch's gap
    # between its top two against how far the implementations differ.
    ours_logits = np.asarray(generator.generate(prompt, 1, 512).logits[-1], np.float32)
    ref.reset()
    theirs_logits = ref.prefill(prompt).float().cpu().numpy().reshape(-1)
    scale = float(np.abs(theirs_logits).max())
    top2 = np.sort(theirs_logits)[-2:]
    row("torch", "first token's logits: max |diff| vs torch / max |logit|; torch's top-2 gap "
        "/ max |logit|", f"{float(np.abs(ours_logits - theirs_logits).max()) / scale:.2e}; "
        f"{float(top2[1] - top2[0]) / scale:.2e}")

    long = [int(t) for t in np.random.default_rng(4).integers(1, 32000, 8192)]
    ours_ttft = ttft(chain, long, 512)
    ref_ttft = ttft_fn(lambda: torch_generate(long, 1))
    row("torch", "TTFT 8192, kerncc 1 GPU chunk 512, ms", f"{ours_ttft * 1e3:.1f}")
    row("torch", "TTFT 8192, torch eager (SDPA), ms", f"{ref_ttft * 1e3:.1f}")
    row("torch", "TTFT 8192 kerncc / torch", f"{ours_ttft / ref_ttft:.3f}")
    RESULTS["torch"] = {"decode_ms": ours * 1e3, "decode_eager_ms": ours_eager * 1e3,
                        "decode_graph_ms": ours_graph, "torch_decode_graph_ms": theirs_graph,
                        "torch_decode_ms": theirs * 1e3, "ttft_ms": ours_ttft * 1e3,
                        "torch_ttft_ms": ref_ttft * 1e3}
    ref = None  # free its weights before the next section
    gc.collect()
    torch.cuda.empty_cache()


def kerncc_graph_ms(chain: Chain, replays: int = 100) -> float:
    """The captured batch-1 `decode` graph of a one-stage chain, replayed back to back."""
    session, backend = chain.sessions[0], chain.sessions[0].backend
    graph = session._graphs[next(k for k in session._graphs if k[0] == "decode")]
    with Busy(backend):
        start = backend.mark()
        for _ in range(replays):
            backend.replay(graph)
        end = backend.mark()
    return backend.elapsed_ms(start, end) / replays


def ttft_fn(run, repeats: int = 3) -> float:
    run()  # warm-up
    return timed_generate(run, repeats)


def ttft(chain: Chain, prompt: list[int], chunk: int) -> float:
    generator = Generator(chain)
    return ttft_fn(lambda: generator.generate(prompt, 1, chunk))


def breakdown(chain: Chain, prompt: list[int], chunk: int) -> None:
    """Where a pipelined TTFT goes: host issue until the last item is in, then the wait."""
    generator = Generator(chain)
    generator.generate(prompt, 1, chunk)
    submits: list[float] = []
    original = chain.submit

    def submit(*args, **kwargs):
        pending = original(*args, **kwargs)
        submits.append(time.perf_counter())
        return pending

    chain.submit = submit  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        generator.generate(prompt, 1, chunk)
        total = time.perf_counter() - t0
    finally:
        del chain.submit
    row("pipeline", f"TTFT 8192 on 2 GPUs, chunk {chunk}: first item issued / last issued / "
        "done, ms", f"{(submits[0] - t0) * 1e3:.1f} / {(submits[-1] - t0) * 1e3:.1f} / "
        f"{total * 1e3:.1f}")


def pipeline(model: dict, out: Path, gpus: int) -> None:
    if gpus < 2:
        row("pipeline", "skipped", "one GPU")
        return
    whole = Chain(model["whole"], backend="cuda")
    two = Chain(model["two"], backend="cuda", devices=[0, 1])
    rng = np.random.default_rng(5)
    for n in (513, 2049, 8192):
        prompt = [int(t) for t in rng.integers(1, 32000, n)]
        base = ttft(whole, prompt, 512)
        base_max = ttft(whole, prompt, 2048)
        piped = ttft(two, prompt, 512)
        row("pipeline", f"TTFT {n}: whole 1 GPU chunk 512 / chunk 2048, ms",
            f"{base * 1e3:.1f} / {base_max * 1e3:.1f}")
        row("pipeline", f"TTFT {n}: 2 stages 2 GPUs chunk 512, ms", f"{piped * 1e3:.1f}")
        row("pipeline", f"TTFT {n}: speedup vs whole chunk 512 (gate >= 1.7 at 8192)",
            f"{base / piped:.3f}")
        row("pipeline", f"TTFT {n}: speedup vs whole's best chunk",
            f"{min(base, base_max) / piped:.3f}")
        RESULTS.setdefault("pipeline", {})[n] = {"whole_ms": base * 1e3,
                                                 "whole_2048_ms": base_max * 1e3,
                                                 "two_gpus_ms": piped * 1e3}
    prompt = [int(t) for t in rng.integers(1, 32000, 8192)]
    for chunk in (256, 1024):
        row("pipeline", f"TTFT 8192, chunk {chunk}: whole 1 GPU / 2 GPUs, ms",
            "{:.1f} / {:.1f}".format(ttft(whole, prompt, chunk) * 1e3,
                                     ttft(two, prompt, chunk) * 1e3))
    breakdown(two, prompt, 512)
    whole_marked = Chain(model["whole"], backend="cuda", graphs="marked")
    two_marked = Chain(model["two"], backend="cuda", devices=[0, 1], graphs="marked")
    base, piped = ttft(whole_marked, prompt, 512), ttft(two_marked, prompt, 512)
    row("pipeline", "TTFT 8192, prefill launched kernel by kernel (graphs=marked): whole / "
        "2 GPUs, ms", f"{base * 1e3:.1f} / {piped * 1e3:.1f} ({base / piped:.3f}x)")
    timeline = Timeline()
    traced = Chain(model["two"], backend="cuda", devices=[0, 1], trace=timeline)
    prompt = [int(t) for t in rng.integers(1, 32000, 8192)]
    Generator(traced).generate(prompt, 1, 512)
    timeline.spans.clear()
    t0 = time.perf_counter()
    Generator(traced).generate(prompt, 1, 512)
    total_ms = (time.perf_counter() - t0) * 1e3
    rows = timeline.rows()
    copy_ms = sum(r["done_ms"] - r["start_ms"] for r in rows if "buffer" in r)
    copied = sum(1 for r in rows if "buffer" in r)
    row("pipeline", "transfers in the 8192 run: count, ms, share of TTFT",
        f"{copied}, {copy_ms:.2f}, {copy_ms / total_ms:.2%}")
    timeline.write(out / "trace-8192-two-gpus.json")
    RESULTS.setdefault("pipeline", {})["transfer_share"] = copy_ms / total_ms


# ---------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-bench")
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--skip", default="", help="sections to skip, comma-separated")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(args.skip.split(","))
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "kerncc-gpu-bench"
    gpus = device_count()
    from cuda.core import Device

    say(f"{gpus} GPU(s): " + ", ".join(Device(i).name for i in range(gpus)))
    RESULTS["gpus"] = gpus
    models = {}
    for size in args.sizes.split(","):
        with section(f"build {size}"):
            models[size] = build(work, size)
    for size, model in models.items():
        if "correctness" not in skip:
            with section(f"correctness {size}"):
                correctness(model, size, gpus)
            gc.collect()
    try:
        run_sections(models, args, out, gpus, skip)
    finally:
        (out / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str) + "\n")
        say("\n| section | measure | value |\n| --- | --- | --- |")
        for sec, what, value in TABLE:
            say(f"| {sec} | {what} | {value} |")
    return 0


def run_sections(models: dict, args, out: Path, gpus: int, skip: set) -> None:
    small = models.get("small")
    if small is not None:
        if "launch" not in skip:
            with section("launch overhead"):
                launch_overhead(small)
        if "torch" not in skip:
            with section("torch"):
                against_torch(small)
        if "pipeline" not in skip:
            with section("pipeline"):
                pipeline(small, out, gpus)


if __name__ == "__main__":
    sys.exit(main())
