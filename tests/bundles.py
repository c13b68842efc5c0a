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
