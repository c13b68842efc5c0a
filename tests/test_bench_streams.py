"""bench/streams.py on the CPU: a tiny run (a prompt and its answer past the size's context,
so the example is generated with a longer one) writes a row for every hold value
with the measures named, keeps every round's figures in results.json, and a bad flag or an
example it cannot build ends in one line naming it, before anything is written."""

from __future__ import annotations

import json

import pytest

from bench.streams import main


def test_a_tiny_run_measures_every_hold(tmp_path, capfd):
    out = tmp_path / "out"
    assert main(["--size", "tiny", "--backend", "cpu", "--dir", str(tmp_path / "models"),
                 "--levels", "3", "--prompt-len", "5", "--max-tokens", "254",
                 "--hold-steps", "4,0", "--out", str(out)]) == 0
    table = capfd.readouterr().out
    for hold in (4, 0):
        assert f"| 3 streams | hold_steps {hold}: tokens/s" in table
    results = json.loads((out / "results.json").read_text())
    runs = results["3"]["4"]
    assert len(runs) == 2 and all(run["tok_s"] > 0 for run in runs)  # two rounds
    assert all(run["ttft_p99"] >= run["ttft_p50"] > 0 for run in runs)
    assert results["3"]["step_ms"] is None  # cpu: the median gap stands in


@pytest.mark.parametrize("argv, says", [
    (["--levels", "0"], "concurrencies of at least 1"),
    (["--levels", "a,b"], "expected concurrencies like 32,128"),
    (["--hold-steps", "8,-1"], "steps of at least 0"),
    (["--max-tokens", "1"], "--max-tokens 1: at least 2"),
    (["--sampled", "1.5"], "expected a fraction in [0, 1], got 1.5"),
    (["--backend", "sim", "--step-ms", "inf"], "expected 0 < milliseconds < 10000, got inf"),
    (["--backend", "cpu", "--step-ms", "2"], "the simulated device's"),
    (["--size", "tiny", "--levels", "5000"], "max_seqs must not exceed max_tokens"),
])
def test_a_bad_flag_is_one_line_naming_it(argv, says, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--dir", str(tmp_path / "models")])
    assert not (tmp_path / "models").exists()  # refused before anything is written
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert says in err and "Traceback" not in err
