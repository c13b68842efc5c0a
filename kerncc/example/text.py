"""The example model's text files: a made-up BPE tokenizer, its chat template, generation config.

`tokenizer_files(config)` gives {file name: JSON text} for `tokenizer.json` (the Hugging Face
`tokenizers` format: a BPE model with a Fuse decoder), `tokenizer_config.json` (special tokens
and a small ChatML chat template) and `generation_config.json` (eos ids). The vocabulary has
exactly `config.vocab` entries: four special tokens, then single characters (newline and
printable ASCII), then merges of lowercase letters (pairs, then letter triples, then pairs of
pairs) until the vocabulary is full, all in a fixed order. The JSON is written here rather than
by the `tokenizers` library so that `kerncc example` needs no optional dependency and its
bytes do not depend on the library's version; tests load it with the library.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

from kerncc.example.config import BOS_ID, EOS_ID, QwenConfig

SPECIALS = ("<|endoftext|>", "<|unk|>", "<|im_end|>", "<|im_start|>")  # ids 0, 1, 2, 3
assert SPECIALS[BOS_ID] == "<|endoftext|>" and SPECIALS[EOS_ID] == "<|im_end|>"
UNK = SPECIALS[1]
# Characters by priority (a vocabulary too small for all keeps the first ones).
LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
CHARACTERS = LETTERS + " \n" + "".join(
    ch for ch in map(chr, range(32, 127)) if ch not in LETTERS + " ")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _merges() -> Iterator[tuple[str, str]]:
    """Merges in vocabulary order: letter pairs, (pair, letter) triples, (pair, pair)."""
    pairs = [(a, b) for a in LETTERS for b in LETTERS]
    yield from pairs
    yield from ((a + b, c) for a, b in pairs for c in LETTERS)
    yield from ((a + b, c + d) for (a, b), (c, d) in itertools.product(pairs, pairs))


def vocabulary(size: int) -> tuple[dict[str, int], list[str]]:
    """(token -> id, merges "a b") of a vocabulary of exactly `size` tokens."""
    if size < len(SPECIALS) + 1:
        raise ValueError(f"the example tokenizer needs a vocabulary of at least "
                         f"{len(SPECIALS) + 1} tokens, not {size}")
    tokens = list(SPECIALS) + list(CHARACTERS[:size - len(SPECIALS)])
    merges: list[str] = []
    known = set(tokens)
    for a, b in _merges():
        if len(tokens) == size:
            break
        if a in known and b in known and a + b not in known:
            tokens.append(a + b)
            known.add(a + b)
            merges.append(f"{a} {b}")
    if len(tokens) < size:
        raise ValueError(f"the example tokenizer cannot fill a vocabulary of {size} tokens")
    return {t: i for i, t in enumerate(tokens)}, merges


def tokenizer_json(size: int) -> dict:
    vocab, merges = vocabulary(size)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(SPECIALS)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "BPE", "dropout": None, "unk_token": UNK,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "vocab": vocab, "merges": merges},
    }


def tokenizer_config(c: QwenConfig) -> dict:
    decoder = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True} for i, t in enumerate(SPECIALS)}
    return {
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": SPECIALS[EOS_ID],
        "model_max_length": c.max_context,
        "pad_token": SPECIALS[BOS_ID],
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK,
    }


def generation_config() -> dict:
    return {"bos_token_id": BOS_ID, "do_sample": False, "eos_token_id": [EOS_ID, BOS_ID]}


def tokenizer_files(c: QwenConfig) -> dict[str, str]:
    """{file name: text} of the example's tokenizer and generation config."""
    def text(value: dict, indent: int | None = 2) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=False) + "\n"

    return {
        "tokenizer.json": text(tokenizer_json(c.vocab), None),
        "tokenizer_config.json": text(tokenizer_config(c)),
        "generation_config.json": text(generation_config()),
    }
