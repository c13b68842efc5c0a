"""What the GPU benches share: the example models they build, a busy stream for event timings,
wall-clock timers of decode steps and TTFT, the one greedy loop they drive a chain with, the
batched decode step timed by graph replays, and the FLOPs of a prefill.

Nothing here runs at import: `python -m bench.decode --help` works on a machine without a GPU.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kerncc.cli.main import main as kerncc
from kerncc.example import generate

SMALL_CONTEXT = 8448  # 8192-token prompts plus decode steps; a multiple of the 16-token page


def build(root: Path, size: str, layers: int = 0, max_seqs: int = 0) -> dict:
    """Generate the example model (`max_seqs`: sequences a call takes, 0: the size's) and
    lower it whole and cut at the middle layer."""
    model_dir = root / (f"{size}-seqs{max_seqs}" if max_seqs else size)
    overrides = {"max_context": SMALL_CONTEXT} if size == "small" else {}
    if layers:
        overrides["layers"] = layers
    if max_seqs:
        overrides["max_seqs"] = max_seqs
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


def greedy(chain, prompt: list[int], max_new: int, chunk: int | None = None
           ) -> tuple[list[int], np.ndarray]:
    """Greedy decoding of one prompt on `chain` as `kerncc run` serves it: (tokens, every
    call's last-row logits). The benches' one use of the engine for a lone prompt, so a change
    of that API is made here."""
    from kerncc.serve.engine import serve_prompts

    (request,), _ = serve_prompts(chain, [prompt], max_new, chunk, logits=True, runs=True)
    rows = [row for _, _, row in request.runs if row is not None]
    return request.generated, np.stack(rows) if rows else None


def device_count() -> int:
    from cuda.core import Device

    return len(Device.get_all_devices())


def device_name() -> str:
    """The first GPU's name, for the --doc header."""
    try:
        from cuda.core import Device

        return Device(0).name
    except Exception:  # noqa: BLE001 - the header names what it can
        return "an unknown device"


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


def timed(run: Callable[[], object], repeats: int = 3) -> float:
    """The median wall time of `repeats` runs, in seconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_step_s(generate_fn: Callable[[list[int], int], object], prompt: list[int],
                  steps: int = 32) -> float:
    """Seconds per decode step: generating steps+1 tokens minus generating 1, over steps."""
    generate_fn(prompt, steps + 1)  # warm-up (graph capture, allocator, heuristics)
    long = timed(lambda: generate_fn(prompt, steps + 1))
    short = timed(lambda: generate_fn(prompt, 1))
    return (long - short) / steps


def ttft_fn(run: Callable[[], object], repeats: int = 3) -> float:
    run()  # warm-up (the graphs of the chunk sizes the prompt uses)
    return timed(run, repeats)


def ttft(chain, prompt: list[int], chunk: int) -> float:
    """Seconds to the first token of `prompt` at prefill chunks of `chunk` (median of 3)."""
    return ttft_fn(lambda: greedy(chain, prompt, 1, chunk))


def replay_ms(busy, graph, replays: int) -> float:
    """A captured graph's time a replay, `replays` back to back behind `busy`'s stream."""
    backend = busy.backend
    with busy:
        start = backend.mark()
        for _ in range(replays):
            backend.replay(graph)
        end = backend.mark()
    return backend.elapsed_ms(start, end) / replays


def batch_inputs(chain, seqs: int, context: int, vocab: int = 32000) -> tuple[dict, dict]:
    """`decode_batch`'s inputs and vars for `seqs` sequences at `context` tokens each, sequence
    s on pages [s * pages, (s + 1) * pages) of 16 tokens, tokens drawn from [1, vocab)."""
    pages = -(-context // 16)
    table_width = chain.sessions[0].manifest.buffers["block_table"].shape[1]
    block_table = np.zeros((seqs, table_width), np.int32)
    for s in range(seqs):
        block_table[s, :pages] = s * pages + np.arange(pages)
    rng = np.random.default_rng(seqs)
    inputs = {
        "token_ids": rng.integers(1, vocab, seqs).astype(np.int32),
        "positions": np.full(seqs, context - 1, np.int32),
        "slot_mapping": np.array([s * pages * 16 + context - 1 for s in range(seqs)], np.int32),
        "seq_lens": np.full(seqs, context, np.int32),
        "block_table": block_table,
    }
    return inputs, {"seqs": seqs, "tokens": seqs}


def batch_step_ms(chain, seqs: int, context: int, vocab: int = 32000, replays: int = 50
                  ) -> float:
    """One `decode_batch` step of `seqs` sequences at `context` tokens each: `replays` graph
    replays behind a busy stream (the GPU's time); on a backend without graphs (cpu), the
    median wall time of 3 runs (host included)."""
    session, backend = chain.sessions[0], chain.sessions[0].backend
    inputs, vars = batch_inputs(chain, seqs, context, vocab)
    chain.run("decode_batch", inputs, vars)  # captures the graph
    chain.run("decode_batch", inputs, vars)
    backend.sync()
    if session.graphs == "off":
        return timed(lambda: chain.run("decode_batch", inputs, vars)) * 1e3
    env = session._vars(vars)
    graph = session._graphs[("decode_batch",
                             *(env[v] for v in session._graph_vars["decode_batch"]))]
    return replay_ms(Busy(backend), graph, replays)


def prefill_flops(cfg: dict, tokens: int) -> float:
    """The FLOPs of a `tokens`-token prefill of the model of `cfg` (a Hugging Face
    config.json): 2 x the linears' parameters a token, causal attention (QK^T and PV over the
    lower triangle) and the last row's lm_head."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, nq, nk = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    per_token = 2 * ((nq + 2 * nk) * hd * h + h * nq * hd + 2 * inter * h + h * inter)
    causal = 2 * 2 * nq * hd * tokens * (tokens + 1) / 2  # QK^T and PV over the causal half
    return cfg["num_hidden_layers"] * (per_token * tokens + causal) + 2 * v * h


def torch_ms(run, reps: int) -> float:
    """GPU ms of `run()`, `reps` back to back between two events (after 3 warm-ups)."""
    import torch

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        run()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps
