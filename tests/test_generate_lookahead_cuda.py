"""Greedy decoding one step ahead of the host on the GPU (marked `gpu`: skipped without a CUDA
driver): the engine (`Config.ahead`, one prompt served alone) issues step k + 1 before step k's token reaches the host, its token
input copied on the device's stream from step k's output (Session.feed). What must hold there,
where the copies, the graphs and the downloads really run asynchronously: the same tokens and
logits, bit for bit, as one step at a time, eagerly and in CUDA graphs, whole and in 2 stages,
with and without a stop token; and the feeds really happened.
"""

from __future__ import annotations

import numpy as np
import pytest

from bundles import whole_and_two
from kerncc.runtime import Chain
from kerncc.runtime.session import Session
from reference_loop import alone

pytestmark = pytest.mark.gpu

PROMPTS = [[7], [3, 1, 4], list(range(5, 90))]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict:
    return whole_and_two(tmp_path_factory.mktemp("lookahead"))


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("bundle", ["whole", "two"])
def test_a_step_ahead_gives_one_step_at_a_times_bits_on_the_gpu(bundles, bundle, graphs,
                                                                 monkeypatch):
    fed = []
    feed = Session.feed
    monkeypatch.setattr(Session, "feed", lambda self, *a, **k: (fed.append(a), feed(self, *a,
                                                                                     **k)))
    with Chain(bundles[bundle], backend="cuda", graphs=graphs) as chain:
        for prompt in PROMPTS:
            full = None
            for stop_at in (None, 2):
                stop = () if full is None else {full[stop_at]}
                results = {}
                for ahead in (True, False):  # `alone` checks every page came back
                    results[ahead] = alone(chain, prompt, 12, 32, stop=stop, ahead=ahead)
                got, want = results[True], results[False]
                assert got.tokens == want.tokens and got.steps == want.steps
                np.testing.assert_array_equal(got.logits.view(np.uint32),
                                              want.logits.view(np.uint32))
                assert np.abs(got.logits).max() > 0
                full = got.tokens
    assert fed, "the steps were fed on the device"
