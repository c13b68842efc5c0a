"""persist_ws_bf16's plan, the host side (runtime/backends/persist.py: `ws_units`, `ws_plan`,
`ws_steps`; no GPU: tests/test_persist_ws_cuda.py and tests/test_persist_cuda.py run the kernel).

What must hold: the constants and the unit layout are the kernel's; a decode layer's run plans as
units (a GEMV and the small launch before it that computes its x) in one launch, its stores left
out exactly where a later unit overwrites them; every read resolves to the launch's input or to
the one earlier output it is (a model of the launches in order agrees, for random chains); and a
launch ends wherever a read, a store or the shadow region would break that: a store over what a
unit it did not wait for reads, a read of part of an output, a store over a weight.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kerncc.kernels import library
from kerncc.runtime.backends import persist

from test_persist import WIDE, decode_sites

SOURCE = Path(library.__file__).resolve().parent / "persist.cu"
SHADOW, WORDS, SHARED = 1 << 44, persist.WS_SHADOW_WORDS, 221440
FIELDS = ("w x r gamma c y y_tag side side_tag res res_tag op pre tagged m n k warps tasks "
          "first threads width block eps pad").split()


def units_of(launch: persist.WsLaunch) -> list[dict]:
    return [dict(zip(FIELDS, persist.WS_UNIT.unpack_from(launch.table, i * persist.WS_UNIT.size)))
            for i in range(launch.count)]


def define(name: str) -> int:
    return int(re.search(rf"#define {name} (\S+)", SOURCE.read_text()).group(1).strip("()"))


def test_the_constants_and_the_unit_layout_are_the_kernels():
    text = SOURCE.read_text()
    assert f"sizeof(Unit) == {persist.WS_UNIT.size}" in text
    assert define("WS_CONSUMERS") + 32 == persist.WS_THREADS
    assert define("WS_MAX_UNITS") == persist.WS_MAX_UNITS
    assert "#define WS_PITCH (2048 + 64)" in text and "#define WS_STAGE (16 * WS_PITCH)" in text
    assert persist.WS_STAGE == 16 * (2048 + 64)
    assert f"bars[2 * {persist.WS_MAX_STAGES}]" in text
    for name, value in (("PRE_NONE", persist.PRE_NONE), ("PRE_RMSNORM", persist.PRE_RMSNORM),
                        ("PRE_ADD_RMSNORM", persist.PRE_ADD_RMSNORM),
                        ("PRE_SILU", persist.PRE_SILU), ("TAGGED_X", persist.TAGGED_X),
                        ("TAGGED_R", persist.TAGGED_R), ("TAGGED_C", persist.TAGGED_C)):
        assert define(name) == value, name
    body = text[text.index("struct Unit {"):text.index("static_assert(sizeof(Unit)")]
    code = "\n".join(line.split("//")[0] for line in body.splitlines()[1:])
    declared = re.findall(r"(\w+)\s*[,;]", code)
    assert declared == FIELDS, declared
    assert persist.WS_ENTRY in library.INTERNAL


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> dict[str, list]:
    return decode_sites(tmp_path_factory.mktemp("wide"), **WIDE)


def planned(sites, env, max_m: int = 1) -> list[list]:
    modules = persist.library_modules()
    out = []
    for run in persist.runs(sites, modules):
        phases = [persist.phase(s, s.grid_at(env), s.var_values(env)) for s in run]
        out.append(persist.ws_steps(phases, SHADOW, WORDS, max_m, SHARED))
    return out


def test_a_decode_layer_plans_as_its_four_units_in_one_launch(wide):
    steps = planned(wide["decode"], {"tokens": 1, "seqs": 1})
    assert [[s[0].count for s in run] for run in steps] == [[1], [4], [3]]
    first, layer, last = (units_of(run[0][0]) for run in steps)
    P = persist
    assert [u["pre"] for u in layer] == [P.PRE_NONE, P.PRE_ADD_RMSNORM, P.PRE_SILU, P.PRE_RMSNORM]
    assert [u["op"] for u in layer] == [0, 0, 1, 0]
    assert [u["warps"] for u in layer] == [16, 8, 16, 8]  # the GEMV launches' own tiles
    assert [u["first"] for u in layer] == [0, 128, 256, 384]
    o_proj, gate_up, down, qkv = layer
    # o_out, gate_up, the residual after post_norm and after down pass as tagged words
    assert gate_up["x"] == o_proj["y_tag"] != 0 and gate_up["tagged"] == P.TAGGED_X
    assert down["x"] == gate_up["y_tag"] and down["c"] == gate_up["res_tag"] != 0
    assert down["tagged"] == P.TAGGED_X | P.TAGGED_C
    assert qkv["x"] == down["y_tag"] and qkv["tagged"] == P.TAGGED_X
    # post_norm's stores are overwritten whole later in the launch (residual by down, normed
    # by the next input_norm): left out; down's C is the residual post_norm made
    assert gate_up["res"] == 0 and gate_up["side"] == 0
    assert down["y"] == gate_up["r"] and down["side"] != 0  # residual; act stays
    assert qkv["side"] != 0 and qkv["y"] != 0 and qkv["y_tag"] == 0  # nothing reads qkv after
    # in the last run nothing overwrites post_norm's normed
    assert last[1]["side"] != 0 and last[1]["res"] == 0
    assert first[0]["tagged"] == 0 and first[0]["pre"] == P.PRE_RMSNORM
    # the shadows do not overlap and fit the region
    tags = sorted((u[f] - SHADOW, f) for u in layer for f in ("y_tag", "res_tag", "side_tag")
                  if u[f])
    assert [t for t, _ in tags] == sorted({t for t, _ in tags})
    assert all(t % 16 == 0 and t < 4 * WORDS for t, _ in tags)


def test_rows_past_max_m_go_launch_by_launch(wide):
    for run in planned(wide["decode_batch"], {"tokens": 2, "seqs": 2}):
        assert all(isinstance(s, int) for s in run)
        assert run == list(range(len(run)))
    assert all(len(run) == 1 for run in planned(wide["decode_batch"],
                                                {"tokens": 2, "seqs": 2}, max_m=2))


# ---- synthetic chains: the hazards ----------------------------------------------------------

K = 2048  # a GEMV of k = n = 2048 at m = 1: 4 KB in, 4 KB out
OUT = 2 * K


def gemv(x: int, w: int, y: int, acc: bool = False) -> persist.Phase:
    return persist.Phase(persist.GEMV_ACC if acc else persist.GEMV, K // 16, 1, K, K, warps=16,
                         pointers=(x, w, y, 0))


def norm(x: int, gamma: int, y: int) -> persist.Phase:
    return persist.Phase(persist.RMSNORM, 1, 1, K, threads=256, eps=1e-6,
                         pointers=(x, gamma, y, 0))


def W(i: int) -> int:
    return (1 << 40) + i * (1 << 24)


def B(i: int) -> int:
    return (1 << 36) + i * (1 << 20)


def launches(phases) -> list:
    steps = persist.ws_steps(phases, SHADOW, WORDS, 8, SHARED)
    return [s if isinstance(s, int) else s[0].count for s in steps]


def test_a_store_over_an_input_it_did_not_wait_for_ends_the_launch():
    # unit 1 does not read unit 0's output, so it may store over unit 0's x before unit 0's
    # blocks have read it
    assert launches([gemv(B(0), W(0), B(1)), gemv(B(2), W(1), B(0))]) == [1, 1]
    # when it reads unit 0's output, every block of unit 0 has read x first
    assert launches([gemv(B(0), W(0), B(1)), gemv(B(1), W(1), B(0))]) == [2]


def test_a_read_of_part_of_an_output_ends_the_launch():
    assert launches([gemv(B(0), W(0), B(1)), gemv(B(1) + 16, W(1), B(2))]) == [1, 1]


def test_a_store_over_a_weight_ends_the_launch():
    assert launches([gemv(B(0), W(0), W(5)), gemv(B(1), W(5), B(2))]) == [1, 1]


def test_a_gemv_storing_over_its_own_c_is_one_unit():
    assert launches([gemv(B(0), W(0), B(1), acc=True)]) == [1]
    unit = units_of(persist.ws_steps([gemv(B(0), W(0), B(1), acc=True)], SHADOW, WORDS, 8,
                                     SHARED)[0][0])[0]
    assert unit["c"] == unit["y"] == B(1) and unit["tagged"] == 0


def test_a_norm_in_place_goes_launch_by_launch():
    """Its block 0 would store over the x the other blocks still fold."""
    assert launches([norm(B(0), W(0), B(0)), gemv(B(0), W(1), B(1))]) == [0, 1]
    # unless a later unit overwrites it whole, so the store is left out
    assert launches([norm(B(0), W(0), B(0)), gemv(B(0), W(1), B(1)),
                     gemv(B(1), W(2), B(0))]) == [2]


def test_a_small_launch_no_gemv_reads_goes_alone():
    assert launches([gemv(B(0), W(0), B(1)), norm(B(1), W(1), B(2))]) == [1, 1]
    assert launches([norm(B(0), W(0), B(1)), gemv(B(2), W(1), B(3))]) == [0, 1]


def test_the_shadow_region_bounds_a_launch():
    chain = [gemv(B(i), W(i), B(i + 1)) for i in range(4)]
    steps = persist.ws_steps(chain, SHADOW, 2 * K, 8, SHARED)  # room for two outputs' words
    assert [s[0].count for s in steps] == [3, 1]
    assert all(s[0].words <= 2 * K for s in steps)


def test_no_launch_takes_more_units_than_the_table():
    chain = [gemv(B(i), W(i), B(i + 1)) for i in range(persist.WS_MAX_UNITS + 3)]
    assert launches(chain) == [persist.WS_MAX_UNITS, 3]


# ---- the plan against the launches in order, for random chains ----------------------------------

@st.composite
def chains(draw):
    """Up to 8 GEMVs (some with C) and norms over 4 activation buffers."""
    phases = []
    for i in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["gemv", "acc", "norm"]))
        x, y = draw(st.integers(0, 3)), draw(st.integers(0, 3))
        if kind == "norm":
            phases.append(norm(B(x), W(100 + i), B(y)))
        else:
            phases.append(gemv(B(x), W(i), B(y), acc=kind == "acc"))
    return phases


@given(chains())
def test_every_read_is_the_value_the_launches_in_order_give(phases):
    """Model: memory as versions (the launch and output that last stored a range). Each planned
    launch must read, for each of its unit's sources, exactly the version the launches in order
    read, from where the plan says (the launch's input: plain; an earlier unit's output: its
    shadow); its plain stores, applied in order, leave what the launches leave."""
    steps = persist.ws_steps(phases, SHADOW, WORDS, 8, SHARED)
    # the launches in order
    memory: dict[int, tuple] = {}
    reads_seq: dict[int, dict[str, tuple]] = {}
    for i, p in enumerate(phases):
        a, w, c, _ = p.pointers
        if p.kind == persist.RMSNORM:
            reads_seq[i] = {"x": memory.get(a, ("input", a))}
            memory[c] = (i, "y")
        else:
            reads_seq[i] = {"x": memory.get(a, ("input", a))}
            if p.kind == persist.GEMV_ACC:
                reads_seq[i]["c"] = memory.get(c, ("input", c))
            memory[c] = (i, "y")
    final_seq = dict(memory)
    # the plan
    memory, done = {}, []
    for step in steps:
        if isinstance(step, int):
            p = phases[step]
            memory[p.pointers[2]] = (step, "y")
            done.append(step)
            continue
        launch = step[0]
        units = units_of(launch)
        start = len(done)
        order: list[int] = []
        j = start
        for u in units:  # which phases this launch stands for, in order
            pre = 1 if u["pre"] != persist.PRE_NONE else 0
            order.append(j + pre)
            j += 1 + pre
        shadows: dict[int, tuple] = {}
        inputs = dict(memory)
        for gi, u in zip(order, units):
            p = phases[gi]
            x_phase = phases[gi - 1] if u["pre"] != persist.PRE_NONE else p
            want = reads_seq[gi - 1 if u["pre"] != persist.PRE_NONE else gi]["x"]
            got = (shadows[u["x"]] if u["tagged"] & persist.TAGGED_X else
                   inputs.get(u["x"], ("input", u["x"])))
            assert got == want and u["x"] == (x_phase.pointers[0] if not
                                              u["tagged"] & persist.TAGGED_X else u["x"])
            if u["op"] == persist.OP_GEMV_ACC:
                got = (shadows[u["c"]] if u["tagged"] & persist.TAGGED_C else
                       inputs.get(u["c"], ("input", u["c"])))
                assert got == reads_seq[gi]["c"]
            for plain, tag, version in ((u["side"], u["side_tag"], (gi - 1, "y")),
                                        (u["y"], u["y_tag"], (gi, "y"))):
                if plain:
                    memory[plain] = version
                if tag:
                    shadows[tag] = version
        done += list(range(start, j))
    assert done == list(range(len(phases)))
    # what the launches leave, for every range a plain store could reach
    for pointer, version in final_seq.items():
        assert memory.get(pointer) == version, pointer


# ---- the decode attention as units: the whole step in one launch ------------------------------


def ws_planned(sites, env, max_m: int = 1, extent=None) -> list[list]:
    modules = persist.library_modules(persist.WS_KERNEL_KINDS)
    out = []
    for run in persist.runs(sites, modules, persist.WsKernel.limit):
        phases = [persist.phase(s, s.grid_at(env), s.var_values(env)) for s in run]
        out.append((run, persist.ws_steps(phases, SHADOW, WORDS, max_m, SHARED, extent)))
    return out


def test_the_decode_step_plans_as_one_launch_attention_included(wide):
    (run, steps), = ws_planned(wide["decode"], {"tokens": 1, "seqs": 1})
    assert run[0].label == "l0.input_norm" and run[-1].label == "l1.down_proj"
    assert len(steps) == 1 and not isinstance(steps[0], int)
    units = units_of(steps[0][0])
    P = persist
    assert [u["op"] for u in units] == [P.OP_GEMV, P.OP_ROPE, P.OP_SPLIT, P.OP_GEMV, P.OP_GEMV,
                                        P.OP_GEMV_ACC] * 2
    assert [u["pre"] for u in units][:6] == [P.PRE_RMSNORM, P.PRE_NONE, P.PRE_NONE,
                                             P.PRE_COMBINE, P.PRE_ADD_RMSNORM, P.PRE_SILU]
    for layer in (0, 6):
        qkv, rope, split, o_proj = units[layer:layer + 4]
        # the rope reads the qkv GEMV's tagged words and stores qkv whole, so the GEMV's own
        # plain store is left out; the KV slot is the state's
        assert rope["x"] == qkv["y_tag"] != 0 and rope["tagged"] == P.TAGGED_X
        assert qkv["y"] == 0 and rope["y"] != 0 and rope["res"] != 0
        # the split waits for the rope's count, the combine (in o_proj's staging) for the split's
        assert (split["threads"], split["width"]) == (layer + 1, rope["tasks"])
        assert (o_proj["threads"], o_proj["width"]) == (layer + 2, split["tasks"])
        assert split["tasks"] == 1 * 8 * split["pad"]  # seqs x kv heads x max_splits
        assert split["y"] == o_proj["x"] != 0  # the partials: stored plain, every layer
        # attn_out: left out where the next layer's combine overwrites it whole
        assert (o_proj["side"] != 0) == (layer == 6)
    # a split's staging fits x's place in shared memory, rows aligned off the bank period
    launch = steps[0][0]
    assert 2 * launch.xrow >= max(persist.Unit(persist.Phase(persist.SPLIT, 1, 1, 16, 8), None,
                                               (0,)).scratch(), 0)
    assert launch.xrow % 64 == 32


def test_every_row_count_plans_with_aligned_x_rows(wide):
    for seqs in (1, 2, 3, 5, 8):
        for run, steps in ws_planned(wide["decode_batch"], {"tokens": seqs, "seqs": seqs}, 8):
            launches = [s[0] for s in steps if not isinstance(s, int)]
            assert launches, seqs
            for launch in launches:
                assert launch.xrow % 64 == 32 and launch.m == seqs
                split = persist.Unit(persist.Phase(persist.SPLIT, 1, seqs, 16, 8), None, (0,))
                assert 2 * seqs * launch.xrow >= split.scratch()


def test_a_split_reads_q_only_after_a_rope_counts_it():
    """A GEMV's output passes as tagged words, which a split does not read: a split after a
    GEMV that wrote its q (no rope between) goes in a launch of its own."""
    split = persist.Phase(persist.SPLIT, 1 * 8 * 2, 1, 16, 8, eps=0.088,
                          pointers=(B(0), W(50), B(2), B(3), B(4)), extra=(16, 2))
    q = persist.Phase(persist.GEMV, 4096 // 32, 1, 4096, K, warps=8,
                      pointers=(B(1), W(0), B(0), 0))
    steps = persist.ws_steps([q, split], SHADOW, WORDS, 8, SHARED)
    assert [s if isinstance(s, int) else s[0].count for s in steps] == [1, 1]


def test_attention_launches_it_cannot_take_are_no_phase():
    rope = (16, 32, 48, 64, 80, 96, 1, 16, 8, 128, 1e-6)
    assert persist.attention_phase(persist.ROPE, rope, (1, 1, 1)).tasks == 1
    assert persist.attention_phase(persist.ROPE, rope[:9] + (64,) + rope[10:], (1, 1, 1)) is None
    assert persist.attention_phase(persist.ROPE, (24,) + rope[1:], (1, 1, 1)) is None  # rows128
    split = (16, 32, 48, 64, 80, 2, 16, 8, 128, 16, 4, 0.088)
    assert persist.attention_phase(persist.SPLIT, split, (2, 8, 4)).tasks == 2 * 8 * 4
    assert persist.attention_phase(persist.SPLIT, split, (1, 8, 4)) is None  # a sequence left
    assert persist.attention_phase(persist.SPLIT, split[:6] + (12,) + split[7:], (2, 8, 4)) is None
    combine = (16, 32, 48, 2, 16, 128, 4)
    assert persist.attention_phase(persist.COMBINE, combine, (2, 16, 1)).tasks == 32
    assert persist.attention_phase(persist.COMBINE, combine, (2, 8, 1)) is None


@st.composite
def attention_chains(draw):
    """Decode-layer-shaped chains (qkv GEMV, rope, split, combine + o_proj) whose buffers are
    drawn from small pools, so they alias now and then."""
    phases = []
    for layer in range(draw(st.integers(1, 3))):
        qkv, kv = B(draw(st.integers(0, 2))), W(200 + draw(st.integers(0, 1)))
        part, out = B(10 + draw(st.integers(0, 1))), B(20 + draw(st.integers(0, 1)))
        phases.append(persist.Phase(persist.GEMV, 4096 // 32, 1, 4096, K, warps=8,
                                    pointers=(B(30 + layer), W(layer), qkv, 0)))
        if draw(st.booleans()):
            phases.append(persist.Phase(persist.ROPE, 1, 1, 16, 8, eps=1e-6,
                                        pointers=(qkv, W(100), B(40), W(101), B(41), kv)))
        phases.append(persist.Phase(persist.SPLIT, 8 * 2, 1, 16, 8, eps=0.088,
                                    pointers=(qkv, kv, B(42), B(43), part), extra=(16, 2)))
        phases.append(persist.Phase(persist.COMBINE, 16, 1, 16, pointers=(part, B(43), out),
                                    extra=(2,)))
        phases.append(persist.Phase(persist.GEMV, K // 16, 1, K, K, warps=16,
                                    pointers=(out, W(50 + layer), B(30 + layer + 1), 0)))
    return phases


def extent(pointer: int) -> tuple[int, int]:
    """Every buffer of these chains is its own allocation of 64 KB (a KV state included)."""
    return pointer - pointer % (1 << 16), 1 << 16


def outputs(p: persist.Phase) -> list[int]:
    if p.kind == persist.ROPE:
        return [p.pointers[0], p.pointers[5]]
    return [p.pointers[4] if p.kind == persist.SPLIT else p.pointers[2]]


@given(attention_chains())
def test_counted_reads_wait_for_the_unit_the_launches_in_order_say_wrote_them(phases):
    """For each planned launch: a split reads q and the KV state only after the count of the
    rope that last wrote them in the launch (or reads the launch's input when none did), the
    combine reads the partials after the split that wrote them, and a rope reads the tagged
    words of the GEMV that wrote its qkv."""
    steps = persist.ws_steps(phases, SHADOW, WORDS, 8, SHARED, extent)
    done = 0
    for step in steps:
        if isinstance(step, int):
            done = step + 1
            continue
        launch = step[0]
        units = units_of(launch)
        # the launches this launch stands for, and the unit each one is part of
        owner, j = {}, done
        for u, unit in enumerate(units):
            span = 2 if unit["pre"] != persist.PRE_NONE else 1
            for i in range(j, j + span):
                owner[i] = u
            j += span
        for i in range(done, j):  # each read's last writer among the launches before it
            p = phases[i]
            def last_writer(pointer, size):
                for w in range(i - 1, done - 1, -1):
                    if any(extent(o)[0] == extent(pointer)[0] for o in outputs(phases[w])):
                        return w
                return None
            unit = units[owner[i]]
            if p.kind == persist.SPLIT:
                writer = last_writer(p.pointers[0], 1)
                if writer is None:
                    assert unit["threads"] == -1
                else:
                    assert phases[writer].kind == persist.ROPE
                    assert unit["threads"] == owner[writer]
                    assert unit["width"] == units[owner[writer]]["tasks"]
            if p.kind == persist.COMBINE:
                writer = last_writer(p.pointers[0], 1)
                waited = units[owner[i]]
                if writer is None:
                    assert waited["threads"] == -1
                else:
                    assert phases[writer].kind == persist.SPLIT
                    assert waited["threads"] == owner[writer]
            if p.kind == persist.ROPE:
                writer = last_writer(p.pointers[0], 1)
                if writer is None:
                    assert unit["tagged"] == 0 and unit["x"] == p.pointers[0]
                else:
                    assert unit["tagged"] == persist.TAGGED_X
                    assert unit["x"] == units[owner[writer]]["y_tag"] != 0
        done = j
    assert done == len(phases)
