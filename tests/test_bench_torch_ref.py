"""The PyTorch eager baseline (bench/torch_ref.py) against the numpy oracle, on the CPU.

Skipped where torch is not importable. With bf16 attention (what the baseline runs) the last
row's logits agree with the oracle within about 1.2% of the largest logit: the oracle keeps the
softmax probabilities in f32, SDPA's bf16 kernels do not. With the attention computed in f32
instead, most prompts agree to f32 rounding (the rounding points are the oracle's); a rare bf16
rounding flip, from a different summation order, moves a few by up to ~0.7%.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from bench.torch_ref import TorchQwen

from kerncc.example import generate
from tests.oracle import Oracle

LENGTHS = (1, 2, 7, 16, 17, 40, 100)  # across the 16-slot pages kerncc uses, and one row
TOLERANCE = 0.03  # of the largest |logit|; seen: 0.012 at most


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Oracle]:
    out = tmp_path_factory.mktemp("tiny")
    _, weights = generate(out, "tiny")
    return out, Oracle(weights)


@pytest.fixture(scope="module")
def model(tiny: tuple[Path, Oracle]) -> TorchQwen:
    return TorchQwen(tiny[0], "cpu")


def prompt(n: int, seed: int = 0) -> list[int]:
    """Varied nonzero token ids (never all the same, never the zero row)."""
    rng = np.random.default_rng(1000 + n + seed)
    return [int(t) for t in rng.integers(1, 256, size=n)]


def error(got: torch.Tensor, want: np.ndarray) -> float:
    """Largest difference as a share of the largest |logit|."""
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    return float(np.abs(got.numpy() - want).max() / np.abs(want).max())


def fresh_prefill(model: TorchQwen, tokens: list[int]) -> torch.Tensor:
    model.reset()
    return model.prefill(tokens)


@pytest.fixture
def f32_attention(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """SDPA computed in f32 (the oracle keeps softmax in f32) and rounded to bf16 once."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def upcast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object
               ) -> torch.Tensor:
        return sdpa(q.float(), k.float(), v.float(), **kwargs).to(q.dtype)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", upcast)
    yield


@pytest.mark.parametrize("n", LENGTHS)
def test_prefill_matches_oracle(model: TorchQwen, tiny: tuple[Path, Oracle], n: int) -> None:
    tokens = prompt(n)
    assert error(fresh_prefill(model, tokens), tiny[1].logits(tokens)[-1]) < TOLERANCE


def test_rounding_points_are_the_oracles(model: TorchQwen, tiny: tuple[Path, Oracle],
                                         f32_attention: None) -> None:
    errors = [error(fresh_prefill(model, prompt(n)), tiny[1].logits(prompt(n))[-1])
              for n in LENGTHS]
    assert max(errors) < TOLERANCE
    assert sum(e < 1e-5 for e in errors) > len(errors) // 2, errors


@pytest.mark.parametrize("n", (2, 17, 40))
def test_decode_after_prefill_is_prefill_of_the_longer_prompt(model: TorchQwen, n: int) -> None:
    tokens = prompt(n, seed=1)
    whole = fresh_prefill(model, tokens)
    fresh_prefill(model, tokens[:-1])
    assert error(model.decode(tokens[-1]), whole.numpy()) < TOLERANCE
    assert model.length == n


def test_decode_steps_and_chunks_match_the_oracle(model: TorchQwen,
                                                  tiny: tuple[Path, Oracle]) -> None:
    tokens = prompt(24, seed=2)
    fresh_prefill(model, tokens[:9])
    model.prefill(tokens[9:20])  # a chunk after cached tokens: the explicit causal mask
    for i in range(20, 24):
        got = model.decode(tokens[i])
        assert error(got, tiny[1].logits(tokens[: i + 1])[-1]) < TOLERANCE


def test_reset_forgets_the_sequence(model: TorchQwen) -> None:
    tokens = prompt(9, seed=3)
    first = fresh_prefill(model, tokens)
    model.prefill(prompt(5, seed=4))
    assert torch.equal(fresh_prefill(model, tokens), first)


def test_generate_is_greedy(model: TorchQwen, tiny: tuple[Path, Oracle]) -> None:
    """Prefill's last row gives the first token, each decode step the next; each is the
    oracle's best within tolerance (exact equality could flip on a near tie)."""
    start = prompt(6, seed=5)
    generated = model.generate(start, 8)
    assert len(generated) == 8
    assert model.length == len(start) + 7  # the last token is returned, never fed
    logits = fresh_prefill(model, start)
    for i, token in enumerate(generated):
        if i:
            logits = model.decode(generated[i - 1])
        assert token == int(torch.argmax(logits))
        want = tiny[1].logits(start + generated[:i])[-1]
        assert want.max() - want[token] <= TOLERANCE * np.abs(want).max()


def test_cache_overflow_is_refused(model: TorchQwen) -> None:
    model.reset()
    with pytest.raises(ValueError, match="cache holds"):
        model.prefill(prompt(model.config.max_context + 1))
