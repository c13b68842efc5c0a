"""The valid (and a few deliberately invalid) inputs the fuzz cases mutate.

JSON seeds: the golden inputs, `examples/`, the test fixtures, manifests from
`tests.random_manifests.random_manifest` (fixed xorshift seeds, every option) and the tiny example
model (added by the `seeds` fixture, which generates it once per session). kir seeds: the golden
`.kir` inputs and `kerncc fmt --to kir` of every JSON seed that parses.
"""

from __future__ import annotations

import json
from pathlib import Path

from kerncc import kir
from kerncc.manifest import reader
from kerncc.diagnostics import KernccError
from tests.random_manifests import Xorshift, random_manifest

ROOT = Path(__file__).resolve().parents[2]
GOLDEN_INPUTS = ROOT / "golden" / "inputs"
JSON_FILES = (sorted(GOLDEN_INPUTS.glob("*.json")) + sorted((ROOT / "examples").glob("*.json"))
              + sorted((ROOT / "tests" / "fixtures").glob("*.json")))
KIR_FILES = sorted(GOLDEN_INPUTS.glob("*.kir"))
RANDOM_OPTIONS = (
    {}, {"driven": 2}, {"inits": True}, {"derives": True, "per_layer_states": True},
    {"driven": 3, "inits": True, "derives": True},
)


class Seed:
    """One input: a name for failure messages, its text, and its JSON value when it has one.

    A plain class with a short repr: hypothesis prints drawn seeds in full otherwise."""

    def __init__(self, name: str, text: str) -> None:
        self.name = name
        self.text = text

    def __repr__(self) -> str:
        return f"Seed({self.name!r})"

    @property
    def doc(self):
        return json.loads(self.text)


def random_seeds() -> list[Seed]:
    out = []
    for i, options in enumerate(RANDOM_OPTIONS):
        raw = random_manifest(Xorshift(11 + i), **options)
        out.append(Seed(f"random{i}", json.dumps(raw, indent=2)))
    return out


def json_seeds(extra: list[Path] = ()) -> list[Seed]:
    files = [*JSON_FILES, *extra]
    return [Seed(str(p.relative_to(p.parents[1])), p.read_text()) for p in files] + random_seeds()


def kir_seeds(json_: list[Seed]) -> list[Seed]:
    out = [Seed(p.name, p.read_text()) for p in KIR_FILES]
    for seed in json_:
        try:
            out.append(Seed(f"{seed.name}.kir", kir.dumps(reader.loads(seed.text))))
        except KernccError:
            continue  # a seed that does not parse has no kir form
    return out
