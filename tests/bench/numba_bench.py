"""Numba-CUDA twins against their CUDA C kernels, timed side by side in one run (GPU).

    python tests/bench/numba_bench.py [--iters 200]

For each pair (silu_mul_bf16 / silu_mul_bf16_nb, embedding_gather_bf16 /
embedding_gather_bf16_nb) at the small example's shapes (decode: 1 row, prefill: 512 rows),
the two alternate in rounds, each round a CUDA graph of `iters` back-to-back launches timed
with CUDA events (kernel time, not Python's launch rate); the medians and the ratio
numba / CUDA C are printed (goal: <= 1.10).
Then sample_f32 at vocab 32000 and 151936 for greedy, temperature, top-k, top-p (one row and
eight rows per launch), for scale against a decode step.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_elementwise_cuda import Gpu, bf16_bits  # noqa: E402

from kerncc.runtime.sampling import SamplingParams, pack  # noqa: E402

ROUNDS = 7


def i32(v: int) -> ctypes.c_int32:
    return ctypes.c_int32(v)


def _launch(gpu: Gpu, stream, module: str, entry: str, grid: int, block: int, args: list,
            keep: list) -> None:
    slots = [a if isinstance(a, ctypes._SimpleCData) else ctypes.c_uint64(a) for a in args]
    table = (ctypes.c_void_p * len(slots))(*[ctypes.addressof(s) for s in slots])
    keep += [slots, table]  # the driver reads the parameters at capture time; keep them anyway
    gpu.check(gpu.cu.cuLaunchKernel(gpu.function(module, entry), grid, 1, 1, block, 1, 1, 0,
                                    stream, ctypes.addressof(table), 0))


def timed(gpu: Gpu, module: str, entry: str, grid: int, block: int, args: list, iters: int
          ) -> float:
    """Microseconds per launch: a CUDA graph of `iters` back-to-back launches, replayed and
    timed with CUDA events (so the kernels' time, not Python's launch rate, is measured)."""
    cu = gpu.cu
    stream = gpu.check(cu.cuStreamCreate(1))  # non-blocking: capturable
    keep: list = []
    _launch(gpu, stream, module, entry, grid, block, args, keep)  # warm (module load)
    gpu.check(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
    for _ in range(iters):
        _launch(gpu, stream, module, entry, grid, block, args, keep)
    graph = gpu.check(cu.cuStreamEndCapture(stream))
    exe = gpu.check(cu.cuGraphInstantiate(graph, 0))
    gpu.check(cu.cuGraphLaunch(exe, stream))  # warm
    start, end = (gpu.check(cu.cuEventCreate(0)) for _ in range(2))
    gpu.check(cu.cuEventRecord(start, stream))
    gpu.check(cu.cuGraphLaunch(exe, stream))
    gpu.check(cu.cuEventRecord(end, stream))
    gpu.check(cu.cuEventSynchronize(end))
    ms = gpu.check(cu.cuEventElapsedTime(start, end))
    gpu.check(cu.cuGraphExecDestroy(exe))
    gpu.check(cu.cuGraphDestroy(graph))
    gpu.check(cu.cuStreamDestroy(stream))
    return ms * 1e3 / iters


def pair(gpu: Gpu, label: str, c: tuple, nb: tuple, grid: int, block: int, args: list,
         iters: int) -> None:
    times = {c[1]: [], nb[1]: []}
    for _ in range(ROUNDS):
        for module, entry in (c, nb):
            times[entry].append(timed(gpu, module, entry, grid, block, args, iters))
    tc, tn = (float(np.median(times[e])) for e in (c[1], nb[1]))
    print(f"{label:34s} cuda-c {tc:8.2f} us   numba {tn:8.2f} us   numba/cuda-c {tn / tc:5.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    iters = parser.parse_args().iters
    gpu = Gpu()
    rng = np.random.default_rng(0)
    inter, block, hidden, vocab = 6144, 128, 2048, 32000
    for rows in (1, 512, 2048):
        gate_up = gpu.upload(bf16_bits(rng.standard_normal((rows, 2 * inter)).astype(np.float32)))
        act = gpu.upload(np.zeros(rows * inter, np.uint16))
        grid = -(-rows * inter // 8 // 256)
        pair(gpu, f"silu_mul rows={rows} inter={inter}", ("activation", "silu_mul_bf16"),
             ("activation_nb", "silu_mul_bf16_nb"), grid, 256,
             [gate_up, act, i32(rows), i32(inter), i32(block)], iters)
    table = gpu.upload(bf16_bits(rng.standard_normal((vocab, hidden)).astype(np.float32)))
    for rows in (1, 512, 2048):
        ids = gpu.upload(rng.integers(0, vocab, rows).astype(np.int32))
        out = gpu.upload(np.zeros(rows * hidden, np.uint16))
        pair(gpu, f"embedding rows={rows} hidden={hidden}", ("embed", "embedding_gather_bf16"),
             ("embed_nb", "embedding_gather_bf16_nb"), rows, 128,
             [ids, table, out, i32(rows), i32(hidden)], iters)
    for v in (32000, 151936):
        logits = gpu.upload((rng.standard_normal((8, v)) * 3).astype(np.float32))
        tokens = gpu.upload(np.zeros(8, np.int32))
        for name, p in (("greedy", SamplingParams()), ("T=0.8", SamplingParams(0.8, seed=1)),
                        ("T=0.8 top-k 50", SamplingParams(0.8, top_k=50, seed=1)),
                        ("T=0.8 top-p 0.9", SamplingParams(0.8, top_p=0.9, seed=1)),
                        ("T=0.8 k50 p0.9", SamplingParams(0.8, 50, 0.9, seed=1))):
            for rows in (1, 8):
                words = gpu.upload(pack(list(range(rows)), [p] * rows,
                                        [(r, 0) for r in range(rows)], v))
                us = timed(gpu, "sampling_nb", "sample_f32", rows, 1024,
                           [logits, words, tokens, i32(rows), i32(v), i32(v)], 50)
                print(f"sample_f32 vocab={v:6d} {name:16s} rows={rows}: {us:8.2f} us")
        if v == 32000:
            us = timed(gpu, "sampling", "argmax_f32", 8, 256, [logits, tokens, i32(8), i32(v)], 50)
            print(f"argmax_f32 vocab={v:6d} rows=8 (today's greedy op): {us:8.2f} us")
    gpu.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
