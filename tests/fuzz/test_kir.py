""".kir texts, mutated by token and by byte, through the same commands as JSON manifests.

Seeds: the golden `.kir` inputs (three of them deliberately broken) and `kerncc fmt --to kir` of
every JSON seed. A token mutation keeps most of the text lexable (names, numbers, punctuation,
keywords, `%n`, `#n`, `@n`, long expression chains, deep parentheses), so cases reach the
parser's and the builder's error paths rather than only the lexer's. Every failure must name
`file:line:col`, and what `fmt` prints must read back to the same manifest.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kerncc.kir.parse import keywords
from tests.random_manifests import examples

from . import harness
from .harness import fresh_dir
from .mutate import mutate_bytes, mutate_tokens, tokenize
from .test_manifests import check_manifest_file

TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|[A-Za-z0-9_.:%#@/-]+|\s+|.', re.DOTALL)
PUNCTUATION = ("{", "}", "[", "]", "(", ")", "=", ",", "<", ">", "@", "+", "*", " ", "\n", '"',
               "//", "[0, 8)", "per tp", "\t")
VALUES = ("%0", "%99", "#0", "#99999999999999999999", "@0", "@4294967296", "0", "-1", "1.5",
          "1e400", "18446744073709551616", "9" * 5000, "tokens", "seqs", "x", '"a b"', '""',
          '"\\u0000"', '"\\ud800"', '"名前"', "bf16", "i32", "buffer<bf16>", "bytes<0>",
          "extern:x", "tokens" + " + 1" * 3000, "(" * 3000 + "tokens" + ")" * 3000,
          "tokens" + " * 2" * 3000, "ceildiv")


def extra_tokens() -> tuple[str, ...]:
    return tuple(sorted(keywords())) + PUNCTUATION + VALUES


def write_kir(fuzz_root: Path, text: bytes) -> Path:
    path = fresh_dir(fuzz_root) / "model.kir"
    path.write_bytes(text)
    return path


@settings(max_examples=examples(200, 5000))
@given(data=st.data())
def test_mutated_kir_tokens(data: st.DataObject, seeds, fuzz_root: Path) -> None:
    seed = data.draw(st.sampled_from(seeds.kir), label="seed")
    text = mutate_tokens(tokenize(seed.text, TOKEN), extra_tokens(), data)
    path = write_kir(fuzz_root, text.encode("utf-8", "surrogatepass"))
    check_manifest_file(path, data)
    shutil.rmtree(path.parent)
    harness.case("kir: tokens")


@settings(max_examples=examples(100, 3000))
@given(data=st.data())
def test_mutated_kir_bytes(data: st.DataObject, seeds, fuzz_root: Path) -> None:
    seed = data.draw(st.sampled_from(seeds.kir), label="seed")
    path = write_kir(fuzz_root, mutate_bytes(seed.text.encode(), data))
    check_manifest_file(path, data)
    shutil.rmtree(path.parent)
    harness.case("kir: bytes")
