"""The decode attention's split and combine as one launch, through whole models on the GPU
(marked `gpu`: skipped without a CUDA driver).

runtime/backends/attention.py joins each decode layer's two attention launches into one
(kernels/attention.cu `attn_decode_joined[_tc]_bf16`). What must hold: the same tokens and
logits, bit for bit, as the two launches, at batch 1 and batched, eagerly and in CUDA graphs,
whole and in 2 stages, with sequences long enough that the batched program's blocks loop over
their splits; and the pairs really went out joined. Two models: the tiny example (head dim 16:
the CUDA-core split) and one of head dim 128 (the tensor-core split), both with 2048 keys of
context (16 splits, so the batched program's 8 blocks a kv head loop).
"""

from __future__ import annotations

import pytest

from bundles import close_chains, cuda_chain, same_generations, same_served, whole_and_two

pytestmark = pytest.mark.gpu

MODELS = {"cuda-cores": {"max_context": 2048},
          "tensor-cores": {"hidden": 256, "heads": 8, "kv_heads": 4, "head_dim": 128,
                           "intermediate": 512, "max_context": 2048, "max_seqs": 8}}
LONG = [(i * 29) % 250 + 1 for i in range(1100)]  # 9 splits: past the 8 blocks a kv head
PROMPTS = [[7], [3, 1, 4], list(range(5, 150)), LONG]


@pytest.fixture(scope="module", params=sorted(MODELS))
def bundles(request, tmp_path_factory) -> dict:
    return whole_and_two(tmp_path_factory.mktemp(request.param), **MODELS[request.param])


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("bundle", ["whole", "two"])
def test_the_joined_attention_gives_the_two_launches_bits(bundles, bundle, graphs):
    on, off = (cuda_chain(bundles[bundle], graphs, join_attention=flag)
               for flag in (True, False))
    try:
        same_generations(on, off, PROMPTS)
        assert on.backend.joined > 0, "the decode attention went out joined"
        assert off.backend.joined == 0
    finally:
        close_chains(on, off)


@pytest.mark.parametrize("running", [3, 8])
def test_batched_decode_through_the_joined_attention_gives_the_two_launches_bits(bundles,
                                                                               running):
    prompts = [[(i * (13 + s)) % 251 + 1 for i in range(9 + 7 * s)] for s in range(running - 1)]
    prompts.append(LONG)
    on, off = (cuda_chain(bundles["whole"], join_attention=flag) for flag in (True, False))
    try:
        same_served(on, off, prompts)
        assert on.backend.joined > 0
    finally:
        close_chains(on, off)


def test_no_manifest_can_launch_the_joined_kernel():
    from kerncc.kernels import library
    from kerncc.runtime.backends import attention
    from kerncc.runtime.backends.base import BackendError
    from kerncc.runtime.backends.cuda import CudaBackend

    backend = CudaBackend(0)
    try:
        for entry in attention.JOINED.values():
            with pytest.raises(BackendError, match="a manifest cannot launch it"):
                backend.check_kernel(entry, library.index()[attention.MODULE]["sha256"])
    finally:
        backend.close()
