"""The cuda backend on the tiny example model (marked `gpu`: skipped without a CUDA driver).

What must hold on a GPU: the whole manifest and its 2-stage bundle give bitwise identical
logits and tokens (one GPU in sequence, and two GPUs when there are two); graph replay gives
the same bits as eager launches; the GPU agrees with the numpy references within bf16
tolerance; a trace is written; driver failures are KernccErrors naming the place.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kerncc.cli.main import main
from kerncc.diagnostics import KernccError
from kerncc.example import generate
from kerncc.runtime import Bundle, Chain
from kerncc.runtime.backends.probe import cuda_devices
from reference_loop import alone
from kerncc.runtime.trace import Timeline

pytestmark = pytest.mark.gpu

PROMPTS = [[7], [3, 1, 4], list(range(5, 22)), [(i * 37) % 250 + 1 for i in range(64)],
           [(i * 11) % 200 + 3 for i in range(65)], [(i * 5) % 97 + 2 for i in range(130)],
           [(i * 13) % 251 + 1 for i in range(200)]]


def device_count() -> int:
    return cuda_devices()[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    manifest, _ = generate(tmp_path_factory.mktemp("tiny"), "tiny")
    return manifest


@pytest.fixture(scope="module")
def bundles(model) -> dict[str, Path]:
    out = {}
    for name, pipeline in (("whole", "emit"),
                           ("two", "cut{at-label=l1.input_norm},slice-derive,emit")):
        target = model.parent / name
        assert main(["lower", str(model), "-p", pipeline, "-o", str(target)]) == 0
        out[name] = target
    return out


def serve(chain: Chain, prompt: list[int], chunk: int, max_new: int = 9):
    result = alone(chain, prompt, max_new, chunk)
    return result.tokens, result.logits


@pytest.mark.parametrize("chunk", [64, 5])
def test_two_stages_on_one_gpu_equal_the_whole_bitwise(bundles, chunk):
    whole = Chain(bundles["whole"], backend="cuda")
    two = Chain(bundles["two"], backend="cuda")
    for prompt in PROMPTS:
        tokens, logits = serve(whole, prompt, chunk)
        tokens2, logits2 = serve(two, prompt, chunk)
        assert tokens == tokens2
        assert np.abs(logits).max() > 0
        np.testing.assert_array_equal(logits.view(np.uint32), logits2.view(np.uint32))


@pytest.mark.skipif("device_count() < 2")
def test_two_stages_on_two_gpus_equal_the_whole_bitwise(bundles):
    whole = Chain(bundles["whole"], backend="cuda")
    two = Chain(bundles["two"], backend="cuda", devices=[0, 1])
    assert {b.index for b in two.backends} == {0, 1}
    for prompt in PROMPTS:
        tokens, logits = serve(whole, prompt, 5)
        tokens2, logits2 = serve(two, prompt, 5)
        assert tokens == tokens2
        np.testing.assert_array_equal(logits.view(np.uint32), logits2.view(np.uint32))


def test_graph_replay_equals_eager(bundles):
    graphs = Chain(bundles["two"], backend="cuda")
    eager = Chain(bundles["two"], backend="cuda", graphs=False)
    for prompt in PROMPTS[:4]:
        tokens, logits = serve(graphs, prompt, 64)
        tokens2, logits2 = serve(eager, prompt, 64)
        assert tokens == tokens2
        np.testing.assert_array_equal(logits.view(np.uint32), logits2.view(np.uint32))
    assert any(s._graphs for s in graphs.sessions)  # decode really went through graphs
    assert not any(s._graphs for s in eager.sessions)


@pytest.mark.parametrize("graphs", [True, False])
def test_overlapping_launches_give_the_same_bits(bundles, graphs):
    """Programmatic dependent launch (each kernel waits for the one before it in-kernel)
    changes when blocks start, never what they compute: the same bits with it off. Only
    launches captured into graphs overlap; launched one by one they stay plain."""
    chains = {}
    for pdl in (True, False):
        chain = Chain(bundles["two"], backend="cuda", graphs=graphs)
        for backend in chain.backends:
            backend.pdl = pdl
        chains[pdl] = chain
    for prompt in PROMPTS[:4]:
        tokens, logits = serve(chains[True], prompt, 64)
        tokens2, logits2 = serve(chains[False], prompt, 64)
        assert tokens == tokens2
        np.testing.assert_array_equal(logits.view(np.uint32), logits2.view(np.uint32))
    overlapped = sum(b.overlapped for b in chains[True].backends)
    assert overlapped > 0 if graphs else overlapped == 0  # the graphs really overlapped
    assert sum(b.overlapped for b in chains[False].backends) == 0



def test_a_closed_or_dropped_chain_gives_its_device_memory_back(bundles):
    """A chain's weights, KV states and buffers live on the GPU: close() (or the end of a
    `with` block) gives them back at once, and so does dropping the chain, so a process that
    loads bundle after bundle does not run out of memory. A closed chain refuses work."""
    import gc

    from cuda.bindings import driver as cu

    def used() -> int:
        _, free, total = cu.cuMemGetInfo()
        return total - free

    def loaded() -> Chain:  # the states alone: 2 layers x 65536 tokens x 128 bytes = 16 MiB
        chain = Chain(bundles["two"], backend="cuda", token_capacity=1 << 16)
        serve(chain, PROMPTS[3], 64)
        return chain

    loaded().close()  # the context, cuBLAS and the module loader's own state stay
    gc.collect()
    base = used()
    chain = loaded()
    held = used() - base
    assert held >= 16 << 20
    chain.close()
    assert used() - base < held // 4
    with pytest.raises(Exception, match="closed"):
        serve(chain, PROMPTS[0], 5)
    chain.close()  # twice is fine
    with loaded() as scoped:
        assert used() - base >= held // 2
    assert used() - base < held // 4 and scoped.backends[0].closed
    dropped = loaded()
    assert used() - base >= held // 2
    del dropped
    gc.collect()
    assert used() - base < held // 4


def test_downloads_dropped_unread_give_their_pinned_buffers_back():
    """A download nobody reads keeps its pinned host buffer only until its copy has landed:
    the next download takes it again, so a caller that drops downloads does not grow pinned
    memory without bound, and a read download still gives its bytes."""
    import gc

    from kerncc.runtime.backends.cuda import CudaBackend

    backend = CudaBackend(0)
    try:
        data = np.arange(3000, dtype=np.float32)
        allocation = backend.allocate(data.nbytes)
        backend.upload(allocation, 0, data)
        backend.download(allocation, 0, data.nbytes)  # one buffer of this size in the pool
        pinned = len(backend._pinned_all)
        for _ in range(50):
            backend.download_async(allocation, 0, data.nbytes)  # dropped at once
            gc.collect()
            backend.sync()
        assert len(backend._pinned_all) == pinned
        got = backend.download_async(allocation, 0, data.nbytes).result()
        assert np.array_equal(got.view(np.float32), data)
    finally:
        backend.close()


def test_cuda_agrees_with_the_cpu_references(bundles):
    gpu = Chain(bundles["whole"], backend="cuda")
    cpu = Chain(bundles["whole"], backend="cpu")
    for prompt in PROMPTS[:5]:
        _, logits = serve(gpu, prompt, 64, max_new=4)
        _, reference = serve(cpu, prompt, 64, max_new=4)
        scale = np.abs(reference).max()
        assert scale > 0
        # bf16 activations: kernels and references round the same values, but GEMM
        # summation orders differ, so a last-bit difference may grow through the layers.
        assert np.abs(logits - reference).max() <= 0.05 * scale


def test_trace_has_every_stage_and_transfer(bundles, tmp_path):
    timeline = Timeline()
    chain = Chain(bundles["two"], backend="cuda", trace=timeline)
    serve(chain, PROMPTS[3], 16, max_new=3)
    path = tmp_path / "trace.json"
    timeline.write(path)
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    tracks = {e["args"].get("stage") for e in spans if "stage" in e["args"]}
    assert tracks == {0, 1}
    assert any("buffer" in e["args"] for e in spans)
    assert all(e["dur"] >= 0 for e in spans)
    for row in timeline.rows():
        assert row["done_ms"] >= row["start_ms"] >= row["issued_ms"] - 1.0


def test_cli_runs_on_cuda(bundles, capsys):
    assert main(["run", str(bundles["two"]), "--backend", "cuda", "--prompt", "1,2,3",
                 "--max-new", "4"]) == 0
    gpu = capsys.readouterr().out.strip().splitlines()[-1]
    assert main(["run", str(bundles["two"]), "--backend", "cpu", "--prompt", "1,2,3",
                 "--max-new", "4"]) == 0
    cpu = capsys.readouterr().out.strip().splitlines()[-1]
    assert len(gpu.split()) == 4
    assert gpu == cpu  # the tiny model's top tokens are far apart


@pytest.mark.skipif("device_count() < 2")
def test_cli_runs_on_two_gpus_with_a_trace(bundles, capsys, tmp_path):
    trace = tmp_path / "trace.json"
    assert main(["run", str(bundles["two"]), "--backend", "cuda", "--devices", "0,1",
                 "--prompt", ",".join(str(t) for t in PROMPTS[5]), "--chunk", "16",
                 "--max-new", "4", "--trace", str(trace)]) == 0
    two = capsys.readouterr().out.strip().splitlines()[-1]
    assert main(["run", str(bundles["whole"]), "--backend", "cuda",
                 "--prompt", ",".join(str(t) for t in PROMPTS[5]), "--chunk", "16",
                 "--max-new", "4"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == two
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len({e["pid"] for e in spans}) == 2  # one track group per GPU


def test_device_arrays_show_the_buffers_in_place(bundles):
    chain = Chain(bundles["whole"], backend="cuda")
    serve(chain, PROMPTS[2], 8, max_new=2)
    session = chain.sessions[0]
    view = session.device_array("logits")
    face = view.__cuda_array_interface__
    assert face["shape"] == session.read("logits").shape and face["data"][0] != 0
    torch = pytest.importorskip("torch")
    if face["typestr"] == "<f4":
        seen = torch.as_tensor(view, device="cuda").cpu().numpy()
        np.testing.assert_array_equal(seen, session.read("logits"))


def test_a_missing_device_is_a_clean_error(bundles):
    with pytest.raises(KernccError, match="no CUDA device 64"):
        Chain(bundles["two"], backend="cuda", devices=[0, 64])


def test_a_tampered_cubin_fails_at_load_naming_the_site(bundles, tmp_path):
    import shutil

    copy = tmp_path / "b"
    shutil.copytree(bundles["two"], copy)
    # a bundle names its checkpoint relative to itself: the copy's is given by the caller
    checkpoint = (bundles["two"] / json.loads((copy / "bundle.json").read_text())["checkpoint"])
    cubin = sorted((copy / "stage0" / "modules").glob("*.cubin"))[0]
    cubin.write_bytes(b"\0" * 64)
    with pytest.raises(KernccError) as err:
        Chain(Bundle(copy), backend="cuda", checkpoint=checkpoint.resolve())
    assert "modules" in str(err.value) or "sha256" in str(err.value)
