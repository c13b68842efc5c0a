"""Process placement on GPUs (issue 21), measured side by side in one run; a table is printed last.

    python -m bench.placement [--out DIR] [--sizes tiny,small] [--skip ttft,...] [--doc FILE]

Sections (each guarded: a failing section is reported and the others still run):
  correctness  the 2-stage bundle as two stage processes against the in-process chain on the
               same GPUs: bitwise equal tokens and logits. On one GPU both stage processes
               share it (host link); on two, NCCL links, and the host link too.
  ttft         TTFT of an 8192-token prompt (small model, chunk 512): the whole model on one
               GPU, the in-process chain on 2 GPUs, 2 stage processes on 2 GPUs (NCCL); with
               CUDA graphs (auto) and kernel by kernel (graphs=marked), where one host thread
               per GPU should matter most. Goal: process placement >= 1.85x the whole model.
               On one GPU: 2 stage processes sharing it against the in-process chain (a
               sanity figure, not a speedup).
  bandwidth    NCCL send/recv between two processes against the in-process peer copy
               (CudaBackend.send), 1 MiB .. 256 MiB, GB/s (two GPUs).
  serve        tokens/s at concurrency 32 (kerncc.serve.engine.serve_prompts, when it exists):
               in-process chain against 2 stage processes, on 2 GPUs (1 GPU: shared).
Everything is written under --out (default $OUT or ./placement-bench): results.json; --doc
docs/benchmarks.md also writes the table there, between the file's `placement` markers.
Needs the cuda extra; NCCL needs nccl4py (pip install 'kerncc[nccl]').
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

import numpy as np

from bench.gpu import build, device_count, device_name, greedy, ttft
from bench.report import Report, say
from kerncc.runtime import Chain
from kerncc.runtime.placement.process import ProcessChain
from kerncc.runtime.placement.transport import nccl_missing

REPORT = Report("placement")
RESULTS = REPORT.results
row = REPORT.row

MIB = 1 << 20
BACKEND = ["cuda"]  # --backend cpu smoke-tests the script's logic without a GPU


def stage_devices(gpus: int) -> list[int] | None:
    if BACKEND[0] == "cpu":
        return None
    return [0, 1] if gpus >= 2 else [0]


def transports(gpus: int) -> list[str]:
    if gpus < 2 or BACKEND[0] == "cpu":
        return ["host"]
    return ["host", "nccl"] if nccl_missing() is None else ["host"]


# ---------------------------------------------------------------------------------- sections


def correctness(model: dict, size: str, gpus: int) -> None:
    devices = stage_devices(gpus)
    thread = Chain(model["two"], backend=BACKEND[0], devices=devices)
    rng = np.random.default_rng(3)
    lengths = (1, 17, 65, 200) if size == "tiny" else (1, 65, 700)
    prompts = [[int(t) for t in rng.integers(1, 200, n)] for n in lengths]
    for transport in transports(gpus):
        with ProcessChain(model["two"], backend=BACKEND[0], devices=devices,
                          transport=transport) as chain:
            same = 0
            for prompt in prompts:
                for chunk in (16, 64):
                    want_tokens, want_logits = greedy(thread, prompt, 8, chunk)
                    got_tokens, got_logits = greedy(chain, prompt, 8, chunk)
                    same += got_tokens == want_tokens and np.array_equal(
                        got_logits.view(np.uint8), want_logits.view(np.uint8))
            total = len(prompts) * 2
            row("correctness", f"{size}: 2 stage processes on GPUs {devices} ({transport}) vs "
                "in-process chain, bitwise equal runs", f"{same}/{total}")
            RESULTS.setdefault("correctness", {})[f"{size}-{transport}"] = [same, total]


def ttft_section(model: dict, gpus: int) -> None:
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(1, 32000, 8192)]
    devices = stage_devices(gpus)
    best = "nccl" if "nccl" in transports(gpus) else "host"
    for graphs in ("auto", "marked"):
        whole = ttft(Chain(model["whole"], backend=BACKEND[0], graphs=graphs), prompt, 512)
        thread = ttft(Chain(model["two"], backend=BACKEND[0], devices=devices, graphs=graphs),
                      prompt, 512)
        with ProcessChain(model["two"], backend=BACKEND[0], devices=devices, graphs=graphs,
                          transport=best) as chain:
            process = ttft(chain, prompt, 512)
        where = f"2 GPUs ({best})" if gpus >= 2 else "1 shared GPU (host)"
        row("ttft", f"TTFT 8192 chunk 512 graphs={graphs}: whole 1 GPU / thread chain / "
            f"process chain on {where}, ms",
            f"{whole * 1e3:.1f} / {thread * 1e3:.1f} / {process * 1e3:.1f}")
        row("ttft", f"graphs={graphs}: process vs whole (goal >= 1.85 on 2 GPUs) / thread vs "
            "whole", f"{whole / process:.3f} / {whole / thread:.3f}")
        RESULTS.setdefault("ttft", {})[graphs] = {"whole_ms": whole * 1e3,
                                                  "thread_ms": thread * 1e3,
                                                  "process_ms": process * 1e3,
                                                  "transport": best, "gpus": gpus}


def _nccl_rank(rank: int, uid: bytes, sizes: list[int], repeats: int, conn) -> None:
    """One end of the bandwidth test: rank 0 sends, rank 1 receives, on GPU `rank`."""
    from nccl import core as nccl

    from kerncc.runtime.backends.cuda import CudaBackend
    from kerncc.runtime.placement.transport import _DeviceBytes

    backend = CudaBackend(rank)
    comm = nccl.Communicator.init(nranks=2, rank=rank, unique_id=nccl.UniqueId.from_bytes(uid))
    buffer = backend.allocate(max(sizes))
    stream = int(backend.stream_handle)
    times = []
    for nbytes in sizes:
        view = _DeviceBytes(buffer.ptr, nbytes)
        for warm in (True, False):
            conn.send("go")
            conn.recv()  # both ranks start together
            t0 = time.perf_counter()
            for _ in range(1 if warm else repeats):
                if rank == 0:
                    comm.send(view, 1, stream=stream)
                else:
                    comm.recv(view, 0, stream=stream)
            backend.sync()
            if not warm:
                times.append(time.perf_counter() - t0)
    conn.send(times)


def bandwidth(gpus: int) -> None:
    if gpus < 2:
        row("bandwidth", "skipped", "one GPU")
        return
    sizes, repeats = [MIB, 16 * MIB, 64 * MIB, 256 * MIB], 20
    peer = _peer_copy_times(sizes, repeats)
    missing = nccl_missing()
    if missing:
        row("bandwidth", "NCCL skipped", missing)
        nccl = [None] * len(sizes)
    else:
        nccl = _nccl_times(sizes, repeats)
    for nbytes, p, n in zip(sizes, peer, nccl):
        text = f"peer {nbytes * repeats / p / 1e9:.1f}"
        if n is not None:
            text += f" / NCCL {nbytes * repeats / n / 1e9:.1f} ({p / n:.2f}x)"
        row("bandwidth", f"{nbytes // MIB} MiB, GB/s", text)
        RESULTS.setdefault("bandwidth", {})[nbytes] = {"peer_s": p, "nccl_s": n,
                                                       "repeats": repeats}


def _peer_copy_times(sizes: list[int], repeats: int) -> list[float]:
    from kerncc.runtime.backends.cuda import CudaBackend

    a, b = CudaBackend(0), CudaBackend(1)
    a.enable_peer(b)
    b.enable_peer(a)
    source, target = a.allocate(max(sizes)), b.allocate(max(sizes))
    times = []
    for nbytes in sizes:
        a.send(source, b, target, nbytes)  # warm-up (the landing buffer)
        a.sync()
        b.sync()
        t0 = time.perf_counter()
        for _ in range(repeats):
            a.send(source, b, target, nbytes)
        a.sync()
        b.sync()
        times.append(time.perf_counter() - t0)
    return times


def _nccl_times(sizes: list[int], repeats: int) -> list[float]:
    from nccl import core as nccl

    context = multiprocessing.get_context("spawn")
    uid = nccl.get_unique_id().as_bytes
    ends = [context.Pipe() for _ in range(2)]
    procs = [context.Process(target=_nccl_rank, args=(r, uid, sizes, repeats, ends[r][1]),
                             daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for _ in range(2 * len(sizes)):  # a barrier per timed loop
            for ours, _theirs in ends:
                if not ours.poll(120):
                    raise RuntimeError("an NCCL rank did not answer in 120 s")
                ours.recv()
            for ours, _theirs in ends:
                ours.send("go")
        results = []
        for ours, _theirs in ends:
            if not ours.poll(120):
                raise RuntimeError("an NCCL rank did not answer in 120 s")
            results.append(ours.recv())
        return [max(s, r) for s, r in zip(*results)]
    finally:
        for p in procs:
            p.join(10)
            if p.exitcode is None:
                p.kill()


def serve_section(model: dict, gpus: int) -> None:
    try:
        from kerncc.serve.engine import serve_prompts
    except ImportError:
        row("serve", "skipped", "kerncc.serve does not exist in this checkout")
        return
    rng = np.random.default_rng(9)
    prompts = [[int(t) for t in rng.integers(1, 32000, int(n))]
               for n in rng.integers(64, 1024, 32)]
    max_new, devices = 64, stage_devices(gpus)
    best = "nccl" if "nccl" in transports(gpus) else "host"
    rates = {}
    for name in ("thread", "process"):
        runner = Chain(model["two"], backend=BACKEND[0], devices=devices) if name == "thread" \
            else ProcessChain(model["two"], backend=BACKEND[0], devices=devices, transport=best)
        try:
            serve_prompts(runner, prompts[:4], 4)  # warm-up (graph capture)
            t0 = time.perf_counter()
            requests, _ = serve_prompts(runner, prompts, max_new)
            took = time.perf_counter() - t0
        finally:
            if name == "process":
                runner.close()
        rates[name] = sum(len(r.generated) for r in requests) / took
    row("serve", f"tokens/s at concurrency 32 on GPUs {devices}: thread chain / 2 stage "
        f"processes ({best})", f"{rates['thread']:.0f} / {rates['process']:.0f} "
        f"({rates['process'] / rates['thread']:.2f}x)")
    RESULTS["serve"] = rates


# ---------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.placement",
                                     description=__doc__.splitlines()[0])
    REPORT.add_options(parser)
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--skip", default="", help="sections to skip, comma-separated")
    parser.add_argument("--backend", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke test of the script itself (no GPU figures)")
    args = parser.parse_args(argv)
    BACKEND[0] = args.backend
    skip = set(args.skip.split(","))
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "kerncc-placement-bench"
    gpus = device_count() if args.backend == "cuda" else 0
    say(f"{gpus} GPU(s); nccl4py: {nccl_missing() or 'yes'}")
    RESULTS["gpus"] = gpus
    models = {}
    for size in args.sizes.split(","):
        with REPORT.section(f"build {size}"):
            models[size] = build(work, size)
    try:
        for size, model in models.items():
            if "correctness" not in skip:
                with REPORT.section(f"correctness {size}"):
                    correctness(model, size, gpus)
        small = models.get("small")
        if small is not None and "ttft" not in skip:
            with REPORT.section("ttft"):
                ttft_section(small, gpus)
        if "bandwidth" not in skip:
            with REPORT.section("bandwidth"):
                bandwidth(gpus)
        if small is not None and "serve" not in skip:
            with REPORT.section("serve"):
                serve_section(small, gpus)
    finally:
        status = REPORT.finish(args, device_name() if args.backend == "cuda" else "the cpu", argv)
    return status


if __name__ == "__main__":
    sys.exit(main())
