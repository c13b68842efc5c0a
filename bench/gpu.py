"""What the GPU benches share: the example models they build, a busy stream for event timings,
wall-clock timers of decode steps and TTFT, and the one greedy loop they drive a chain with.

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


def build(root: Path, size: str, layers: int = 0) -> dict:
    """Generate the example model and lower it whole and cut at the middle layer."""
    model_dir = root / size
    overrides = {"max_context": SMALL_CONTEXT} if size == "small" else {}
    if layers:
        overrides["layers"] = layers
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
