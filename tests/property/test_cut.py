"""Every cut that is made computes the whole; every refusal is a documented reason (spec §3.9)."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kerncc import symbolic
from kerncc.manifest import reader
from kerncc.diagnostics import KernccError
from kerncc.ir import IR
from kerncc.passes.cut import cut_ir, cut_manifest
from tests.random_manifests import Xorshift, examples, random_manifest, random_points
from kerncc.verify import verify

DOCUMENTED = ("touched by stages", "passes through untouched")


def _draw_manifest(data: st.DataObject):
    choose = lambda n: data.draw(st.integers(0, n - 1))  # noqa: E731
    options = dict(driven=data.draw(st.integers(1, 2)), inits=data.draw(st.booleans()),
                   derives=data.draw(st.booleans()), per_layer_states=data.draw(st.booleans()))
    man = reader.from_raw(random_manifest(choose, **options))
    calls = min(len(man.programs[p].calls) for p in man.driven_programs())
    points = tuple(random_points(choose, calls))
    return man, points


def _check_cut(man, points) -> list[str] | None:
    """None when the cut is made and proved; else the refusal messages."""
    verify(man)
    try:
        stages, _ = cut_manifest(man, {p: points for p in man.driven_programs()})
    except KernccError as err:
        return err.messages()
    assert len(stages) == len(points) + 1
    for s, stage in enumerate(stages):
        assert (stage.cut.stage, stage.cut.stages) == (s, len(points) + 1)
        assert stage.topology is None
        assert set(stage.ops) <= set(man.ops)
        verify(stage)
    symbolic.check_stages(man, stages)
    return None


@settings(max_examples=examples(400, 10_000))
@given(st.data())
def test_every_cut_that_is_made_computes_the_whole(data: st.DataObject) -> None:
    man, points = _draw_manifest(data)
    refusals = _check_cut(man, points)
    for message in refusals or ():
        assert any(reason in message for reason in DOCUMENTED), message


def test_kern_seeds_cut_often_and_refuse_sometimes() -> None:
    """kern's own 400 seeds: over 200 cuts made, and some refused (spec §3.9)."""
    made = refused = 0
    for seed in range(1, 401):
        rng = Xorshift(seed)
        man = reader.from_raw(random_manifest(rng))
        points = tuple(random_points(rng, len(man.programs["p"].calls)))
        refusals = _check_cut(man, points)
        if refusals is None:
            made += 1
        else:
            refused += 1
            assert all(any(r in msg for r in DOCUMENTED) for msg in refusals)
    assert made > 200 and refused > 0


def _seeded(seed: int = 3):
    rng = Xorshift(seed)
    return reader.from_raw(random_manifest(rng))


@pytest.mark.parametrize("points", [(), (0,), (5, 5), (2, 1)])
def test_a_cut_says_why_it_cannot_be_made(points) -> None:
    man = _seeded()
    with pytest.raises(KernccError, match="at least one, increasing, none at 0"):
        cut_manifest(man, {"p": points})


def test_a_point_past_the_end_is_refused() -> None:
    man = _seeded()
    n = len(man.programs["p"].calls)
    with pytest.raises(KernccError, match=f"program `p` has {n} calls; it cannot be cut before "
                                          f"call {n}"):
        cut_manifest(man, {"p": (n,)})


def _first_proved_cut():
    for seed in range(1, 100):
        rng = Xorshift(seed)
        man = reader.from_raw(random_manifest(rng, inits=True))
        points = (len(man.programs["p"].calls) // 2,)
        try:
            ir = cut_ir(IR.from_manifest(man), {"p": points})
        except KernccError:
            continue
        return man, list(ir.stages)
    raise AssertionError("no seed cut")


def test_the_proof_notices_a_missing_call() -> None:
    man, stages = _first_proved_cut()
    symbolic.check_stages(man, stages)
    program = stages[0].programs["p"]
    broken = attrs.evolve(stages[0], programs={**stages[0].programs,
                                               "p": attrs.evolve(program,
                                                                 calls=program.calls[1:])})
    with pytest.raises(KernccError, match="the stages do not compute the whole"):
        symbolic.check_stages(man, [broken, *stages[1:]])


def test_the_proof_notices_a_call_reading_the_wrong_value() -> None:
    man, stages = _first_proved_cut()
    last = stages[-1]
    program = last.programs["p"]
    call = program.calls[-1]
    swapped = attrs.evolve(call, label="someone else")
    broken = attrs.evolve(last, programs={**last.programs, "p": attrs.evolve(
        program, calls=program.calls[:-1] + (swapped,))})
    with pytest.raises(KernccError) as err:
        symbolic.check_stages(man, [*stages[:-1], broken])
    assert "output buffer `y` differs" in str(err.value)
    assert "someone else" in str(err.value)
