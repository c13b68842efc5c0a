"""A decode GEMV and the small kernel before it as one launch, the host side
(runtime/backends/fuse.py; no GPU: tests/test_fuse_cuda.py runs the kernels).

What must hold: the pairs are each layer's input norm and qkv GEMM, and its silu_mul and down
GEMM (never across a gated, foreign or reordered launch); the fused launch goes out when the two
launches agree at their values (the GEMM reads exactly the small kernel's output, m <= 8, aligned
rows, the output apart from every input), with the small kernel's inputs and the GEMM's
arguments, on the GEMV's grid; otherwise both go out as prepared, in order.
"""

from __future__ import annotations

import ctypes
import struct

import attrs
import numpy as np
import pytest

from kerncc.kernels import library
from kerncc.manifest.model import When
from kerncc.runtime.backends import fuse, gemv

from test_persist import WIDE, decode_sites, issue, originals  # noqa: E402 (tests/ on the path)

MODULES = {name: library.index()[name]["sha256"] for name in ("norm", "activation")}
PAIRS = [(f"l{i}.{a}", f"l{i}.{b}") for i in range(2)
         for a, b in (("input_norm", "qkv_proj"), ("act", "down_proj"))]


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> dict[str, list]:
    return decode_sites(tmp_path_factory.mktemp("wide"), **WIDE)


def labels(found) -> list[tuple[str, str]]:
    return [(a.label, b.label) for a, b in found]


def test_the_pairs_are_each_layers_norm_and_qkv_and_its_act_and_down(wide):
    for program in ("decode", "decode_batch", "prefill"):
        found = fuse.pairs(wide[program], MODULES)
        assert labels(found) == PAIRS, program
        assert [a.entry for a, _ in found] == [fuse.NORM, fuse.SILU] * 2
        assert [b.extern_name for _, b in found] == ["cublaslt_bf16_tn",
                                                     "cublaslt_bf16_tn_acc"] * 2
    assert fuse.pairs(wide["load"], MODULES) == []


def test_a_gated_foreign_or_parted_launch_makes_no_pair(wide):
    sites = wide["decode"]
    at = next(i for i, s in enumerate(sites) if s.label == "l0.act")
    for i, changed in ((at, attrs.evolve(sites[at], when=When("tokens", 1, 4))),
                       (at + 1, attrs.evolve(sites[at + 1], when=When("tokens", 1, 4))),
                       (at, attrs.evolve(sites[at], module="0" * 64))):
        found = fuse.pairs(sites[:i] + [changed] + sites[i + 1:], MODULES)
        assert ("l0.act", "l0.down_proj") not in labels(found)
        assert len(found) == 3
    parted = sites[:at] + [sites[at + 1], sites[at]] + sites[at + 2:]
    assert ("l0.act", "l0.down_proj") not in labels(fuse.pairs(parted, MODULES))


X, GN, Y, W, C = 0x10000, 0x20000, 0x30000, 0x1000000, 0x40000


def norm(x=X, gn=GN, y=Y, rows=4, cols=2048, eps=1e-6):
    return [x, gn, y, np.int32(rows), np.int32(cols), np.float32(eps)]


def gemm(a=Y, w=W, c=C, m=4, n=4096, k=2048):
    return [a, w, c, np.int32(m), np.int32(n), np.int32(k)]


def test_a_norm_and_its_gemm_fuse_only_where_they_agree():
    assert fuse.norm_values(norm(), 256, gemm(), 0) == (X, GN, Y, pytest.approx(1e-6), 256,
                                                        W, C, 4, 4096, 2048, 0)
    assert fuse.norm_values(norm(rows=8), 1024, gemm(m=8), 2) is not None
    for args, threads, g, mode in (
            (norm(), 256, gemm(a=Y + 16), 0),  # A is not the norm's output
            (norm(rows=5), 256, gemm(), 0),  # rows
            (norm(cols=1024), 256, gemm(), 0),  # width
            (norm(rows=9), 256, gemm(m=9), 0),  # more rows than a fused tile takes
            (norm(x=X + 8), 256, gemm(), 0),  # unaligned
            (norm(), 96 + 16, gemm(), 0),  # a launch warp short of 32 threads
            (norm(), 2048, gemm(), 0),
            (norm(y=X, x=X), 256, gemm(a=X), 0),  # in place: blocks would read what others write
            (norm(), 256, gemm(c=Y + 4096), 0),  # the output over y
            (norm(gn=Y + 64), 256, gemm(), 0),
            (norm(), 256, gemm(n=16384), 0),  # cuBLAS takes it
            (norm(x=1 << 40, y=1 << 41, rows=8, cols=16384), 256,
             gemm(a=1 << 41, m=8, k=16384), 0),  # more than shared memory holds
            (norm(), 256, gemm(), 3)):
        assert fuse.norm_values(args, threads, g, mode) is None, (args, threads, g, mode)


def silu(gate_up=X, act=Y, rows=4, inter=2048, block=64):
    return [gate_up, act, np.int32(rows), np.int32(inter), np.int32(block)]


def test_a_silu_mul_and_its_gemm_fuse_only_where_they_agree():
    assert fuse.silu_values(silu(), gemm(n=2048), 1) == (X, Y, 64, W, C, 4, 2048, 2048, 1)
    for args, g in ((silu(act=Y + 32), gemm()), (silu(rows=3), gemm()),
                    (silu(inter=1024), gemm()), (silu(block=12), gemm()),
                    (silu(block=48), gemm()),  # 2048 % 48
                    (silu(gate_up=X + 2), gemm()), (silu(gate_up=Y - 8192), gemm()),
                    (silu(rows=16), gemm(m=16))):
        assert fuse.silu_values(args, g, 1) is None, (args, g)


class Backend:
    """Records the fused launches: (entry, grid, block, shared, the parameters' values)."""

    def __init__(self) -> None:
        self.launched: list[tuple] = []

    def launch_fused(self, function, grid, block, shared, params) -> None:
        formats = fuse.FORMATS[fuse.NORM if "rmsnorm" in function else fuse.SILU]
        table = (ctypes.c_void_p * len(formats)).from_address(params)
        values = [struct.unpack("<" + fmt, ctypes.string_at(table[i], struct.calcsize(fmt)))[0]
                  for i, fmt in enumerate(formats)]
        self.launched.append((function, grid, block, shared, values))


def fused(sites: list, calls: list, backend: Backend) -> dict:
    return fuse.join(backend, {entry: entry for entry in gemv.FUSED_ENTRIES}, {"p": sites},
                     originals(sites, calls))


@pytest.mark.parametrize("program, env", [("decode", {"tokens": 1, "seqs": 1}),
                                          ("decode_batch", {"tokens": 3, "seqs": 3})])
def test_the_pairs_go_out_fused_and_the_rest_as_prepared(wide, program, env, monkeypatch):
    monkeypatch.setattr(gemv, "MAX_M", 8)
    sites, calls, backend = wide[program], [], Backend()
    issue(sites, fused(sites, calls, backend), env)
    plain: list = []
    issue(sites, originals(sites, plain), env)
    paired = {label for pair in PAIRS for label in pair}
    assert calls == [c for c in plain if c[0] not in paired]
    m = env["tokens"]
    # qkv: n = (16 + 2 * 8) * 128 = 4096 (8 warps); down: n = 2048 (16 warps)
    shared = 2 * m * (2048 + gemv.FUSED_PAD)  # the activations in shared memory
    assert [(f, g, b, sh) for f, g, b, sh, _ in backend.launched] == [
        ("gemv_rmsnorm_bf16_tn_mb1", (256, 1, 1), (256, 1, 1), shared),
        ("gemv_silu_bf16_tn_mb1_w16", (128, 1, 1), (512, 1, 1), shared)] * 2
    by_label = {s.label: s for s in sites}
    for (small, gemm_label), (_, _, _, _, values) in zip(PAIRS, backend.launched):
        s, g = by_label[small], by_label[gemm_label]
        small_args = s.bind(s.var_values(env))
        a, w, c, *_ = g.bind(g.var_values(env))
        assert values[-6:] == [w, c, m, int(g.bind(g.var_values(env))[4]), 2048,
                               gemv.MODES[g.extern_name]]
        if s.entry == fuse.NORM:
            assert values[:3] == small_args[:3] and values[2] == a
            assert values[3] == pytest.approx(float(small_args[5])) and values[4] == s.block[0]
        else:
            assert values[:2] == small_args[:2] and values[1] == a
            assert values[2] == int(small_args[4])


def test_launches_that_do_not_agree_go_out_as_prepared(wide, monkeypatch):
    monkeypatch.setattr(gemv, "MAX_M", 8)
    for program, env in (("prefill", {"tokens": 64, "seqs": 2}),  # m of 64
                         ("decode_batch", {"tokens": 9, "seqs": 9})):
        sites, calls, backend = wide[program], [], Backend()
        plain: list = []
        issue(sites, fused(sites, calls, backend), env)
        issue(sites, originals(sites, plain), env)
        assert backend.launched == [] and calls == plain, program
    monkeypatch.setattr(gemv, "MAX_M", 0)  # cuBLAS takes every GEMM
    sites, calls, backend = wide["decode"], [], Backend()
    plain = []
    issue(sites, fused(sites, calls, backend), {"tokens": 1, "seqs": 1})
    issue(sites, originals(sites, plain), {"tokens": 1, "seqs": 1})
    assert backend.launched == [] and calls == plain


def test_a_gemm_without_its_small_kernel_is_an_error(wide):
    sites, calls, backend = wide["decode"], [], Backend()
    launchers = fused(sites, calls, backend)
    qkv = next(s for s in sites if s.label == "l0.qkv_proj")
    env = {"tokens": 1, "seqs": 1}
    with pytest.raises(RuntimeError, match="came without it"):
        launchers[qkv.number](qkv.grid_at(env), 0, qkv.var_values(env))
