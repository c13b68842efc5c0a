"""The example model lowered whole and cut in two, the pair most runtime tests compare."""

from __future__ import annotations

from pathlib import Path

from kerncc.cli.main import main
from kerncc.example import generate

TWO = "cut{at-label=l1.input_norm},slice-derive,emit"  # stage 0: layer 0; stage 1: the rest


def whole_and_two(root: Path, size: str = "tiny", **overrides) -> dict[str, Path]:
    """The `size` example (with `overrides`) generated under `root`, lowered whole and in two
    stages: {"whole": bundle, "two": bundle}."""
    model, _ = generate(root / "model", size, **overrides)
    out = {}
    for name, pipeline in (("whole", "emit"), ("two", TWO)):
        assert main(["lower", str(model), "-p", pipeline, "-o", str(root / name)]) == 0
        out[name] = root / name
    return out


def cuda_chain(bundle: Path, graphs: bool = True, **backend: object):
    """A Chain over `bundle` on a CudaBackend of its own, with the backend's attributes in
    `backend` set first (they are read when a Session loads: `pipe_attention`,
    `pipe_columns`). Close it with `close_chains`."""
    from kerncc.runtime import Chain
    from kerncc.runtime.backends.cuda import CudaBackend

    made = CudaBackend(0)
    for name, value in backend.items():
        if not hasattr(made, name):
            raise AttributeError(f"CudaBackend has no `{name}`")
        setattr(made, name, value)
    return Chain(bundle, backend=made, graphs=graphs)


def close_chains(*chains) -> None:
    """Close chains made by `cuda_chain`, and their backends (a chain leaves a backend it was
    given open)."""
    for chain in chains:
        chain.close()
        chain.backend.close()


def same_logits(a, b) -> None:
    """The two logits bit for bit."""
    import numpy as np

    np.testing.assert_array_equal(np.asarray(a, np.float32).view(np.uint32),
                                  np.asarray(b, np.float32).view(np.uint32))


def same_generations(on, off, prompts, max_new: int = 9, chunk: int = 64) -> None:
    """Each prompt generated through both chains: the same tokens and logits, bit for bit
    (and logits that are not all zero)."""
    import numpy as np

    from reference_loop import alone

    for prompt in prompts:
        got, want = (alone(c, prompt, max_new, chunk) for c in (on, off))
        assert np.abs(got.logits).max() > 0
        assert got.tokens == want.tokens, len(prompt)
        same_logits(got.logits, want.logits)


def same_served(on, off, prompts, max_new: int = 12, chunk: int = 64) -> None:
    """The prompts served together through both chains' engines (batched decode steps): the
    same tokens and logits, bit for bit."""
    from kerncc.serve.engine import serve_prompts

    got, engine = serve_prompts(on, prompts, max_new, chunk=chunk, logits=True)
    want, _ = serve_prompts(off, prompts, max_new, chunk=chunk, logits=True)
    assert engine.calls["decode_batch"] > 0
    for r, r2 in zip(got, want):
        assert r.generated == r2.generated
        for a, b in zip(r.logits, r2.logits):
            same_logits(a, b)
