"""The writer's indenting encoder is `json.dumps(indent=2, ensure_ascii=False)` byte for byte."""

from __future__ import annotations

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kerncc.manifest.writer import indented_json
from tests.random_manifests import examples

SCALARS = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True)
           | st.text(max_size=8))
KEYS = st.text(max_size=6) | st.integers(-3, 3) | st.booleans() | st.none() | st.floats(-2, 2)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.tuples(inner, inner) | st.dictionaries(KEYS, inner, max_size=4),
                      max_leaves=30)


@settings(max_examples=examples(300, 5_000))
@given(VALUES)
def test_same_text_as_json_dumps(value) -> None:
    assert indented_json(value) == json.dumps(value, indent=2, ensure_ascii=False)


def test_the_edges_spelled_as_json_does() -> None:
    value = {"é\n\"": [math.inf, -math.inf, 1e300, -0.0, {}, [], True, None, 10**30], 2: {1.5: 0}}
    assert indented_json(value) == json.dumps(value, indent=2, ensure_ascii=False)
