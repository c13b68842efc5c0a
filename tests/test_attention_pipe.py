"""The batched decode's split attention pipelined, the host side (runtime/backends/
attention_pipe.py; no GPU: tests/test_attention_pipe_cuda.py runs the kernel).

What must hold: only the tensor-core split's launches from the library's attention cubin are
candidates, and at their values only those whose blocks loop over splits (grid z below
max_splits: `decode_batch`, never `decode`) go out as the pipelined kernel, with the split's
arguments, grid x and y, the Z rule's grid z and the shared memory the kernel's layout needs for
that head dim and group; the rest go out as prepared. The layout arithmetic is the kernel's
(the constants are read from attention.cu); the switch reads 0 or 1; and the entry is an
ordinary library kernel with the split kernels' numpy reference.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import attrs
import numpy as np
import pytest

from kerncc.cli.main import main
from kerncc.example import generate
from kerncc.kernels import library
from kerncc.kernels.reference import KERNELS
from kerncc.runtime.backends import attention_pipe as pipe
from kerncc.runtime.launch import VarScalar, parse_sites

SHA = library.index()[pipe.MODULE]["sha256"]
SOURCE = library.KERNELS_DIR / "attention.cu"
SPLIT = library.KERNELS_DIR / "attention_split.cuh"  # DC_WARPS and the split it pipelines
SMS = 132  # an H200's multiprocessors
# 2048 keys of context: 16 splits, so decode_batch's 8 blocks a kv head loop (decode: 16)
LONG = {"hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "max_context": 2048}
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
    """Each program's launch sites of the example model's stage, as a Session parses them."""
    model, _ = generate(tmp_path / "model", "tiny", **overrides)
    assert main(["lower", str(model), "-p", "emit", "-o", str(tmp_path / "out")]) == 0
    plan = json.loads((tmp_path / "out" / "stage0" / "plan.json").read_text())
    return parse_sites(plan, Addresses())


def issue(sites: list, launchers: dict, env: dict) -> None:
    """What Session._issue_program does with a program's sites."""
    for site in sites:
        launchers[site.number](site.grid_at(env), 0, site.var_values(env))


def originals(sites: list, calls: list) -> dict:
    def launcher(site):
        return lambda grid, shared, scalars: calls.append((site.label, grid, tuple(scalars)))
    return {site.number: launcher(site) for site in sites}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, list]:
    return decode_sites(tmp_path_factory.mktemp("tiny"))  # head dim 16: the CUDA-core split


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> dict[str, list]:
    return decode_sites(tmp_path_factory.mktemp("wide"), **LONG)


# ---- the kernel's layout --------------------------------------------------------------------


def test_the_layout_constants_are_the_kernels():
    text = SOURCE.read_text() + SPLIT.read_text()
    defines = dict(re.findall(r"^#define (DC_WARPS|DP_\w+) (\d+)", text, flags=re.MULTILINE))
    assert {k: int(v) for k, v in defines.items()} == {
        "DC_WARPS": pipe.WARPS, "DP_MAX_SLOTS": pipe.MAX_SLOTS, "DP_SM_SHARED": pipe.SM_SHARED,
        "DP_BLOCK_RESERVED": pipe.BLOCK_RESERVED, "DP_BLOCK_SHARED_MAX": pipe.BLOCK_SHARED_MAX}
    assert f'extern "C" __global__ void __launch_bounds__(DC_WARPS * 32, 2)\n{pipe.ENTRY}(' in text
    assert pipe.ENTRY in library.index()[pipe.MODULE]["entries"]


# (hd, G): (slots a warp, dynamic shared bytes), as the kernel's constexpr dp_slots and
# dp_smem_bytes give them (printed by a host build of those functions)
LAYOUT = {
    (32, 1): (6, 50304), (32, 2): (6, 51456), (32, 4): (6, 53760), (32, 8): (6, 58368),
    (64, 1): (6, 100544), (64, 2): (6, 102784), (64, 4): (6, 107264), (64, 8): (5, 99840),
    (96, 1): (4, 101632), (96, 2): (4, 104960), (96, 4): (4, 111616), (96, 8): (3, 100352),
    (128, 1): (3, 102720), (128, 2): (3, 107136), (128, 4): (6, 214272), (128, 8): (6, 231936),
}


@pytest.mark.parametrize("hd,g", sorted(LAYOUT))
def test_the_shared_memory_of_each_head_dim_and_group(hd, g):
    slots, shared = LAYOUT[(hd, g)]
    assert (pipe.slots(hd, g), pipe.shared_bytes(hd, g)) == (slots, shared)
    # ring | 8 warps' partials | q rows | stats
    assert shared == slots * 8 * 16 * hd * 2 + 8 * g * hd * 4 + g * hd * 2 + 8 * g * 2 * 4
    assert 3 <= slots <= pipe.MAX_SLOTS and shared <= pipe.BLOCK_SHARED_MAX
    two_fit = 2 * (shared + pipe.BLOCK_RESERVED) <= pipe.SM_SHARED
    assert two_fit == ((hd, g) not in ((128, 4), (128, 8)))  # two blocks a multiprocessor
    if not two_fit:  # one block then, with the most slots it may take
        assert shared + pipe.slot_bytes(hd) > pipe.BLOCK_SHARED_MAX or slots == pipe.MAX_SLOTS
    assert pipe.MAX_SHARED >= shared


def test_the_small_models_shape_takes_two_blocks_a_multiprocessor():
    """hd 128, G 2 (16 q heads over 8 kv heads): 3 slots, 104.6 KiB, two blocks a
    multiprocessor."""
    assert pipe.shared_bytes(128, 2) == 107136
    assert 2 * (107136 + pipe.BLOCK_RESERVED) <= pipe.SM_SHARED


# ---- the Z rule -----------------------------------------------------------------------------


@pytest.mark.parametrize("grid,per_sm,z", [
    ((32, 8, 8), 2, 1),  # 256 (sequence, kv head) columns fill the 264 places: one block each
    ((17, 8, 8), 2, 1),  # 136: two blocks would need 272
    ((16, 8, 8), 2, 2),  # 128 x 2 = 256 <= 264
    ((8, 8, 8), 2, 4),  # 64 x 4: the 8-sequence step, a split a block at 512 keys
    ((8, 8, 8), 1, 2),  # one block a multiprocessor (hd 128 at G = 4 or 8)
    ((4, 8, 8), 2, 8),
    ((2, 8, 8), 2, 8),  # 16 x 16 would fit; never more than the launch's own 8
    ((1, 8, 32), 2, 32),
    ((1, 1, 4), 2, 4),
    ((64, 8, 8), 2, 1),  # more columns than places: still one
])
def test_the_pipelined_grid_z(grid, per_sm, z):
    assert pipe.blocks(grid, SMS, per_sm) == z


def test_the_grid_z_fills_one_wave_and_stays_within_the_launchs():
    for x in range(1, 40):
        for y in (1, 2, 4, 8):
            for z in (1, 2, 3, 8, 32):
                for per_sm in (1, 2):
                    got = pipe.blocks((x, y, z), SMS, per_sm)
                    assert 1 <= got <= z
                    places = SMS * per_sm
                    assert got == 1 or x * y * got <= places  # within one wave
                    assert got == z or x * y * (got + 1) > places  # and the most that fit


def test_two_blocks_fit_a_multiprocessor_only_where_their_shared_memory_does():
    for hd in pipe.HEAD_DIMS:
        for g in pipe.GROUPS:
            two = 2 * (pipe.shared_bytes(hd, g) + pipe.BLOCK_RESERVED) <= pipe.SM_SHARED
            assert pipe.resident(hd, g) == (2 if two else 1)
    assert pipe.resident(128, 2) == 2  # the small example's heads
    assert pipe.resident(128, 8) == 1


# ---- which launches ---------------------------------------------------------------------------


def test_the_candidates_are_the_tensor_core_splits(tiny, wide):
    for program in ("decode", "decode_batch"):
        found = pipe.sites(wide[program], SHA)
        assert [s.label for s in found] == ["l0.attention", "l1.attention"], program
        assert {s.entry for s in found} == {pipe.SPLIT}
        assert pipe.sites(tiny[program], SHA) == []  # hd 16: attn_decode_split_bf16
    for program in ("prefill", "load"):
        assert pipe.sites(wide[program], SHA) == []
    site = pipe.sites(wide["decode_batch"], SHA)[0]
    for changed in (attrs.evolve(site, module="0" * 64), attrs.evolve(site, block=(128, 1, 1)),
                    attrs.evolve(site, entry=pipe.ENTRY)):
        assert pipe.sites([changed], SHA) == []
    assert pipe.sites([attrs.evolve(site, when=None)], SHA) == [site]


def test_a_launch_fits_where_its_blocks_loop_over_splits():
    assert pipe.fits((4, 2, 8), 4, 2, 64, 16, 8)
    assert pipe.fits((32, 8, 8), 16, 8, 128, 32, SMS)
    assert pipe.fits((32, 8, 31), 16, 8, 128, 32, SMS)
    assert pipe.fits((17, 8, 8), 16, 8, 128, 32, SMS)  # 136 columns
    for grid, nq, nk, hd, splits, sms in (
            ((16, 8, 8), 16, 8, 128, 32, SMS),  # 128 columns: fewer than the multiprocessors
            ((8, 8, 8), 16, 8, 128, 32, SMS),  # the 8-sequence step: measured slower piped
            ((4, 2, 8), 4, 2, 64, 16, 9),
            ((4, 2, 16), 4, 2, 64, 16, 8),  # a block per split: `decode`
            ((4, 2, 17), 4, 2, 64, 16, 8),
            ((4, 2, 0), 4, 2, 64, 16, 8),
            ((4, 2, 8), 4, 2, 80, 16, 8),  # a head dim of the CUDA-core kernel
            ((4, 2, 8), 4, 2, 160, 16, 8),
            ((4, 2, 8), 6, 4, 64, 16, 8),  # nq / nk not whole
            ((4, 2, 8), 48, 4, 64, 16, 8),  # G = 12
            ((4, 0, 8), 4, 0, 64, 16, 8)):
        assert not pipe.fits(grid, nq, nk, hd, splits, sms), (grid, nq, nk, hd, splits, sms)


class Backend:
    """Counts the pipelined launches as CudaBackend does; records the launches' shared memory
    limits."""

    def __init__(self) -> None:
        self.piped = 0
        self.prepared: list[tuple[int, int]] = []  # (site number, shared bytes allowed)

    def prepare(self, calls: list):
        def prepare(site, shared):
            self.prepared.append((site.number, shared))

            def launch(grid, shared, scalars):
                calls.append(("piped", site.label, grid, shared, tuple(scalars)))
            return launch
        return prepare


def piped(sites: list, calls: list, backend: Backend, sms: int = SMS) -> dict:
    return pipe.pipe(backend, backend.prepare(calls), sms, {"p": sites}, originals(sites, calls))


FEW = 6  # a GPU of 6 multiprocessors, so that the test models' 2 kv heads reach it


@pytest.mark.parametrize("seqs,z", [(1, None), (2, None), (3, 2), (4, 1), (20, 1)])
def test_the_batched_split_goes_out_pipelined_and_the_rest_as_prepared(wide, seqs, z):
    """z None: fewer (sequence, kv head) columns than multiprocessors, the split kernel."""
    env = {"tokens": seqs, "seqs": seqs}
    for program in ("decode_batch", "decode"):
        sites, calls, backend = wide[program], [], Backend()
        plain: list = []
        issue(sites, piped(sites, calls, backend, sms=FEW), env)
        issue(sites, originals(sites, plain), env)
        splits = [s for s in sites if s.entry == pipe.SPLIT]
        assert backend.prepared == [(s.number, pipe.shared_bytes(64, 2)) for s in splits]
        if program == "decode" or z is None:  # a block per split, or too few columns
            assert calls == plain and backend.piped == 0
            continue
        assert backend.piped == 2
        assert [c for c in calls if c[0] != "piped"] == [
            c for c in plain if not (c[0].endswith(".attention") and c[1][2] == 8)]
        got = [c for c in calls if c[0] == "piped"]
        want = [c for c in plain if c[0].endswith(".attention") and c[1][2] == 8]
        assert len(got) == len(want) == 2
        for (_, label, grid, shared, scalars), (plabel, pgrid, pscalars) in zip(got, want):
            assert label == plabel and scalars == pscalars  # the split's own arguments
            assert grid == (seqs, 2, pipe.blocks(pgrid, FEW, pipe.resident(64, 2))) == (
                seqs, 2, z)
            assert shared == pipe.shared_bytes(64, 2)
        # in order: each pipelined split where the split was
        assert [c[1] if c[0] == "piped" else c[0] for c in calls] == [c[0] for c in plain]


def test_too_few_columns_keep_the_split_kernel_unless_the_threshold_is_lowered(wide):
    """On 132 multiprocessors 3 sequences x 2 kv heads stay on the split kernel; the backend's
    `pipe_columns` (what the GPU tests set for their small models) lowers the threshold only:
    Z still follows the multiprocessor count."""
    sites = wide["decode_batch"]
    for columns, want in ((None, 0), (6, 2), (7, 0), (1, 2)):
        calls, backend = [], Backend()
        launchers = pipe.pipe(backend, backend.prepare(calls), SMS, {"p": sites},
                              originals(sites, calls), columns)
        issue(sites, launchers, {"tokens": 3, "seqs": 3})
        assert backend.piped == want, columns
        assert all(c[2] == (3, 2, 8) for c in calls if c[0] == "piped")  # 264 // 6 > 8: z 8


def test_the_z_rule_follows_the_multiprocessor_count(wide):
    sites, calls, backend = wide["decode_batch"], [], Backend()
    issue(sites, piped(sites, calls, backend, sms=4), {"tokens": 4, "seqs": 4})
    assert {c[2] for c in calls if c[0] == "piped"} == {(4, 2, 1)}  # 8 columns >= 4 SMs


def test_a_head_shape_the_kernel_does_not_take_stays_as_prepared(wide):
    sites = wide["decode_batch"]
    at = next(i for i, s in enumerate(sites) if s.entry == pipe.SPLIT)
    args = list(sites[at].args)
    args[pipe.HD] = np.int32(80)
    changed = sites[:at] + [attrs.evolve(sites[at], args=tuple(args))] + sites[at + 1:]
    calls, backend = [], Backend()
    launchers = piped(changed, calls, backend)
    assert [n for n, _ in backend.prepared] == [s.number for s in changed
                                                if s.entry == pipe.SPLIT][1:]
    assert not isinstance(launchers[changed[at].number], pipe.Piped)
    assert isinstance(launchers[backend.prepared[0][0]], pipe.Piped)


def test_values_read_from_vars_are_read_at_each_launch(wide):
    """A plan whose max_splits reads a var: the launcher binds it at each launch, and the shared
    memory limit is the most any head shape needs."""
    sites = wide["decode_batch"]
    at = next(i for i, s in enumerate(sites) if s.entry == pipe.SPLIT)
    args = list(sites[at].args)
    args[pipe.SPLITS] = VarScalar("i32", "splits")
    site = attrs.evolve(sites[at], args=tuple(args))
    calls, backend = [], Backend()
    launchers = piped([site], calls, backend, sms=4)
    assert backend.prepared == [(site.number, pipe.MAX_SHARED)]
    for splits, went in ((8, False), (9, True), (16, True)):
        env = {"tokens": 2, "seqs": 2, "splits": splits}
        calls.clear()
        launchers[site.number](site.grid_at(env), 0, site.var_values(env))
        assert (calls[0][0] == "piped") is went, splits
        if went:  # 4 columns on 4 multiprocessors of two blocks each: Z = 2
            assert calls[0][2:4] == ((2, 2, 2), pipe.shared_bytes(64, 2))


# ---- the backend -----------------------------------------------------------------------------


def test_the_cuda_backend_pipes_its_launches_when_the_switch_is_on(wide):
    """CudaBackend.rewrite_launchers itself (on a stand-in for the backend: no GPU here)."""
    pytest.importorskip("cuda.bindings")
    from kerncc.runtime.backends.cuda import CudaBackend

    sites, calls = wide["decode_batch"], []
    stand_in = Backend()
    fake = SimpleNamespace(
        pipe_attention=True, pipe_columns=None, invariant=False,
        device=SimpleNamespace(properties=SimpleNamespace(multiprocessor_count=FEW)),
        _pipe_launch=stand_in.prepare(calls), piped=0)
    launchers = CudaBackend.rewrite_launchers(fake, {"p": sites}, originals(sites, calls))
    issue(sites, launchers, {"tokens": 3, "seqs": 3})
    assert fake.piped == 2 and [c[0] for c in calls].count("piped") == 2
    fake.pipe_attention = False
    calls.clear()
    issue(sites, CudaBackend.rewrite_launchers(fake, {"p": sites}, originals(sites, calls)),
          {"tokens": 3, "seqs": 3})
    assert not any(c[0] == "piped" for c in calls)


# ---- the switch, the library, the reference --------------------------------------------------


def test_the_switch(monkeypatch):
    from kerncc import config
    from kerncc.diagnostics import KernccError

    monkeypatch.delenv("KERNCC_PIPE_ATTENTION", raising=False)
    assert config.pipe_attention() is True  # on: faster at 32 sequences on an H200
    for text, value in (("0", False), ("1", True), (" 1 ", True)):
        monkeypatch.setenv("KERNCC_PIPE_ATTENTION", text)
        assert config.pipe_attention() is value
    for bad in ("on", "2", "true", ""):
        monkeypatch.setenv("KERNCC_PIPE_ATTENTION", bad)
        with pytest.raises(KernccError, match="KERNCC_PIPE_ATTENTION="):
            config.pipe_attention()


def test_the_entry_is_a_library_kernel_with_the_split_kernels_reference():
    """Its arguments are the split kernel's (no memory of the backend's), so a manifest naming
    it is as safe as one naming the split kernel (it traps with too little shared memory); the
    cpu backend runs the split kernels' reference for it."""
    from kerncc.runtime.backends.cpu import CpuBackend

    assert library.module_of(pipe.ENTRY) == pipe.MODULE
    assert KERNELS[pipe.ENTRY] is KERNELS[pipe.SPLIT] is KERNELS["attn_decode_split_bf16"]
    CpuBackend().check_kernel(pipe.ENTRY, SHA)


def test_the_kernel_begins_by_waiting():
    from kerncc.kernels import build

    body = build.entry_bodies(SOURCE.read_text())[pipe.ENTRY]
    assert body.strip().startswith("pdl_begin();")
