"""Decode and prefill against the H200's limits (issue 20), side by side in one run.

    python tests/bench/decode_bench.py [--out DIR] [--layers 24] [--skip gemm,profile,...] [--defaults-only]
        [--ablate]

Builds the `small` example (24 layers, hidden 2048; `--layers` for a quicker look) whole and
cut at the middle layer, then measures, each section guarded so a failure leaves the rest:
  gemm     each decode GEMM shape of the model at m = 1, 8, 16, 32: cuBLAS against kerncc's GEMV
           kernels (kernels/gemv.cu), events around back-to-back launches over rotating
           weight copies (more bytes than the L2 holds), as achieved weight bandwidth.
  copy     the HBM ceiling: a large device-to-device copy (bytes read + written).
  profile  the batch-1 decode step after a 512-token prompt, each launch between events behind
           a busy stream, summed per op, for cuBLAS only and with the GEMV kernels.
  decode   ms/token at batch 1 (Generator, 32 steps, 512-token prompt, host included) and the
           decode graph's replay (GPU only) for each entry of POLICIES (cuBLAS only, the
           default GEMV choice, an alternative, the opt-in persistent runs, 2 stages on the
           same GPU; --defaults-only: the defaults and the persistent runs); and the batched
           step at 8 and 32 sequences (graph replays of `decode_batch`, 512 tokens each), all
           against the roofline of the bytes they must read (weights once + every sequence's KV).
  torch    the PyTorch reference's decode step (tests/bench/torch_ref.py), eager and eager
           captured in one CUDA graph, against the same roofline.
  fuse     the input norm, the silu_mul and both computed in the GEMVs after them (runtime/
           backends/fuse.py, opt-in) against their own launches, in turn: batch 1 and 8
           sequences.
  join     the decode attention's split and combine as one launch (runtime/backends/
           attention.py, opt-in) against the two, alternating, as fuse.
  pipe     the batched decode's split attention pipelined across each block's splits, with
           the backend's own Z (runtime/backends/attention_pipe.py, the default) against the
           split kernel, alternating, as join: batch 1 (the `decode` program keeps the split
           kernel) and 8 sequences (below the threshold: the split kernel too) are controls of
           the noise; 32 sequences go out pipelined.
  lookahead greedy decoding a step ahead of the host (the next step's token fed on the
           device) against one step at a time, alternating: ms/token at batch 1, whole and
           2 stages.
  attention the batched decode at 32/8/2 sequences and 512-4096 tokens with the attention's split
           blocks per (sequence, kv head) at max_splits (a block per split), 16, 8 and 4.
  bitwise  whole vs 2 stages on one GPU (prompts x chunks, 9 tokens): identical bits.
  ablate   (only with --ablate) the batch-1 decode graph and an 8-sequence step with each
           kind of layer launch left out in turn (ABLATIONS): what each kernel costs the step
           inside the graph, overlap included.
  prefill  TTFT of 4096 tokens at chunks 2048 / 1024 / 512 with the wgmma prefill attention
           (the default) and the mma.sync one, alternating, and the per-op GPU time of one
           2048-row chunk at context 2048, against the bf16 tensor-core roofline.
The table is printed last and written with everything else to --out (results.json); --doc
docs/benchmarks.md also writes it there, between the file's decode_bench markers, headed by
the command, the commit, the device and the date.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import (RESULTS, TABLE, Busy, DocError, build, decode_step_s, row, say,  # noqa: E402
                       section, ttft, write_rows)

from kerncc.runtime import Chain  # noqa: E402
from kerncc.runtime.backends import attention, attention_pipe, fuse, gemv, persist  # noqa: E402
from kerncc.runtime.generate import Generator, Served, _Record  # noqa: E402

HBM_TBS = 4.0  # the ceiling measured in `copy` replaces this when that section runs
TC_TFLOPS = 800.0  # bf16 dense, measured on these machines (KINDS.md: 769-798)
CAPACITY = 32 * 1024  # tokens of KV per chain: 32 sequences of 1024, or one 8k prompt
CONTEXT = 512


def chain_of(bundle: Path, max_m: int, pdl: bool = True, runs: str | None = None,
             join: bool = False, fused: bool | frozenset = False, pipe: bool = False) -> Chain:
    """A cuda chain with GEMV kernels up to m = max_m, with or without overlapping launches
    (programmatic dependent launch, runtime/backends/cuda.py), with or without persistent
    runs (runtime/backends/persist.py), the joined decode attention
    (runtime/backends/attention.py), the GEMVs fused with the small kernel before them
    (runtime/backends/fuse.py) and the pipelined batched decode attention
    (runtime/backends/attention_pipe.py; the last four decided as the stages load)."""
    gemv.MAX_M = max_m
    before = persist.ENABLED, attention.ENABLED, fuse.ENABLED, attention_pipe.ENABLED
    persist.ENABLED, attention.ENABLED, fuse.ENABLED, attention_pipe.ENABLED = (
        runs, join, fused, pipe)
    try:
        chain = Chain(bundle, backend="cuda", token_capacity=CAPACITY)
    finally:
        persist.ENABLED, attention.ENABLED, fuse.ENABLED, attention_pipe.ENABLED = before
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
    from kerncc.runtime.backends.cuda import CudaBackend

    gemv.MAX_M = 32  # every size, to compare
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
            gemv.NARROW_ENTRY, gemv.WIDE_MAX_TILES = DEFAULT_POLICY[0], DEFAULT_POLICY[2]
        for wa in ws:
            backend.free(wa)
        backend.free(a), backend.free(c)
    RESULTS["gemm_us"] = out


def gemm_shape(backend, busy, site, out: dict, shape: tuple, data: tuple) -> None:
    """One GEMM shape at m = 1, 8, 16, 32: cuBLAS against each GEMV kernel, one row each."""
    op, n, k, extern = shape
    a, c, ws, copies, wbytes = data
    for m in (1, 8, 16, 32):
        results = {}
        paths = ["cublas", "gemv_bf16_tn_mb1", "gemv_bf16_tn_mb1_w16"]
        for path in paths if m <= 8 else paths[:2]:
            def launch(wa, m=m, path=path):
                if path == "cublas":
                    backend.blas.gemm(extern, a.ptr, wa.ptr, c.ptr, m, n, k)
                else:
                    site(a.ptr, wa.ptr, c.ptr, m, n, k, backend.stream_handle)
            gemv.NARROW_ENTRY, gemv.WIDE_MAX_TILES = (
                path if m <= 8 and path != "cublas" else "gemv_bf16_tn_mb1"), 0
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


def decode_profile(chain: Chain, label: str, seqs: int = 1) -> None:
    """Each launch of one decode step between events, summed per op: batch 1 (`decode`, after
    a 512-token prompt) or `seqs` sequences of CONTEXT tokens (`decode_batch`)."""
    session, backend = chain.sessions[0], chain.sessions[0].backend
    if seqs == 1:
        prompt = [int(t) for t in np.random.default_rng(3).integers(1, 32000, CONTEXT)]
        Generator(chain).generate(prompt, 2, 512)
        env, program = dict(session.last_vars), "decode"
    else:
        inputs, vars = batch_inputs(chain, seqs, CONTEXT)
        chain.run("decode_batch", inputs, vars)
        env, program = session._vars(vars), "decode_batch"
    backend.sync()
    busy = Busy(backend)
    originals = dict(session._launchers)
    totals: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    try:
        marks: list[tuple] = []

        def timed(number, launcher):
            site = session._by_number[number]
            name = f"{site.op} {site.entry.removeprefix('extern:')}"

            def launch(grid, shared, scalars):
                start = backend.mark()
                launcher(grid, shared, scalars)
                marks.append((name, start, backend.mark()))
            return launch

        session._launchers = {n: timed(n, fn) for n, fn in originals.items()}
        for _ in range(5):
            marks.clear()
            with busy:
                session._issue_program(program, env)
            backend.sync()
            run: dict[str, float] = {}
            for name, a, b in marks:
                run[name] = run.get(name, 0.0) + backend.elapsed_ms(a, b)
            for name, ms in run.items():
                totals.setdefault(name, []).append(ms)
        counts = {name: sum(1 for n, _, _ in marks if n == name) for name in totals}
    finally:
        session._launchers = originals
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


def batch_inputs(chain: Chain, seqs: int, context: int) -> tuple[dict, dict]:
    """`decode_batch`'s inputs and vars for `seqs` sequences at `context` tokens each."""
    pages = -(-context // 16)
    table_width = chain.sessions[0].manifest.buffers["block_table"].shape[1]
    block_table = np.zeros((seqs, table_width), np.int32)
    for s in range(seqs):
        block_table[s, :pages] = s * pages + np.arange(pages)
    rng = np.random.default_rng(seqs)
    inputs = {
        "token_ids": rng.integers(1, 32000, seqs).astype(np.int32),
        "positions": np.full(seqs, context - 1, np.int32),
        "slot_mapping": np.array([s * pages * 16 + context - 1 for s in range(seqs)], np.int32),
        "seq_lens": np.full(seqs, context, np.int32),
        "block_table": block_table,
    }
    return inputs, {"seqs": seqs, "tokens": seqs}


def batch_step_ms(chain: Chain, seqs: int, context: int) -> float:
    """One `decode_batch` step of `seqs` sequences at `context` tokens each: graph replays."""
    session, backend = chain.sessions[0], chain.sessions[0].backend
    inputs, vars = batch_inputs(chain, seqs, context)
    chain.run("decode_batch", inputs, vars)  # captures the graph
    chain.run("decode_batch", inputs, vars)
    backend.sync()
    busy = Busy(backend)
    env = session._vars(vars)
    graph = session._graphs[("decode_batch",
                             *(env[v] for v in session._graph_vars["decode_batch"]))]
    replays = 50
    with busy:
        start = backend.mark()
        for _ in range(replays):
            backend.replay(graph)
        end = backend.mark()
    return backend.elapsed_ms(start, end) / replays


def decode_rows(model: dict, cfg: dict, hbm: float, defaults_only: bool = False) -> None:
    roof_ms = (weight_bytes(cfg) + kv_bytes(cfg, CONTEXT)) / (hbm * 1e12) * 1e3
    row("decode", f"roofline batch 1 (weights {weight_bytes(cfg) / 1e9:.2f} GB + KV of "
        f"{CONTEXT} tokens at {hbm:.2f} TB/s), ms", f"{roof_ms:.3f}")
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, 32000, CONTEXT)]
    out = {}
    for label, bundle, max_m, policy, pdl, runs, *join in POLICIES:
        if defaults_only and not any(f"({kind}" in label
                                     for kind in ("the default)", "persistent", "joined")):
            continue
        gemv.NARROW_ENTRY, gemv.WIDE_ENTRY, gemv.WIDE_MAX_TILES, gemv.CUBLAS_MIN_N = policy
        chain = chain_of(model[bundle], max_m, pdl, runs, *join)
        generator = Generator(chain)
        step = decode_step_s(lambda p, n: generator.generate(p, n, 512).tokens, prompt)
        ms = step * 1e3
        row("decode", f"decode batch 1, {label}: ms/token (Generator, host included), x roofline",
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
        del chain, generator
        gc.collect()
    gemv.NARROW_ENTRY, gemv.WIDE_ENTRY, gemv.WIDE_MAX_TILES, gemv.CUBLAS_MIN_N = DEFAULT_POLICY
    RESULTS["decode_ms"] = out
    RESULTS["decode_roofline_ms"] = roof_ms


DEFAULT_POLICY = (gemv.NARROW_ENTRY, gemv.WIDE_ENTRY, gemv.WIDE_MAX_TILES, gemv.CUBLAS_MIN_N)
BIG = 1 << 30
POLICIES = [  # label, bundle, GEMV max m, (narrow entry, wide entry, wide max tiles, cuBLAS min n),
    # overlapping launches (PDL), persistent runs (KERNCC_PERSIST)[, the joined decode attention:
    # KERNCC_JOIN_ATTENTION, off unless given]
    ("cuBLAS only, no PDL", "whole", 0, DEFAULT_POLICY, False, None),
    ("GEMV m<=8, no PDL (the default before this round)", "whole", 8, DEFAULT_POLICY, False,
     None),
    ("GEMV m<=8 + PDL (the default)", "whole", 8, DEFAULT_POLICY, True, None),
    ("GEMV m<=8 + PDL + the attention's split and combine as one launch (joined, opt-in)",
     "whole", 8, DEFAULT_POLICY, True, None, True),
    ("GEMV m<=8 + PDL + persistent runs (persistent, opt-in)", "whole", 8, DEFAULT_POLICY, True,
     persist.ENTRY),
    ("GEMV m<=8 + PDL + persistent runs, weights in a shared-memory ring (persistent, opt-in)",
     "whole", 8, DEFAULT_POLICY, True, persist.RING_ENTRY),
    ("cuBLAS only + PDL", "whole", 0, DEFAULT_POLICY, True, None),
    ("2 stages on 1 GPU, GEMV m<=8, no PDL", "two", 8, DEFAULT_POLICY, False, None),
    ("2 stages on 1 GPU, GEMV m<=8 + PDL (the default)", "two", 8, DEFAULT_POLICY, True, None),
    ("2 stages on 1 GPU, GEMV m<=8 + PDL + the attention as one launch (joined, opt-in)",
     "two", 8, DEFAULT_POLICY, True, None, True),
    ("2 stages on 1 GPU, GEMV m<=8 + PDL + persistent runs (persistent, opt-in)", "two", 8,
     DEFAULT_POLICY, True, persist.ENTRY),
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
                # the attention's two launches apart (not joined), so each can be left out
                with chain_of(model["whole"], 8, True, join=False) as chain:
                    Generator(chain).generate(prompt, 4, 512)  # captures the decode graph
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


def join_ab(model: dict, cfg: dict, hbm: float, rounds: int = 4) -> None:
    """The decode attention's split and combine as one launch (runtime/backends/attention.py)
    against the two launches: `policy_ab`."""
    policy_ab("join", "joined attention / two launches", "join", "joined", model, cfg, hbm,
              rounds)


def pipe_ab(model: dict, cfg: dict, hbm: float, rounds: int = 4) -> None:
    """The batched decode's split attention pipelined (runtime/backends/attention_pipe.py)
    against the split kernel: `policy_ab`. Only `decode_batch` at 17 sequences or more (of 8 kv
    heads, on 132 multiprocessors) goes out pipelined, so the batch-1 and 8-sequence rows
    compare the same kernels: controls of the noise."""
    policy_ab("pipe", "pipelined attention / one split a block", "pipe", "piped", model, cfg,
              hbm, rounds, counted=("whole",))


def fuse_ab(model: dict, cfg: dict, hbm: float, rounds: int = 2) -> None:
    """The input norm, the silu_mul and both computed in the GEMVs after them
    (runtime/backends/fuse.py) against their own launches, in turn (rotated each round): the
    batch-1 `decode` graph and `decode_batch` steps of 8 sequences x CONTEXT tokens, medians
    of `rounds`, as ms and the saving a layer against none."""
    layers = cfg["num_hidden_layers"]
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, 32000, CONTEXT)]
    variants = {"none": frozenset(), "norm": fuse.CHOICES["norm"],
                "silu": fuse.CHOICES["silu"], "both": fuse.CHOICES["1"]}
    times: dict[tuple, list[float]] = {}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % 4:] + names[:r % 4]:
            with chain_of(model["whole"], 8, True, fused=variants[name]) as chain:
                Generator(chain).generate(prompt, 4, 512)
                if variants[name] and not any(b.fused for b in chain.backends):
                    raise RuntimeError(f"fuse {name}: no launch went out fused")
                times.setdefault((name, 1), []).append(graph_step_ms(chain))
                times.setdefault((name, 8), []).append(batch_step_ms(chain, 8, CONTEXT))
            gc.collect()
    for seqs in (1, 8):
        base = statistics.median(times[("none", seqs)])
        got = {n: statistics.median(times[(n, seqs)]) for n in names}
        row("fuse", f"decode {'batch 1' if seqs == 1 else f'{seqs} sequences'}: fused none / "
            f"norm / silu / both, ms (us a layer saved)", " / ".join(
                f"{got[n]:.4f} ({(base - got[n]) / layers * 1e3:.2f})" for n in names))
    RESULTS["fuse_ms"] = {" ".join(map(str, k)): v for k, v in times.items()}


def persist_ab(model: dict, cfg: dict, hbm: float, rounds: int = 4) -> None:
    """The decode runs as persist_ws_bf16 launches (runtime/backends/persist.py: a producer
    warp's ring, tagged words, the small kernels folded) against the launches, every other
    option at its default on both sides: `policy_ab`. It takes m = 1 only (WS_MAX_M), so the
    8- and 32-sequence rows compare the same kernels: controls of the noise."""
    defaults = {"join": attention.ENABLED, "fused": fuse.ENABLED, "pipe": attention_pipe.ENABLED}
    policy_ab("persist", "persistent ws runs / launches", "runs", "persisted", model, cfg, hbm,
              rounds, values=(persist.WS_ENTRY, None), base=defaults)


def policy_ab(name: str, what_ab: str, option: str, counter: str, model: dict, cfg: dict,
              hbm: float, rounds: int = 4, counted: tuple[str, ...] = ("whole", "two"),
              values: tuple = (True, False), base: dict | None = None) -> None:
    """A chain_of option on against off, alternating: the batch-1 `decode` graph whole and in 2
    stages, and `decode_batch` steps of 8 and 32 sequences x CONTEXT tokens (graph replays),
    medians of `rounds`, as ms and the saving a layer; `counter` is the backend's count of
    the launches the option makes (it must move when on, in the bundles `counted`). The order
    flips each round, so an even count puts each side first equally often: with 3 rounds the
    same kernels on both sides read 0.8 us a layer apart at 8 sequences (session 13).
    `values`: the option's (on, off); `base`: the other options (default: all off)."""
    layers = cfg["num_hidden_layers"]
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, 32000, CONTEXT)]
    times: dict[tuple, list[float]] = {}
    base = {"join": False, "fused": False, "pipe": False} if base is None else base
    for r in range(rounds):
        for join in ((True, False) if r % 2 == 0 else (False, True)):
            for bundle in ("whole", "two"):
                options = {**base, option: values[0] if join else values[1]}
                with chain_of(model[bundle], 8, True, **options) as chain:
                    Generator(chain).generate(prompt, 4, 512)  # captures the decode graph
                    times.setdefault((join, bundle, 1), []).append(graph_step_ms(chain))
                    if bundle == "whole":
                        for seqs in (8, 32):
                            times.setdefault((join, bundle, seqs), []).append(
                                batch_step_ms(chain, seqs, CONTEXT))
                    if (join and bundle in counted
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


def lookahead_ab(model: dict, cfg: dict, hbm: float, rounds: int = 3) -> None:
    """Greedy decoding one step ahead of the host (runtime/generate.py LOOKAHEAD: the next
    step issued before this one's token is known, its token fed on the device) against one
    step at a time, alternating: ms/token through the Generator at batch 1 (host included),
    whole and in 2 stages, beside the decode graph's replay (the GPU's own step)."""
    from kerncc.runtime import generate as gen

    roof_ms = (weight_bytes(cfg) + kv_bytes(cfg, CONTEXT)) / (hbm * 1e12) * 1e3
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, 32000, CONTEXT)]
    before = gen.LOOKAHEAD
    try:
        for bundle in ("whole", "two"):
            with chain_of(model[bundle], 8, True) as chain:
                generator = Generator(chain)
                gen.LOOKAHEAD = True  # the rounds of the bundle before left it as they ended
                if generator._feeder() is None:
                    raise RuntimeError("the decode steps cannot be fed on the device")
                times: dict[bool, list[float]] = {True: [], False: []}
                for r in range(rounds):
                    for ahead in ((True, False) if r % 2 == 0 else (False, True)):
                        gen.LOOKAHEAD = ahead
                        times[ahead].append(1e3 * decode_step_s(
                            lambda p, n: generator.generate(p, n, 512).tokens, prompt))
                gms = graph_step_ms(chain)
            on, off = (statistics.median(times[k]) for k in (True, False))
            row("lookahead", f"decode batch 1, {bundle}: ms/token a step ahead / one step at "
                f"a time (x roofline); the graph's step", f"{on:.3f} ({on / roof_ms:.2f}x) / "
                f"{off:.3f} ({off / roof_ms:.2f}x); {gms:.3f}")
            RESULTS.setdefault("lookahead_ms", {})[bundle] = {"ahead": times[True],
                                                              "one at a time": times[False],
                                                              "graph": gms}
            gc.collect()
    finally:
        gen.LOOKAHEAD = before


def attention_blocks(model: dict, cfg: dict, hbm: float) -> None:
    """The batched decode's step with Z split blocks per (sequence, kv head) (the grid z of
    `attn_decode_batch`; the bits are the same for any Z): a block per split (Z = max_splits,
    the code before), 16, the default 8, and 4, at short and long contexts, one sequence too
    (what `decode`'s grid would give)."""
    from gpu_bench import kerncc

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


def graph_step_ms(chain: Chain) -> float:
    """The batch-1 `decode` step's GPU time: every stage's graph (captured by the Generator)
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


def torch_graph(model: dict, cfg: dict, hbm: float) -> None:
    """The PyTorch reference's decode step (tests/bench/torch_ref.py) at context 512, eager
    and captured in one CUDA graph (warmed up on a side stream, then replayed)."""
    import torch
    from torch_ref import TorchQwen, decode_step_ms

    roof_ms = (weight_bytes(cfg) + kv_bytes(cfg, CONTEXT)) / (hbm * 1e12) * 1e3
    ref = TorchQwen(model["dir"], "cuda")
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, 32000, CONTEXT - 1)]
    eager, replay = decode_step_ms(ref, prompt)
    row("torch", "PyTorch decode step at context 512, eager (host-bound), ms, x roofline",
        f"{eager:.3f}, {eager / roof_ms:.2f}x")
    row("torch", "PyTorch decode step at context 512, eager captured in one CUDA graph, ms, "
        "x roofline", f"{replay:.3f}, {replay / roof_ms:.2f}x")
    RESULTS["torch_graph_ms"] = replay
    RESULTS["torch_eager_ms"] = eager
    del ref
    gc.collect()
    torch.cuda.empty_cache()


def bitwise(model: dict) -> None:
    whole, two = chain_of(model["whole"], 8), chain_of(model["two"], 8)
    rng = np.random.default_rng(7)
    same = total = 0
    for n in (1, 7, 33, 65, 513):
        prompt = [int(t) for t in rng.integers(1, 32000, n)]
        for chunk in (512, 16):
            if n > 100 and chunk == 16:
                continue
            t1, l1 = (lambda r: (r.tokens, r.logits))(Generator(whole).generate(prompt, 9, chunk))
            t2, l2 = (lambda r: (r.tokens, r.logits))(Generator(two).generate(prompt, 9, chunk))
            t3, l3 = (lambda r: (r.tokens, r.logits))(Generator(whole).generate(prompt, 9, chunk))
            assert np.abs(l1).max() > 0
            total += 1
            ok = t1 == t2 == t3 and l1.tobytes() == l2.tobytes() == l3.tobytes()
            same += ok
            if not ok:
                say(f"    differs: prompt {n} chunk {chunk}: max |diff| "
                    f"{np.abs(l1 - l2).max():.3e} / rerun {np.abs(l1 - l3).max():.3e}")
    row("bitwise", "GEMV m<=8: whole vs 2 stages on 1 GPU vs whole again (prompts x chunks, "
        "9 tokens)", f"{same}/{total} identical")
    RESULTS["bitwise"] = [same, total]


def prefill_profile(chain: Chain, context: int, chunk: int) -> None:
    session, backend = chain.sessions[0], chain.sessions[0].backend
    generator = Generator(chain)
    program = generator.chunk_program
    prompt = [int(t) for t in np.random.default_rng(5).integers(1, 32000, context + chunk)]
    seq, record = Served(prompt), _Record()
    while seq.cached < context:
        generator._feed(seq, min(chunk, context - seq.cached), program, record, wait=False)
    generator._reserve(seq, context + chunk)
    inputs = generator._inputs(seq, context, context + chunk)
    vars = generator.protocol.vars(1, chunk, chunk, context + chunk)
    backend.sync()
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
    busy = Busy(backend)
    try:
        session._launchers = {n: timed(n, fn) for n, fn in originals.items()}
        for _ in range(3):
            marks.clear()
            with busy:
                session.submit(program.name, inputs, vars, outputs=False)
            backend.sync()
            run: dict[str, float] = {}
            for name, a, b in marks:
                run[name] = run.get(name, 0.0) + backend.elapsed_ms(a, b)
            for name, ms in run.items():
                totals.setdefault(name, []).append(ms)
        counts = {name: sum(1 for n, _, _ in marks if n == name) for name in totals}
    finally:
        session._launchers = originals
    best = {name: min(v) for name, v in totals.items()}
    whole = sum(best.values())
    row("prefill", f"one {chunk}-row chunk at context {context}: event sum ms", f"{whole:.3f}")
    say(f"  per op (prefill chunk {chunk} at {context}): op entry, count, ms, share")
    for name in sorted(best, key=best.get, reverse=True):
        say(f"    {name[:58]:58s} {counts[name]:5d} {best[name]:8.3f} {best[name] / whole:6.1%}")
    RESULTS.setdefault("prefill_profile", {})[f"{chunk}@{context}"] = best


def prefill_flops(cfg: dict, tokens: int) -> float:
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, nq, nk = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    per_token = 2 * ((nq + 2 * nk) * hd * h + h * nq * hd + 2 * inter * h + h * inter)
    causal = 2 * 2 * nq * hd * tokens * (tokens + 1) / 2  # QK^T and PV over the causal half
    return cfg["num_hidden_layers"] * (per_token * tokens + causal) + 2 * v * h


def mma_sync_bundle(model: dict, cfg: dict) -> Path:
    """The small model lowered with the mma.sync prefill attention (attention.cu) in place of
    the wgmma one (attention_sm90a.cu), the default before it."""
    from gpu_bench import kerncc

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
    mma.sync one, alternating, PDL on (the default) for both."""
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
    gemv.MAX_M = 8
    chain = Chain(model["whole"], backend="cuda", token_capacity=CAPACITY, graphs="off")
    for context in (0, 2048):  # the 4096-token prompt's two chunks
        prefill_profile(chain, context, 2048)


# ---------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "decode-bench")
    parser.add_argument("--layers", type=int, default=0, help="override the layer count")
    parser.add_argument("--skip", default="")
    parser.add_argument("--defaults-only", action="store_true",
                        help="decode: only the default policies (whole and 2 stages)")
    parser.add_argument("--ablate", action="store_true",
                        help="also the ablation of the decode graph (about a minute)")
    parser.add_argument("--doc", type=Path, default=None,
                        help="write the run's rows into this markdown file (docs/benchmarks.md) "
                        "between its decode_bench markers")
    parser.add_argument("--commit", default=os.environ.get("KERNCC_COMMIT", ""),
                        help="the commit the rows name (default: git's HEAD, if it answers)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(args.skip.split(","))
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "kerncc-decode-bench"
    t0 = time.perf_counter()
    try:
        with section("build small"):
            import gpu_bench

            if args.layers:
                original = gpu_bench.generate
                gpu_bench.generate = lambda d, s, **o: original(d, s, layers=args.layers, **o)
            model = build(work, "small")
        say(f"  built in {time.perf_counter() - t0:.1f} s")
        cfg = config(model)
        hbm = HBM_TBS
        if "copy" not in skip:
            with section("copy"):
                from kerncc.runtime.backends.cuda import CudaBackend
                hbm = copy_ceiling(CudaBackend(0))
        if "gemm" not in skip:
            with section("gemm"):
                gemm_bench(cfg)
        if "profile" not in skip:
            for label, max_m in (("cuBLAS", 0), ("GEMV m<=8", 8)):
                with section(f"profile {label}"):
                    decode_profile(chain_of(model["whole"], max_m, False), label)
                gc.collect()
            with section("profile 32 sequences"):
                decode_profile(chain_of(model["whole"], 8, False), "32 sequences", seqs=32)
            gc.collect()
        if args.ablate:
            with section("ablate", limit=400):
                ablate(model, cfg)
        if "decode" not in skip:
            with section("decode", limit=400):
                decode_rows(model, cfg, hbm, args.defaults_only)
        if "fuse" not in skip:
            with section("fuse", limit=300):
                fuse_ab(model, cfg, hbm)
        if "join" not in skip:
            with section("join", limit=300):
                join_ab(model, cfg, hbm)
        if "persist" not in skip:
            with section("persist", limit=300):
                persist_ab(model, cfg, hbm)
        if "pipe" not in skip:
            with section("pipe", limit=300):
                pipe_ab(model, cfg, hbm)
        if "lookahead" not in skip:
            with section("lookahead", limit=300):
                lookahead_ab(model, cfg, hbm)
        if "attention" not in skip:
            with section("attention"):
                attention_blocks(model, cfg, hbm)
        if "torch" not in skip:
            with section("torch"):
                torch_graph(model, cfg, hbm)
        if "bitwise" not in skip:
            with section("bitwise"):
                bitwise(model)
        gc.collect()
        if "prefill" not in skip:
            with section("prefill"):
                prefill_rows(model, cfg)
    finally:
        (out / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str) + "\n")
        say(f"\ntotal {time.perf_counter() - t0:.1f} s")
        say("\n| section | measure | value |\n| --- | --- | --- |")
        for sec, what, value in TABLE:
            say(f"| {sec} | {what} | {value} |")
        if args.doc is not None:
            try:
                write_rows(args.doc, "decode_bench", TABLE, doc_header(args.commit),
                           anchor=DOC_ANCHOR)
                say(f"rows written into {args.doc}")
            except DocError as err:
                say(f"decode_bench: --doc: {err}")
                return 1
    return 0


DOC_ANCHOR = "### Where a decode step's time goes"  # the rows go before it the first time
UNSHOWN = ("--doc", "--commit", "--out")  # options of the run, not of what it measures


def shown_command(argv: list[str]) -> str:
    """The command that measures the same again: these arguments without UNSHOWN's options
    (as `--doc X` or `--doc=X`)."""
    shown, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in UNSHOWN:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in UNSHOWN)):
            shown.append(arg)
    return " ".join(["python tests/bench/decode_bench.py", *shown])


def doc_header(commit: str) -> str:
    """The line above the rows: how to get them again, from which commit, on what, when."""
    import subprocess

    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = "an unknown commit"
    try:
        from cuda.core import Device

        device = Device(0).name
    except Exception:  # noqa: BLE001 - the header names what it can
        device = "an unknown device"
    command = shown_command(sys.argv[1:])
    return (f"The latest rows of `{command}`, at {commit} on {device}, "
            f"{time.strftime('%Y-%m-%d')} (each x is the ratio to the roofline its row names):")


if __name__ == "__main__":
    sys.exit(main())
