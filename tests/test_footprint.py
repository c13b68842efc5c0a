"""A bundle's device memory from its plans (kerncc.runtime.footprint), proven before any load.

On the cpu backend the plan's footprint must equal, byte for byte, what the Session allocates
(peak while loading and resident after); a device whose free bytes cannot hold the stages is
refused before a single allocation, naming what to lower; `kerncc report` and `kerncc serve`
print it. On a GPU (marked `gpu`) the plan's resident bytes agree with the device's own reading
after load within 2%, and a refusal leaves the device's free memory as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path

import pytest

from kerncc.cli.main import main
from kerncc.diagnostics import KernccError
from kerncc.example import generate
from kerncc.runtime import Bundle, Chain, Session
from kerncc.runtime.backends.cpu import CpuBackend
from kerncc.runtime.footprint import (StageFootprint, bundle_footprints, check_fits,
                                      fitting_capacity, headroom, stage_footprint)


class Counting(CpuBackend):
    """The cpu backend, counting live bytes (and their peak) and every upload; `free` is the
    device's free bytes it reports (None: no limit)."""

    def __init__(self, free: int | None = None) -> None:
        self.limit = free
        self.live = self.peak = self.uploads = self.allocations = 0

    def allocate(self, nbytes: int):
        self.allocations += 1
        self.live += int(nbytes)
        self.peak = max(self.peak, self.live)
        return super().allocate(nbytes)

    def free(self, allocation) -> None:
        if allocation is not None:
            self.live -= allocation.size

    def upload(self, allocation, offset, data) -> None:
        self.uploads += 1
        super().upload(allocation, offset, data)

    def free_bytes(self) -> int | None:
        return self.limit


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, Path]:
    manifest, _ = generate(tmp_path_factory.mktemp("tiny"), "tiny")
    out = {}
    for name, pipeline in (("whole", "emit"), ("two", "cut,slice-derive,emit")):
        assert main(["lower", str(manifest), "-p", pipeline, "-o",
                     str(manifest.parent / name)]) == 0
        out[name] = manifest.parent / name
    return out


def footprints(path: Path, token_capacity: int | None = None) -> list[StageFootprint]:
    bundle = Bundle.open(path)
    return bundle_footprints([(s.manifest, s.plan) for s in bundle.stages], token_capacity)


@pytest.mark.parametrize("name", ["whole", "two"])
@pytest.mark.parametrize("capacity", [None, 4096])
def test_the_plan_gives_exactly_what_a_session_allocates(bundles, name, capacity):
    """Per stage: the peak while loading (the derive staging held) and what stays after."""
    for f in footprints(bundles[name], capacity):
        backend = Counting()
        session = Session(bundles[name], f.stage, backend, token_capacity=f.token_capacity)
        assert backend.peak == f.peak(), f.parts()
        assert backend.live == f.resident()
        assert session.token_capacity == f.token_capacity
        assert f.pages == f.token_capacity // 16 and f.page_tokens == 16


def test_the_kv_pool_grows_with_the_token_capacity(bundles):
    small, large = footprints(bundles["two"], 1024), footprints(bundles["two"], 8192)
    for a, b in zip(small, large):
        assert b.parts()["kv pool"] == 8 * a.parts()["kv pool"] > 0
        assert b.parts()["weights"] == a.parts()["weights"] > 0
        assert b.pages == 8 * a.pages == 512


def test_a_stage_that_does_not_fit_is_refused_before_any_allocation(bundles):
    f = footprints(bundles["whole"])[0]
    backend = Counting(free=f.peak() - 1)
    with pytest.raises(KernccError, match="nothing was loaded") as err:
        Session(bundles["whole"], 0, backend)
    assert backend.allocations == 0 and backend.uploads == 0
    assert "free" in str(err.value)
    fits = Counting(free=f.peak())  # exactly enough is enough
    Session(bundles["whole"], 0, fits)
    assert fits.peak == f.peak()


def test_a_chain_checks_its_stages_together_on_one_device(bundles):
    """Each stage alone fits, both together do not: refused before stage 0 loads."""
    stages = footprints(bundles["two"])
    backend = Counting(free=sum(f.peak() for f in stages) - 1)
    assert all(f.peak() <= backend.limit for f in stages)
    with pytest.raises(KernccError, match="stages 0, 1 need"):
        Chain(bundles["two"], backend)
    assert backend.allocations == 0 and backend.uploads == 0
    Chain(bundles["two"], Counting(free=sum(f.peak() for f in stages)))


def test_a_large_pool_names_the_pool_and_the_import_flags(bundles):
    f = footprints(bundles["whole"], 1 << 20)[0]
    assert f.parts()["kv pool"] > f.parts()["weights"]
    with pytest.raises(KernccError) as err:
        check_fits([f], f.peak() // 2, "device 0")
    text = str(err.value)
    assert "KV pool" in text and "--max-seqs" in text and "--max-context" in text
    assert f"{f.pages} KV pages" in text
    with pytest.raises(KernccError, match="nothing was loaded"):
        Chain(bundles["whole"], Counting(free=f.peak() // 2), token_capacity=1 << 20)


def test_large_weights_name_more_stages_and_fp8(bundles):
    f = footprints(bundles["whole"], 16)[0]
    assert f.parts()["weights"] > f.parts()["kv pool"]
    with pytest.raises(KernccError) as err:
        check_fits([f], 1000, "device 0")
    assert "cut{stages=N}" in err.value.diagnostics[0].message
    assert "--quantize fp8" in err.value.diagnostics[0].message


def test_no_device_limit_always_fits(bundles):
    check_fits(footprints(bundles["two"], 1 << 24), None, "cpu")


def test_the_device_rounding_counts_every_allocation():
    f = StageFootprint(0, (3, 5), (1,), 7, (11,), 13, 64, 16)
    assert f.peak() == 40 and f.resident() == 27
    assert f.peak(lambda n: -(-n // 8) * 8) == 8 + 8 + 8 + 8 + 16 + 16
    assert f.pages == 4


def test_report_prints_the_device_memory(bundles):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["report", str(bundles["two"])]) == 0
    text = out.getvalue()
    assert "device memory per stage at load" in text
    assert "kv pages" in text and "peak (load)" in text
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["report", "--format", "json", str(bundles["two"])]) == 0
    planned = json.loads(out.getvalue())["device_memory"]
    assert planned == [f.to_json() for f in footprints(bundles["two"])]
    assert all(s["peak"] == s["resident"] + s["staging"] for s in planned)


def test_serve_prints_the_memory_before_loading(bundles, monkeypatch):
    """What serve prints before placement.make: stage, peak, pages (the load that follows is
    replaced here by a refusal, so nothing binds a port or loads)."""
    from kerncc.cli import serve

    def refuse(*args, **kwargs):
        raise KernccError.single("stopped before load")

    monkeypatch.setattr(serve.placement, "make", refuse)
    bundle = Bundle.open(bundles["two"])
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(KernccError, match="before load"):
        serve._serve_here(None, bundle, None, None, None)
    lines = err.getvalue().splitlines()
    assert [line.split(":")[1].strip() for line in lines] == ["stage 0", "stage 1"]
    f = footprints(bundles["two"])[0]
    assert f"{f.pages} KV pages of 16 tokens" in lines[0]
    err = io.StringIO()  # at --kv-tokens, the pool it gives
    with contextlib.redirect_stderr(err), pytest.raises(KernccError, match="before load"):
        serve._serve_here(argparse.Namespace(kv_tokens=32), bundle, None, None, None)
    assert "2 KV pages of 16 tokens" in err.getvalue().splitlines()[0]


@pytest.fixture(scope="module")
def deep_pool(tmp_path_factory) -> Path:
    """The tiny model, cut in two, whose default KV pool (64 sequences of 8192 positions: 64
    MiB a stage) dwarfs its weights."""
    manifest, _ = generate(tmp_path_factory.mktemp("pool"), "tiny", max_seqs=64,
                           max_context=8192)
    out = manifest.parent / "two"
    assert main(["lower", str(manifest), "-p", "cut,slice-derive,emit", "-o", str(out)]) == 0
    return out


def peak_at(path: Path, capacity: int) -> int:
    return sum(f.peak() for f in footprints(path, capacity))


def test_a_pool_past_the_free_memory_is_fitted_to_the_device(deep_pool):
    """No capacity given: a chain's stages get the most whole pages that fit the device's
    free bytes less the headroom, every stage the same, and allocate no more than that."""
    default = footprints(deep_pool)[0].token_capacity
    room = peak_at(deep_pool, default) // 2
    backend = Counting(free=room + 512 * (1 << 20))
    assert headroom(backend.limit) == 512 * (1 << 20)
    chain = Chain(deep_pool, backend)
    got = chain.token_capacity
    assert got % 16 == 0 and default // 4 < got < default
    assert peak_at(deep_pool, got) <= room < peak_at(deep_pool, got + 16)
    assert [s.token_capacity for s in chain.sessions] == [got, got]
    assert backend.peak <= room
    alone = Counting(free=backend.limit)  # a Session alone is fitted the same way
    assert Session(deep_pool, 1, alone).token_capacity >= got


def test_a_given_pool_is_never_cut_and_a_device_short_of_one_chunk_is_refused(deep_pool):
    default = footprints(deep_pool)[0].token_capacity
    room = peak_at(deep_pool, default) // 2
    given = Chain(deep_pool, Counting(free=room + 512 * (1 << 20)), token_capacity=default)
    assert given.token_capacity == default  # what the fitting above cut, given, is kept
    short = Counting(free=peak_at(deep_pool, 64) - 1)  # less than one 64-row chunk's pool
    with pytest.raises(KernccError, match="nothing was loaded"):
        Chain(deep_pool, short)
    assert short.allocations == 0
    stages = [(f.stage, Bundle.open(deep_pool).stages[f.stage].manifest,
               Bundle.open(deep_pool).stages[f.stage].plan) for f in footprints(deep_pool)]
    assert fitting_capacity(stages, None, default) == default  # no device limit: the default
    assert fitting_capacity(stages, 1 << 40, default) == default  # room enough: the default


def test_kv_tokens_sizes_the_pool_of_run(tmp_path, capsys):
    """`--kv-tokens` is the pool's token slots: a request needing more is refused, located."""
    manifest, _ = generate(tmp_path / "m", "tiny")
    assert main(["run", str(manifest), "--prompt", "1,2,3", "--max-new", "4",
                 "--kv-tokens", "32"]) == 0
    capsys.readouterr()
    prompt = ",".join(["5"] * 30)
    assert main(["run", str(manifest), "--prompt", prompt, "--max-new", "4",
                 "--kv-tokens", "32"]) == 1
    assert "KV cache's token slots" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["run", str(manifest), "--prompt", "1", "--kv-tokens", "0"])
    assert exit_.value.code == 2
    capsys.readouterr()
    assert main(["run", str(manifest), "--prompt", "1", "--kv-tokens", "15"]) == 1
    err = capsys.readouterr().err
    assert "holds not one page of 16 tokens" in err and err.count("error:") == 1


def test_serve_says_when_its_pool_is_short_of_every_sequence_at_the_context_bound(bundles):
    from kerncc.cli.serve import engine_line
    from kerncc.serve.engine import Engine

    for capacity, tail in ((32, "2 KV pages of 16 tokens (of 64 for every sequence at the "
                                "context bound)"), (None, "64 KV pages of 16 tokens")):
        with Chain(bundles["whole"], token_capacity=capacity) as chain:
            assert engine_line("tiny", chain, Engine(chain)).endswith(tail)


# ---------------------------------------------------------------------------------------------
# On a GPU


def _cuda_model(tmp_path_factory) -> Path:
    """Weights of some 740 MB, so that what the plan leaves out (cubins, the driver's own
    bookkeeping) stays well under 2% of what it counts."""
    manifest, _ = generate(tmp_path_factory.mktemp("mid"), "tiny", layers=4, hidden=2048,
                           heads=16, kv_heads=8, head_dim=128, intermediate=8192, vocab=32000)
    out = manifest.parent / "two"
    assert main(["lower", str(manifest), "-p", "cut,slice-derive,emit", "-o", str(out)]) == 0
    return out


@pytest.mark.gpu
def test_cuda_device_reading_agrees_with_the_plan(tmp_path_factory):
    from kerncc.runtime.backends import make_backend

    path = _cuda_model(tmp_path_factory)
    backend = make_backend("cuda")
    # a KV pool of 4 GiB beside 0.74 GB of weights: the ~30 small allocations (inputs, norms)
    # stay far under 2% however the driver rounds them
    capacity = 1 << 18
    planned = sum(f.resident(backend.device_bytes) for f in footprints(path, capacity))
    Chain(path, backend, token_capacity=capacity).close()  # modules and cuBLAS warmed
    before = backend.free_bytes()
    chain = Chain(path, backend, token_capacity=capacity)
    backend.sync()
    used = before - backend.free_bytes()
    assert abs(used - planned) <= 0.02 * planned, (used, planned)
    chain.close()


@pytest.mark.gpu
def test_cuda_refuses_a_pool_past_the_free_memory_untouched(tmp_path_factory):
    from kerncc.runtime.backends import make_backend

    path = _cuda_model(tmp_path_factory)
    backend = make_backend("cuda")
    free = backend.free_bytes()
    f = footprints(path)[0]
    per_token = f.parts()["kv pool"] // f.token_capacity
    capacity = -(-(free // per_token + 1) // 16) * 16
    with pytest.raises(KernccError, match="nothing was loaded"):
        Chain(path, backend, token_capacity=capacity)
    assert abs(backend.free_bytes() - free) < (4 << 20)
