"""kerncc.serve.pack: the spec's cases (§6.2) and its exhaustive property test."""

from __future__ import annotations

import itertools

import pytest

from kerncc.serve.pack import Bounds, Waiting, pack

B = Bounds(rows=8, seqs=3, context=20)


@pytest.mark.parametrize("seqs, plan", [
    ([(0, 5), (0, 5), (0, 5)], [(0, 5), (1, 3)]),
    ([(0, 20)], [(0, 8)]),
    ([(0, 1)] * 4, [(0, 1), (1, 1), (2, 1)]),
    ([(4, 0), (0, 2)], [(1, 2)]),
    ([], []),
    ([(16, 8), (0, 8)], [(0, 4)]),
    ([(10, 2), (0, 8)], [(0, 2), (1, 6)]),
    ([(20, 2)], []),
])
def test_the_spec_cases(seqs, plan):
    assert pack([Waiting(pos, left) for pos, left in seqs], B) == plan


def drain(seqs: list[Waiting]) -> list[int]:
    """Apply plans until nothing is left; the rows each sequence was sent."""
    sent = [0] * len(seqs)
    for _ in range(sum(s.left for s in seqs) + 1):
        plan = pack(seqs, B)
        if not plan:
            break
        indices = [i for i, _ in plan]
        assert indices == sorted(set(indices))
        assert indices[0] == next(i for i, s in enumerate(seqs) if s.left > 0)
        assert sum(n for _, n in plan) <= B.rows and len(plan) <= B.seqs
        assert sum(seqs[i].pos + n for i, n in plan) <= B.context
        for i, n in plan:
            assert 0 < n <= seqs[i].left
            sent[i] += n
            seqs[i] = Waiting(seqs[i].pos + n, seqs[i].left - n)
    assert all(s.left == 0 for s in seqs), "everything drains"
    return sent


def test_every_row_is_sent_exactly_once_and_everything_drains():
    cases = 0
    for a, b, c in itertools.product(range(4), range(4), range(10)):
        for first_pos in (0, 1, 2):
            seqs = [Waiting(first_pos, a), Waiting(0, b), Waiting(0, c)]
            assert drain(list(seqs)) == [a, b, c]
            cases += 1
    assert cases == 480
