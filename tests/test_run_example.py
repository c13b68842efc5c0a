"""End to end on the tiny example model: whole manifest vs 2- and 3-stage bundles vs the oracle.

The gate of spec §6.4 in miniature: for 7 prompts (1 to 2x the chunk rows) and two chunk
sizes, chunked prefill then greedy decode gives bitwise equal logits (every step) and tokens
from the whole manifest and from its cut bundles on the cpu backend; and the whole agrees with
the independent numpy oracle (tests/oracle.py) within bf16 tolerance. Also the README's
main command, from a shell.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kerncc.lower import lower_to_bundle
from kerncc.cli.main import main
from kerncc.example import generate
from tests.oracle import Oracle
from kerncc.runtime import Bundle, Chain
from reference_loop import alone

PASSES = "share-states,slice-once,slice-derive,emit"
CUTS = {"2 stages": "cut{at=12}", "3 stages": "cut{at=7,18}"}
CHUNKS = (3, 8)
PROMPT_LENGTHS = (1, 2, 3, 5, 8, 11, 16)  # 1 .. 2x the larger chunk
MAX_NEW = 3
BF16_TOLERANCE = 3e-2


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, Path]:
    return generate(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="module")
def generators(model) -> dict[str, Chain]:
    manifest, _ = model
    out = {"whole": Chain(lower_to_bundle(manifest))}
    for name, cut in CUTS.items():
        target = manifest.parent / name.replace(" ", "-")
        assert main(["lower", str(manifest), "-p", f"{cut},{PASSES}", "-o", str(target)]) == 0
        out[name] = Chain(Bundle(target))
    return out


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, vocab, n).tolist() for n in PROMPT_LENGTHS]


def test_stages_equal_the_whole_bit_for_bit(generators):
    whole = generators["whole"]
    vocab = whole.sessions[0].manifest.buffers["logits"].shape[1]
    for chunk in CHUNKS:
        for prompt in prompts(vocab):
            expected = alone(whole, prompt, MAX_NEW, chunk)
            assert len(expected.tokens) == MAX_NEW
            for name, gen in generators.items():
                got = alone(gen, prompt, MAX_NEW, chunk)
                where = f"{name}, chunk {chunk}, prompt of {len(prompt)}"
                assert got.tokens == expected.tokens, where
                assert got.steps == expected.steps, where
                assert got.logits.view(np.uint32).tobytes() == \
                    expected.logits.view(np.uint32).tobytes(), where


def test_the_whole_matches_the_oracle(model, generators):
    _, weights = model
    oracle = Oracle(weights)
    whole = generators["whole"]
    worst = 0.0
    for prompt in prompts(oracle.config.vocab):
        got = alone(whole, prompt, MAX_NEW, CHUNKS[0])
        tokens = prompt + got.tokens
        # Each step's logits are those of the last row it fed: positions at step ends.
        ends = np.cumsum([rows for _, rows in got.steps])
        reference = oracle.logits(tokens[:int(ends[-1])])
        for step, end in enumerate(ends):
            expected = reference[int(end) - 1]
            err = float(np.max(np.abs(got.logits[step] - expected)) / np.max(np.abs(expected)))
            worst = max(worst, err)
        assert got.tokens == oracle.greedy(prompt, MAX_NEW)
    print(f"whole vs oracle: max relative logits error {worst:.2e}")
    assert worst < BF16_TOLERANCE


def test_stage_py_and_interpreted_plans_agree(generators, model):
    bundle = generators["3 stages"].bundle
    interpreted = Chain(bundle, interpret=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    a = alone(generators["3 stages"], prompt, MAX_NEW, 3)
    b = alone(interpreted, prompt, MAX_NEW, 3)
    assert a.tokens == b.tokens
    assert a.logits.tobytes() == b.logits.tobytes()


def test_the_readme_command_from_a_shell(tmp_path):
    # The installed `kerncc` script when there is one, else the same CLI through this Python.
    kerncc = shutil.which("kerncc") or f"{shlex.quote(sys.executable)} -m kerncc"
    out = shlex.quote(str(tmp_path / "model"))
    logits = tmp_path / "logits.npy"
    command = (f"{kerncc} example qwen --size tiny -o {out} && "
               f"{kerncc} lower {out}/model.json -p cut,slice-derive,emit -o {out}/out && "
               f"{kerncc} run {out}/out --backend cpu --prompt 1,2,3 --max-new 4 "
               f"--logits {shlex.quote(str(logits))}")
    done = subprocess.run(command, shell=True, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    tokens = [int(t) for t in done.stdout.strip().splitlines()[-1].split()]
    oracle = Oracle(tmp_path / "model" / "model.safetensors")
    assert tokens == oracle.greedy([1, 2, 3], 4)
    # the prefill chunk's (its last row gives the first token), then 3 one-row steps
    assert np.load(logits).shape == (4, oracle.config.vocab)


@pytest.mark.parametrize("flag, value", [("--max-new", "0"), ("--max-new", "-1"),
                                         ("--chunk", "0"), ("--chunk", "x")])
def test_run_refuses_counts_below_one(flag, value, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["run", "nowhere", "--prompt", "1,2", flag, value])
    assert stop.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err
