"""The batch-invariant decode GEMMs against cuBLAS, per weight shape and rows, on a GPU.

    python -m bench.gemv [--every] [--out DIR] [--doc docs/benchmarks.md]

For the `small` example's and an 8B model's (Qwen3-8B) weight shapes, at m = 1, 8, 16, 32, 48,
64, 96 and 128 rows (the example's decode steps take up to 128): the path the invariant policy
gives a decode site (runtime/backends/gemv.py: the GEMV entry `invariant_entry` picks, or where
`takes_lt` says so the pinned split-free cuBLASLt algorithms), and on a row of their own the
pinned algorithms whatever the width, against torch.matmul (cuBLAS, free to pick its kernel by
m), each timed as 24 launches over four copies of W (more than L2 holds) in one CUDA graph, best
of five replays; and whether the entry's rows equal the same rows launched one at a time, bit
for bit (what makes a sequence's logits independent of its batch). `--every` also times every
entry of the warp count the policy fixes for the shape (what `invariant_entry` is chosen from:
the `_smem` entries, which stage A through shared memory, among the 8-warp ones). Needs torch
with CUDA.
"""

from __future__ import annotations

import argparse
import sys

from bench.report import Report

REPORT = Report("gemv")
SHAPES = {"small qkv": (4096, 2048), "small o": (2048, 2048), "small gate_up": (12288, 2048),
          "small down": (2048, 6144), "small lm_head": (32000, 2048),
          "8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (24576, 4096),
          "8b down": (4096, 12288), "8b lm_head": (151936, 4096)}
ROWS = (1, 8, 16, 32, 48, 64, 96, 128)
COPIES, REPEATS = 4, 24


def graph_us(torch, stream, launch) -> float:
    """Microseconds a launch, from REPEATS launches in one graph (launch(i) uses W copy i)."""
    with torch.cuda.stream(stream):
        launch(0)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(REPEATS):
                launch(i)
        graph.replay()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record(stream)
            graph.replay()
            end.record(stream)
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e3 / REPEATS)
    return best


def measure(torch, site, gemv, label: str, n: int, k: int, every: bool) -> None:
    from cuda.bindings import driver as cu

    stream = torch.cuda.Stream()
    handle = cu.CUstream(stream.cuda_stream)
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
          for _ in range(COPIES)]
    a = torch.randn(max(ROWS), k, device="cuda", dtype=torch.bfloat16, generator=gen)
    c = torch.empty(max(ROWS), n, device="cuda", dtype=torch.bfloat16)
    alone = torch.empty_like(c)
    torch.cuda.synchronize()  # the operands were made on the default stream
    with torch.cuda.stream(stream):
        for r in range(max(ROWS)):
            site(a[r].data_ptr(), ws[0].data_ptr(), alone[r].data_ptr(), 1, n, k, handle)
    for m in ROWS:
        with torch.cuda.stream(stream):
            site(a.data_ptr(), ws[0].data_ptr(), c.data_ptr(), m, n, k, handle)
        torch.cuda.synchronize()
        same = torch.equal(c[:m], alone[:m])
        ours = graph_us(torch, stream, lambda i: site(
            a.data_ptr(), ws[i % COPIES].data_ptr(), c.data_ptr(), m, n, k, handle))
        theirs = graph_us(torch, stream, lambda i: torch.matmul(a[:m], ws[i % COPIES].T,
                                                                out=c[:m]))
        entry = gemv.invariant_entry(m, n).removeprefix("gemv_bf16_tn_")
        lt = pinned_us(torch, stream, (a, ws, c, alone), m, n, k)
        if gemv.takes_lt(n, k):  # the policy's path here: the pinned split-free algorithms
            ours, entry, same = lt[0], "pinned cuBLASLt", lt[1]
        REPORT.row(label, f"m={m}: invariant ({entry}) / cuBLAS us, ratio; rows equal alone",
                   f"{ours:.1f} / {theirs:.1f}, {ours / theirs:.2f}x; "
                   f"{'bitwise' if same else 'DIFFER'}")
        REPORT.row(label, f"m={m}: pinned split-free cuBLASLt us, x cuBLAS; rows equal alone",
                   f"{lt[0]:.1f}, {lt[0] / theirs:.2f}x; {'bitwise' if lt[1] else 'DIFFER'}")
        if every:
            REPORT.row(label, f"m={m}: every entry of its warps, us (! rows differ)",
                       " ".join(every_entry(torch, stream, gemv, (a, ws, c, alone, handle),
                                            m, n, k)))


def every_entry(torch, stream, gemv, operands, m: int, n: int, k: int) -> list[str]:
    """Each entry of the warp count `invariant_entry` fixes for n, forced, timed and checked."""
    a, ws, c, alone, handle = operands
    threads = gemv.ENTRIES[gemv.invariant_entry(1, n)][0]
    cells = []
    for entry, (count, _, _) in gemv.ENTRIES.items():
        if count != threads:
            continue
        forced = _Forced(SITE[0], entry)
        with torch.cuda.stream(stream):
            forced(a.data_ptr(), ws[0].data_ptr(), c.data_ptr(), m, n, k, handle)
        torch.cuda.synchronize()
        same = torch.equal(c[:m], alone[:m])
        us = graph_us(torch, stream, lambda i: forced(
            a.data_ptr(), ws[i % COPIES].data_ptr(), c.data_ptr(), m, n, k, handle))
        cells.append(f"{entry.removeprefix('gemv_bf16_tn_')}={us:.1f}{'' if same else '!'}")
    return cells


def pinned_us(torch, stream, operands, m: int, n: int, k: int) -> tuple[float, bool]:
    """The pinned split-free cuBLASLt GEMM a decode site of (n, k) takes (largest m 128): us a
    launch, and whether its rows equal the same rows launched one at a time."""
    from kerncc.runtime.backends import cublas

    a, ws, c, _ = operands
    if not LT:
        workspace = torch.empty(cublas.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        LT.extend((cublas.Lt(workspace.data_ptr()), workspace))  # the workspace lives on
    pinned = LT[0].pinned("cublaslt_bf16_tn", n, k, max(ROWS))
    handle = int(stream.cuda_stream)
    alone = torch.empty_like(c)
    with torch.cuda.stream(stream):
        for r in range(m):
            pinned(a[r].data_ptr(), ws[0].data_ptr(), alone[r].data_ptr(), 1, handle)
        pinned(a.data_ptr(), ws[0].data_ptr(), c.data_ptr(), m, handle)
    torch.cuda.synchronize()
    same = torch.equal(c[:m], alone[:m])
    us = graph_us(torch, stream, lambda i: pinned(a.data_ptr(), ws[i % COPIES].data_ptr(),
                                                  c.data_ptr(), m, handle))
    return us, same


SITE: list = []  # the one invariant GemvSite (main)
LT: list = []  # one cuBLASLt handle, then its workspace (pinned_us)


class _Forced:
    """A GemvSite's launch with its entry forced (bench only: the policy picks per m)."""

    def __init__(self, site, entry: str) -> None:
        self.site, self.entry = site, entry

    def __call__(self, *args) -> None:
        self.site.launch(self.entry, *args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gemv",
                                     description=__doc__.splitlines()[0])
    REPORT.add_options(parser)
    parser.add_argument("--every", action="store_true",
                        help="also time every entry of the shape's warp count")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("bench.gemv: needs torch with CUDA", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("bench.gemv: no CUDA device", file=sys.stderr)
        return 1
    from kerncc.runtime.backends import gemv
    from kerncc.runtime.backends.cuda import check

    torch.zeros(1, device="cuda")  # the primary context the GEMV module loads into
    site = gemv.Gemv(check).site("cublaslt_bf16_tn", invariant=True)
    SITE.append(site)
    for label, (n, k) in SHAPES.items():
        with REPORT.section(label):
            measure(torch, site, gemv, label, n, k, args.every)
        torch.cuda.empty_cache()
    return REPORT.finish(args, torch.cuda.get_device_name(), argv)


if __name__ == "__main__":
    sys.exit(main())
