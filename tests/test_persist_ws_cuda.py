"""persist_ws_bf16 on the GPU (marked `gpu`: skipped without a CUDA driver): what its design adds
to tests/test_persist_cuda.py's checks (the launches' bits, whole and in 2 stages, batched).

* The tags come round every 65535 launches, and then the last block clears the shadows: decode
  across that point gives the launches' bits, and the epoch has moved past it.
* A model whose down GEMV is 3072 deep and whose gate_up has an odd number of 32-row tasks
  (n = 6144: 192 tasks) gives the launches' bits, batch 1 and 4 sequences.
"""

from __future__ import annotations

import numpy as np
import pytest

from bundles import close_chains, cuda_chain, same_generations, same_served, whole_and_two
from kerncc.runtime.backends import persist

pytestmark = pytest.mark.gpu

WIDE = {"hidden": 2048, "heads": 16, "kv_heads": 8, "head_dim": 128, "intermediate": 3072,
        "max_seqs": 8}
PROMPTS = [[7], list(range(5, 22)), [(i * 37) % 250 + 1 for i in range(64)]]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict:
    return whole_and_two(tmp_path_factory.mktemp("ws"), **WIDE)


def ws_chain(bundle, max_m: int = 8):
    return cuda_chain(bundle, persist=persist.WS_ENTRY, persist_max_m=max_m)


@pytest.mark.parametrize("bundle", ["whole", "two"])
def test_a_deeper_model_gives_the_launches_bits(bundles, bundle):
    on, off = ws_chain(bundles[bundle]), cuda_chain(bundles[bundle], persist=None)
    try:
        same_generations(on, off, PROMPTS)
        assert on.backend.persisted > 0
    finally:
        close_chains(on, off)


def test_batched_steps_give_the_launches_bits(bundles):
    prompts = [[(i * (13 + s)) % 251 + 1 for i in range(9 + 7 * s)] for s in range(4)]
    on, off = ws_chain(bundles["whole"]), cuda_chain(bundles["whole"], persist=None)
    try:
        same_served(on, off, prompts, 10, chunk=32)
        assert on.backend.persisted > 0
    finally:
        close_chains(on, off)


def test_the_tags_come_round_and_the_bits_stay(bundles):
    on, off = ws_chain(bundles["whole"]), cuda_chain(bundles["whole"], persist=None)
    try:
        same_generations(on, off, PROMPTS[:1])  # loads the kernel, captures the graphs
        kernel = on.backend._persistent[persist.WS_ENTRY]
        # a few launches before the tags wrap: the next prompts' steps cross it
        on.backend.upload(kernel.sync, 0, np.array([65535 - 5, 0], np.uint32))
        same_generations(on, off, PROMPTS[1:])
        epoch, finished = on.backend.download(kernel.sync, 0, 8).view(np.uint32)
        assert finished == 0
        assert 65535 <= epoch < 65535 + 10_000, epoch
    finally:
        close_chains(on, off)
