"""When the runtime captures graphs and what a replay issues, checked on the cpu backend.

`Recording` is the cpu backend with graphs: `capture` records the launches (their grid and
scalars fixed, as a CUDA graph fixes a kernel's parameters) instead of running them, and
`replay` runs the record. Served through it, a chain must give the same bits as eager cpu
launches, while the policy decides what is captured: `graph` programs at their first run,
other driven programs once a var assignment (a chunk size) comes back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kerncc.cli.main import main
from kerncc.diagnostics import KernccError
from kerncc.example import generate
from kerncc.runtime import Chain
from kerncc.runtime.backends.cpu import CpuBackend
from reference_loop import alone
from kerncc.runtime.session import AUTO_GRAPHS
from kerncc.serve.engine import Config, Engine, Request, serve_prompts


class Recording(CpuBackend):
    graphs = True

    def __init__(self) -> None:
        self.record: list | None = None
        self.captured: list[str] = []
        self.replays = 0

    def prepare(self, site):
        run = super().prepare(site)

        def launch(grid, shared, scalars):
            if self.record is not None:
                self.record.append((run, tuple(grid), shared, tuple(scalars)))
            else:
                run(grid, shared, scalars)

        launch.program = site.program
        return launch

    def capture(self, issue):
        self.record = []
        try:
            issue()
        finally:
            graph, self.record = self.record, None
        self.captured.append(graph[0][0].__qualname__ if graph else "empty")
        return graph

    def replay(self, graph):
        self.replays += 1
        for run, grid, shared, scalars in graph:
            run(grid, shared, scalars)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    manifest, _ = generate(tmp_path_factory.mktemp("tiny"), "tiny")
    out = manifest.parent / "two"
    assert main(["lower", str(manifest), "-p", "cut{at=12},slice-derive,emit", "-o",
                 str(out)]) == 0
    return out


PROMPT = [(i * 29) % 250 + 1 for i in range(30)]  # chunks of 8: 8, 8, 8, 5, then steps
LONG = [(i * 31) % 250 + 1 for i in range(64)]


def serve(chain: Chain, prompt=PROMPT, chunk: int = 8):
    result = alone(chain, prompt, 5, chunk)
    return result.tokens, result.logits


def test_replays_give_the_bits_of_eager_launches(bundle):
    eager_tokens, eager_logits = serve(Chain(bundle, backend="cpu"))
    assert np.abs(eager_logits).max() > 0
    backend = Recording()
    chain = Chain(bundle, backend=backend)
    for _ in range(2):  # the second time, every chunk size has a graph
        tokens, logits = serve(chain)
        assert tokens == eager_tokens
        np.testing.assert_array_equal(logits.view(np.uint32), eager_logits.view(np.uint32))
    assert backend.replays > 0


def keys(chain: Chain) -> set[tuple]:
    """(program, tokens) of every captured graph."""
    found = set()
    for s in chain.sessions:
        for program, *values in s._graphs:
            found.add((program, dict(zip(s._graph_vars[program], values))["tokens"]))
    return found


def test_auto_captures_graph_programs_first_and_chunk_sizes_when_they_repeat(bundle):
    chain = Chain(bundle, backend=Recording())
    serve(chain)
    # prefill at 8 rows came back (captured at its second chunk); 5 rows ran once: eager.
    assert keys(chain) == {("prefill", 8), ("decode", 1)}
    serve(chain, chunk=5)  # 29 = 5 x 5 + 4: now 5 repeats; 4 runs once
    assert keys(chain) == {("prefill", 8), ("prefill", 5), ("decode", 1)}


def test_marked_captures_only_graph_programs_and_off_nothing(bundle):
    marked = Chain(bundle, backend=Recording(), graphs="marked")
    serve(marked)
    assert {k[0] for k in keys(marked)} == {"decode"}
    off = Chain(bundle, backend=Recording(), graphs="off")
    serve(off)
    assert keys(off) == set()
    with pytest.raises(KernccError, match="unknown graph policy `always`"):
        Chain(bundle, backend=Recording(), graphs="always")


def test_auto_keeps_a_bounded_number_of_chunk_graphs(bundle):
    chain = Chain(bundle, backend=Recording())
    for chunk in range(1, AUTO_GRAPHS + 4):
        serve(chain, prompt=LONG[: 2 * chunk + 1], chunk=chunk)  # every size twice
    prefill = {k for k in keys(chain) if k[0] == "prefill"}
    assert len(prefill) == AUTO_GRAPHS


def test_a_server_captures_every_decode_size_before_its_first_step(bundle):
    """An engine captures the graph of the one-row forward a step of 1 to max_running
    sequences takes when it is made (no step then waits for a capture), only those, and
    serving through them gives the bits of eager launches."""
    prompts = [PROMPT, LONG[:21], LONG[5:40]]
    eager, _ = serve_prompts(Chain(bundle, backend="cpu"), prompts, 6, chunk=8, logits=True)
    backend = Recording()
    chain = Chain(bundle, backend=backend)
    engine = Engine(chain, Config(max_running=3, chunk=8, logits=True))
    made = keys(chain)
    assert made == {("decode", 1), ("decode_batch", 2), ("decode_batch", 3)}  # as steps pick
    assert len(backend.captured) == 2 * 3  # each of the two stages, each size once
    requests = [engine.submit(Request(list(p), 6)) for p in prompts]
    engine.run_until_idle()
    assert {k for k in keys(chain) if k[0] != "prefill"} == made  # none captured while serving
    for request, alone_run in zip(requests, eager):
        assert request.generated == alone_run.generated
        for got, want in zip(request.logits, alone_run.logits):
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert Engine(Chain(bundle, backend="cpu"), Config(max_running=3)).model.capture_graphs(3) == 0
    stage = chain.sessions[0]
    assert not stage.capture("prefill", {"tokens": 8})  # not marked `graph`: captured as it comes
    with pytest.raises(KernccError, match="nope"):
        stage.capture("nope")
    with pytest.raises(KernccError, match="seqs"):
        stage.capture("decode_batch", {"seqs": 99})
