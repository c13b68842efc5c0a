"""One `kerncc lower -p default,emit` computes each analysis once per manifest object (issue 14).

Verification, buffer sizes, the dataflow graph and the cut's crossing spans are memoized per
manifest object (kerncc.analysis.cache); this counts the real computations of one lowering
through the CLI and fails if any manifest object has one computed twice (before the cache,
one lowering verified 18 times and computed buffer sizes 22 times).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from kerncc.analysis import cache, dataflow, liveness
from kerncc.cli.main import main
from kerncc.verify import verify

MODEL = Path(__file__).resolve().parent.parent / "golden" / "inputs" / "layers3.json"


def _counting(monkeypatch: pytest.MonkeyPatch, target: object, attr: str,
              counts: Counter, name: str) -> None:
    real = getattr(target, attr)

    def counted(man, *args):
        counts[(name, id(man), args)] += 1
        return real(man, *args)

    monkeypatch.setattr(target, attr, counted)


def test_one_lowering_computes_each_analysis_once_per_manifest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    cache.clear()
    counts: Counter = Counter()
    _counting(monkeypatch, verify, "compute", counts, "verify")
    _counting(monkeypatch, liveness.buffer_sizes, "compute", counts, "buffer_sizes")
    _counting(monkeypatch, dataflow._graph, "compute", counts, "graph")
    _counting(monkeypatch, dataflow, "_live_spans", counts, "crossings")
    held = []  # keep every manifest alive, so no id is reused within the run
    real_entry = cache._entry
    monkeypatch.setattr(cache, "_entry", lambda man: (held.append(man), real_entry(man))[1])

    code = main(["lower", str(MODEL), "-p", "default,emit", "-o", str(tmp_path / "out")])
    capsys.readouterr()
    assert code == 0
    kinds = Counter(name for name, _, _ in counts)
    assert {"verify", "buffer_sizes", "graph", "crossings"} <= set(kinds)
    twice = {key: n for key, n in counts.items() if n > 1}
    assert not twice, f"computed more than once per manifest object: {twice}"
    # Stages a pass leaves alone stay the same object: fewer verifications than pass x stage.
    assert kinds["verify"] < 1 + 2 * 5
