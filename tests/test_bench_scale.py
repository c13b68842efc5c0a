"""bench/scale.py (issue 43's benchmark) runs end to end at `--size tiny` on the cpu backend:
every row of the table is there, with the FP8 model's decode beside bf16's, the batched step,
TTFT and serving rows (a batch past the bundle's seqs bound said so, not run), the
invariance A/B's rows, the transformers rows skipped with the reason, and --help works without
a GPU."""

from __future__ import annotations

import importlib.util
import json
import statistics
import time
from pathlib import Path

import numpy as np
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
    shown = capsys.readouterr().out
    assert "--size" in shown and "--tflops" in shown and "--out" in shown


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One tiny run on the cpu backend: its table and results.json."""
    out = tmp_path_factory.mktemp("scale")
    scale = load()
    assert scale.main(["--size", "tiny", "--steps", "2", "--prompt", "4", "--out", str(out)]) == 0
    return scale.REPORT.table(), json.loads((out / "results.json").read_text())


def test_tiny_runs_on_the_cpu_backend(tiny):
    table, results = tiny
    for name in ("import fp8", "lower bf16 2 stages", "memory fp8 whole", "startup bf16 whole",
                 "startup split fp8 whole", "startup stream bf16 2 stages",
                 "decode bf16 2 stages", "decode fp8 whole", "fp8 / bf16"):
        assert f"| {name} |" in table
    assert "FAILED" not in table
    fp8, bf16 = results["fp8 whole"], results["bf16 whole"]
    assert fp8["step_bytes"] < bf16["step_bytes"]  # FP8 linears: fewer bytes a step
    assert bf16["decode_ms"] > 0 and results["fp8_over_bf16"] > 0
    assert bf16["first_token_s"] >= bf16["load_s"] > 0
    for timing in (bf16, fp8):  # the load's split adds up to no more than the load
        split = timing["load_split"]
        parts = sum(split[k] for k in ("read", "copy", "quantize", "once", "other"))
        assert split["bytes"] > 0 and abs(parts - timing["load_s"]) < 1e-6


def test_tiny_has_the_batched_ttft_and_serving_rows(tiny):
    table, results = tiny
    # tiny's bundle takes 8 sequences: the 8-sequence step runs, 32 and 64 say why not
    batch = results["batch"]
    assert list(batch) == ["8"] and batch["8"]["step_ms"] > 0
    assert batch["8"]["roofline_ms"] > 0
    for seqs in (32, 64):
        assert f"| batch {seqs} | decode_batch step, {seqs} x 4 tokens" in table
        assert "skipped: the bundle's seqs bound is 8" in table.split(f"| batch {seqs} |")[1]
    ttft = results["ttft"]
    assert set(ttft) == {"64", "128"}
    assert ttft["128"]["roofline_ms"] > ttft["64"]["roofline_ms"] > 0
    assert all(t["ms"] > 0 for t in ttft.values()) and results["tensor_peak_flops"] > 0
    assert "| peak | bf16 peak of the TTFT roofline: numpy f32 matmul" in table
    serve = results["serve"]
    assert set(serve) == {"1", "8"}
    assert serve["1"]["tokens"] == 4 and serve["8"]["tokens"] == 8 * 4  # 4 new tokens each
    assert "| serve 64 | concurrency 64" in table
    assert "| transformers | decode, TTFT, greedy agreement | skipped: " in table


def test_a_failing_section_is_a_row_and_the_rest_still_run(tmp_path, monkeypatch):
    scale = load()

    def broken(*args, **kwargs):
        raise RuntimeError("no batch today")

    monkeypatch.setattr(scale, "batch_step_ms", broken)
    assert scale.main(["--size", "tiny", "--steps", "2", "--prompt", "4", "--out",
                       str(tmp_path)]) == 0
    table = scale.REPORT.table()
    assert "| batch | FAILED | RuntimeError: no batch today |" in table
    assert "| ttft 64 |" in table and "| serve 8 |" in table


def test_a_section_past_its_bound_is_a_row(monkeypatch):
    scale = load()
    monkeypatch.setitem(scale.LIMITS, "ttft", 0.2)
    started = time.monotonic()
    with scale.section("ttft"):
        while time.monotonic() < started + 10:  # bounded: the alarm ends it long before
            pass
    assert time.monotonic() - started < 5
    (name, what, value), = scale.REPORT.rows
    assert (name, what) == ("ttft", "FAILED") and "past its 0.2 s bound" in value


def test_bad_counts_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as done:
        load().main(["--size", "tiny", "--steps", "1"])
    assert done.value.code == 2 and "--steps must be at least 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        load().main(["--size", "tiny", "--tflops", "0"])
    assert done.value.code == 2 and "--tflops must be positive" in capsys.readouterr().err


def test_agreement_counts_argmax_matches_and_near_ties_apart():
    scale = load()
    theirs = np.array([[0.1, 2.0, -1.0, 0.5],     # argmax 1: ours 1, equal
                       [1.0, 0.995, 0.2, -0.3],   # argmax 0, ours 1: a near-tie (gap 0.005)
                       [-2.0, 0.3, 0.9, 0.4]])    # argmax 2, ours 3: a real flip (gap 0.5)
    ours = theirs + np.array([[0.0, 0.02, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0],
                              [0.0, 0.0, 0.0, -0.05]])
    found = scale.agreement([1, 1, 3], ours, theirs)
    assert found == {"diff": pytest.approx(0.05 / 2.0), "equal": 1, "ties": 1, "tokens": 3}


def test_one_failing_transformers_measure_leaves_the_others():
    scale = load()

    def failing():
        raise RuntimeError("capture failed")

    scale.attempt("transformers decode", "decode in one CUDA graph", failing)
    assert scale.REPORT.rows == [("transformers decode", "decode in one CUDA graph: FAILED",
                                  "RuntimeError: capture failed")]

    def stuck():
        raise scale.SectionTimeout("past its 1 s bound")

    with pytest.raises(scale.SectionTimeout):  # the section's bound is not swallowed
        scale.attempt("transformers ttft", "TTFT 4096", stuck)


def test_tiny_has_the_invariance_ab_rows(tiny):
    """The invariant / batch-shaped A/B: two chains a round, two rounds, the 8-sequence step
    (the batch-1 graph row is cuda's); the tax is computed from the two medians."""
    table, results = tiny
    ab = results["invariant"]
    assert list(ab) == ["8"]
    assert len(ab["8"]["invariant_ms"]) == len(ab["8"]["shaped_ms"]) == 2
    assert all(t > 0 for t in ab["8"]["invariant_ms"] + ab["8"]["shaped_ms"])
    on, off = (statistics.median(ab["8"][k]) for k in ("invariant_ms", "shaped_ms"))
    assert (f"| invariant 8 | decode_batch step, 8 x 4 tokens: invariant / batch-shaped ms, "
            f"tax | {on:.3f} / {off:.3f}, {(on / off - 1) * 100:+.1f}% |") in table
