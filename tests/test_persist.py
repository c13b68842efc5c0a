"""Persistent decode runs, the host side (runtime/backends/persist.py), and the kernel's deal of
tasks as a model (no GPU; tests/test_persist_cuda.py runs the kernel).

What must hold: the constants and the phase layout are the kernel's; the runs are the decode
layer's stretches between the attention launches (never across a gated, foreign or unknown
launch); a launch becomes a phase exactly when the GEMV kernels (or the small kernel) would
take it whole; a run goes out as one launch or, when any launch of it cannot, launch by launch
in order; and the kernel's deal (round-robin tasks, each waiting for the phase before it, the
next GEMV's weights loaded ahead) finishes every task once under any interleaving.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import attrs
import pytest

from kerncc.cli.main import main
from kerncc.example import generate
from kerncc.kernels import library
from kerncc.manifest.model import When
from kerncc.runtime.backends import gemv, persist
from kerncc.runtime.launch import parse_sites

SOURCE = Path(library.__file__).resolve().parent / "persist.cu"
ALIGNED = 1 << 32


class Addresses:
    """A resolver giving every buffer, state and arena slot its own 16-byte aligned address."""

    def __init__(self) -> None:
        self.bases: dict[tuple[str, str], int] = {}

    def pointer(self, record: dict, program: str) -> int:
        (kind, name), = ((k, v) for k, v in record.items() if k != "offset")
        base = self.bases.setdefault((kind, name), ALIGNED * (len(self.bases) + 1))
        return base + int(record.get("offset", 0))


def decode_sites(tmp_path: Path, **overrides) -> dict[str, list]:
    model, _ = generate(tmp_path / "model", "tiny", **overrides)
    assert main(["lower", str(model), "-p", "emit", "-o", str(tmp_path / "out")]) == 0
    plan = json.loads((tmp_path / "out" / "stage0" / "plan.json").read_text())
    return parse_sites(plan, Addresses())


# What the GEMV kernels take whole at m <= 8 (hidden 2048, 16 heads of 128: k 2048 everywhere)
WIDE = {"hidden": 2048, "heads": 16, "kv_heads": 8, "head_dim": 128, "intermediate": 2048,
        "max_seqs": 8}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, list]:
    return decode_sites(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> dict[str, list]:
    return decode_sites(tmp_path_factory.mktemp("wide"), **WIDE)


def labels(run: list) -> list[str]:
    return [site.label for site in run]


# ---- the kernel's constants and layout ------------------------------------------------------


def test_the_constants_and_the_phase_layout_are_the_kernels():
    text = SOURCE.read_text()
    defines = dict(re.findall(r"#define (\w+) (\d+)", text))
    assert int(defines["PERSIST_THREADS"]) == persist.THREADS
    assert int(defines["PERSIST_MAX_PHASES"]) == persist.MAX_PHASES
    kinds = {name: int(defines[f"PHASE_{name}"]) for name in
             ("GEMV", "GEMV_ACC", "RMSNORM", "ADD_RMSNORM", "SILU_MUL")}
    assert kinds == {"GEMV": persist.GEMV, "GEMV_ACC": persist.GEMV_ACC,
                     "RMSNORM": persist.RMSNORM, "ADD_RMSNORM": persist.ADD_RMSNORM,
                     "SILU_MUL": persist.SILU_MUL}
    body = re.search(r"struct Phase \{(.*?)\};", text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    pointers = sum(int(n) for n in re.findall(r"const void\* \w+\[(\d+)\]", body))
    words = sum(len(decl.split(",")) for decl in re.findall(r"(?:int|float) ([^;\[]+);", body))
    words += sum(int(n) for n in re.findall(r"int \w+\[(\d+)\]", body))
    assert 8 * pointers + 4 * words == persist.PHASE.size == 80
    for entry in (persist.ENTRY, persist.RING_ENTRY):
        assert re.search(rf"{entry}\(const PersistTable \w+, int \w+, unsigned\*", text)
        assert entry in library.index()[persist.MODULE]["entries"]
        assert entry in library.INTERNAL
    stages = int(defines["RING_STAGES"])
    stage = re.search(r"#define RING_STAGE_BYTES \(32 \* \((\d+) \+ (\d+)\)\)", text)
    assert persist.RING_SMEM == stages * 32 * (int(stage[1]) + int(stage[2]))
    assert persist.RING_SMEM + 16 * 1024 <= 227 * 1024  # with the static arrays, one block fits


def test_a_table_packs_each_phase_after_the_tasks_before_it():
    phases = [persist.Phase(persist.RMSNORM, 1, 1, 2048, threads=256, eps=1e-6,
                            pointers=(16, 32, 48, 0)),
              persist.Phase(persist.GEMV, 128, 1, 2048, 2048, warps=16, pointers=(48, 64, 80, 0)),
              persist.Phase(persist.SILU_MUL, 3, 1, 6144, 32, threads=256,
                            pointers=(96, 112, 0, 0))]
    raw = persist.table(phases)
    assert len(raw) == persist.PHASE.size * persist.MAX_PHASES
    rows = [persist.PHASE.unpack_from(raw, i * persist.PHASE.size) for i in range(4)]
    assert [r[6] for r in rows[:3]] == [0, 1, 129]  # first
    assert rows[1][:4] == (48, 64, 80, 0) and rows[1][4:12] == (persist.GEMV, 128, 1, 1, 2048,
                                                                 2048, 16, 0)
    assert rows[0][12] == pytest.approx(1e-6)
    assert rows[3] == persist.PHASE.unpack(bytes(persist.PHASE.size))  # the rest is zero
    with pytest.raises(ValueError, match="1 to 32 phases"):
        persist.table([])
    with pytest.raises(ValueError, match="not 33"):
        persist.table(phases[:1] * 33)


# ---- runs ------------------------------------------------------------------------------------


def test_runs_are_the_layers_stretches_between_the_attention_launches(tiny):
    modules = persist.library_modules()
    tail = ["o_proj", "post_norm", "gate_up_proj", "act", "down_proj"]
    expected = [["l0.input_norm", "l0.qkv_proj"],
                [f"l0.{n}" for n in tail] + ["l1.input_norm", "l1.qkv_proj"],
                [f"l1.{n}" for n in tail]]
    for program in ("decode", "decode_batch", "prefill"):
        assert [labels(r) for r in persist.runs(tiny[program], modules)] == expected, program
    assert persist.runs(tiny["load"], modules) == []


def test_a_gated_foreign_or_unknown_launch_ends_a_run(tiny):
    modules = persist.library_modules()
    sites = tiny["decode"]
    at = next(i for i, s in enumerate(sites) if s.label == "l0.act")
    for changed in (attrs.evolve(sites[at], when=When("tokens", 1, 4)),
                    attrs.evolve(sites[at], module="0" * 64),
                    attrs.evolve(sites[at], entry="silu_mul_bf16_nb")):
        found = [labels(r) for r in persist.runs(sites[:at] + [changed] + sites[at + 1:],
                                                 modules)]
        assert ["l0.o_proj", "l0.post_norm", "l0.gate_up_proj"] in found
        assert ["l0.down_proj", "l1.input_norm", "l1.qkv_proj"] in found
        assert not any("l0.act" in run for run in found)


def test_a_long_stretch_is_cut_into_runs_of_at_most_max_phases(tiny):
    modules = persist.library_modules()
    norm = next(s for s in tiny["decode"] if s.label == "l0.input_norm")
    found = persist.runs([norm] * 40 + [norm], modules)
    assert [len(r) for r in found] == [32, 9]
    assert persist.runs([norm], modules) == []


# ---- phases -----------------------------------------------------------------------------------


@pytest.mark.parametrize("m, n, k, warps, tasks", [
    (1, 2048, 2048, 16, 128),   # o_proj of small: 128 tiles, the 16-warp entry
    (8, 2048, 6144, 16, 128),   # down_proj, three rounds of k
    (1, 4096, 2048, 8, 128),    # qkv: 256 tiles of 8 warps, two a task
    (3, 12288, 2048, 8, 384),   # gate/up
    (1, 4112, 2048, 8, 129),    # 257 tiles: the last task's second tile is past n
])
def test_a_gemm_is_a_phase_where_the_gemv_kernels_take_it_whole(m, n, k, warps, tasks):
    got = persist.gemm_phase(persist.GEMV_ACC, 1 << 20, 2 << 20, 3 << 20, m, n, k)
    assert got == persist.Phase(persist.GEMV_ACC, tasks, m, n, k, warps=warps,
                                pointers=(1 << 20, 2 << 20, 3 << 20, 0))
    assert gemv.entry_for(m, n) == {8: gemv.NARROW_ENTRY, 16: gemv.WIDE_ENTRY}[warps]


@pytest.mark.parametrize("m, n, k, a", [
    (9, 2048, 2048, 0),      # past m = 8 (the mb2 kernel, or cuBLAS)
    (0, 2048, 2048, 0),      # nothing to multiply
    (1, 2040, 2048, 0),      # a partial tile
    (1, 2048, 1024, 0),      # half a round of the 16-warp loop
    (1, 4096, 1536, 0),      # a round and a half of the 8-warp loop
    (1, 2048, 2048, 8),      # A not 16-byte aligned (cuBLAS takes it)
    (1, 32000, 2048, 0),     # n past CUBLAS_MIN_N: cuBLAS's
])
def test_a_gemm_the_gemv_kernels_would_not_take_whole_is_no_phase(m, n, k, a):
    assert persist.gemm_phase(persist.GEMV, (1 << 20) + a, 2 << 20, 3 << 20, m, n, k) is None


def test_no_gemm_is_a_phase_with_the_gemv_kernels_off(monkeypatch):
    monkeypatch.setattr(gemv, "MAX_M", 0)
    assert persist.gemm_phase(persist.GEMV, 1 << 20, 2 << 20, 3 << 20, 1, 2048, 2048) is None


def test_the_decode_launches_of_a_wide_model_are_phases(wide):
    env = {"tokens": 3, "seqs": 3}
    modules = persist.library_modules()
    for run in persist.runs(wide["decode_batch"], modules):
        for site in run:
            got = persist.phase(site, site.grid_at(env), site.var_values(env))
            assert got is not None and got.tasks > 0 and got.m == 3, site.label
            if site.label.endswith("norm"):
                assert (got.n, got.threads, got.tasks) == (2048, 256, 3)
                assert got.eps == pytest.approx(1e-6)
            if site.label.endswith("act"):
                assert (got.n, got.threads) == (2048, 256)
            if site.label.endswith("down_proj"):
                assert (got.kind, got.warps) == (persist.GEMV_ACC, 16)
    prefill = {"tokens": 64, "seqs": 1}
    qkv = next(s for s in wide["prefill"] if s.label == "l0.qkv_proj")
    assert persist.phase(qkv, qkv.grid_at(prefill), qkv.var_values(prefill)) is None


def test_a_launch_of_an_odd_shape_is_no_phase():
    args = (16, 32, 48, 1, 2048, 1e-6)
    assert persist.kernel_phase(persist.RMSNORM, args, (1, 1, 1), (256, 1, 1)) is not None
    assert persist.kernel_phase(persist.RMSNORM, args, (1, 2, 1), (256, 1, 1)) is None
    assert persist.kernel_phase(persist.RMSNORM, args, (1, 1, 1), (1024, 1, 1)) is None
    assert persist.kernel_phase(persist.RMSNORM, args, (1, 1, 1), (100, 1, 1)) is None
    assert persist.kernel_phase(persist.RMSNORM, args, (0, 1, 1), (256, 1, 1)).tasks == 0


# ---- a run's launchers -------------------------------------------------------------------------


class Kernel:
    """Records each launch's phases, read back from the table it was handed."""

    steps = staticmethod(persist.one_launch)
    kinds, limit = persist.KERNEL_KINDS, persist.MAX_PHASES

    def __init__(self) -> None:
        self.launched: list[list[tuple]] = []

    def launch(self, packed: bytes, count: int) -> None:
        self.launched.append([persist.PHASE.unpack_from(packed, i * persist.PHASE.size)
                              for i in range(count)])


def issue(sites: list, launchers: dict, env: dict) -> None:
    """What Session._issue_program does with a program's sites."""
    for site in sites:
        launchers[site.number](site.grid_at(env), 0, site.var_values(env))


def originals(sites: list, calls: list) -> dict:
    def launcher(site):
        return lambda grid, shared, scalars: calls.append((site.label, grid, tuple(scalars)))
    return {site.number: launcher(site) for site in sites}


def test_a_run_goes_out_as_one_launch_when_every_launch_is_a_phase(wide):
    sites, calls, kernel = wide["decode"], [], Kernel()
    joined = persist.join(kernel, {"decode": sites}, originals(sites, calls))
    issue(sites, joined, {"tokens": 1, "seqs": 1})
    assert [len(p) for p in kernel.launched] == [2, 7, 5]
    assert [p[4] for p in kernel.launched[1]] == [
        persist.GEMV, persist.ADD_RMSNORM, persist.GEMV, persist.SILU_MUL, persist.GEMV_ACC,
        persist.RMSNORM, persist.GEMV]
    firsts = [p[6] for p in kernel.launched[1]]
    assert firsts == [sum(p[5] for p in kernel.launched[1][:i]) for i in range(7)]
    joined_labels = {f"l{i}.{n}" for i in range(2) for n in (
        "input_norm", "qkv_proj", "o_proj", "post_norm", "gate_up_proj", "act", "down_proj")}
    left = [label for label, *_ in calls]
    assert left == [s.label for s in sites if s.label not in joined_labels]
    assert "l0.attention" in left and "lm_head" in left


def test_a_run_goes_launch_by_launch_in_order_when_one_launch_is_no_phase(tiny, wide):
    for sites, env in ((tiny["decode"], {"tokens": 1, "seqs": 1}),  # k of 64: no GEMV phase
                       (wide["prefill"], {"tokens": 64, "seqs": 2})):  # m of 64
        plain, joined_calls, kernel = [], [], Kernel()
        issue(sites, originals(sites, plain), env)
        issue(sites, persist.join(kernel, {"p": sites}, originals(sites, joined_calls)), env)
        assert kernel.launched == [] and joined_calls == plain


def test_a_run_cut_short_leaves_nothing_for_the_next(wide):
    sites, calls, kernel = wide["decode"], [], Kernel()
    joined = persist.join(kernel, {"decode": sites}, originals(sites, calls))
    run = persist.runs(sites, persist.library_modules())[1]
    env = {"tokens": 1, "seqs": 1}
    for site in run[:3]:  # an error stopped the program here
        joined[site.number](site.grid_at(env), 0, site.var_values(env))
    issue(sites, joined, env)
    assert [len(p) for p in kernel.launched] == [2, 7, 5]
    with pytest.raises(RuntimeError, match="launch 2 of a persistent run came after 0"):
        joined[run[2].number](run[2].grid_at(env), 0, run[2].var_values(env))


# ---- the deal, as a model of persist_run_bf16's control flow -------------------------------------


def deal(phases: list[tuple[bool, int, int]], blocks: int, seed: int) -> list[tuple[int, int]]:
    """Run the kernel's loop for `phases` ([(is GEMV, tasks, rounds)]) on `blocks` blocks, one
    step of a random block at a time; return the (phase, task) order tasks finished in.
    Checks as it goes what the kernel relies on: a block only waits for the phase before its
    task's, a GEMV round computes with the weights loaded for it, and nothing deadlocks."""
    first = [sum(t for _, t, _ in phases[:p]) for p in range(len(phases))]
    total = sum(t for _, t, _ in phases)

    def phase_of(task: int, p: int) -> int:
        while p + 1 < len(phases) and first[p + 1] <= task:
            p += 1
        return p

    def advance(it, b):
        task, p, r = it
        if r + 1 < (phases[p][2] if phases[p][0] else 1):
            return (task, p, r + 1)
        task += blocks
        return (total, len(phases), 0) if task >= total else (task, phase_of(task, p), 0)

    def next_gemv(it, b):
        while it[0] < total and not phases[it[1]][0]:
            it = advance(it, b)
        return it

    done = [0] * len(phases)
    finished: list[tuple[int, int]] = []

    def block(b):
        ready = 1
        it = (b, phase_of(b, 0), 0) if b < total else (total, len(phases), 0)
        wi = next_gemv(it, b)
        loaded = wi
        while it[0] < total:
            task, p, r = it
            gemm = phases[p][0]
            if gemm:
                assert loaded == it  # the weights in registers are this round's
                wi = next_gemv(advance(it, b), b)
                nxt = wi
            if p >= ready:
                while done[p - 1] < phases[p - 1][1]:
                    yield "wait"
                ready = p + 1
            yield "work"
            last = not gemm or r + 1 == phases[p][2]
            if last:
                done[p] += 1
                finished.append((p, task - first[p]))
            if gemm:
                loaded = nxt
            it = advance(it, b)

    rng = random.Random(seed)
    live = {b: block(b) for b in range(blocks)}
    waits = 0
    while live:
        b = rng.choice(sorted(live))
        try:
            step = next(live[b])
        except StopIteration:
            del live[b]
            continue
        waits = waits + 1 if step == "wait" else 0
        assert waits < 50 * blocks * len(phases) + 1000, "the blocks wait on each other"
    return finished


@pytest.mark.parametrize("seed", range(12))
def test_the_deal_finishes_every_task_once_in_phase_order(seed):
    rng = random.Random(seed)
    phases = [(rng.random() < 0.6, rng.randint(1, 40), rng.randint(1, 3))
              for _ in range(rng.randint(2, 9))]
    finished = deal(phases, rng.randint(1, 24), seed)
    assert sorted(finished) == [(p, t) for p, (_, n, _) in enumerate(phases) for t in range(n)]
    # a task finished only after every task of the phases before it
    seen = [0] * len(phases)
    for p, _ in finished:
        assert all(seen[q] == phases[q][1] for q in range(p)), (p, seen)
        seen[p] += 1


def test_no_manifest_can_launch_the_persistent_kernel():
    """Its table holds raw device pointers: a plan that named it could point it anywhere."""
    from kerncc.runtime.backends.base import BackendError
    from kerncc.runtime.backends.cpu import CpuBackend

    sha = library.index()[persist.MODULE]["sha256"]
    assert library.is_internal(persist.ENTRY, sha)
    with pytest.raises(BackendError, match="a manifest cannot launch it"):
        CpuBackend().check_kernel(persist.ENTRY, sha)
    # a module of the bundle's own that happens to use the name is just a kernel without a
    # reference on the cpu backend
    assert not library.is_internal(persist.ENTRY, "0" * 64)
    with pytest.raises(BackendError, match="no reference for kernel `persist_run_bf16`"):
        CpuBackend().check_kernel(persist.ENTRY, "0" * 64)


def test_a_run_plans_once_for_each_set_of_launch_values(wide, monkeypatch):
    sites, kernel = wide["decode_batch"], Kernel()
    joined = persist.join(kernel, {"d": sites}, originals(sites, []))
    planned = []
    real = persist.phase
    monkeypatch.setattr(persist, "phase", lambda *a: planned.append(a[0].label) or real(*a))
    for seqs in (2, 2, 5, 2):
        issue(sites, joined, {"tokens": seqs, "seqs": seqs})
    assert len(planned) == 2 * 14  # two sets of values, 14 launches in runs
    assert [run[0][7] for run in kernel.launched] == [2] * 3 + [2] * 3 + [5] * 3 + [2] * 3  # m
