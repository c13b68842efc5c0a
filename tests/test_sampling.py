"""Sampling on the cpu backend: the numpy reference of sample_f32 and the runtime's API.

The draws follow softmax(logits / T) (total variation over many steps of one seed), a seed
and counter reproduce a token, temperature 0 and top-k 1 are greedy (the manifest's argmax),
top-k and top-p keep exactly the tokens they should, bad parameters are refused naming the
parameter, and `kerncc run` samples reproducibly with --seed.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kerncc.diagnostics import KernccError
from kerncc.kernels import sampling_ref as ref
from kerncc.runtime.sampling import SamplingParams, pack, sample_logits

PROBS = np.array([0.35, 0.25, 0.15, 0.1, 0.07, 0.05, 0.02, 0.01], np.float32)
LOGITS = np.log(PROBS)[None, :]


def draws(logits: np.ndarray, params: SamplingParams, n: int) -> np.ndarray:
    return sample_logits(logits, [0] * n, [params] * n, [(0, s) for s in range(n)])


def softmax(z: np.ndarray) -> np.ndarray:
    p = np.exp(z - z.max())
    return p / p.sum()


def test_philox_known_answers():
    # Random123's kat_vectors for philox4x32_10.
    assert ref.philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C,
                                                        0x9B00DBD8)
    m = 0xFFFFFFFF
    assert ref.philox4x32_10((m, m, m, m), (m, m)) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6,
                                                        0x6D5451FD)
    assert ref.philox4x32_10((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
                             (0xA4093822, 0x299F31D0)) == (0xD16CFE09, 0x94FDCCEB, 0x5001E420,
                                                           0x24126EA1)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_distribution_follows_softmax(temperature):
    n = 20000
    seen = np.bincount(draws(LOGITS, SamplingParams(temperature, seed=9), n), minlength=8) / n
    want = softmax(LOGITS[0].astype(np.float64) / temperature)
    tv = 0.5 * np.abs(seen - want).sum()
    assert tv < 0.015, (seen, want)  # 20000 draws of 8 outcomes: TV noise is about 0.006


def test_top_k_and_top_p_keep_the_right_tokens():
    n = 4000
    got = draws(LOGITS, SamplingParams(1.0, top_k=3, seed=1), n)
    assert set(got.tolist()) == {0, 1, 2}
    seen = np.bincount(got, minlength=3) / n
    assert 0.5 * np.abs(seen - PROBS[:3] / PROBS[:3].sum()).sum() < 0.03
    # top-p 0.58: 0.35 + 0.25 = 0.60 holds it (the fewest top tokens); 0.62 needs a third
    assert set(draws(LOGITS, SamplingParams(1.0, top_p=0.58, seed=2), n).tolist()) == {0, 1}
    assert set(draws(LOGITS, SamplingParams(1.0, top_p=0.3, seed=3), n).tolist()) == {0}
    assert set(draws(LOGITS, SamplingParams(1.0, top_p=0.62, seed=4), n).tolist()) == {0, 1, 2}
    # both: top-k first, then top-p of what is left (0.35 / 0.75 < 0.5 <= 0.6 / 0.75)
    both = SamplingParams(1.0, top_k=3, top_p=0.5, seed=5)
    assert set(draws(LOGITS, both, n).tolist()) == {0, 1}


def test_ties_at_the_boundary_stay():
    x = np.array([[3.0, 1.0, 3.0, 2.0, 3.0]], np.float32)
    assert set(draws(x, SamplingParams(1.0, top_k=1, seed=1), 600).tolist()) == {0, 2, 4}


@settings(max_examples=40)
@given(st.integers(2, 64), st.integers(0, 2**64 - 1), st.integers(0, 2**32), st.data())
def test_greedy_paths_are_argmax(vocab, seed, step, data):
    rng = np.random.default_rng(seed % 2**32)
    x = (rng.standard_normal((1, vocab)) * 5).astype(np.float32)
    first = int(np.argmax(x[0]))
    t = data.draw(st.floats(0.05, 5.0))
    for params in (SamplingParams(0.0, seed=seed), SamplingParams(t, top_k=1, seed=seed),
                   SamplingParams(), SamplingParams(0.0, top_k=5, top_p=0.3)):
        assert sample_logits(x, [0], [params], [(3, step)])[0] == first


def test_greedy_keeps_the_argmax_op_on_ties():
    x = np.array([[1.0, 7.0, 7.0, -np.inf]], np.float32)
    assert sample_logits(x, [0], [SamplingParams()], [(0, 0)])[0] == 1
    tokens = np.zeros(1, np.int32)
    from kerncc.kernels.reference import KERNELS
    KERNELS["argmax_f32"](None, x.view(np.uint8).reshape(-1), tokens.view(np.uint8), 1, 4)
    assert tokens[0] == 1


def test_seed_and_counter_reproduce():
    x = (np.random.default_rng(0).standard_normal((3, 500)) * 3).astype(np.float32)
    p = SamplingParams(0.8, top_k=40, top_p=0.9, seed=123)
    counters = [(s, k) for s in range(3) for k in range(20)]
    rows = [c[0] for c in counters]
    a = sample_logits(x, rows, [p] * len(rows), counters)
    b = sample_logits(x, rows, [p] * len(rows), counters)
    assert np.array_equal(a, b) and len(set(a.tolist())) > 5
    # one row at a time gives what a batch gives: the draw depends on (seed, sequence, step)
    single = [sample_logits(x, [r], [p], [c])[0] for r, c in zip(rows, counters)]
    assert single == a.tolist()
    other = sample_logits(x, rows, [SamplingParams(0.8, 40, 0.9, seed=124)] * len(rows), counters)
    assert not np.array_equal(a, other)


def test_the_reference_kernel_abi_matches_sample_logits():
    from kerncc.kernels.reference import KERNELS

    x = (np.random.default_rng(1).standard_normal((4, 300)) * 2).astype(np.float32)
    params = [SamplingParams(1.1, seed=5), SamplingParams(0.5, top_k=9, seed=6),
              SamplingParams(0.0), SamplingParams(2.0, top_p=0.7, seed=7)]
    rows, counters = [3, 0, 2, 1], [(1, 2), (3, 4), (5, 6), (7, 8)]
    words = pack(rows, params, counters, 300)
    out = np.zeros(4, np.int32)
    KERNELS["sample_f32"](None, x.view(np.uint8).reshape(-1), words.view(np.uint8).reshape(-1),
                          out.view(np.uint8), 4, 300, 300)
    assert out.tolist() == sample_logits(x, rows, params, counters).tolist()


@pytest.mark.parametrize("field, value", [("temperature", -0.5), ("temperature", float("nan")),
                                          ("temperature", float("inf")), ("temperature", "1"),
                                          ("top_p", 0.0), ("top_p", 1.01), ("top_p", -1.0),
                                          ("top_k", -1), ("top_k", 2.5), ("top_k", True),
                                          ("seed", -1), ("seed", 2**64), ("seed", 1.0)])
def test_bad_parameters_are_refused(field, value):
    with pytest.raises(KernccError, match=f"`{field}`"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("value", [1e39, 3.5e38, 1e300])
def test_a_temperature_past_float32_is_refused(value):
    """The kernel takes the temperature as f32: 1e39 became inf there (a RuntimeWarning on the
    cpu path, then every token equally likely), though it passed as finite."""
    with pytest.raises(KernccError, match="`temperature`.*float32"):
        SamplingParams(value)
    SamplingParams(float(np.finfo(np.float32).max))  # the largest that fits is taken


def test_edges_are_accepted():
    SamplingParams(0.0, 0, 1.0, 0)
    SamplingParams(1e-3, 10**9, 1e-6, 2**64 - 1)
    assert SamplingParams(seed=None).resolved().seed is not None
    assert SamplingParams(seed=4).resolved().seed == 4


def test_session_sample_refuses_bad_requests(tmp_path):
    from kerncc.example import generate
    from kerncc.lower import lower_to_bundle
    from kerncc.runtime import Chain

    manifest, _ = generate(tmp_path / "q", "tiny")
    session = Chain(lower_to_bundle(manifest), backend="cpu").sessions[-1]
    p = SamplingParams(1.0, seed=1)
    for rows, params, counters, match in (([5], [p], [(0, 0)], "outside"),
                                          ([0], [p, p], [(0, 0)], "one of each"),
                                          ([0], [p], [(0, -1)], "counter"),
                                          ([0], [{"temperature": 1}], [(0, 0)], "SamplingParams"),
                                          (None, [p], [(0, 0)], "rows: expected a list"),
                                          ([0], None, [(0, 0)], "params: expected a list"),
                                          ([0], [p], 7, "counters: expected a list")):
        with pytest.raises(KernccError, match=match):
            session.sample("logits", rows, params, counters)
    with pytest.raises(KernccError, match="f32 logits"):
        session.sample("next_tokens", [0], [p], [(0, 0)])


def test_chain_sample_is_the_last_stage_s(tmp_path):
    from kerncc.example import generate
    from kerncc.lower import lower_to_bundle
    from kerncc.runtime import Chain

    manifest, _ = generate(tmp_path / "q", "tiny")
    chain = Chain(lower_to_bundle(manifest, "cut,slice-derive,emit"), backend="cpu")
    assert len(chain.sessions) == 2
    inputs = {"token_ids": np.array([1, 2, 3], np.int32), "positions": np.arange(3, dtype=np.int32),
              "slot_mapping": np.arange(3, dtype=np.int32), "seq_lens": np.array([3], np.int32),
              "block_table": np.zeros((1, 16), np.int32), "cu_seqlens": np.array([0, 3, 3, 3, 3], np.int32)}
    chain.run("prefill", inputs, {"tokens": 3, "seqs": 1})
    p = [SamplingParams(1.0, seed=s) for s in range(16)]
    counters = [(0, 0)] * 16
    got = chain.sample("logits", [0] * 16, p, counters)
    assert got.tolist() == chain.sessions[-1].sample("logits", [0] * 16, p, counters).tolist()
    with pytest.raises(KernccError, match="no stage"):
        chain.sample("nope", [0], p[:1], counters[:1])


def test_kerncc_run_samples_by_seed(tmp_path, capsys):
    from kerncc.cli.main import main
    from kerncc.example import generate

    manifest, _ = generate(tmp_path / "q", "tiny")
    base = ["run", str(manifest), "--backend", "cpu", "--prompt", "1,2,3", "--max-new", "6"]

    def tokens(*flags: str) -> str:
        assert main(base + list(flags)) == 0
        return capsys.readouterr().out.strip().splitlines()[-1]

    greedy = tokens()
    assert tokens("--temperature", "0") == greedy
    assert tokens("--temperature", "5", "--top-k", "1") == greedy
    sampled = tokens("--temperature", "1.5", "--seed", "3")
    assert sampled == tokens("--temperature", "1.5", "--seed", "3")
    assert sampled != greedy or sampled != tokens("--temperature", "1.5", "--seed", "4")
    assert main(base + ["--top-p", "0"]) != 0
    assert "--top-p 0.0: must be in (0, 1]" in capsys.readouterr().err  # the flag, as given
