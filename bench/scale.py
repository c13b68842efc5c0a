"""An 8B model on one GPU (issue 43): import, lower, startup and batch-1 decode, bf16 and FP8,
side by side in one run.

    python bench/scale.py [--size 8b|mid|tiny] [--backend cuda|cpu] [--out DIR] [--steps N]
                          [--prompt N] [--work DIR]

`--size 8b` (the default, for a GPU machine with transformers and torch) builds a checkpoint in
Qwen3-8B's exact shapes (36 layers, hidden 4096, 32/8 heads of 128, intermediate 12288, vocab
151936, untied head) with random bf16 weights, written by transformers' `save_pretrained` in
shards; `--size tiny` writes kerncc's tiny example instead (numpy, seconds) and runs on the
cpu backend, so the script itself is tested in CI (tests/test_bench_scale.py); `--size mid`
the example at 0.23 GB, on the cpu backend too (a load worth profiling). Then, timing
each step:
  import   `kerncc import` of the folder as bf16, and with `--quantize fp8` (headers only);
  lower    each manifest whole (`emit`) and cut in two (`cut{stages=2},slice-derive,emit`);
  memory   the plan's peak and resident bytes per stage (kerncc.runtime.footprint);
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
The table is printed last; --out DIR also gets results.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# Qwen3-8B's config.json, less what transformers fills in itself
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645,
}
SIZES = {  # import limits, token capacity of a chain, prompt and steps by default
    "8b": {"max_tokens": 2048, "max_seqs": 8, "max_context": 8192, "capacity": 4096,
           "prompt": 512, "steps": 64},
    "tiny": {"max_tokens": 64, "max_seqs": 4, "max_context": 256, "capacity": 256,
             "prompt": 16, "steps": 4},
    "mid": {"max_tokens": 256, "max_seqs": 4, "max_context": 512, "capacity": 512,
            "prompt": 16, "steps": 4},
}
# --size mid: the example's shapes at 0.23 GB (4 layers, hidden 1024, vocab 32000), enough
# bytes for a profile of loading on the cpu backend
MID = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 4, "head_dim": 128,
       "intermediate": 3072, "vocab": 32000}
CUT = "cut{stages=2},slice-derive,emit"
RESULTS: dict[str, Any] = {}
ROWS: list[tuple[str, str, str]] = []


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def row(name: str, what: str, value: str) -> None:
    ROWS.append((name, what, value))
    say(f"  {name}: {what} = {value}")


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
    prompt = [(i * 7919) % 250 + 3 for i in range(prompt_len)]  # ids every vocabulary has
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


# ---------------------------------------------------------------------------------- main


def table() -> str:
    widths = [max(len(r[c]) for r in ROWS) for c in range(3)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip()
                     for r in ROWS)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--size", choices=sorted(SIZES), default="8b",
                   help="8b: Qwen3-8B's shapes by transformers (a GPU machine); tiny: the tiny "
                        "example on the cpu backend, in seconds; mid: the example at 0.23 GB "
                        "(a load worth profiling on the cpu backend)")
    p.add_argument("--backend", choices=("cuda", "cpu"),
                   help="default: cuda for 8b, cpu for tiny")
    p.add_argument("--out", type=Path, help="write results.json here")
    p.add_argument("--work", type=Path, help="checkpoint and bundles here (default: a "
                   "temporary folder, removed at the end)")
    p.add_argument("--steps", type=int, help="decode steps timed (default: the size's)")
    p.add_argument("--prompt", type=int, help="prompt tokens before decode (default: the "
                   "size's)")
    args = p.parse_args(argv)
    for name in ("steps", "prompt"):
        value = getattr(args, name)
        if value is not None and value < 2:
            p.error(f"--{name} must be at least 2")
    return args


def run(args: argparse.Namespace, work: Path) -> None:
    size = SIZES[args.size]
    backend = args.backend or ("cuda" if args.size == "8b" else "cpu")
    limits = {k: size[k] for k in ("max_tokens", "max_seqs", "max_context")}
    folder = work / "checkpoint"
    row("checkpoint", f"{args.size} written, s", f"{checkpoint(args.size, folder):.1f}")
    bundles = import_and_lower(folder, work, limits)
    read = memory(bundles, size["capacity"])
    bandwidth = copy_bandwidth(backend)
    RESULTS["copy_bytes_per_s"] = bandwidth
    row("copy", f"{backend} copy bandwidth, GB/s", f"{bandwidth / 1e9:.1f}")
    decode_all(bundles, read, backend, size["capacity"], args.prompt or size["prompt"],
               args.steps or size["steps"], bandwidth)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="kerncc-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        run(args, work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(table())
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(
            {"rows": ROWS, "results": RESULTS}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
