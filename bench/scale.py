"""An 8B model on one GPU (issue 43): import, lower, startup, decode at batch 1 and batched,
TTFT, serving, FP8 and transformers beside it, side by side in one run.

    python -m bench.scale [--size 8b|mid|tiny] [--backend cuda|cpu] [--out DIR] [--steps N]
                          [--prompt N] [--tflops T] [--work DIR] [--doc docs/benchmarks.md]

`--size 8b` (the default, for a GPU machine with transformers and torch) builds a checkpoint in
Qwen3-8B's exact shapes (36 layers, hidden 4096, 32/8 heads of 128, intermediate 12288, vocab
151936, untied head) with random bf16 weights, written by transformers' `save_pretrained` in
shards; `--size tiny` writes kerncc's tiny example instead (numpy, seconds) and runs on the
cpu backend, every section scaled down, so the script itself is tested in CI
(tests/test_bench_scale.py); `--size mid` the example at 0.23 GB, on the cpu backend too (a
load worth profiling). Then, timing each step:
  import   `kerncc import` of the folder as bf16, and with `--quantize fp8` (headers only);
  lower    each manifest whole (`emit`) and cut in two (`cut{stages=2},slice-derive,emit`);
  memory   the plan's peak and resident bytes per stage (kerncc.runtime.footprint), and the
           bf16 whole bundle's at the token capacity the batched sections below load it with;
  startup  bundle on disk to a loaded chain (weights read, derive and once programs run), and
           to the first token of a 1-token prompt (graphs captured on the way), and where the
           load went: waiting for the shards' reads, for the device's copies, the FP8
           quantize (derive), the once programs, the rest, the first token (graphs);
  decode   ms/token at batch 1 after a `--prompt`-token prompt (greedy, `--steps` tokens,
           host included: the time between tokens), for bf16 whole, bf16 in 2 stages on the
           one device and FP8 whole, against the roofline of the bytes a step reads (every
           weight once but the embedding table, plus the prompt's KV) over the measured copy
           bandwidth (a device-to-device copy on cuda, a numpy copy on cpu), and FP8 against
           bf16.
The sections below load bf16 whole once more, with room for the largest of them:
  batch    the `decode_batch` step at 8, 32 and 64 sequences of `--prompt` tokens (graph
           replays on cuda, bench/gpu.py's batch_step_ms; wall time on cpu) against the
           roofline of the bytes it reads (weights once + every sequence's KV); a batch past
           the bundle's `seqs` bound is a row saying so;
  ttft     time to the first token of 4096 and 8192 random tokens at chunk 2048 (64 and 128
           at chunk 32 for tiny) against the tensor roofline: the prefill's FLOPs (2 x the
           linears' parameters a token, causal attention, the last row's lm_head) over the
           bf16 peak, measured (a cuBLASLt 8192^3 GEMM on random data; a numpy f32 matmul on
           cpu) or stated with --tflops;
  serve    tokens/s through the engine in process (serve_prompts, no HTTP) at concurrency 1,
           8, 32, 64: that many random-id prompts of 512 tokens at once, 64 new tokens each
           (16 and 4 for tiny and mid), after a warm-up round of the same shape;
  invariant  the batch-invariant GEMMs (the default) against the batch-shaped path
           (`KERNCC_INVARIANT=0`, kept for this A/B) on bf16 whole: a chain of each,
           alternating, two rounds (the order flips), the batch-1 decode graph after the
           prompt (cuda) and the `batch` steps; medians and the tax a row (issue 39: at most
           5%; on cpu both chains compute the same way, so the rows only exercise the bench);
  transformers  (cuda, with torch and transformers importable; else a row saying why) the
           same checkpoint in transformers bf16, SDPA: eager decode on a StaticCache captured
           in one CUDA graph after the same prompt (GPU time a step), TTFT of 4096 tokens in
           one forward, and greedy agreement: kerncc bf16 whole's first 16 greedy tokens of 4
           prompts fed through transformers (teacher-forced), their logits' max |diff| /
           max |logit| and the tokens equal to its argmax, near-ties counted apart (random
           weights make near-flat logits, where rounding alone may pick either).
Each section is bounded: one that fails or passes its time bound becomes a FAILED row and the
others still run. The table is printed last and written with everything else to --out
(results.json); --doc also writes it into that file between its `scale` markers.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bench.gpu import batch_step_ms, greedy, prefill_flops, torch_ms, ttft, ttft_fn
from bench.report import Report

REPORT = Report("scale")
RESULTS = REPORT.results
row = REPORT.row

# Qwen3-8B's config.json, less what transformers fills in itself
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645,
}
# Import limits, the token capacity of the startup and batch-1 chains, prompt and steps by
# default; then the batched sections': sequences a step, TTFT prompts and their chunk,
# serving concurrency, prompt and new tokens. 8b's 64 sequences of 512 tokens plan 20.5 GiB
# at the 36,864 tokens serving needs (kerncc.runtime.footprint): an 80 GB GPU holds them.
SIZES = {
    "8b": {"max_tokens": 2048, "max_seqs": 64, "max_context": 8192, "capacity": 4096,
           "prompt": 512, "steps": 64, "batches": (8, 32, 64), "ttft": (4096, 8192),
           "chunk": 2048, "serve": (1, 8, 32, 64), "serve_prompt": 512, "serve_new": 64},
    "tiny": {"max_tokens": 64, "max_seqs": 8, "max_context": 256, "capacity": 256,
             "prompt": 16, "steps": 4, "batches": (8, 32, 64), "ttft": (64, 128), "chunk": 32,
             "serve": (1, 8, 32, 64), "serve_prompt": 16, "serve_new": 4},
    "mid": {"max_tokens": 256, "max_seqs": 8, "max_context": 512, "capacity": 512,
            "prompt": 16, "steps": 4, "batches": (8, 32, 64), "ttft": (128, 256), "chunk": 128,
            "serve": (1, 8, 32, 64), "serve_prompt": 16, "serve_new": 4},
}
# --size mid: the example's shapes at 0.23 GB (4 layers, hidden 1024, vocab 32000), enough
# bytes for a profile of loading on the cpu backend
MID = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 4, "head_dim": 128,
       "intermediate": 3072, "vocab": 32000}
CUT = "cut{stages=2},slice-derive,emit"
PAGE = 16  # tokens of a KV page (bench/gpu.py's batch_inputs lays sequences out by it)
AGREE_TOKENS, AGREE_PROMPTS, NEAR_TIE = 16, 4, 1e-2
# Each section's bound in seconds: on an H100 the whole 8b run takes about 3 minutes, and
# these keep it under 8 even when one section hangs.
LIMITS = {"decode": 180, "load": 120, "batch": 60, "ttft": 60, "serve": 90,
          "invariant": 120, "transformers": 180}


class SectionTimeout(Exception):
    """A section ran past its bound."""


@contextlib.contextmanager
def alarm(limit: float) -> Iterator[None]:
    """Raise SectionTimeout in this thread after `limit` seconds (between two Python steps;
    a call into the driver returns first). Off the main thread, no bound."""
    def ring(signum, frame):
        raise SectionTimeout(f"past its {limit:g} s bound")

    try:
        before = signal.signal(signal.SIGALRM, ring)
    except (ValueError, AttributeError):  # not the main thread, or no SIGALRM here
        before = None
    if before is None:
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


@contextlib.contextmanager
def section(name: str) -> Iterator[None]:
    """Report.section (a failure is a FAILED row, the others still run) bounded by LIMITS;
    the stacks are dumped a little later, should the alarm not get through."""
    with REPORT.section(name, LIMITS[name] + 30), alarm(LIMITS[name]):
        yield


# ---------------------------------------------------------------------------------- checkpoint


def write_8b(folder: Path) -> None:
    """Qwen3-8B's shapes, random bf16 weights, saved by transformers in shards."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**{k: v for k, v in QWEN3_8B.items()
                            if k not in ("architectures", "model_type")})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="4GB")
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def write_example(folder: Path, size: str) -> None:
    from kerncc.example import generate

    if size == "mid":
        limits = {k: SIZES["mid"][k] for k in ("max_tokens", "max_seqs", "max_context")}
        generate(folder, "small", **MID, **limits)
    else:
        generate(folder, "tiny")
    (folder / "model.json").unlink()  # imported below, as a Hugging Face folder


def checkpoint(size: str, folder: Path) -> float:
    start = time.perf_counter()
    if size == "8b":
        write_8b(folder)
    else:
        write_example(folder, size)
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------- steps


def timed(fn, *args, **kwargs) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def import_and_lower(folder: Path, work: Path, limits: dict) -> dict[str, Path]:
    """The bundles: bf16 and fp8, whole and cut; import and lower seconds in the table."""
    from kerncc.cli.main import main as kerncc
    from kerncc.hf.importer import import_model

    bundles = {}
    for kind, quantize in (("bf16", None), ("fp8", "fp8")):
        done, seconds = timed(import_model, folder, folder / f"{kind}.json",
                              quantize=quantize, **limits)
        row(f"import {kind}", "kerncc import, s", f"{seconds:.2f}")
        for cut, pipeline in (("whole", "emit"), ("2 stages", CUT)):
            out = work / f"{kind}-{cut.replace(' ', '')}"
            code, seconds = timed(kerncc, ["lower", str(done.path), "-p", pipeline, "-o",
                                           str(out)])
            if code != 0:
                raise SystemExit(f"kerncc lower {done.path} -p {pipeline} failed ({code})")
            row(f"lower {kind} {cut}", f"lower ({pipeline}), s", f"{seconds:.2f}")
            bundles[f"{kind} {cut}"] = out
    return bundles


def memory(bundles: dict[str, Path], capacity: int) -> dict[str, int]:
    """Each bundle's planned peak (all stages); the bytes a decode step reads."""
    from kerncc.runtime import Bundle
    from kerncc.runtime.footprint import bundle_footprints, human

    read = {}
    for name, path in bundles.items():
        bundle = Bundle.open(path)
        prints = bundle_footprints([(s.manifest, s.plan) for s in bundle.stages], capacity)
        row(f"memory {name}", "planned peak / resident, all stages",
            f"{human(sum(f.peak() for f in prints))} / {human(sum(f.resident() for f in prints))}")
        read[name] = sum(step_weight_bytes(s.plan) for s in bundle.stages)
    return read


def step_weight_bytes(plan: dict) -> int:
    """Weights a decode step reads: every weight and carry but the embedding table (one row
    a token) and the rope table (one row)."""
    buffers = plan["memory"]["buffers"]
    return sum(int(b["bytes"]) for name, b in buffers.items()
               if b.get("kind") in ("weight", "carry") and name not in ("embed.w", "rope"))


def kv_bytes(bundle_path: Path, tokens: int) -> int:
    from kerncc.runtime import Bundle

    bundle = Bundle.open(bundle_path)
    return tokens * sum(s.manifest.states[name].bytes_per_token
                        for s in bundle.stages for name in s.manifest.states)


def copy_bandwidth(backend: str) -> float:
    """Bytes per second of a large copy (read + write counted), the roofline's denominator."""
    if backend == "cpu":
        a = np.ones(64 << 20, np.uint8)
        b = np.empty_like(a)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            np.copyto(b, a)
            times.append(time.perf_counter() - start)
        return 2 * a.nbytes / min(times)
    from cuda.bindings import driver as cu

    from kerncc.runtime.backends import make_backend
    from kerncc.runtime.backends.cuda import check

    device = make_backend("cuda")
    n = 4 << 30
    a, b = device.allocate(n), device.allocate(n)
    times = []
    for _ in range(6):
        start = device.mark()
        check(cu.cuMemcpyDtoDAsync(cu.CUdeviceptr(b.ptr), cu.CUdeviceptr(a.ptr), n,
                                   device.stream_handle), "copy")
        times.append(device.elapsed_ms(start, device.mark()) * 1e-3)
    device.close()
    return 2 * n / sorted(times[1:])[len(times[1:]) // 2]


def prompt_ids(n: int) -> list[int]:
    """A prompt of ids every vocabulary has (the batch-1 decode's and transformers')."""
    return [(i * 7919) % 250 + 3 for i in range(n)]


def random_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(3, vocab, n)]


def decode(path: Path, backend: str, capacity: int, prompt: list[int],
           steps: int) -> dict[str, float]:
    """Startup (load, first token) and the decode time per token at batch 1."""
    from kerncc.runtime import Chain
    from kerncc.serve.engine import serve_prompts

    class Stamps(list):  # the engine's listener: when each token reached the host
        def token(self, request, token) -> None:
            self.append(time.perf_counter())

        def done(self, request) -> None:
            pass

    chain, load = timed(Chain, path, backend=backend, token_capacity=capacity)
    try:
        split = load_split(chain, load)
        _, first = timed(serve_prompts, chain, [[1]], 1)
        stamps = Stamps()
        serve_prompts(chain, [prompt], steps + 1, listener=stamps)
    finally:
        chain.close()
        gc.collect()
    per_token = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    return {"load_s": load, "first_token_s": load + first, "decode_ms": per_token * 1e3,
            "load_split": {**split, "first_token": first}}


def load_split(chain: Any, load: float) -> dict[str, float]:
    """Where a chain's load went, summed over its stages (Session.load_times): `read` and
    `copy` are the time the loading thread waited for the shards' reads and for the device's
    copies, `quantize` the derive programs less the sources streamed inside them, `once` the
    once programs, `other` the rest (the bundle opened and checked, allocations, modules)."""
    times: dict[str, float] = {}
    for session in chain.sessions:
        for key, value in session.load_times.items():
            times[key] = times.get(key, 0.0) + value
    split = {"read": times.get("load_read_wait_s", 0.0),
             "copy": times.get("load_copy_wait_s", 0.0),
             "quantize": max(0.0, times.get("derive", 0.0) - times.get("sources", 0.0)),
             "once": times.get("once", 0.0)}
    split["other"] = max(0.0, load - sum(split.values()))
    split["bytes"] = times.get("load_bytes", 0.0)
    split["fill_thread_s"] = times.get("load_fill_s", 0.0)
    return split


def decode_all(bundles: dict[str, Path], read: dict[str, int], backend: str, capacity: int,
               prompt_len: int, steps: int, bandwidth: float) -> None:
    prompt = prompt_ids(prompt_len)
    for name in ("bf16 whole", "bf16 2 stages", "fp8 whole"):
        timing = decode(bundles[name], backend, capacity, prompt, steps)
        step_bytes = read[name] + kv_bytes(bundles[name], prompt_len)
        roofline_ms = step_bytes / bandwidth * 1e3
        RESULTS[name] = {**timing, "step_bytes": step_bytes, "roofline_ms": roofline_ms}
        row(f"startup {name}", "bundle to loaded chain / to first token, s",
            f"{timing['load_s']:.2f} / {timing['first_token_s']:.2f}")
        split = timing["load_split"]
        row(f"startup split {name}", "read / copy / quantize / once / other / first token "
            "(graphs), s", " / ".join(f"{split[k]:.2f}" for k in
                                      ("read", "copy", "quantize", "once", "other",
                                       "first_token")))
        row(f"startup stream {name}", "GB streamed, GB/s of the load, thread-s filling",
            f"{split['bytes'] / 1e9:.2f}, {split['bytes'] / 1e9 / timing['load_s']:.1f}, "
            f"{split['fill_thread_s']:.2f}")
        row(f"decode {name}", f"batch 1 after {prompt_len} tokens, ms/token (x roofline)",
            f"{timing['decode_ms']:.3f} ({timing['decode_ms'] / roofline_ms:.2f}x of "
            f"{roofline_ms:.3f})")
    ratio = RESULTS["fp8 whole"]["decode_ms"] / RESULTS["bf16 whole"]["decode_ms"]
    RESULTS["fp8_over_bf16"] = ratio
    row("fp8 / bf16", "decode batch 1, whole", f"{ratio:.2f}x")


# ---------------------------------------------------------------------------------- batched


def tensor_peak(backend: str) -> tuple[float, str]:
    """FLOP/s of a large matmul, the TTFT roofline's denominator, and what was measured (on
    random data: zeros run faster than any prompt's activations)."""
    rng = np.random.default_rng(5)
    if backend == "cpu":
        n = 512
        a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
        times = []
        for _ in range(5):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return 2 * n ** 3 / min(times), f"numpy f32 matmul {n}^3, measured"
    import ml_dtypes

    from kerncc.runtime.backends import make_backend

    device = make_backend("cuda")
    n, reps = 8192, 20
    try:
        data = (rng.random(n * n, dtype=np.float32) - 0.5).astype(ml_dtypes.bfloat16)
        a, w, c = (device.allocate(n * n * 2) for _ in range(3))
        device.upload(a, 0, data)
        device.upload(w, 0, data[::-1].copy())
        for _ in range(3):
            device.blas.gemm("cublaslt_bf16_tn", a.ptr, w.ptr, c.ptr, n, n, n)
        start = device.mark()
        for _ in range(reps):
            device.blas.gemm("cublaslt_bf16_tn", a.ptr, w.ptr, c.ptr, n, n, n)
        seconds = device.elapsed_ms(start, device.mark()) * 1e-3
    finally:
        device.close()
    return 2 * n ** 3 * reps / seconds, f"cuBLASLt bf16 {n}^3 on random data, measured"


def peak_flops(args: argparse.Namespace, backend: str) -> float:
    """The TTFT roofline's FLOP/s: --tflops, else measured; said in a row."""
    if args.tflops:
        peak, how = args.tflops * 1e12, "stated (--tflops)"
    else:
        peak, how = tensor_peak(backend)
    RESULTS["tensor_peak_flops"] = peak
    row("peak", f"bf16 peak of the TTFT roofline: {how}, TFLOP/s", f"{peak / 1e12:.3g}")
    return peak


def planned_peak(bundle: Path, capacity: int) -> str:
    from kerncc.runtime import Bundle
    from kerncc.runtime.footprint import bundle_footprints, human

    opened = Bundle.open(bundle)
    prints = bundle_footprints([(s.manifest, s.plan) for s in opened.stages], capacity)
    return human(sum(f.peak() for f in prints))


def room(size: dict, prompt_len: int, seqs_bound: int) -> int:
    """Tokens of KV the batched sections need at once: the largest batch of `prompt_len`
    tokens, the longest TTFT prompt, the widest serving round (each within the seqs bound;
    a page of slack a served sequence)."""
    pages = -(-prompt_len // PAGE) * PAGE
    batch = max((s for s in size["batches"] if s <= seqs_bound), default=1) * pages
    serve = max((c for c in size["serve"] if c <= seqs_bound), default=1) * (
        size["serve_prompt"] + size["serve_new"] + PAGE)
    return -(-max(batch, max(size["ttft"]), serve) // PAGE) * PAGE


def batch_rows(chain: Any, bundle: Path, weights: int, bandwidth: float, batches: tuple,
               context: int, vocab: int) -> None:
    """The decode_batch step of each batch against the roofline of the bytes it reads."""
    session = chain.sessions[0]
    bound = session.manifest.vars["seqs"].max
    pool = session.token_capacity
    how = "graph replay" if session.graphs != "off" else "wall, host included"
    per_sequence = kv_bytes(bundle, context)
    for seqs in batches:
        what = f"decode_batch step, {seqs} x {context} tokens ({how}), ms (x roofline)"
        needed = seqs * -(-context // PAGE) * PAGE
        if seqs > bound or needed > pool:
            why = (f"the bundle's seqs bound is {bound}" if seqs > bound
                   else f"needs {needed} tokens of KV, the chain holds {pool}")
            row(f"batch {seqs}", what, f"skipped: {why}")
            continue
        ms = batch_step_ms(chain, seqs, context, vocab)
        roof = (weights + seqs * per_sequence) / bandwidth * 1e3
        RESULTS.setdefault("batch", {})[seqs] = {"step_ms": ms, "roofline_ms": roof}
        row(f"batch {seqs}", what, f"{ms:.3f} ({ms / roof:.2f}x of {roof:.3f})")


def invariant_rows(bundle: Path, backend: str, capacity: int, batches: tuple, context: int,
                   vocab: int, rounds: int = 2) -> None:
    """Batch-invariant GEMMs against the batch-shaped path on `bundle`, a chain of each,
    alternating `rounds` rounds: the batch-1 decode graph (cuda) and the decode_batch steps of
    `batches` within the bundle's seqs bound; medians and the tax a row."""
    from bench.decode import graph_step_ms
    from kerncc.runtime import Chain
    from kerncc.runtime.backends import gemv

    prompt = prompt_ids(context)
    times: dict[tuple[bool, int], list[float]] = {}
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            before, gemv.INVARIANT = gemv.INVARIANT, on
            try:
                chain = Chain(bundle, backend=backend, token_capacity=capacity)
            finally:
                gemv.INVARIANT = before
            try:
                sizes = [b for b in batches if b <= chain.sessions[0].manifest.vars["seqs"].max]
                if backend == "cuda":
                    greedy(chain, prompt, 4)  # captures the decode graph
                    times.setdefault((on, 1), []).append(graph_step_ms(chain))
                for seqs in sizes:
                    times.setdefault((on, seqs), []).append(
                        batch_step_ms(chain, seqs, context, vocab))
            finally:
                chain.close()
                gc.collect()
    for seqs in sorted({s for _, s in times}):
        on, off = (statistics.median(times[(flag, seqs)]) for flag in (True, False))
        what = ("decode batch 1 (graph replay)" if seqs == 1
                else f"decode_batch step, {seqs} x {context} tokens")
        row(f"invariant {seqs}", f"{what}: invariant / batch-shaped ms, tax",
            f"{on:.3f} / {off:.3f}, {(on / off - 1) * 100:+.1f}%")
        RESULTS.setdefault("invariant", {})[seqs] = {"invariant_ms": times[(True, seqs)],
                                                     "shaped_ms": times[(False, seqs)]}


def ttft_rows(chain: Any, cfg: dict, tokens_list: tuple, chunk: int, context: int, vocab: int,
              peak: float) -> None:
    """TTFT of random prompts at `chunk` against the tensor roofline over `peak` FLOP/s."""
    rng = np.random.default_rng(4)
    for tokens in tokens_list:
        flops = prefill_flops(cfg, tokens)
        roof = flops / peak * 1e3
        what = (f"TTFT {tokens} at chunk {chunk}, ms (x tensor roofline: "
                f"{flops / 1e12:.3g} TFLOP)")
        if tokens > context:
            row(f"ttft {tokens}", what, f"skipped: the bundle's max_context is {context}")
            continue
        ms = ttft(chain, random_ids(rng, tokens, vocab), chunk) * 1e3
        RESULTS.setdefault("ttft", {})[tokens] = {"ms": ms, "roofline_ms": roof}
        row(f"ttft {tokens}", what, f"{ms:.1f} ({ms / roof:.2f}x of {roof:.1f})")


def serve_rows(chain: Any, concurrency: tuple, prompt_len: int, new: int, vocab: int) -> None:
    """Output tokens/s of `c` prompts served together through the engine, for each c."""
    from kerncc.serve.engine import serve_prompts

    bound = chain.sessions[0].manifest.vars["seqs"].max
    rng = np.random.default_rng(11)
    for c in concurrency:
        what = (f"concurrency {c}: {c} x {prompt_len} random tokens, {new} new each, "
                "tokens/s (s)")
        if c > bound:
            row(f"serve {c}", what, f"skipped: the bundle's seqs bound is {bound}")
            continue
        warm = [random_ids(rng, prompt_len, vocab) for _ in range(c)]
        serve_prompts(chain, warm, min(new, 4))  # the graphs of this round's shapes
        prompts = [random_ids(rng, prompt_len, vocab) for _ in range(c)]
        (requests, _), seconds = timed(serve_prompts, chain, prompts, new)
        made = sum(len(r.generated) for r in requests)
        RESULTS.setdefault("serve", {})[c] = {"tokens": made, "s": seconds}
        row(f"serve {c}", what, f"{made / seconds:.0f} ({seconds:.2f} s)")


# ---------------------------------------------------------------------------------- transformers


def transformers_missing(backend: str) -> str | None:
    """Why the transformers rows cannot run here, or None."""
    if backend != "cuda":
        return "they capture a CUDA graph: the cuda backend only"
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as err:
        return f"{err.name or err} is not importable"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def hf_model(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"torch_dtype": torch.bfloat16, "attn_implementation": "sdpa"}
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, device_map="cuda", **kwargs)
    except (ImportError, ValueError):  # device_map wants accelerate in some versions
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs).to("cuda")
    return model.eval()


def static_cache(model, length: int):
    from transformers import StaticCache

    try:
        return StaticCache(config=model.config, max_cache_len=length)
    except TypeError:  # transformers before 4.56: batch, device and dtype up front
        return StaticCache(config=model.config, max_batch_size=1, max_cache_len=length,
                           device=model.device, dtype=model.dtype)


def hf_decode_ms(model, prompt: list[int], reps: int = 100) -> float:
    """GPU ms of transformers' eager decode step after `prompt` on a StaticCache, captured in
    one CUDA graph (warmed up on a side stream first: capturing the first run fails) and
    replayed at that length."""
    import torch

    device = model.device
    cache = static_cache(model, len(prompt) + 16)
    token = torch.full((1, 1), 17, dtype=torch.long, device=device)
    position = torch.tensor([len(prompt)], device=device)

    def step():
        return model(input_ids=token, past_key_values=cache, cache_position=position,
                     use_cache=True).logits

    def done(phase: str) -> None:  # a device fault said of the phase that made it
        try:
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 - the FAILED row names the phase
            raise RuntimeError(f"{phase}: {type(err).__name__}: {err}") from None

    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt], device=device), past_key_values=cache,
              cache_position=torch.arange(len(prompt), device=device), use_cache=True,
              logits_to_keep=1)
        done("the prefill on the StaticCache")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        done("the eager steps before the capture")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        done("the captured step's replay")
        return torch_ms(graph.replay, reps)


def hf_first(model, prompt: list[int]) -> int:
    """The first token of `prompt` in one SDPA forward (no cache), on the host."""
    import torch

    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt], device=model.device), use_cache=False,
                       logits_to_keep=1).logits
        return int(logits[0, -1].argmax())


def hf_rows(model, ids: list[int], n: int) -> np.ndarray:
    """transformers' last `n` rows of logits over `ids`, one forward (float32, on the host)."""
    import torch

    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids], device=model.device), use_cache=False,
                       logits_to_keep=n).logits
        return logits[0].float().cpu().numpy()


def agreement_prompts(prompt_len: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(9)
    lengths = (prompt_len, max(2, prompt_len // 2), 33, 7)[:AGREE_PROMPTS]
    return [random_ids(rng, n, vocab) for n in lengths]


def agreement(tokens: list[int], ours: np.ndarray, theirs: np.ndarray) -> dict:
    """kerncc's greedy `tokens` and their logits rows `ours` against transformers' rows
    `theirs` over the same tokens (teacher-forced: each row sees kerncc's tokens before it):
    max |diff| / max |their logit|, tokens equal to their argmax, and the unequal ones where
    their top two are within NEAR_TIE of the scale apart (random weights make near-flat
    logits, where rounding alone may pick either)."""
    scale = float(np.abs(theirs).max())
    top2 = np.sort(theirs, axis=-1)[:, -2:]
    argmax = theirs.argmax(axis=-1)
    unequal = [i for i, t in enumerate(tokens) if int(argmax[i]) != t]
    return {"diff": float(np.abs(ours - theirs).max()) / scale, "equal": len(tokens) - len(unequal),
            "ties": sum(1 for i in unequal if top2[i, 1] - top2[i, 0] < NEAR_TIE * scale),
            "tokens": len(tokens)}


def attempt(name: str, what: str, measure) -> None:
    """`measure()`, or a FAILED row for it alone: one of transformers' measures failing (a
    version whose cache will not capture) leaves the others. The section's bound still
    ends the section."""
    try:
        measure()
    except SectionTimeout:
        raise
    except Exception as err:  # noqa: BLE001 - a bench reports and goes on
        row(name, f"{what}: FAILED", f"{type(err).__name__}: {err}"[:300])


def transformers_rows(folder: Path, chain: Any, prompt_len: int, ttft_tokens: int,
                      vocab: int) -> None:
    """transformers on the same checkpoint beside kerncc: greedy agreement, TTFT, decode
    (the CUDA graph last: a capture that fails may leave torch's stream unusable). Closes
    `chain` (its memory goes to transformers' copy of the weights)."""
    import torch

    prompts = agreement_prompts(prompt_len, vocab)
    ours = [greedy(chain, p, AGREE_TOKENS) for p in prompts]
    chain.close()
    gc.collect()
    model, seconds = timed(hf_model, folder)
    row("transformers load", "from_pretrained bf16 onto the GPU, s", f"{seconds:.1f}")
    out = RESULTS["transformers"] = {}

    def agree() -> None:
        found = out["agreement"] = [
            agreement(tokens, rows[-len(tokens):], hf_rows(model, p + tokens[:-1], len(tokens)))
            for p, (tokens, rows) in zip(prompts, ours)]
        row("transformers greedy", f"kerncc bf16 whole's {AGREE_TOKENS} greedy tokens of "
            f"{len(prompts)} prompts, teacher-forced through transformers bf16: max |diff| / "
            "max |logit|; tokens equal to its argmax (+ near-ties)",
            " / ".join(f"{a['diff']:.1e}; {a['equal']}/{a['tokens']} (+{a['ties']})"
                       for a in found))

    def first_token() -> None:
        long = random_ids(np.random.default_rng(4), ttft_tokens, vocab)
        ms = out["ttft_ms"] = ttft_fn(lambda: hf_first(model, long)) * 1e3
        ours_ms = RESULTS.get("ttft", {}).get(ttft_tokens, {}).get("ms")
        versus = f"; kerncc's {ours_ms / ms:.2f}x" if ours_ms else ""
        row("transformers ttft", f"TTFT {ttft_tokens}, SDPA, one forward, ms",
            f"{ms:.1f}{versus}")

    def step() -> None:
        ms = out["decode_ms"] = hf_decode_ms(model, prompt_ids(prompt_len))
        ours_ms = RESULTS.get("bf16 whole", {}).get("decode_ms")
        versus = (f"; kerncc bf16 whole's ms/token (host included) {ours_ms / ms:.2f}x"
                  if ours_ms else "")
        row("transformers decode", f"eager in one CUDA graph, StaticCache, after {prompt_len} "
            "tokens, ms/step (GPU)", f"{ms:.3f}{versus}")

    try:
        attempt("transformers greedy", "greedy agreement", agree)
        attempt("transformers ttft", f"TTFT {ttft_tokens}", first_token)
        attempt("transformers decode", "decode in one CUDA graph", step)
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--size", choices=sorted(SIZES), default="8b",
                   help="8b: Qwen3-8B's shapes by transformers (a GPU machine); tiny: the tiny "
                        "example on the cpu backend, in seconds; mid: the example at 0.23 GB "
                        "(a load worth profiling on the cpu backend)")
    p.add_argument("--backend", choices=("cuda", "cpu"),
                   help="default: cuda for 8b, cpu for tiny")
    p.add_argument("--work", type=Path, help="checkpoint and bundles here (default: a "
                   "temporary folder, removed at the end)")
    p.add_argument("--steps", type=int, help="decode steps timed (default: the size's)")
    p.add_argument("--prompt", type=int, help="prompt tokens before decode, and each "
                   "sequence's tokens in the batched steps (default: the size's)")
    p.add_argument("--tflops", type=float, help="the bf16 peak of the TTFT roofline, "
                   "TFLOP/s (default: measured)")
    REPORT.add_options(p)
    args = p.parse_args(argv)
    for name in ("steps", "prompt"):
        value = getattr(args, name)
        if value is not None and value < 2:
            p.error(f"--{name} must be at least 2")
    if args.tflops is not None and not args.tflops > 0:
        p.error("--tflops must be positive")
    return args


def run(args: argparse.Namespace, work: Path, backend: str) -> None:
    size = SIZES[args.size]
    limits = {k: size[k] for k in ("max_tokens", "max_seqs", "max_context")}
    prompt_len, steps = args.prompt or size["prompt"], args.steps or size["steps"]
    folder = work / "checkpoint"
    row("checkpoint", f"{args.size} written, s", f"{checkpoint(args.size, folder):.1f}")
    cfg = json.loads((folder / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    bundles = import_and_lower(folder, work, limits)
    read = memory(bundles, size["capacity"])
    bandwidth = copy_bandwidth(backend)
    RESULTS["copy_bytes_per_s"] = bandwidth
    row("copy", f"{backend} copy bandwidth, GB/s", f"{bandwidth / 1e9:.1f}")
    with section("decode"):
        decode_all(bundles, read, backend, size["capacity"], prompt_len, steps, bandwidth)
    with section("invariant"):  # before transformers, whose failures can end the context
        invariant_rows(bundles["bf16 whole"], backend, room(size, prompt_len, size["max_seqs"]),
                       size["batches"], prompt_len, vocab)
    batched(args, size, folder, bundles["bf16 whole"], read["bf16 whole"], bandwidth, backend,
            cfg, prompt_len)


def batched(args: argparse.Namespace, size: dict, folder: Path, bundle: Path, weights: int,
            bandwidth: float, backend: str, cfg: dict, prompt_len: int) -> None:
    """The sections on one bf16 whole chain with room for them all, then transformers."""
    from kerncc.runtime import Chain

    vocab = int(cfg["vocab_size"])
    capacity = room(size, prompt_len, size["max_seqs"])
    row("memory bf16 whole, batched", f"planned peak at {capacity} tokens of KV",
        planned_peak(bundle, capacity))
    chain = None
    with section("load"):
        chain, seconds = timed(Chain, bundle, backend=backend, token_capacity=capacity)
        row("load bf16 whole, batched", f"bundle to loaded chain ({capacity} tokens), s",
            f"{seconds:.2f}")
    sections = (
        ("batch", lambda: batch_rows(chain, bundle, weights, bandwidth, size["batches"],
                                     prompt_len, vocab)),
        ("ttft", lambda: ttft_rows(chain, cfg, size["ttft"], size["chunk"],
                                   size["max_context"], vocab, peak_flops(args, backend))),
        ("serve", lambda: serve_rows(chain, size["serve"], size["serve_prompt"],
                                     size["serve_new"], vocab)),
    )
    try:
        for name, measure in sections:
            with section(name):
                if chain is None:
                    raise RuntimeError("the chain did not load")
                measure()
        with section("transformers"):
            why = transformers_missing(backend)
            if why is not None:
                row("transformers", "decode, TTFT, greedy agreement", f"skipped: {why}")
            elif chain is None:
                raise RuntimeError("the chain did not load")
            else:
                transformers_rows(folder, chain, prompt_len, size["ttft"][0], vocab)
    finally:
        if chain is not None:
            chain.close()
        gc.collect()


def device_label(backend: str) -> str:
    if backend == "cpu":
        return "the cpu backend"
    from bench.gpu import device_name

    return device_name()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    backend = args.backend or ("cuda" if args.size == "8b" else "cpu")
    work = args.work or Path(tempfile.mkdtemp(prefix="kerncc-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        run(args, work, backend)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return REPORT.finish(args, device_label(backend), argv)


if __name__ == "__main__":
    sys.exit(main())
