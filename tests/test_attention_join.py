"""The decode attention's split and combine as one launch, the host side
(runtime/backends/attention.py; no GPU: tests/test_attention_cuda.py and
tests/test_attention_join_cuda.py run the kernel).

What must hold: the pairs are each decode layer's attention (never prefill's, never across a
gated, foreign or reordered launch); the joined launch goes out when the two launches agree at
their values, with the split's grid and the split's arguments followed by the combine's rows and
the counters; otherwise both go out as prepared, in order; and no manifest may name the kernel.
"""

from __future__ import annotations

import struct

import attrs
import numpy as np
import pytest

from kerncc.kernels import library
from kerncc.manifest.model import When
from kerncc.runtime.backends import attention

from test_persist import decode_sites, issue, originals  # noqa: E402  (tests/ is on the path)

SHA = library.index()[attention.MODULE]["sha256"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, list]:
    return decode_sites(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> dict[str, list]:
    return decode_sites(tmp_path_factory.mktemp("wide"), hidden=256, heads=4, kv_heads=2,
                        head_dim=64)


def test_the_pairs_are_the_decode_layers_attention(tiny, wide):
    for sites, split in ((tiny, "attn_decode_split_bf16"), (wide, "attn_decode_split_tc_bf16")):
        for program in ("decode", "decode_batch"):
            found = attention.pairs(sites[program], SHA)
            assert [(s.label, c.label) for s, c in found] == [
                ("l0.attention", "l0.attention"), ("l1.attention", "l1.attention")], program
            assert {s.entry for s, _ in found} == {split}
            assert {c.entry for _, c in found} == {attention.COMBINE}
        assert attention.pairs(sites["prefill"], SHA) == []
        assert attention.pairs(sites["load"], SHA) == []


def test_a_gated_foreign_or_parted_launch_makes_no_pair(tiny):
    sites = tiny["decode"]
    at = next(i for i, s in enumerate(sites) if s.entry == attention.COMBINE)
    for changed in (attrs.evolve(sites[at], when=When("tokens", 1, 4)),
                    attrs.evolve(sites[at], module="0" * 64),
                    attrs.evolve(sites[at], block=(64, 1, 1))):
        found = attention.pairs(sites[:at] + [changed] + sites[at + 1:], SHA)
        assert [s.label for s, _ in found] == ["l1.attention"]
    parted = sites[:at] + [sites[at + 1], sites[at]] + sites[at + 2:]
    assert [s.label for s, _ in attention.pairs(parted, SHA)] == ["l1.attention"]


def split_args(part=0x1000, lens=0x2000, seqs=4, nq=16, nk=8, hd=128, splits=33):
    return [0x10, 0x20, 0x30, lens, part, np.int32(seqs), np.int32(nq), np.int32(nk),
            np.int32(hd), np.int32(64), np.int32(splits), np.float32(0.088)]


def combine_args(part=0x1000, lens=0x2000, seqs=4, nq=16, hd=128, splits=33):
    return [part, lens, 0x40, np.int32(seqs), np.int32(nq), np.int32(hd), np.int32(splits)]


def test_two_launches_are_one_joined_launch_only_where_they_agree():
    assert attention.fits((4, 8, 8), split_args(), (4, 16, 1), combine_args())
    assert attention.fits((4, 8, 33), split_args(), (4, 16, 1), combine_args())
    for split, grid, combine, cgrid in (
            (split_args(part=0x1100), (4, 8, 8), combine_args(), (4, 16, 1)),
            (split_args(lens=0x2100), (4, 8, 8), combine_args(), (4, 16, 1)),
            (split_args(), (4, 8, 8), combine_args(seqs=3), (3, 16, 1)),
            (split_args(), (4, 8, 8), combine_args(hd=64), (4, 16, 1)),
            (split_args(), (4, 8, 8), combine_args(splits=32), (4, 16, 1)),
            (split_args(), (3, 8, 8), combine_args(), (4, 16, 1)),  # a grid short of seqs
            (split_args(), (4, 8, 8), combine_args(), (4, 8, 1)),
            (split_args(), (4, 8, 0), combine_args(), (4, 16, 1)),
            (split_args(nk=5), (4, 5, 8), combine_args(), (4, 16, 1)),  # 16 / 5 heads
            (split_args(nq=48, nk=4), (4, 4, 8), combine_args(nq=48), (4, 48, 1)),  # G = 12
            (split_args(seqs=4096), (4096, 8, 8), combine_args(seqs=4096), (4096, 16, 1))):
        assert not attention.fits(grid, split, cgrid, combine), (split, grid, combine, cgrid)


class Backend:
    """Records the joined launches: (function, grid, block, shared, the parameters' values)."""

    def __init__(self) -> None:
        self.launched: list[tuple] = []

    def launch_joined(self, function, grid, block, shared, params) -> None:
        import ctypes

        table = (ctypes.c_void_p * len(attention._FORMATS)).from_address(params)
        values = [struct.unpack("<" + fmt, ctypes.string_at(table[i], struct.calcsize(fmt)))[0]
                  for i, fmt in enumerate(attention._FORMATS)]
        self.launched.append((function, grid, block, shared, values))


def joined(sites: list, calls: list, backend: Backend) -> dict:
    return attention.join(backend, lambda entry, module: (entry, module), lambda: 0xC0,
                          {"p": sites}, originals(sites, calls))


def test_the_pairs_go_out_joined_and_the_rest_as_prepared(wide):
    sites, calls, backend = wide["decode_batch"], [], Backend()
    issue(sites, joined(sites, calls, backend), {"tokens": 3, "seqs": 3})
    plain: list = []
    issue(sites, originals(sites, plain), {"tokens": 3, "seqs": 3})
    assert [c for c in calls] == [c for c in plain if c[0] != "l0.attention"
                                  and c[0] != "l1.attention"]
    assert len(backend.launched) == 2
    attn = [c for c in plain if c[0] == "l0.attention"]
    (split_label, split_grid, _), _ = attn
    for function, grid, block, shared, values in backend.launched:
        assert function == ("attn_decode_joined_tc_bf16", SHA)
        assert grid == split_grid and grid[0] == 3 and block == (256, 1, 1) and shared == 0
        assert values[13] == 0xC0  # the counters
        assert values[5:9] == [3, 4, 2, 64]  # seqs, nq, nk, hd
    (l0, l1) = (next(s for s in sites if s.label == f"l{i}.attention"
                     and s.entry == attention.COMBINE) for i in range(2))
    env = {"tokens": 3, "seqs": 3}
    assert backend.launched[0][4][12] == l0.bind(l0.var_values(env))[2]  # the combine's rows
    assert backend.launched[1][4][12] == l1.bind(l1.var_values(env))[2]


def test_launches_that_do_not_agree_go_out_as_prepared(wide, monkeypatch):
    monkeypatch.setattr(attention, "COUNTS", 2)  # fewer counters than seqs * nk
    sites, calls, backend = wide["decode_batch"], [], Backend()
    plain: list = []
    issue(sites, joined(sites, calls, backend), {"tokens": 3, "seqs": 3})
    issue(sites, originals(sites, plain), {"tokens": 3, "seqs": 3})
    assert backend.launched == [] and calls == plain


def test_a_combine_without_its_split_is_an_error(wide):
    sites, calls, backend = wide["decode"], [], Backend()
    launchers = joined(sites, calls, backend)
    combine = next(s for s in sites if s.entry == attention.COMBINE)
    env = {"tokens": 1, "seqs": 1}
    with pytest.raises(RuntimeError, match="combine launch came without its split"):
        launchers[combine.number](combine.grid_at(env), 0, combine.var_values(env))


def test_no_manifest_can_launch_the_joined_kernel():
    """Its counters are the backend's memory: a plan that named it could point them anywhere."""
    from kerncc.runtime.backends.base import BackendError
    from kerncc.runtime.backends.cpu import CpuBackend

    for entry in attention.JOINED.values():
        assert library.is_internal(entry, SHA)
        assert entry in library.index()[attention.MODULE]["entries"]
        with pytest.raises(BackendError, match="a manifest cannot launch it"):
            CpuBackend().check_kernel(entry, SHA)
