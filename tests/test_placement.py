"""Placements: stages in their own processes (and Ray actors) give what the in-process chain gives.

On the cpu backend, 2- and 3-stage cuts of the tiny example (`cut{stages=N},slice-derive,emit`)
run as ProcessChains: chunked prefill and greedy decode give bitwise equal tokens and logits to
the in-process Chain, for the engine unchanged. Faults: a stage killed with SIGKILL in the
middle of a generation fails it at once with an error naming the stage; a stage frozen with
SIGSTOP fails it after the (2 s) timeout; a stage that cannot load fails the start; in every
case no stage process is left. GPU cases (two stage processes sharing one GPU over the host
link, two GPUs over NCCL) are marked gpu; the Ray case runs when Ray is installed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kerncc.cli.main import main
from kerncc.diagnostics import KernccError
from kerncc.example import generate
from kerncc.runtime import Bundle, Chain
from kerncc.runtime.model_runner import ModelRunner, Rows
from kerncc.runtime.placement import make_runner
from kerncc.runtime.placement.process import ProcessChain
from kerncc.runtime.placement.transport import link_kind
from reference_loop import alone

PROMPTS = ([5], [3, 1, 4, 1, 5, 9, 2, 6], list(range(7, 27)))
FAULT_TIMEOUT = 2.0
BOUND = 15.0  # seconds any fault may take to surface, with room for a loaded CI machine


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[int, Path]:
    manifest, _ = generate(tmp_path_factory.mktemp("tiny"), "tiny")
    out = {}
    for stages in (2, 3):
        target = manifest.parent / f"cut{stages}"
        assert main(["lower", str(manifest), "-p", f"cut{{stages={stages}}},slice-derive,emit",
                     "-o", str(target)]) == 0
        out[stages] = target
    return out


def _alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or before the read
        return False


def _no_stage_left(pids: list[int]) -> None:
    deadline = time.monotonic() + BOUND
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if _alive(p)] == []


@pytest.mark.parametrize("stages", [2, 3])
def test_process_chain_equals_the_in_process_chain_bit_for_bit(bundles, stages):
    thread = Chain(Bundle(bundles[stages]))
    with ProcessChain(bundles[stages]) as chain:
        assert isinstance(chain, Chain) and len(chain.pids) == stages
        process = chain
        assert ModelRunner(process).protocol == ModelRunner(thread).protocol
        for prompt in PROMPTS:
            for chunk in (3, 8):
                want = alone(thread, prompt, 4, chunk)
                got = alone(process, prompt, 4, chunk)
                assert got.tokens == want.tokens and got.steps == want.steps
                assert got.logits.dtype == want.logits.dtype
                assert np.array_equal(got.logits.view(np.uint8), want.logits.view(np.uint8))
        assert len(set(want.tokens)) > 1  # not a degenerate model
        pids = chain.pids
    _no_stage_left(pids)


def test_submit_pipelines_items_and_checks_like_a_chain(bundles):
    thread = Chain(Bundle(bundles[2]))
    with ProcessChain(bundles[2]) as chain:
        assert chain.programs == thread.programs
        assert chain.sessions[0].token_capacity == thread.sessions[0].token_capacity
        model = ModelRunner(thread)
        inputs = model.inputs([Rows(0, [4, 8, 15, 16, 23], [], [0], 0, 5)])
        vars = model.protocol.vars(1, 5, 5, 5)
        program = model.chunk_program.name
        want = thread.run(program, inputs, vars)
        pendings = [chain.submit(program, inputs, vars) for _ in range(3)]  # none waited for
        for pending in pendings:
            got = pending.result()
            assert sorted(got) == sorted(want)
            assert all(np.array_equal(got[n], want[n]) for n in want)
        with pytest.raises(KernccError, match="outside"):
            chain.submit(program, inputs, {**vars, next(iter(vars)): 10**9})
        with pytest.raises(KernccError, match="no stage has program `nope`"):
            chain.submit("nope", inputs, vars)
        with pytest.raises(KernccError, match="no stage of the bundle takes input"):
            chain.submit(program, {"nope": np.zeros(1)}, vars)
        chain.sync()


def test_an_item_a_stage_refuses_fails_alone(bundles):
    """A token past the vocabulary fails its item with the stage's own error (as the
    in-process chain words it, file and line included); the chain goes on serving."""
    thread = Chain(Bundle(bundles[2]))
    with ProcessChain(bundles[2]) as chain:
        errors = []
        for runner in (thread, chain):
            model = ModelRunner(runner)
            inputs = model.inputs([Rows(0, [1, 2, 3], [], [0], 0, 3)])
            token = next(f.name for f in model.protocol.fills if f.fill == "token")
            bad = {**inputs, token: np.full_like(inputs[token], 10**6)}
            with pytest.raises(KernccError) as err:
                runner.submit(model.chunk_program.name, bad,
                              model.protocol.vars(1, 3, 3, 3)).result()
            errors.append(str(err.value))
        assert errors[0] == errors[1] and "1000000" in errors[1]
        assert alone(chain, [1, 2, 3], 2).tokens == \
            alone(thread, [1, 2, 3], 2).tokens  # still serving


def test_a_killed_stage_fails_the_generation_at_once(bundles):
    chain = ProcessChain(bundles[3])
    pids = chain.pids
    step = ModelRunner(chain).step_program.name
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            for _ in range(1000):  # bounded: the kill ends it long before
                alone(chain, list(range(1, 40)), 8, 1)
        except BaseException as err:  # noqa: BLE001 - the test looks at it
            errors.append(err)

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()
    deadline = time.monotonic() + BOUND
    while chain.items < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    killed = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    worker.join(BOUND)
    took = time.monotonic() - killed
    assert not worker.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], KernccError)
    assert f"stage 1 (pid {pids[1]}) was killed by SIGKILL" in str(errors[0])
    assert took < FAULT_TIMEOUT  # at once, not after a timeout
    with pytest.raises(KernccError, match="the process chain is down: stage 1"):
        chain.submit(step, {}, {})
    _no_stage_left(pids)


def test_a_frozen_stage_fails_its_items_after_the_timeout(bundles, monkeypatch):
    kill_all = ProcessChain._kill_all

    def slow_kill_all(self):  # widen the window an early error would show in
        time.sleep(0.3)
        kill_all(self)

    monkeypatch.setattr(ProcessChain, "_kill_all", slow_kill_all)
    chain = ProcessChain(bundles[2], timeout=FAULT_TIMEOUT)
    pids = chain.pids
    assert alone(chain, [1, 2, 3], 2).tokens
    os.kill(pids[1], signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        with pytest.raises(KernccError, match=rf"stage 1 \(pid {pids[1]}\) stopped answering"):
            alone(chain, [1, 2, 3, 4], 2)
        took = time.monotonic() - frozen
        assert FAULT_TIMEOUT * 0.9 <= took < BOUND
        # the stages are killed and reaped before the items fail: none is left to see
        assert [p for p in pids if _alive(p)] == []
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone already: nothing to wake
            os.kill(pids[1], signal.SIGCONT)
    _no_stage_left(pids)


def test_a_stage_that_cannot_load_fails_the_start(bundles, tmp_path):
    with pytest.raises(KernccError, match="does not exist"):
        ProcessChain(bundles[2], checkpoint=tmp_path / "missing.safetensors")
    assert [c for c in _children() if "kerncc" in c] == []


def _children() -> list[str]:
    me = str(os.getpid())
    out = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[1] == me and fields[0] != "Z":
                out.append((entry / "cmdline").read_text())
        except (OSError, IndexError):
            continue
    return out


def test_make_runner_picks_by_name(bundles):
    assert type(make_runner(Bundle(bundles[2]), "cpu", None, "thread")) is Chain
    with pytest.raises(KernccError, match="unknown placement `moon`"):
        make_runner(bundles[2], "cpu", None, "moon")
    with pytest.raises(KernccError, match="not one of the thread placement's"):
        make_runner(bundles[2], "cpu", None, "thread", timeout=3)
    with pytest.raises(KernccError, match="--devices needs the cuda backend"):
        make_runner(bundles[2], "cpu", [0, 1], "process")


def test_link_kinds():
    assert link_kind("auto", "cpu", None, None) == "host"
    assert link_kind("host", "cuda", 0, 1) == "host"
    assert link_kind("auto", "cuda", 0, 0) == "host"  # NCCL takes one rank per GPU
    with pytest.raises(KernccError, match="needs the cuda backend"):
        link_kind("nccl", "cpu", None, None)
    with pytest.raises(KernccError, match="share GPU 0"):
        link_kind("nccl", "cuda", 0, 0)
    with pytest.raises(KernccError, match="unknown transport"):
        link_kind("pigeon", "cpu", None, None)


def test_kerncc_run_with_process_placement(bundles, capsys):
    args = ["run", str(bundles[3]), "--prompt", "1,2,3,4,5", "--max-new", "3"]
    assert main(args) == 0
    want = capsys.readouterr().out.strip().splitlines()[-1]
    assert main([*args, "--placement", "process", "--stage-timeout", "30"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip().splitlines()[-1] == want
    assert "ProcessChain" in captured.err
    assert main([*args, "--placement", "process", "--transport", "nccl"]) == 1
    assert "needs the cuda backend" in capsys.readouterr().err


@pytest.mark.parametrize("prompts", [["1,2,3"], ["1,2,3", "4,5"]], ids=["one", "several"])
def test_kerncc_run_leaves_no_stage_process_behind(bundles, capsys, prompts):
    """run never closed its chain: called as a function (not as a process that exits), the
    stage processes outlived it."""
    import multiprocessing

    argv = ["run", str(bundles[2]), "--placement", "process", "--max-new", "2"]
    assert main([*argv, *(f for p in prompts for f in ("--prompt", p))]) == 0
    capsys.readouterr()
    left = [p for p in multiprocessing.active_children() if p.name.startswith("kerncc stage")]
    assert left == []


@pytest.mark.parametrize("command", ["run", "serve"])
@pytest.mark.parametrize("placement, flag, value, takes", [
    ("thread", "--transport", "host", "--placement process or ray"),
    ("thread", "--stage-timeout", "5", "--placement process or ray"),
    ("thread", "--ray-address", "auto", "--placement ray"),
    ("process", "--ray-address", "auto", "--placement ray")])
def test_a_placement_flag_the_placement_does_not_read_is_a_usage_error(
        bundles, capsys, command, placement, flag, value, takes):
    """The thread placement has no stage processes to time out or links to choose, and only
    Ray joins a cluster: these flags were accepted and did nothing."""
    prompt = ["--prompt", "1,2"] if command == "run" else []
    missing = ["--weights", str(bundles[2] / "missing.safetensors")]  # bounded if accepted
    with pytest.raises(SystemExit) as stop:  # before anything loads: a usage error
        main([command, str(bundles[2]), *prompt, *missing, "--placement", placement, flag,
              value])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: kerncc {command}")
    assert f"{flag}: only {takes} takes it" in err and f"--placement {placement}" in err


def test_the_serving_engine_over_stage_processes_equals_the_in_process_chain(bundles):
    """Several prompts batched by the engine (kerncc.serve) over two stage processes."""
    from kerncc.serve.engine import serve_prompts

    prompts = [list(p) for p in PROMPTS]
    want, _ = serve_prompts(Chain(bundles[2]), prompts, 4)
    with ProcessChain(bundles[2]) as chain:
        got, engine = serve_prompts(chain, prompts, 4)
    assert [r.generated for r in got] == [r.generated for r in want]
    assert all(len(r.generated) == 4 for r in got)
    assert engine.calls.get("decode_batch", 0) >= 1  # served together, not one by one


def test_ray_placement_needs_ray_or_runs(bundles, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(KernccError, match=r"pip install 'kerncc\[ray\]'"):
        make_runner(bundles[2], "cpu", None, "ray")


@pytest.mark.slow
def test_ray_chain_equals_the_in_process_chain(bundles):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        thread = Chain(Bundle(bundles[3]))
        chain = make_runner(bundles[3], "cpu", None, "ray", timeout=60)
        ray_gen, step = chain, ModelRunner(chain).step_program.name
        for prompt in PROMPTS:
            want, got = alone(thread, prompt, 3, 3), alone(ray_gen, prompt, 3, 3)
            assert got.tokens == want.tokens
            assert np.array_equal(got.logits.view(np.uint8), want.logits.view(np.uint8))
        pid = chain.sessions[1].pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(KernccError, match=rf"the Ray chain is down: stage 1 \(pid {pid}\)"):
            alone(ray_gen, [1, 2, 3], 2)
        with pytest.raises(KernccError, match="the Ray chain is down"):
            chain.submit(step, {}, {})
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------------------------------
# GPU (not run on the CPU machine; see docs/runtime.md "Placements")


def _gpus() -> int:
    from kerncc.runtime.backends.probe import cuda_devices

    return cuda_devices()[0]


@pytest.mark.gpu
def test_two_stage_processes_share_one_gpu(bundles):
    thread = Chain(Bundle(bundles[2]), backend="cuda")
    with ProcessChain(bundles[2], backend="cuda", devices=[0]) as chain:
        assert set(chain.kinds.values()) == {"host"}
        process = chain
        for prompt in PROMPTS:
            want, got = alone(thread, prompt, 4, 8), alone(process, prompt, 4, 8)
            assert got.tokens == want.tokens
            assert np.array_equal(got.logits.view(np.uint8), want.logits.view(np.uint8))


@pytest.mark.gpu
def test_two_gpus_over_nccl_equal_the_peer_copy_chain(bundles):
    if _gpus() < 2:
        pytest.skip("needs two GPUs")
    pytest.importorskip("nccl.core")
    thread = Chain(Bundle(bundles[2]), backend="cuda", devices=[0, 1])
    with ProcessChain(bundles[2], backend="cuda", devices=[0, 1], transport="nccl") as chain:
        assert set(chain.kinds.values()) == {"nccl"}
        process = chain
        for prompt in PROMPTS:
            want, got = alone(thread, prompt, 4, 8), alone(process, prompt, 4, 8)
            assert got.tokens == want.tokens
            assert np.array_equal(got.logits.view(np.uint8), want.logits.view(np.uint8))


def test_no_stage_outlives_a_killed_head(bundles, tmp_path):
    """The head itself killed with SIGKILL: every stage sees its channel close and ends."""
    import subprocess
    import sys

    script = tmp_path / "head.py"
    script.write_text(
        "import sys, time\n"
        "from kerncc.runtime.placement.process import ProcessChain\n"
        "if __name__ == '__main__':\n"
        f"    chain = ProcessChain({str(bundles[2])!r})\n"
        "    print(*chain.pids, flush=True)\n"
        "    time.sleep(120)\n")
    head = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        import select

        assert select.select([head.stdout], [], [], 4 * BOUND)[0], "the head did not start"
        pids = [int(p) for p in head.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        head.kill()
        head.wait(BOUND)
    _no_stage_left(pids)


def test_no_progress_blames_the_stage_that_holds_the_chain_up():
    """The head's rule for a stage that beats but does not move (a hung device): the stage
    whose item was ready longest ago is named, not one waiting on it."""
    from kerncc.runtime.placement.process import RemotePending, _Flight

    chain = ProcessChain.__new__(ProcessChain)
    chain.timeout, chain._lock = 1.0, threading.Lock()
    chain._procs = [type("P", (), {"pid": 100 + k})() for k in range(3)]
    now = time.monotonic()
    chain._progress = [now - 5.0] * 3
    flight = _Flight(RemotePending(chain, 0), last=2, stages=3)
    flight.sent = now - 5.0
    flight.done_at = {0: now - 4.0}  # stage 0 issued it; stage 1 never did; 2 waits on 1
    flight.waiting = {1, 2}
    chain._flights = {0: flight}
    with pytest.raises(KernccError, match=r"stage 1 \(pid 101\) made no progress on item 0"):
        chain._check_progress()
    chain._progress[1] = now  # stage 1 just moved: nobody is stuck yet
    chain._check_progress()
    flight.done_at[1], flight.waiting = now - 2.0, {2}  # now stage 2 holds it up
    chain._progress[1] = now - 2.0
    with pytest.raises(KernccError, match=r"stage 2 \(pid 102\) made no progress"):
        chain._check_progress()


def test_nccl_links_call_nccl4py_as_documented(monkeypatch):
    """The NCCL link against a stand-in for nccl4py (no GPU here): both ends join one two-rank
    communicator with the sender's id; a crossing is a send on the sender's stream and a recv
    on the receiver's, of the buffer's first bytes; a poisoned item moves no bytes."""
    import multiprocessing
    import sys
    import types

    from kerncc.runtime.placement.transport import NcclLink

    calls: list[tuple] = []

    class Communicator:
        @classmethod
        def init(cls, *, nranks, rank, unique_id):
            calls.append(("init", nranks, rank, unique_id.raw))
            comm = cls()
            comm.rank = rank
            return comm

        def send(self, buf, peer, *, stream):
            cai = buf.__cuda_array_interface__
            calls.append(("send", self.rank, cai["data"][0], cai["shape"], peer, stream))

        def recv(self, buf, peer, *, stream):
            cai = buf.__cuda_array_interface__
            calls.append(("recv", self.rank, cai["data"][0], cai["shape"], peer, stream))

    class UniqueId:
        def __init__(self, raw: bytes) -> None:
            self.raw, self.as_bytes = raw, raw

        @staticmethod
        def from_bytes(raw: bytes) -> UniqueId:
            return UniqueId(bytes(raw))

    core = types.SimpleNamespace(Communicator=Communicator, UniqueId=UniqueId,
                                 get_unique_id=lambda: UniqueId(b"\x07" * 128))
    monkeypatch.setitem(sys.modules, "nccl", types.SimpleNamespace(core=core))
    monkeypatch.setitem(sys.modules, "nccl.core", core)

    def session(index: int, ptr: int, stream: int):
        allocation = types.SimpleNamespace(ptr=ptr, nbytes=4096)
        return types.SimpleNamespace(
            stage=types.SimpleNamespace(index=index),
            memory=types.SimpleNamespace(buffer=lambda name: allocation),
            backend=types.SimpleNamespace(activate=lambda: None, stream_handle=stream,
                                          stream_joined=lambda: calls.append(("joined", index))))

    reader, writer = multiprocessing.Pipe(duplex=False)
    sender = NcclLink(session(0, 0x1000, 11), writer, sender=True)
    receiver = NcclLink(session(1, 0x2000, 22), reader, sender=False)
    sender.open(None)
    receiver.open(sender.unique_id())
    sender.put(0, "residual", 768)
    receiver.land("residual", receiver.take(0, "residual"), {})
    sender.put(1, "residual", None)
    assert receiver.take(1, "residual") is None
    with pytest.raises(KernccError, match="expected `residual` of item 2"):
        sender.put(3, "residual", 8)
        receiver.take(2, "residual")
    # NCCL's work joins the stream: the backend is told first (no overlapping launch after it)
    assert calls == [("init", 2, 0, b"\x07" * 128), ("init", 2, 1, b"\x07" * 128),
                     ("joined", 0), ("send", 0, 0x1000, (768,), 1, 11),
                     ("joined", 1), ("recv", 1, 0x2000, (768,), 0, 22),
                     ("joined", 0), ("send", 0, 0x1000, (8,), 1, 11)]  # item 1 moved nothing
    with pytest.raises(KernccError, match="holds 4096"):
        sender.put(4, "residual", 5000)
