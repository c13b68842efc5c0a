"""Decode and prefill on one GPU (two for `pipeline`) against the machine's limits, side by
side in one run; the table is printed last.

    python -m bench.decode [--out DIR] [--layers 24] [--skip gemm,profile,...] [--only decode,...]
        [--defaults-only] [--ablate] [--doc docs/benchmarks.md]

Builds the `small` example (24 layers, hidden 2048; `--layers` for a quicker look) whole and
cut at the middle layer, then measures, each section guarded so a failure leaves the rest:
  copy      the HBM ceiling: a large device-to-device copy (bytes read + written).
  gemm      each decode GEMM shape of the model at m = 1, 8, 16, 32: cuBLAS against kerncc's
            GEMV kernels (kernels/gemv.cu), events around back-to-back launches over rotating
            weight copies (more bytes than the L2 holds), as achieved weight bandwidth.
  profile   the batch-1 decode step after a 512-token prompt (and a 32-sequence step), each
            launch between events behind a busy stream, summed per op, for cuBLAS only and with
            the GEMV kernels.
  launch    the decode step launched eagerly against its graph: host issue per launch and what
            an eager launch costs over the graph.
  decode    ms/token at batch 1 (host included, 32 steps after a 512-token prompt) and the
            decode graph's replay (GPU only) for each entry of POLICIES (cuBLAS only, the
            default GEMV choice, without overlapping launches, 2 stages on the same GPU;
            --defaults-only: the defaults, whole and 2 stages), and the batched step at 8 and 32
            sequences (graph replays of `decode_batch`, 512 tokens each), each against the
            roofline of the bytes it must read (weights once + every sequence's KV).
  pipe      the batched decode's split attention pipelined (runtime/backends/attention_pipe.py,
            the default) against the split kernel, alternating: batch 1 and 8 sequences run the
            same kernels on both sides (controls of the noise); 32 sequences go out pipelined.
  invariant the batch-invariant GEMMs (the default: every decode GEMM on the GEMV kernels at any
            batch and width, prefill chunks on pinned split-free cuBLASLt algorithms) against
            the batch-shaped path (KERNCC_INVARIANT=0: cuBLAS by m), alternating: the batch-1
            decode graph, decode_batch steps of 8, 32 (and 64 where the model takes 64
            sequences) x CONTEXT tokens, and TTFT of 4096 and 8192 tokens at chunk 2048.
  attention the batched decode at 32/8/2/1 sequences and 512-4096 tokens with the attention's
            split blocks per (sequence, kv head) at max_splits (a block per split), 16, 8, 4.
  torch     the PyTorch reference (bench/torch_ref.py) on the same weights: its decode step
            eager and captured in one CUDA graph against kerncc's, the first token's logits,
            and TTFT of 8192 tokens.
  bitwise   whole vs 2 stages on one GPU (and on two, and the whole on GPU 1, when there are
            two), prompts x chunks, 9 tokens: identical bits.
  prefill   TTFT of 4096 tokens at chunks 2048 / 1024 / 512 with the wgmma prefill attention
            (the default) and the mma.sync one, alternating, and the per-op GPU time of one
            2048-row chunk, against the bf16 tensor-core roofline.
  first-token TTFT of 4096 tokens through the serving engine with the first token from the last
            prefill chunk (the default) against a one-row step for the last prompt token.
  pipeline  (two GPUs) TTFT of 513 / 2049 / 8192 tokens: the whole model on one GPU against 2
            stages on 2 GPUs (chunked prefill pipelined), and the share of time in transfers.
  ablate    (only with --ablate) the batch-1 decode graph and an 8-sequence step with each
            kind of layer launch left out in turn (ABLATIONS): what each kernel costs the step
            inside the graph, overlap included.
The table is printed last and written with everything else to --out (results.json); --doc
docs/benchmarks.md also writes it there, between the file's `decode` markers, headed by the
command, the commit, the device and the date.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench.gpu import (Busy, batch_inputs, batch_step_ms, build, decode_step_s, device_count,
                       device_name, greedy, kerncc, prefill_flops, replay_ms, ttft)
from bench.report import Report, say
from kerncc.example.config import make_config

REPORT = Report("decode")
RESULTS = REPORT.results
row = REPORT.row
HBM_TBS = 4.0  # the ceiling measured in `copy` replaces this when that section runs
TC_TFLOPS = 800.0  # bf16 dense, as measured on H200s (769-798 TFLOP/s on random data)
CAPACITY = 64 * 1024  # tokens of KV per chain: 64 sequences of 1024, or one 8k prompt
CONTEXT = 512


def chain_of(bundle: Path, max_m: int, pdl: bool = True, pipe: bool | None = None,
             invariant: bool | None = None):
    """A cuda chain with GEMV kernels up to m = max_m, with or without overlapping launches
    (programmatic dependent launch, runtime/backends/cuda.py), with or without the pipelined
    batched decode attention (runtime/backends/attention_pipe.py; None: the default), with or
    without batch-invariant GEMMs (None: the default; off, max_m applies as before)."""
    from kerncc.runtime import Chain
    from kerncc.runtime.backends import attention_pipe, gemv

    gemv.MAX_M = max_m
    before = attention_pipe.ENABLED, gemv.INVARIANT
    if pipe is not None:
        attention_pipe.ENABLED = pipe
    if invariant is not None:
        gemv.INVARIANT = invariant
    try:
        chain = Chain(bundle, backend="cuda", token_capacity=CAPACITY)
    finally:
        attention_pipe.ENABLED, gemv.INVARIANT = before
    for backend in chain.backends:
        backend.pdl = pdl
    return chain
def config(model: dict) -> dict:
    return json.loads((model["dir"] / "config.json").read_text())


def weight_bytes(cfg: dict) -> int:
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, nq, nk = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    per_layer = ((nq + 2 * nk) * hd * h + h * nq * hd + 2 * inter * h + h * inter) * 2
    return cfg["num_hidden_layers"] * per_layer + v * h * 2


def kv_bytes(cfg: dict, tokens: int) -> int:
    return cfg["num_hidden_layers"] * tokens * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2


# ---------------------------------------------------------------------------------- sections


def copy_ceiling(backend) -> float:
    from cuda.bindings import driver as cu

    from kerncc.runtime.backends.cuda import check

    n = 4 << 30
    a, b = backend.allocate(n), backend.allocate(n)
    times = []
    for _ in range(6):
        start = backend.mark()
        check(cu.cuMemcpyDtoDAsync(cu.CUdeviceptr(b.ptr), cu.CUdeviceptr(a.ptr), n,
                                   backend.stream_handle), "copy")
        times.append(backend.elapsed_ms(start, backend.mark()))
    backend.free(a), backend.free(b)
    best = statistics.median(times[1:])
    tbs = 2 * n / (best * 1e-3) / 1e12
    row("copy", "device-to-device copy of 4 GiB (read + write), TB/s", f"{tbs:.2f}")
    RESULTS["copy_tbs"] = tbs
    return tbs


def gemm_shapes(cfg: dict) -> list[tuple[str, int, int, str]]:
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, nq, nk = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return [("qkv_proj", (nq + 2 * nk) * hd, h, "cublaslt_bf16_tn"),
            ("o_proj", h, nq * hd, "cublaslt_bf16_tn"),
            ("gate_up_proj", 2 * inter, h, "cublaslt_bf16_tn"),
            ("down_proj", h, inter, "cublaslt_bf16_tn_acc"),
            ("lm_head", v, h, "cublas_bf16_tn_f32")]


def gemm_bench(cfg: dict) -> None:
    from kerncc.runtime.backends import gemv
    from kerncc.runtime.backends.cuda import CudaBackend

    gemv.MAX_M = 8  # every size the GEMV kernels take, to compare
    policy = gemv.NARROW_ENTRY, gemv.WIDE_MAX_TILES
    backend = CudaBackend(0)
    rng = np.random.default_rng(0)
    busy = Busy(backend)
    out = {}
    for op, n, k, extern in gemm_shapes(cfg):
        wbytes = n * k * 2
        copies = max(2, -(-(256 << 20) // wbytes))
        ws = [backend.allocate(wbytes) for _ in range(copies)]
        bits = rng.integers(0x3C00, 0x3D00, size=n * k, dtype=np.uint16)  # bf16 in [2^-7, 2^-6)
        for wa in ws:
            backend.upload(wa, 0, bits.view(np.uint8))
        a = backend.allocate(32 * k * 2)
        backend.upload(a, 0, rng.integers(0x3F00, 0x3F80, size=32 * k, dtype=np.uint16)
                       .view(np.uint8))
        c = backend.allocate(32 * n * 4)
        site = backend._gemv_site(extern)
        try:
            gemm_shape(backend, busy, site, out, (op, n, k, extern), (a, c, ws, copies, wbytes))
        finally:  # the policy is module state: a failure must not leave it changed
            gemv.NARROW_ENTRY, gemv.WIDE_MAX_TILES = policy
        for wa in ws:
            backend.free(wa)
        backend.free(a), backend.free(c)
    RESULTS["gemm_us"] = out


def gemm_shape(backend, busy, site, out: dict, shape: tuple, data: tuple) -> None:
    """One GEMM shape at m = 1, 8, 16, 32: cuBLAS against each GEMV kernel (m <= 8, the most
    they take), one row each."""
    from kerncc.runtime.backends import gemv

    op, n, k, extern = shape
    a, c, ws, copies, wbytes = data
    for m in (1, 8, 16, 32):
        results = {}
        paths = ["cublas", "gemv_bf16_tn_mb1", "gemv_bf16_tn_mb1_w16"]
        for path in paths if m <= 8 else paths[:1]:
            def launch(wa, m=m, path=path):
                if path == "cublas":
                    backend.blas.gemm(extern, a.ptr, wa.ptr, c.ptr, m, n, k)
                else:
                    site(a.ptr, wa.ptr, c.ptr, m, n, k, backend.stream_handle)
            gemv.NARROW_ENTRY, gemv.WIDE_MAX_TILES = (
                path if path != "cublas" else "gemv_bf16_tn_mb1"), 0
            for wa in ws:
                launch(wa)
            reps = 4 * copies
            with busy:
                start = backend.mark()
                for i in range(reps):
                    launch(ws[i % copies])
                end = backend.mark()
            results[path] = backend.elapsed_ms(start, end) * 1e3 / reps
        row("gemm", f"{op} n={n} k={k} m={m}: us (weights TB/s) of " + " / ".join(
            p.replace("gemv_bf16_tn_", "") for p in results),
            " / ".join(f"{us:.1f} ({wbytes / us / 1e6:.2f})" for us in results.values()))
        out[f"{op} m={m}"] = results


def launch_times(session, busy, issue, rounds: int
                 ) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Every launch `issue()` makes on `session`, timed between events and summed per op over
    `rounds` runs: ({op entry: [ms a round]}, {op entry: launches a round})."""
    backend = session.backend
    originals = dict(session._launchers)
    marks: list[tuple] = []

    def timed(number, launcher):
        site = session._by_number[number]
        name = f"{site.op} {site.entry.removeprefix('extern:')}"

        def launch(grid, shared, scalars):
            start = backend.mark()
            launcher(grid, shared, scalars)
            marks.append((name, start, backend.mark()))
        return launch

    totals: dict[str, list[float]] = {}
    try:
        session._launchers = {n: timed(n, fn) for n, fn in originals.items()}
        for _ in range(rounds):
            marks.clear()
            with busy:
                issue()
            backend.sync()
            run: dict[str, float] = {}
            for name, a, b in marks:
                run[name] = run.get(name, 0.0) + backend.elapsed_ms(a, b)
            for name, ms in run.items():
                totals.setdefault(name, []).append(ms)
    finally:
        session._launchers = originals
    return totals, {name: sum(1 for n, _, _ in marks if n == name) for name in totals}


def decode_profile(chain, label: str, seqs: int = 1) -> None:
    """Each launch of one decode step between events, summed per op: batch 1 (`decode`, after
    a 512-token prompt) or `seqs` sequences of CONTEXT tokens (`decode_batch`)."""
    session, backend = chain.sessions[0], chain.sessions[0].backend
    if seqs == 1:
        prompt = [int(t) for t in np.random.default_rng(3).integers(1, 32000, CONTEXT)]
        greedy(chain, prompt, 2, 512)
        env, program = dict(session.last_vars), "decode"
    else:
        inputs, vars = batch_inputs(chain, seqs, CONTEXT)
        chain.run("decode_batch", inputs, vars)
        env, program = session._vars(vars), "decode_batch"
    backend.sync()
    busy = Busy(backend)
    totals, counts = launch_times(session, busy, lambda: session._issue_program(program, env), 5)
    graph = backend.capture(lambda: session._issue_program(program, env))
    backend.replay(graph)
    backend.sync()
    graph_ms = replay_ms(busy, graph, 200)
    best = {name: statistics.median(v) for name, v in totals.items()}
    whole = sum(best.values())
    row(f"profile/{label}", "decode step: launches, event sum ms, graph replay ms",
        f"{sum(counts.values())}, {whole:.3f}, {graph_ms:.3f}")
    lines = []
    for name in sorted(best, key=best.get, reverse=True):
        lines.append(f"{name[:58]:58s} {counts[name]:5d} {best[name]:8.3f} {best[name] / whole:6.1%}"
                     f" {best[name] / counts[name] * 1e3:7.1f} us each")
    say(f"  per op ({label}): op entry, count, ms, share, each")
    for line in lines:
        say("    " + line)
    RESULTS.setdefault("profile", {})[label] = {"graph_ms": graph_ms, "event_sum_ms": whole,
                                                "ops": {n: [counts[n], best[n]] for n in best}}


def decode_rows(model: dict, cfg: dict, hbm: float, defaults_only: bool = False) -> None:
    roof_ms = (weight_bytes(cfg) + kv_bytes(cfg, CONTEXT)) / (hbm * 1e12) * 1e3
    row("decode", f"roofline batch 1 (weights {weight_bytes(cfg) / 1e9:.2f} GB + KV of "
        f"{CONTEXT} tokens at {hbm:.2f} TB/s), ms", f"{roof_ms:.3f}")
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, 32000, CONTEXT)]
    out = {}
    for label, bundle, max_m, pdl in POLICIES:
        if defaults_only and "(the default)" not in label:
            continue
        chain = chain_of(model[bundle], max_m, pdl)
        step = decode_step_s(lambda p, n, chain=chain: greedy(chain, p, n, 512), prompt)
        ms = step * 1e3
        row("decode", f"decode batch 1, {label}: ms/token (host included), x roofline",
            f"{ms:.3f}, {ms / roof_ms:.2f}x")
        out[label] = ms
        gms = graph_step_ms(chain)
        row("decode", f"decode batch 1, {label}: graph replay per step (GPU only), ms, x "
            "roofline", f"{gms:.3f}, {gms / roof_ms:.2f}x")
        out[f"{label}, graph"] = gms
        if bundle == "whole":
            for seqs in (8, 32):
                limit = chain.sessions[0].manifest.vars["seqs"].max
                if seqs > limit:
                    row("decode", f"decode {seqs} sequences, {label}", f"skipped (seqs max {limit})")
                    continue
                roof = (weight_bytes(cfg) + seqs * kv_bytes(cfg, CONTEXT)) / (hbm * 1e12) * 1e3
                bms = batch_step_ms(chain, seqs, CONTEXT)
                row("decode", f"decode {seqs} sequences x {CONTEXT} tokens, {label}: step ms, "
                    f"roofline ms, x roofline", f"{bms:.3f}, {roof:.3f}, {bms / roof:.2f}x")
                out[f"{label}, {seqs} sequences"] = [bms, roof]
        del chain
        gc.collect()
    RESULTS["decode_ms"] = out
    RESULTS["decode_roofline_ms"] = roof_ms


POLICIES = [  # label, bundle, GEMV max m, overlapping launches (PDL)
    ("cuBLAS only, no PDL", "whole", 0, False),
    ("GEMV m<=8, no PDL", "whole", 8, False),
    ("GEMV m<=8 + PDL (the default)", "whole", 8, True),
    ("cuBLAS only + PDL", "whole", 0, True),
    ("2 stages on 1 GPU, GEMV m<=8, no PDL", "two", 8, False),
    ("2 stages on 1 GPU, GEMV m<=8 + PDL (the default)", "two", 8, True),
]


# What `ablate` leaves out of every layer, by call label (kerncc/example/qwen.py
# layer_call_names), and which launches of the call (None: all of them).
ABLATIONS = {
    "the attention's combine": [("attention", 1)],
    "the attention's split": [("attention", 0)],
    "the attention": [("attention", None)],
    "qk_rope_kv": [("qk_rope_kv", None)],
    "post_norm": [("post_norm", None)],
    "input_norm": [("input_norm", None)],
    "act": [("act", None)],
    "o_proj": [("o_proj", None)],
    "qkv_proj": [("qkv_proj", None)],
    "down_proj": [("down_proj", None)],
    "gate_up_proj": [("gate_up_proj", None)],
    "every small kernel (the GEMVs stay)": [
        (n, None) for n in ("attention", "qk_rope_kv", "post_norm", "input_norm", "act")],
    "every GEMV (the small kernels stay)": [
        (n, None) for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")],
}


def ablate(model: dict, cfg: dict, rounds: int = 2) -> None:
    """What each kernel costs inside the decode graph: the batch-1 `decode` graph and an
    8-sequence `decode_batch` step with the named launches of every layer left out (their
    sites launch nothing, so the results are wrong and only the time counts), rounds
    alternating with the whole step. A saving is what the kernel costs the step, overlap
    included: at most what fusing it away could give."""
    from kerncc.runtime.backends import cuda

    layers = cfg["num_hidden_layers"]
    prepare, skip = cuda.CudaBackend.prepare, set()

    def prepare_skipping(backend, site):
        name = (site.label or "").split(".", 1)[-1]
        if (name, site.launch) in skip or (name, None) in skip:
            return lambda grid, shared, scalars: None
        return prepare(backend, site)

    variants = {"nothing": [], **ABLATIONS}
    times: dict[str, dict[int, list[float]]] = {v: {1: [], 8: []} for v in variants}
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, 32000, CONTEXT)]
    cuda.CudaBackend.prepare = prepare_skipping
    try:
        for r in range(rounds):
            for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                skip.clear()
                skip.update(variants[name])
                with chain_of(model["whole"], 8, True) as chain:
                    greedy(chain, prompt, 4, 512)  # captures the decode graph
                    times[name][1].append(graph_step_ms(chain))
                    times[name][8].append(batch_step_ms(chain, 8, CONTEXT))
                gc.collect()
    finally:
        cuda.CudaBackend.prepare = prepare
    base = {n: statistics.median(times["nothing"][n]) for n in (1, 8)}
    for name, got in times.items():
        ms = {n: statistics.median(got[n]) for n in (1, 8)}
        saved = {n: (base[n] - ms[n]) / layers * 1e3 for n in (1, 8)}
        row("ablate", f"decode graph without {name}: batch 1 ms, us a layer saved; 8 "
            f"sequences ms, us a layer saved", f"{ms[1]:.4f}, {saved[1]:.2f}; {ms[8]:.4f}, "
            f"{saved[8]:.2f}")
        RESULTS.setdefault("ablate", {})[name] = {"batch 1": got[1], "8 sequences": got[8]}


def pipe_ab(model: dict, cfg: dict, hbm: float, rounds: int = 4) -> None:
    """The batched decode's split attention pipelined (runtime/backends/attention_pipe.py)
    against the split kernel: `policy_ab`. Only `decode_batch` at 17 sequences or more (of 8 kv
    heads, on 132 multiprocessors) goes out pipelined, so the batch-1 and 8-sequence rows
    compare the same kernels: controls of the noise."""
    policy_ab("pipe", "pipelined attention / one split a block", "piped", model, cfg, hbm,
              rounds, counted=("whole",))


def policy_ab(name: str, what_ab: str, counter: str, model: dict, cfg: dict, hbm: float,
              rounds: int = 4, counted: tuple[str, ...] = ("whole", "two")) -> None:
    """chain_of's `pipe` on against off, alternating: the batch-1 `decode` graph whole and in 2
    stages, and `decode_batch` steps of 8 and 32 sequences x CONTEXT tokens (graph replays),
    medians of `rounds`, as ms and the saving a layer; `counter` is the backend's count of
    the launches the option makes (it must move when on, in the bundles `counted`). The order
    flips each round, so an even count puts each side first equally often: with 3 rounds the
    same kernels on both sides read 0.8 us a layer apart at 8 sequences."""
    layers = cfg["num_hidden_layers"]
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, 32000, CONTEXT)]
    times: dict[tuple, list[float]] = {}
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            for bundle in ("whole", "two"):
                with chain_of(model[bundle], 8, True, pipe=on) as chain:
                    greedy(chain, prompt, 4, 512)  # captures the decode graph
                    times.setdefault((on, bundle, 1), []).append(graph_step_ms(chain))
                    if bundle == "whole":
                        for seqs in (8, 32):
                            times.setdefault((on, bundle, seqs), []).append(
                                batch_step_ms(chain, seqs, CONTEXT))
                    if (on and bundle in counted
                            and not any(getattr(b, counter) for b in chain.backends)):
                        raise RuntimeError(f"{name}: no launch went out {counter}")
                gc.collect()
    for bundle, seqs in (("whole", 1), ("two", 1), ("whole", 8), ("whole", 32)):
        on = statistics.median(times[(True, bundle, seqs)])
        off = statistics.median(times[(False, bundle, seqs)])
        roof = (weight_bytes(cfg) + seqs * kv_bytes(cfg, CONTEXT)) / (hbm * 1e12) * 1e3
        what = f"{seqs} sequences" if seqs > 1 else "batch 1" + (", 2 stages" if bundle == "two"
                                                                  else "")
        row(name, f"decode {what}: {what_ab}, ms (x roofline), us a layer saved",
            f"{on:.4f} ({on / roof:.2f}x) / {off:.4f} ({off / roof:.2f}x), "
            f"{(off - on) / layers * 1e3:.2f}")
    RESULTS[f"{name}_ms"] = {" ".join(map(str, k)): v for k, v in times.items()}


def invariant_ab(model: dict, cfg: dict, hbm: float, rounds: int = 4) -> None:
    """Batch-invariant GEMMs (the default) against the batch-shaped path, alternating (the
    order flips each round): the batch-1 decode graph, decode_batch steps of 8, 32 and, where
    the model takes them, 64 and 128 sequences (graph replays), TTFT of 4096 and 8192 tokens at
    chunk 2048; medians of `rounds`, and the tax (invariant / batch-shaped - 1) a row."""
    layers = cfg["num_hidden_layers"]
    most = int(cfg.get("kerncc", {}).get("max_seqs", 32))
    batches = [b for b in (8, 32, 64, 128) if b <= most]
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(1, 32000, CONTEXT)]
    long = {n: [int(t) for t in rng.integers(1, 32000, n)] for n in (4096, 8192)}
    times: dict[tuple, list[float]] = {}
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            with chain_of(model["whole"], 8, True, invariant=on) as chain:
                paths = {p for b in chain.backends for p in b.gemm_paths.values()}
                if on and not {"gemv", "pinned"} <= paths:
                    raise RuntimeError(f"invariant: GEMM paths {sorted(paths)}")
                greedy(chain, prompt, 4, 512)  # captures the decode graph
                times.setdefault((on, "decode", 1), []).append(graph_step_ms(chain))
                for seqs in batches:
                    times.setdefault((on, "decode", seqs), []).append(
                        batch_step_ms(chain, seqs, CONTEXT))
                for tokens, ids in long.items():
                    times.setdefault((on, "ttft", tokens), []).append(
                        ttft(chain, ids, 2048) * 1e3)
            gc.collect()
    for kind, size in sorted({k[1:] for k in times}):
        on = statistics.median(times[(True, kind, size)])
        off = statistics.median(times[(False, kind, size)])
        if kind == "decode":
            roof = (weight_bytes(cfg) + size * kv_bytes(cfg, CONTEXT)) / (hbm * 1e12) * 1e3
            what = f"decode {size} sequences" if size > 1 else "decode batch 1"
            extra = f" (x roofline {on / roof:.2f} / {off / roof:.2f}), us a layer " \
                    f"{(on - off) / layers * 1e3:+.2f}"
        else:
            what, extra = f"TTFT {size} (chunk 2048)", ""
        row("invariant", f"{what}: invariant / batch-shaped ms, tax",
            f"{on:.4f} / {off:.4f}, {(on / off - 1) * 100:+.1f}%{extra}")
    RESULTS["invariant_ms"] = {" ".join(map(str, k)): v for k, v in times.items()}


def attention_blocks(model: dict, cfg: dict, hbm: float) -> None:
    """The batched decode's step with Z split blocks per (sequence, kv head) (the grid z of
    `attn_decode_batch`; the bits are the same for any Z): a block per split (Z = max_splits,
    the code before), 16, the default 8, and 4, at short and long contexts, one sequence too
    (what `decode`'s grid would give)."""
    source = json.loads(Path(model["manifest"]).read_text())
    splits = source["ops"]["attn_decode"]["impl"]["launches"][0]["grid"][2]
    for blocks in (splits, 16, 8, 4):
        manifest = json.loads(json.dumps(source))
        manifest["ops"]["attn_decode_batch"]["impl"]["launches"][0]["grid"][2] = blocks
        variant = Path(model["manifest"]).with_name(f"model-z{blocks}.json")
        variant.write_text(json.dumps(manifest))
        bundle = variant.with_name(f"whole-z{blocks}")
        if kerncc(["lower", str(variant), "-p", "emit", "-o", str(bundle)]) != 0:
            raise RuntimeError(f"lowering the Z = {blocks} variant failed")
        chain = chain_of(bundle, 8, True)
        for seqs, context in ((32, 512), (8, 512), (8, 2048), (2, 4096), (1, 512), (1, 4096)):
            roof = (weight_bytes(cfg) + seqs * kv_bytes(cfg, context)) / (hbm * 1e12) * 1e3
            ms = batch_step_ms(chain, seqs, context)
            row("attention", f"decode {seqs} sequences x {context} tokens, {blocks} split "
                f"blocks per (sequence, kv head): step ms, x roofline", f"{ms:.3f}, "
                f"{ms / roof:.2f}x")
            RESULTS.setdefault("attention_blocks", {})[f"{blocks} {seqs}x{context}"] = ms
        del chain
        gc.collect()


def graph_step_ms(chain) -> float:
    """The batch-1 `decode` step's GPU time: every stage's graph (captured by `greedy`)
    replayed in order, with the hand-over copies between stages, back to back (one GPU)."""
    backend = chain.sessions[0].backend
    steps = []
    for k, session in enumerate(chain.sessions):
        key = next(g for g in session._graphs if g[0] == "decode")
        env = {n: v for n, v in session.last_vars.items() if n in session.manifest.vars}
        steps.append((k, env, session._graphs[key]))
    busy = Busy(backend)
    replays = 100
    with busy:
        start = backend.mark()
        for _ in range(replays):
            for k, env, graph in steps:
                chain._receive(k, env, 0)
                chain.sessions[k].backend.replay(graph)
        end = backend.mark()
    return backend.elapsed_ms(start, end) / replays


def torch_rows(model: dict, cfg: dict, hbm: float) -> None:
    """The PyTorch reference (bench/torch_ref.py) on the same weights: its decode step at
    context 512, eager and captured in one CUDA graph, against kerncc's decode graph and the
    roofline; greedy tokens and the first token's logits side by side (the example's random
    weights make near-ties, so a flip is told apart by torch's top-2 gap); TTFT of 8192
    tokens, kerncc at chunk 512 against torch eager in one shot."""
    import torch

    from bench.gpu import ttft_fn
    from bench.torch_ref import TorchQwen, decode_step_ms

    roof_ms = (weight_bytes(cfg) + kv_bytes(cfg, CONTEXT)) / (hbm * 1e12) * 1e3
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, 32000, CONTEXT - 1)]
    chain = chain_of(model["whole"], 8)
    ours_tokens, _ = greedy(chain, prompt, 9, 512)  # also captures the decode graph
    ours = graph_step_ms(chain)
    ref = TorchQwen(model["dir"], "cuda")
    eager, replay = decode_step_ms(ref, prompt)
    row("torch", "PyTorch decode step at context 512, eager (host-bound), ms, x roofline",
        f"{eager:.3f}, {eager / roof_ms:.2f}x")
    row("torch", "PyTorch decode step at context 512, eager captured in one CUDA graph, ms, "
        "x roofline", f"{replay:.3f}, {replay / roof_ms:.2f}x")
    row("torch", "decode step GPU time: kerncc's graph / torch's graph, ms",
        f"{ours:.3f} / {replay:.3f} = {ours / replay:.2f}x")
    ref.reset()
    theirs_tokens = ref.generate(prompt, 9)
    equal = sum(a == b for a, b in zip(ours_tokens, theirs_tokens))
    row("torch", "greedy tokens equal to torch's (9; a near-tie may flip)", f"{equal}/9")
    ours_logits = np.asarray(greedy(chain, prompt, 1, 512)[1][-1], np.float32)
    ref.reset()
    theirs_logits = ref.prefill(prompt).float().cpu().numpy().reshape(-1)
    scale = float(np.abs(theirs_logits).max())
    top2 = np.sort(theirs_logits)[-2:]
    row("torch", "first token's logits: max |diff| vs torch / max |logit|; torch's top-2 gap "
        "/ max |logit|", f"{float(np.abs(ours_logits - theirs_logits).max()) / scale:.2e}; "
        f"{float(top2[1] - top2[0]) / scale:.2e}")

    def torch_first(tokens: list[int]) -> None:
        ref.reset()
        ref.generate(tokens, 1)
        torch.cuda.synchronize()

    long = [int(t) for t in np.random.default_rng(4).integers(1, 32000, 8192)]
    ours_ttft, theirs_ttft = ttft(chain, long, 512), ttft_fn(lambda: torch_first(long))
    row("torch", "TTFT 8192: kerncc chunk 512 / torch eager (SDPA), ms",
        f"{ours_ttft * 1e3:.1f} / {theirs_ttft * 1e3:.1f} = {ours_ttft / theirs_ttft:.2f}x")
    RESULTS["torch"] = {"eager_ms": eager, "graph_ms": replay, "kerncc_graph_ms": ours,
                        "ttft_ms": theirs_ttft * 1e3, "kerncc_ttft_ms": ours_ttft * 1e3}
    ref = chain = None  # their weights freed before the next section
    gc.collect()
    torch.cuda.empty_cache()


def bitwise(model: dict, gpus: int) -> None:
    """Whole against 2 stages on one GPU, against itself again, and with two GPUs against 2
    stages on both and the whole on GPU 1: the same tokens and logits, bit for bit."""
    from kerncc.runtime import Chain

    whole = chain_of(model["whole"], 8)
    others = {"2 stages on 1 GPU": chain_of(model["two"], 8), "whole again": whole}
    if gpus >= 2:
        others["2 stages on 2 GPUs"] = Chain(model["two"], backend="cuda", devices=[0, 1],
                                             token_capacity=CAPACITY)
        others["whole on GPU 1"] = Chain(model["whole"], backend="cuda", devices=[1],
                                         token_capacity=CAPACITY)
    rng = np.random.default_rng(7)
    cases = [([int(t) for t in rng.integers(1, 32000, n)], chunk)
             for n in (1, 7, 33, 65, 513) for chunk in (512, 16) if n < 100 or chunk == 512]
    expected = [greedy(whole, prompt, 9, chunk) for prompt, chunk in cases]
    assert all(np.abs(logits).max() > 0 for _, logits in expected), "all-zero logits"
    for name, chain in others.items():
        same = 0
        for (prompt, chunk), (tokens, logits) in zip(cases, expected):
            tokens2, logits2 = greedy(chain, prompt, 9, chunk)
            if tokens == tokens2 and logits.tobytes() == logits2.tobytes():
                same += 1
                continue
            say(f"    differs: {name}, prompt {len(prompt)}, chunk {chunk}: max |diff| "
                f"{np.abs(logits - logits2).max():.3e}")
        row("bitwise", f"whole vs {name} (prompts x chunks, 9 tokens)",
            f"{same}/{len(cases)} identical")
        RESULTS.setdefault("bitwise", {})[name] = [same, len(cases)]


def first_token(model: dict, rounds: int = 5) -> None:
    """TTFT of a 4096-token prompt at chunk 2048 through the serving engine: the first token
    from the last prefill chunk (the default) against a one-row step for the last prompt
    token, alternating; the first round is a warm-up."""
    import attrs

    from kerncc.serve.engine import Config, Engine, Request

    chain = chain_of(model["whole"], 8)
    prompt = [int(t) for t in np.random.default_rng(4).integers(1, 32000, 4096)]
    engine = Engine(chain, Config(max_running=4, chunk=2048))
    base = engine.limits
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for emits in (True, False):
            engine.limits = attrs.evolve(base, chunk_emits=emits)
            request = Request(list(prompt), 1)
            started = time.perf_counter()
            engine.submit(request)
            engine.run_until_idle()
            times[emits].append(time.perf_counter() - started)
            if request.finish != "length":
                raise RuntimeError(f"the request finished with {request.finish}")
    on, off = (statistics.median(times[emits][1:]) * 1e3 for emits in (True, False))
    row("first-token", "TTFT 4096 at chunk 2048 through the engine: the first token from the "
        "last chunk / from a one-row step, ms", f"{on:.2f} / {off:.2f} = {on / off:.2f}x")
    RESULTS["first_token_ms"] = {"from the chunk": times[True], "one-row step": times[False]}


def prefill_profile(chain, context: int, chunk: int) -> None:
    from kerncc.runtime.model_runner import ModelRunner, Rows

    session, backend = chain.sessions[0], chain.sessions[0].backend
    model = ModelRunner(chain)  # the protocol's inputs, to put `context` tokens in the cache
    program = model.chunk_program
    prompt = [int(t) for t in np.random.default_rng(5).integers(1, 32000, context + chunk)]
    pages = list(range(-(-(context + chunk) // model.stride)))
    cached = 0
    while cached < context:
        n = min(chunk, context - cached)
        chain.submit(program.name, model.inputs([Rows(0, prompt, [], pages, cached, n)]),
                     model.protocol.vars(1, n, n, cached + n), outputs=False)
        cached += n
    inputs = model.inputs([Rows(0, prompt, [], pages, context, chunk)])
    vars = model.protocol.vars(1, chunk, chunk, context + chunk)
    backend.sync()
    chunk_call = lambda: session.submit(program.name, inputs, vars, outputs=False)  # noqa: E731
    totals, counts = launch_times(session, Busy(backend), chunk_call, 3)
    best = {name: min(v) for name, v in totals.items()}
    whole = sum(best.values())
    row("prefill", f"one {chunk}-row chunk at context {context}: event sum ms", f"{whole:.3f}")
    say(f"  per op (prefill chunk {chunk} at {context}): op entry, count, ms, share")
    for name in sorted(best, key=best.get, reverse=True):
        say(f"    {name[:58]:58s} {counts[name]:5d} {best[name]:8.3f} {best[name] / whole:6.1%}")
    RESULTS.setdefault("prefill_profile", {})[f"{chunk}@{context}"] = best


def mma_sync_bundle(model: dict, cfg: dict) -> Path:
    """The small model lowered with the mma.sync prefill attention (attention.cu) in place of
    the wgmma one (attention_sm90a.cu), the default before it."""
    from kerncc.example.qwen import attn_prefill_smem, ceil_div
    from kerncc.kernels import library

    manifest = json.loads(Path(model["manifest"]).read_text())
    launch = manifest["ops"]["attn_prefill"]["impl"]["launches"][0]
    group = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    launch.update(module=library.module_of("attn_prefill_varlen_bf16"),
                  entry="attn_prefill_varlen_bf16", shared_mem=attn_prefill_smem(cfg["head_dim"]),
                  block=[256, 1, 1])
    launch["grid"][0] = ceil_div("tokens", 64 // group)
    manifest["modules"].pop("attention_sm90a")  # a module nothing launches is an error
    variant = Path(model["manifest"]).with_name("model-mma-sync.json")
    variant.write_text(json.dumps(manifest))
    bundle = variant.with_name("whole-mma-sync")
    if kerncc(["lower", str(variant), "-p", "emit", "-o", str(bundle)]) != 0:
        raise RuntimeError("lowering the mma.sync variant failed")
    return bundle


def prefill_rows(model: dict, cfg: dict) -> None:
    """TTFT of a 4096-token prompt with the wgmma prefill attention (the default) and with the
    mma.sync one, alternating, PDL on (the default) for both; then one chunk's launches of
    2048, 512, 256 and 64 rows, event sums."""
    tokens = 4096
    roof = prefill_flops(cfg, tokens) / (TC_TFLOPS * 1e12) * 1e3
    row("prefill", f"prefill roofline, TTFT {tokens} ({prefill_flops(cfg, tokens) / 1e12:.1f} "
        f"TFLOP at {TC_TFLOPS:.0f} TFLOP/s), ms", f"{roof:.1f}")
    prompt = [int(t) for t in np.random.default_rng(4).integers(1, 32000, tokens)]
    chains = {"wgmma attention (the default)": chain_of(model["whole"], 8, True),
              "mma.sync attention (before)": chain_of(mma_sync_bundle(model, cfg), 8, True)}
    for chunk in (2048, 1024, 512):
        for how, chain in chains.items():
            ms = ttft(chain, prompt, chunk) * 1e3
            row("prefill", f"prefill TTFT {tokens}, chunk {chunk}, {how}: ms, x roofline",
                f"{ms:.1f}, {ms / roof:.2f}x")
            RESULTS.setdefault("ttft_ms", {}).setdefault(how, {})[chunk] = ms
    del chains
    gc.collect()
    from kerncc.runtime import Chain
    from kerncc.runtime.backends import gemv

    gemv.MAX_M = 8
    chain = Chain(model["whole"], backend="cuda", token_capacity=CAPACITY, graphs="off")
    # the 4096-token prompt's two chunks, then the small chunks a server makes beside decodes
    # (each GEMM site takes an algorithm by its rows: runtime/backends/cublas.py BUCKETS)
    for context, chunk in ((0, 2048), (2048, 2048), (0, 512), (0, 256), (0, 64)):
        prefill_profile(chain, context, chunk)



def launch_overhead(model: dict) -> None:
    chain = chain_of(model["whole"], 8)
    session, backend = chain.sessions[0], chain.sessions[0].backend
    greedy(chain, list(range(1, 101)), 2, 512)  # a 100-token context in the cache
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
    graph_ms = replay_ms(busy, graph, 200)
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


def breakdown(chain, prompt: list[int], chunk: int) -> None:
    """Where a pipelined TTFT goes: host issue until the last item is in, then the wait."""
    greedy(chain, prompt, 1, chunk)
    submits: list[float] = []
    original = chain.submit

    def submit(*args, **kwargs):
        pending = original(*args, **kwargs)
        submits.append(time.perf_counter())
        return pending

    chain.submit = submit  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        greedy(chain, prompt, 1, chunk)
        total = time.perf_counter() - t0
    finally:
        del chain.submit
    row("pipeline", f"TTFT 8192 on 2 GPUs, chunk {chunk}: first item issued / last issued / "
        "done, ms", f"{(submits[0] - t0) * 1e3:.1f} / {(submits[-1] - t0) * 1e3:.1f} / "
        f"{total * 1e3:.1f}")


def pipeline(model: dict, out: Path, gpus: int) -> None:
    from kerncc.runtime import Chain
    from kerncc.runtime.trace import Timeline

    if gpus < 2:
        row("pipeline", "skipped", "one GPU")
        return
    whole = Chain(model["whole"], backend="cuda", token_capacity=CAPACITY)
    two = Chain(model["two"], backend="cuda", devices=[0, 1], token_capacity=CAPACITY)
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
    whole_marked = Chain(model["whole"], backend="cuda", graphs="marked",
                         token_capacity=CAPACITY)
    two_marked = Chain(model["two"], backend="cuda", devices=[0, 1], graphs="marked",
                       token_capacity=CAPACITY)
    base, piped = ttft(whole_marked, prompt, 512), ttft(two_marked, prompt, 512)
    row("pipeline", "TTFT 8192, prefill launched kernel by kernel (graphs=marked): whole / "
        "2 GPUs, ms", f"{base * 1e3:.1f} / {piped * 1e3:.1f} ({base / piped:.3f}x)")
    timeline = Timeline()
    traced = Chain(model["two"], backend="cuda", devices=[0, 1], trace=timeline,
                   token_capacity=CAPACITY)
    prompt = [int(t) for t in rng.integers(1, 32000, 8192)]
    greedy(traced, prompt, 1, 512)
    timeline.spans.clear()
    t0 = time.perf_counter()
    greedy(traced, prompt, 1, 512)
    total_ms = (time.perf_counter() - t0) * 1e3
    rows = timeline.rows()
    copy_ms = sum(r["done_ms"] - r["start_ms"] for r in rows if "buffer" in r)
    copied = sum(1 for r in rows if "buffer" in r)
    row("pipeline", "transfers in the 8192 run: count, ms, share of TTFT",
        f"{copied}, {copy_ms:.2f}, {copy_ms / total_ms:.2%}")
    timeline.write(out / "trace-8192-two-gpus.json")
    RESULTS.setdefault("pipeline", {})["transfer_share"] = copy_ms / total_ms


# ---------------------------------------------------------------------------------- main

SECTIONS = ("copy", "gemm", "profile", "launch", "decode", "pipe", "invariant", "attention",
            "torch", "bitwise", "prefill", "first-token", "pipeline")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.decode", description=__doc__.splitlines()[0],
        epilog="sections: " + " ".join(SECTIONS) + " (and ablate with --ablate)")
    REPORT.add_options(parser)
    parser.add_argument("--layers", type=int, default=0, help="override the layer count")
    parser.add_argument("--max-seqs", type=int, default=0, metavar="N",
                        help="sequences a call takes (default: the example's 32; 64 adds the "
                        "64-sequence rows of `invariant`)")
    parser.add_argument("--skip", default="", help="sections to leave out, comma-separated")
    parser.add_argument("--only", default="", help="the only sections to run, comma-separated")
    parser.add_argument("--defaults-only", action="store_true",
                        help="decode: only the default policies (whole and 2 stages)")
    parser.add_argument("--ablate", action="store_true",
                        help="also the ablation of the decode graph (about a minute)")
    args = parser.parse_args(argv)
    chosen = {s for s in (args.only or ",".join(SECTIONS)).split(",") if s}
    unknown = (chosen | set(filter(None, args.skip.split(",")))) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))} (known: "
                     f"{', '.join(SECTIONS)})")
    args.sections = chosen - set(args.skip.split(","))
    if args.max_seqs < 0 or args.layers < 0:
        parser.error("--max-seqs and --layers take a positive count (0: the example's)")
    try:  # the example's own checks, before any file is written
        make_config("small", **{k: v for k, v in (("layers", args.layers),
                                                   ("max_seqs", args.max_seqs)) if v})
    except ValueError as err:
        parser.error(f"--max-seqs {args.max_seqs} / --layers {args.layers}: {err}")
    return args


def main(argv: list[str] | None = None) -> int:
    import os

    args = parse(argv)
    run = args.sections
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "kerncc-decode-bench"
    started = time.perf_counter()
    try:
        with REPORT.section("build small"):
            model = build(work, "small", args.layers, args.max_seqs)
        say(f"  built in {time.perf_counter() - started:.1f} s")
        cfg = config(model)
        gpus = device_count()
        hbm = HBM_TBS
        if "copy" in run:
            with REPORT.section("copy"):
                from kerncc.runtime.backends.cuda import CudaBackend
                hbm = copy_ceiling(CudaBackend(0))
        if "gemm" in run:
            with REPORT.section("gemm"):
                gemm_bench(cfg)
        if "profile" in run:
            for label, max_m in (("cuBLAS", 0), ("GEMV m<=8", 8)):
                with REPORT.section(f"profile {label}"):
                    decode_profile(chain_of(model["whole"], max_m, False), label)
                gc.collect()
            with REPORT.section("profile 32 sequences"):
                decode_profile(chain_of(model["whole"], 8, False), "32 sequences", seqs=32)
            gc.collect()
        if "launch" in run:
            with REPORT.section("launch"):
                launch_overhead(model)
            gc.collect()
        if args.ablate:
            with REPORT.section("ablate", limit=400):
                ablate(model, cfg)
        if "decode" in run:
            with REPORT.section("decode", limit=400):
                decode_rows(model, cfg, hbm, args.defaults_only)
        if "pipe" in run:
            with REPORT.section("pipe", limit=300):
                pipe_ab(model, cfg, hbm)
        if "invariant" in run:
            with REPORT.section("invariant", limit=400):
                invariant_ab(model, cfg, hbm)
        if "attention" in run:
            with REPORT.section("attention"):
                attention_blocks(model, cfg, hbm)
        if "torch" in run:
            with REPORT.section("torch"):
                torch_rows(model, cfg, hbm)
        if "bitwise" in run:
            with REPORT.section("bitwise"):
                bitwise(model, gpus)
        gc.collect()
        if "prefill" in run:
            with REPORT.section("prefill"):
                prefill_rows(model, cfg)
        if "first-token" in run:
            with REPORT.section("first-token"):
                first_token(model)
        gc.collect()
        if "pipeline" in run:
            with REPORT.section("pipeline"):
                pipeline(model, Path(args.out), gpus)
    finally:
        say(f"\ntotal {time.perf_counter() - started:.1f} s")
        status = REPORT.finish(args, device_name(), argv)
    return status


if __name__ == "__main__":
    sys.exit(main())
