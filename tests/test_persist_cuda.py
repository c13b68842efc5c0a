"""Persistent decode runs on the GPU (marked `gpu`: skipped without a CUDA driver).

kernels/persist.cu takes a decode layer's o_proj, post_norm, gate_up, act, down and the next
layer's input_norm and qkv as one launch (runtime/backends/persist.py). What must hold: the same
bits as the launches one by one, at batch 1 and batched, eagerly and in CUDA graphs, whole and
in 2 stages; the runs really went out persistent; a program whose launches it cannot take
(prefill) is untouched. The model is the tiny example widened to hidden 2048 and 16 heads of
128, the smallest where the GEMV kernels take every GEMM whole (k a multiple of 2048).
"""

from __future__ import annotations

import numpy as np
import pytest

from bundles import whole_and_two
from kerncc.runtime import Chain
from reference_loop import alone
from kerncc.serve.engine import serve_prompts

pytestmark = pytest.mark.gpu

WIDE = {"hidden": 2048, "heads": 16, "kv_heads": 8, "head_dim": 128, "intermediate": 2048,
        "max_seqs": 8}
PROMPTS = [[7], [3, 1, 4], list(range(5, 22)), [(i * 37) % 250 + 1 for i in range(64)],
           [(i * 11) % 200 + 3 for i in range(65)]]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict:
    return whole_and_two(tmp_path_factory.mktemp("wide"), **WIDE)


# weights in registers / a shared-memory ring / a producer warp's ring with tagged words
ENTRIES = ["persist_run_bf16", "persist_ring_bf16", "persist_ws_bf16"]


def chain(bundle, persist: str | None, graphs: bool = True) -> Chain:
    from kerncc.runtime.backends.cuda import CudaBackend

    backend = CudaBackend(0)
    backend.persist = persist  # read when a Session loads: the kernel's entry, or None
    backend.persist_max_m = 8  # persist_ws_bf16 takes the batched steps too (default: m = 1)
    return Chain(bundle, backend=backend, graphs=graphs)


def generated(c: Chain, prompt: list[int], chunk: int = 64):
    result = alone(c, prompt, 9, chunk)
    return result.tokens, result.logits


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("bundle", ["whole", "two"])
def test_persistent_runs_give_the_launches_bits(bundles, bundle, graphs, entry):
    on, off = chain(bundles[bundle], entry, graphs), chain(bundles[bundle], None, graphs)
    try:
        for prompt in PROMPTS:
            tokens, logits = generated(on, prompt)
            tokens2, logits2 = generated(off, prompt)
            assert np.abs(logits).max() > 0
            assert tokens == tokens2, prompt
            np.testing.assert_array_equal(logits.view(np.uint32), logits2.view(np.uint32))
        assert on.backend.persisted > 0, "the decode runs went out as persistent launches"
        assert off.backend.persisted == 0
    finally:
        close(on, off)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("running", [3, 8])
def test_batched_decode_through_persistent_runs_gives_the_launches_bits(bundles, running,
                                                                        entry):
    prompts = [[(i * (13 + s)) % 251 + 1 for i in range(9 + 7 * s)] for s in range(running)]
    on, off = chain(bundles["whole"], entry), chain(bundles["whole"], None)
    try:
        requests, engine = serve_prompts(on, prompts, 12, chunk=32, logits=True)
        requests2, _ = serve_prompts(off, prompts, 12, chunk=32, logits=True)
        assert engine.calls["decode_batch"] > 0
        for r, r2 in zip(requests, requests2):
            assert r.generated == r2.generated
            for a, b in zip(r.logits, r2.logits):
                np.testing.assert_array_equal(np.asarray(a).view(np.uint32),
                                              np.asarray(b).view(np.uint32))
        assert on.backend.persisted > 0
    finally:
        close(on, off)


def test_prefill_goes_launch_by_launch(bundles):
    """A 64-row chunk's GEMMs are cuBLAS's (m > 8): its runs go launch by launch, and only the
    decode steps after it go persistent."""
    on = chain(bundles["whole"], ENTRIES[0])
    try:
        prompt = [(i * 7) % 250 + 1 for i in range(64)]
        assert len(generated_n(on, prompt, 1)) == 1  # the prefill's own token only
        assert on.backend.persisted == 0
        generated_n(on, prompt, 3)
        assert on.backend.persisted > 0
    finally:
        close(on)


def generated_n(c: Chain, prompt: list[int], max_new: int) -> list[int]:
    return alone(c, prompt, max_new, 64).tokens


def close(*chains: Chain) -> None:
    for c in chains:
        c.close()
        c.backend.close()  # made here, passed in: the chain leaves it open


def test_no_manifest_can_launch_the_persistent_kernel():
    from kerncc.kernels import library
    from kerncc.runtime.backends import persist
    from kerncc.runtime.backends.base import BackendError
    from kerncc.runtime.backends.cuda import CudaBackend

    backend = CudaBackend(0)
    try:
        for entry in ENTRIES:
            with pytest.raises(BackendError, match="a manifest cannot launch it"):
                backend.check_kernel(entry, library.index()[persist.MODULE]["sha256"])
    finally:
        backend.close()


def test_without_the_gemv_kernels_nothing_goes_persistent(bundles, monkeypatch):
    """The runs compute the GEMV kernels' bits; with those off cuBLAS takes every GEMM, so the
    launches go as prepared and the bits stay cuBLAS's."""
    from kerncc.runtime.backends import gemv

    monkeypatch.setattr(gemv, "MAX_M", 0)
    on, off = chain(bundles["whole"], ENTRIES[0]), chain(bundles["whole"], None)
    try:
        for prompt in PROMPTS[:2]:
            tokens, logits = generated(on, prompt)
            tokens2, logits2 = generated(off, prompt)
            assert tokens == tokens2
            np.testing.assert_array_equal(logits.view(np.uint32), logits2.view(np.uint32))
        assert on.backend.persisted == 0
    finally:
        close(on, off)
