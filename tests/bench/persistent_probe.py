"""Issue 20's structural question: a decode step's chain of GEMVs as one persistent kernel
against the same GEMVs as a CUDA graph of launches (tests/bench/persistent_probe.cu, built here
with nvcc), side by side in one run.

    python tests/bench/persistent_probe.py [--layers 24] [--rows 1,8] [--out DIR]   # ~30 s

The chain is the `small` example's 24 layers x (qkv, o_proj, gate_up, down) weights, 2.4 GB,
each GEMV reading the output of the one before (the norms, rope, attention and activation
between them left out), at m = 1 and 8 rows. Rows, each the median of alternating rounds:
  today            kerncc's GEMV kernels (kernels/gemv.cu, the entries the backend picks),
                   one launch a GEMV in a CUDA graph with programmatic dependent launch
  launches w16/w8  the probe's tile loop (the same arithmetic as gemv.cu's whole-tile loop,
                   16 or 8 warps), one launch a GEMV, the same graph
  persistent       one launch for the chain, every block resident, the next tile's weights
                   loaded before the block waits for that tile's input (in registers: one
                   round of a tile; or, `chain_bulk_w16`, three rounds through shared memory
                   by bulk copies)
  unordered        the persistent kernel without the waits: its weight stream alone (results
                   wrong; the ceiling the waits are measured against)
  ws uU            persistent, a block of 16 consumer warps, a producer warp and a signaller
                   warp: the producer feeds a ring of shared memory (items of 16 rows x U KB,
                   bulk copies) and never waits for an input; the consumers stage each GEMV's
                   x in shared memory once; the signaller raises the counters, off the
                   consumers' path (`chain_ws_u{U}` in the .cu file says why each)
  ws uU tagged     the same without counters: every y word is (tag << 16) | bf16, so a reader
                   knows an element is this launch's by its tag (no fence, no counter poll)
against the HBM roofline of the chain's weight bytes. The probe's modes must give the same bits
as each other (checked and printed); today's kernels agree within bf16 rounding at m = 1.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from cuda.bindings import driver as cu

from kerncc.example.config import make_config
from kerncc.kernels import library
from kerncc.runtime.backends import gemv
from kerncc.runtime.backends.cuda import CudaBackend, check

HERE = Path(__file__).resolve().parent
HBM_TBS = 4.0  # issue 20's roofline: 2.55 GB of weights at 4.0 TB/s = 0.64 ms
GEMV_BYTES = 48  # struct Gemv: w, x, y pointers; n, k, x_stride, first_tile, pre, pad
FOLD = (1, 0, 1, 2)  # a layer's GEMVs' pre when folded: qkv and gate_up norm, down silu_mul
REPLAYS = 10
MODES = {"launch": 0, "persistent": 1, "unordered": 2, "tagged": 3}
ENTRIES = {"w16": ("chain_w16", 512), "w8": ("chain_w8", 256)}
BULK_SMEM = 3 * 16 * (4096 + 64)  # chain_bulk_w16's ring: BULK_STAGES x 16 x BULK_PITCH
WS_XPAD = 32  # chain_ws_u{U}'s x rows in shared memory are k + WS_XPAD elements apart
WS_MAX_STAGES = 16
WS_UNITS = (1, 2, 4)  # chain_ws_u{U}: items of 16 rows x U KB
TABLES = {(False, False): "chain", (False, True): "tagged", (True, False): "fold",
          (True, True): "fold tagged"}  # chain_ws's tables by (folded, tagged)
WS_THREADS = 576  # 16 consumer warps, the producer warp and the signaller warp


def chain_shapes(layers: int) -> list[tuple[int, int]]:
    c = make_config("small")
    layer = [(c.qkv_dim, c.hidden), (c.hidden, c.heads * c.head_dim),
             (2 * c.intermediate, c.hidden), (c.hidden, c.intermediate)]
    return layer * layers


class Probe:
    """The device side: modules, buffers, tables and launches of one run."""

    def __init__(self, shapes: list[tuple[int, int]], rows: int) -> None:
        self.be = CudaBackend(0)
        self.be.activate()
        self.shapes, self.rows = shapes, rows
        self.keep: list = []  # parameter blocks stay alive while graphs hold them
        self._load_modules()
        self._allocate()

    def _load_modules(self) -> None:
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        cubin = Path(tempfile.mkdtemp()) / "persistent_probe.cubin"
        subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-O3", "-I", str(library.KERNELS_DIR),
                        "-o", str(cubin), str(HERE / "persistent_probe.cu")], check=True)
        self.images = [np.frombuffer(cubin.read_bytes(), np.uint8),
                       np.frombuffer(library.cubin_path("gemv").read_bytes(), np.uint8)]
        self.probe = check(cu.cuModuleLoadData(self.images[0].ctypes.data), "load probe")
        self.gemv = check(cu.cuModuleLoadData(self.images[1].ctypes.data), "load gemv")
        device = check(cu.cuCtxGetDevice(), "cuCtxGetDevice")
        self.sms = check(cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device), "SMs")

    def fn(self, module, name: str):
        return check(cu.cuModuleGetFunction(module, name.encode()), name)

    def alloc(self, nbytes: int) -> int:
        return self.be.allocate(nbytes).ptr

    def fill(self, ptr: int, count: int, seed: int, scale: float) -> None:
        self.launch(self.fn(self.probe, "fill_bf16"), 1024, 256,
                    [ptr, ctypes.c_int64(count), ctypes.c_uint32(seed), ctypes.c_float(scale)])

    def _allocate(self) -> None:
        m_max = 8
        self.w = []
        for i, (n, k) in enumerate(self.shapes):
            self.w.append(self.alloc(n * k * 2))
            self.fill(self.w[-1], n * k, 7919 * i + 1, float(np.sqrt(3.0 / k)))
        hidden = self.shapes[0][1]
        self.x0 = self.alloc(m_max * hidden * 2)
        self.fill(self.x0, m_max * hidden, 12345, 1.0)
        self.y = [self.alloc(m_max * n * 2) for n, _ in self.shapes]
        self.done = self.be.allocate(4 * (len(self.shapes) + 1))  # + the gave-up flag
        # chain_ws mode 3: tagged y words, and its own flag, epoch and finished count (zero
        # once: the kernel keeps them between launches)
        self.ytag = [self.alloc(m_max * n * 4) for n, _ in self.shapes]
        self.ll_done = self.be.allocate(4 * (len(self.shapes) + 3))
        for ptr, (n, _) in zip(self.ytag, self.shapes):
            check(cu.cuMemsetD32Async(cu.CUdeviceptr(ptr), 0, m_max * n,
                                      self.be._launch_stream), "cuMemsetD32Async")
        check(cu.cuMemsetD32Async(cu.CUdeviceptr(self.ll_done.ptr), 0, len(self.shapes) + 3,
                                  self.be._launch_stream), "cuMemsetD32Async")
        kmax = max(k for _, k in self.shapes)
        self.gamma = self.alloc(kmax * 2)
        self.fill(self.gamma, kmax, 4242, 1.0)
        fold = [FOLD[j % 4] for j in range(len(self.shapes))]
        self.tables = {"chain": self._table(True), "each": self._table(False),
                       "tagged": self._table(True, self.ytag),
                       "fold": self._table(True, pre=fold),
                       "fold tagged": self._table(True, self.ytag, fold)}
        self.be.sync()

    def _table(self, chained: bool, y: list[int] | None = None,
               pre: list[int] | None = None) -> int:
        body, first, y = b"", 0, y or self.y
        for j, (n, k) in enumerate(self.shapes):
            x, stride = (self.x0, k) if j == 0 else (y[j - 1], self.shapes[j - 1][0])
            body += struct.pack("<QQQiiiii4x", self.w[j], x, y[j], n, k, stride,
                                first if chained else 0, pre[j] if pre else 0)
            first += n // 16
        allocation = self.be.allocate(len(body))
        self.be.upload(allocation, 0, np.frombuffer(body, np.uint8))
        return allocation.ptr

    def launch(self, f, grid: int, block: int, args: list, overlap: bool = False,
               smem: int = 0) -> None:
        slots = [a if isinstance(a, ctypes._SimpleCData) else ctypes.c_uint64(a) for a in args]
        table = (ctypes.c_void_p * len(slots))(*[ctypes.addressof(s) for s in slots])
        config = gemv.launch_config(overlap)
        config.gridDimX, config.blockDimX, config.hStream = grid, block, self.be._launch_stream
        config.sharedMemBytes = smem
        self.keep.append((slots, table, config))
        check(cu.cuLaunchKernelEx(config, f, ctypes.addressof(table), 0), "cuLaunchKernelEx")

    # ---- the variants: each issues one chain on the launch stream ---------------------------

    def today(self) -> None:
        for j, (n, k) in enumerate(self.shapes):
            entry = gemv.entry_for(self.rows, n)
            a = self.x0 if j == 0 else self.y[j - 1]
            self.launch(self.fn(self.gemv, entry), n // 16, gemv.ENTRIES[entry],
                        [a, self.w[j], self.y[j], ctypes.c_int32(self.rows), ctypes.c_int32(n),
                         ctypes.c_int32(k), ctypes.c_int32(0)], overlap=j > 0)

    def launches(self, width: str) -> None:
        name, threads = ENTRIES[width]
        for j, (n, _) in enumerate(self.shapes):
            self.launch(self.fn(self.probe, name), n // 16, threads,
                        [self.tables["each"] + GEMV_BYTES * j, ctypes.c_int32(1),
                         ctypes.c_int32(self.rows), self.done.ptr, ctypes.c_uint32(1),
                         ctypes.c_int32(MODES["launch"])], overlap=j > 0)

    def persistent(self, width: str, mode: str) -> None:
        name, threads = ENTRIES[width]
        f = self.fn(self.probe, name)
        per_sm = check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, threads, 0),
                       "occupancy")
        if per_sm < 1:
            raise RuntimeError(f"{name} does not fit a multiprocessor")
        check(cu.cuMemsetD32Async(cu.CUdeviceptr(self.done.ptr), 0, len(self.shapes) + 1,
                                  self.be._launch_stream), "cuMemsetD32Async")
        # every block resident at once, or a block could wait for one that never starts
        self.launch(f, self.sms * per_sm, threads,
                    [self.tables["chain"], ctypes.c_int32(len(self.shapes)),
                     ctypes.c_int32(self.rows), self.done.ptr, ctypes.c_uint32(1),
                     ctypes.c_int32(MODES[mode])])

    def bulk(self) -> None:
        """chain_bulk_w16: the persistent chain with its weights in a shared-memory ring."""
        f = self.fn(self.probe, "chain_bulk_w16")
        check(cu.cuFuncSetAttribute(
            f, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            BULK_SMEM), "cuFuncSetAttribute(chain_bulk_w16)")
        per_sm = check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, 512, BULK_SMEM),
                       "occupancy")
        if per_sm < 1:
            raise RuntimeError("chain_bulk_w16 does not fit a multiprocessor")
        check(cu.cuMemsetD32Async(cu.CUdeviceptr(self.done.ptr), 0, len(self.shapes) + 1,
                                  self.be._launch_stream), "cuMemsetD32Async")
        self.launch(f, self.sms * per_sm, 512,
                    [self.tables["chain"], ctypes.c_int32(len(self.shapes)),
                     ctypes.c_int32(self.rows), self.done.ptr, ctypes.c_uint32(1)],
                    smem=BULK_SMEM)

    def ws_stages(self, u: int) -> tuple[int, int]:
        """chain_ws_u{u}'s most stages beside its x rows, and the dynamic bytes they take."""
        f = self.fn(self.probe, f"chain_ws_u{u}")
        static = check(cu.cuFuncGetAttribute(
            cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, f), "static shared")
        device = check(cu.cuCtxGetDevice(), "cuCtxGetDevice")
        most = check(cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            device), "shared per block")
        kmax = max(k for _, k in self.shapes)
        x = (self.rows * (kmax + WS_XPAD) * 2 + 127) // 128 * 128
        stage = 16 * (1024 * u + 64)
        stages = min(WS_MAX_STAGES, (most - static - x) // stage)
        return stages, x + stages * stage

    def ws(self, u: int, mode: str, stages: int | None = None, fold: bool = False) -> None:
        """chain_ws_u{u}: the persistent chain, its ring fed by a producer warp of its own."""
        name = f"chain_ws_u{u}"
        most, _ = self.ws_stages(u)
        stages = most if stages is None else min(stages, most)
        kmax = max(k for _, k in self.shapes)
        smem = (self.rows * (kmax + WS_XPAD) * 2 + 127) // 128 * 128 + stages * 16 * (
            1024 * u + 64)
        f = self.fn(self.probe, name)
        check(cu.cuFuncSetAttribute(
            f, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem), f"cuFuncSetAttribute({name})")
        per_sm = check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, WS_THREADS, smem),
                       "occupancy")
        if per_sm < 1:
            raise RuntimeError(f"{name} does not fit a multiprocessor")
        tagged = mode == "tagged"
        if not tagged:
            check(cu.cuMemsetD32Async(cu.CUdeviceptr(self.done.ptr), 0, len(self.shapes) + 1,
                                      self.be._launch_stream), "cuMemsetD32Async")
        self.launch(f, self.sms * per_sm, WS_THREADS,
                    [self.tables[TABLES[fold, tagged]],
                     ctypes.c_int32(len(self.shapes)), ctypes.c_int32(self.rows),
                     (self.ll_done if tagged else self.done).ptr, ctypes.c_uint32(1),
                     ctypes.c_int32(MODES[mode]), ctypes.c_int32(stages),
                     ctypes.c_int32(kmax), self.gamma], smem=smem)

    def gave_up(self) -> bool:
        """Whether a persistent block stopped waiting (a dependency bug, not a slow run)."""
        self.be.sync()
        flags = [self.be.download(done, 4 * len(self.shapes), 4).view(np.uint32)[0]
                 for done in (self.done, self.ll_done)]
        return bool(any(flags))

    def outputs(self, tagged: bool = False) -> list[np.ndarray]:
        """The chain's y buffers as bf16 bytes (mode 3's tagged words: their low halves)."""
        self.be.sync()
        if not tagged:
            return [self.be.download(_Ptr(p, self.rows * n * 2), 0, self.rows * n * 2)
                    for p, (n, _) in zip(self.y, self.shapes)]
        words = [self.be.download(_Ptr(p, self.rows * n * 4), 0, self.rows * n * 4)
                 for p, (n, _) in zip(self.ytag, self.shapes)]
        return [(w.view(np.uint32) & 0xFFFF).astype(np.uint16).view(np.uint8) for w in words]


class _Ptr:
    """An allocation-shaped view of a raw pointer, for CudaBackend.download."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def variants(probe: Probe) -> dict:
    return {
        "today (kerncc GEMVs, graph of launches)": probe.today,
        "launches w16": lambda: probe.launches("w16"),
        "launches w8": lambda: probe.launches("w8"),
        "persistent w16 (1 block a multiprocessor)": lambda: probe.persistent("w16",
                                                                              "persistent"),
        "persistent w8 (2 blocks a multiprocessor)": lambda: probe.persistent("w8",
                                                                             "persistent"),
        "persistent w16, weights 3 rounds ahead in shared memory": probe.bulk,
        "unordered w16 (no waits: the stream alone)": lambda: probe.persistent("w16",
                                                                               "unordered"),
        "unordered w8": lambda: probe.persistent("w8", "unordered"),
        **{f"ws u{u} (producer warp, {probe.ws_stages(u)[0]} x {u} KB rows ahead)":
           (lambda u=u: probe.ws(u, "persistent")) for u in WS_UNITS},
        "ws u2, 3 stages": lambda: probe.ws(2, "persistent", 3),
        **{f"ws u{u} tagged (no counters: each y word carries its launch's tag)":
           (lambda u=u: probe.ws(u, "tagged")) for u in (2, 4)},
        "ws u2 folded (norms, silu_mul in the x staging), counters":
            lambda: probe.ws(2, "persistent", fold=True),
        "ws u2 folded, tagged": lambda: probe.ws(2, "tagged", fold=True),
        **{f"ws u{u} unordered": (lambda u=u: probe.ws(u, "unordered")) for u in WS_UNITS},
    }


def bits(probe: Probe, runs: dict) -> list[str]:
    """Run each variant once and compare outputs: the probe's modes bit for bit (per width),
    today's kernels within bf16 rounding (m = 1; at m > 1 they read x with stride k)."""
    out, lines = {}, []
    for name, issue in runs.items():
        issue()
        out[name] = probe.outputs(tagged=" tagged" in name)
        if probe.gave_up():
            lines.append(f"{name}: a block GAVE UP waiting for its input")
    for width in ENTRIES:
        a, b = out[f"launches {width}"], out[next(n for n in runs if n.startswith(
            f"persistent {width}"))]
        same = all(np.array_equal(x, y) for x, y in zip(a, b))
        lines.append(f"persistent {width} = launches {width}, all {len(a)} outputs: "
                     f"{'identical bits' if same else 'DIFFERENT'}")
    a, b = out["launches w16"], out["persistent w16, weights 3 rounds ahead in shared memory"]
    same = all(np.array_equal(x, y) for x, y in zip(a, b))
    lines.append(f"persistent w16 through shared memory = launches w16: "
                 f"{'identical bits' if same else 'DIFFERENT'}")
    a, b = out["ws u2 folded (norms, silu_mul in the x staging), counters"], \
        out["ws u2 folded, tagged"]
    same = all(np.array_equal(x, y) for x, y in zip(a, b))
    lines.append(f"ws u2 folded: tagged = counters: {'identical bits' if same else 'DIFFERENT'}")
    for name in (n for n in runs if n.startswith("ws") and "unordered" not in n
                 and "folded" not in n):
        same = all(np.array_equal(x, y) for x, y in zip(out["launches w16"], out[name]))
        lines.append(f"{name.split(' (')[0]} = launches w16: "
                     f"{'identical bits' if same else 'DIFFERENT'}")
    if probe.rows == 1:
        a = bf16_to_f32(out["today (kerncc GEMVs, graph of launches)"][-1])
        b = bf16_to_f32(out["launches w16"][-1])
        lines.append(f"today vs launches w16, last output: max |diff| "
                     f"{float(np.max(np.abs(a - b))):.3g} of max |y| "
                     f"{float(np.max(np.abs(a))):.3g}")
    return lines


def time_variants(probe: Probe, runs: dict, rounds: int) -> dict[str, float]:
    graphs = {name: probe.be.capture(lambda issue=issue: [issue() for _ in range(REPLAYS)])
              for name, issue in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            start = probe.be.mark()
            probe.be.replay(graph)
            end = probe.be.mark()
            times[name].append(probe.be.elapsed_ms(start, end) / REPLAYS)
    return {name: float(np.median(t[1:])) for name, t in times.items()}


def report(rows: int, nbytes: int, times: dict[str, float], checks: list[str]) -> list[str]:
    roof = nbytes / (HBM_TBS * 1e12) * 1e3
    base = times["today (kerncc GEMVs, graph of launches)"]
    lines = [f"m = {rows}: {nbytes / 1e9:.2f} GB of weights, roofline {roof:.3f} ms "
             f"at {HBM_TBS} TB/s"]
    for name, ms in times.items():
        lines.append(f"  {name:56s} {ms:7.3f} ms  {nbytes / ms / 1e9:5.2f} TB/s  "
                     f"{ms / roof:5.2f}x roofline  {ms / base:5.3f}x today")
    return lines + [f"  {c}" for c in checks]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rows", default="1,8", help="m values, comma-separated (<= 8)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    shapes = chain_shapes(args.layers)
    nbytes = sum(n * k * 2 for n, k in shapes)
    lines, results = [], {}
    for rows in (int(r) for r in args.rows.split(",")):
        probe = Probe(shapes, rows)
        runs = variants(probe)
        checks = bits(probe, runs)
        times = time_variants(probe, runs, args.rounds)
        lines += report(rows, nbytes, times, checks)
        results[rows] = {"times_ms": times, "checks": checks}
        probe.be.close()
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "persistent_probe.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
