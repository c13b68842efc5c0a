"""bench/scale.py (issue 43's benchmark) runs end to end at `--size tiny` on the cpu backend:
every row of the table is there, with the FP8 model's decode beside bf16's, and --help works
without a GPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "scale.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_scale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_needs_no_gpu(capsys):
    with pytest.raises(SystemExit) as done:
        load().main(["--help"])
    assert done.value.code == 0
    assert "--size" in capsys.readouterr().out


def test_tiny_runs_on_the_cpu_backend(tmp_path, capsys):
    scale = load()
    assert scale.main(["--size", "tiny", "--steps", "2", "--prompt", "4", "--out",
                       str(tmp_path)]) == 0
    table = capsys.readouterr().out
    for name in ("import fp8", "lower bf16 2 stages", "memory fp8 whole", "startup bf16 whole",
                 "startup split fp8 whole", "startup stream bf16 2 stages",
                 "decode bf16 2 stages", "decode fp8 whole", "fp8 / bf16"):
        assert name in table
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    fp8, bf16 = results["fp8 whole"], results["bf16 whole"]
    assert fp8["step_bytes"] < bf16["step_bytes"]  # FP8 linears: fewer bytes a step
    assert bf16["decode_ms"] > 0 and results["fp8_over_bf16"] > 0
    assert bf16["first_token_s"] >= bf16["load_s"] > 0
    for timing in (bf16, fp8):  # the load's split adds up to no more than the load
        split = timing["load_split"]
        parts = sum(split[k] for k in ("read", "copy", "quantize", "once", "other"))
        assert split["bytes"] > 0 and abs(parts - timing["load_s"]) < 1e-6


def test_bad_counts_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as done:
        load().main(["--size", "tiny", "--steps", "1"])
    assert done.value.code == 2 and "--steps must be at least 2" in capsys.readouterr().err
