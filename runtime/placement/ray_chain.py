"""Ray placement: every stage of a bundle a Ray actor, placed by a placement group on a cluster.

`RayChain` is a `Chain` to its callers, like ProcessChain; docs/runtime.md ("Placements") says
where the actors go, what every host must see and how faults end the chain. Items go to every
actor in issue order (Ray runs one caller's calls on an actor in the order they were made). A
stage hands its crossing buffers to the stages after it as the value of its call, which Ray
gives the receiving call as an argument: straight from actor to actor, never through the head;
with `nccl` that value is only the byte count and the bytes go by NCCL on the two actors'
streams. A stage that fails an item raises; the calls that take its crossing buffers then fail
before they run, so the stages after a failure never see the item.

Ray is the optional extra `ray` (`pip install 'kerncc[ray]'`), imported only here.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from kerncc.diagnostics import KernccError
from kerncc.runtime.bundle import Bundle
from kerncc.runtime.chain import Chain
from kerncc.runtime.memory import chain_token_capacity
from kerncc.runtime.placement.process import (DEFAULT_TIMEOUT, START_TIMEOUT, StageView,
                                              check_vars, picklable, running_stages)
from kerncc.runtime.placement.transport import NcclPeer, link_kind
from kerncc.runtime.placement.worker import crossing_bytes, error_message
from kerncc.runtime.session import open_bundle, stage_vars
from kerncc.runtime.weights import CheckpointLike

RAY_HINT = "pip install 'kerncc[ray]'"
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def import_ray() -> Any:
    """The ray module, or a KernccError saying how to install it."""
    try:
        import ray
    except ImportError as err:
        raise KernccError.single(f"--placement ray needs Ray, which is not installed ({err}): "
                                 f"{RAY_HINT}") from None
    return ray


class StageActor:
    """One stage inside a Ray actor (wrapped by `ray.remote` when the chain starts).

    `links` gives the transport of every edge pair it is an end of: {(from, to): kind}."""

    def __init__(self, bundle_dir: str, stage: int, backend: str, checkpoint: Any,
                 token_capacity: int, interpret: bool, graphs: bool | str,
                 allow_nonfinite: bool, links: dict[tuple[int, int], str]) -> None:
        from kerncc.runtime.backends import make_backend
        from kerncc.runtime.session import Session

        self.bundle = Bundle(bundle_dir)
        self.k = stage
        # Ray sets CUDA_VISIBLE_DEVICES to the actor's one GPU: it is device 0 in here.
        options = {"device": 0} if backend == "cuda" else {}
        self.session = Session(self.bundle, stage, make_backend(backend, **options), checkpoint,
                               token_capacity, interpret, graphs, allow_nonfinite)
        self.edges_in = [e for e in self.bundle.edges if e["to"] == stage]
        self.edges_out = [e for e in self.bundle.edges if e["from"] == stage]
        self.peers = {pair: NcclPeer(self.session, sender=pair[0] == stage)
                      for pair, kind in sorted(links.items()) if kind == "nccl"}

    def hello(self) -> tuple:
        s = self.session
        ids = {pair: peer.id for pair, peer in self.peers.items() if peer.sender}
        return (self.k, os.getpid(), s.token_capacity, sorted(s.sites), s.programs, ids)

    def open_links(self, ids: dict[tuple[int, int], bytes]) -> None:
        """Join every NCCL link, in the chain's one (sender, receiver) order."""
        for pair, peer in sorted(self.peers.items()):
            peer.open(ids.get(pair))

    def item(self, item: int, program: str, vars: dict[str, int], inputs: dict[str, Any],
             outputs: bool | list[str] | None, *arrivals: dict) -> tuple[dict, dict]:
        """Serve one item: (crossing buffers for later stages, outputs or {})."""
        s = self.session
        arrived: dict = {}
        for crossing in arrivals:
            arrived.update(crossing)
        for edge in self.edges_in:
            self._land(edge, arrived[(self.k, edge["buffer"])])
        pending = None
        if program in s.sites:
            try:
                pending = s.submit(program, inputs, stage_vars(s.manifest, vars),
                                   outputs=False if outputs is None else outputs)
            except Exception as err:  # noqa: BLE001 - raised again as the head's KernccError
                raise KernccError(*error_message(err, self.k)) from None
        crossing = {(e["to"], e["buffer"]): self._cross(e, vars) for e in self.edges_out}
        found = pending.result() if pending is not None and outputs is not None else {}
        return crossing, {n: np.asarray(a) for n, a in found.items()}

    def _land(self, edge: dict, data: bytes | int) -> None:
        """An edge's bytes (host link) or byte count (NCCL: received on the stream now)."""
        s, name = self.session, edge["buffer"]
        peer = self.peers.get((edge["from"], self.k))
        if peer is not None:
            if data:
                peer.recv(name, int(data))
            return
        if len(data):
            s.backend.upload(s.memory.buffer(name), 0, np.frombuffer(data, dtype=np.uint8))

    def _cross(self, edge: dict, vars: dict[str, int]) -> bytes | int:
        s, name = self.session, edge["buffer"]
        target = self.bundle.stages[edge["to"]].manifest
        nbytes = crossing_bytes(target, name, stage_vars(target, vars))
        peer = self.peers.get((self.k, edge["to"]))
        if peer is not None:
            if nbytes:
                peer.send(name, nbytes)  # on the stream, after this item's launches
            return nbytes
        return s.backend.download(s.memory.buffer(name), 0, nbytes).tobytes() if nbytes \
            else b""


class RayPending:
    """A submitted item: `result()` waits (at most the chain's timeout) for its outputs."""

    def __init__(self, chain: RayChain, item: int, refs: list[Any], last: int) -> None:
        self._chain, self.item, self._refs, self._last = chain, item, refs, last
        self._done: dict[str, np.ndarray] | None = None

    def result(self) -> dict[str, np.ndarray]:
        if self._done is None:
            self._done = self._chain._wait(self.item, self._refs, self._last)
        return self._done


class RayChain(Chain):
    """Every stage of a bundle a Ray actor (see the module docstring)."""

    in_process = False  # inputs go with each item: none staged ahead or fed on the device

    def __init__(self, bundle: Bundle | str | os.PathLike, backend: str = "cpu",
                 checkpoint: CheckpointLike = None, token_capacity: int | None = None,
                 interpret: bool = False, devices: Sequence[int] | None = None,
                 graphs: bool | str = "auto", trace: Any = None, address: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT, start_timeout: float = START_TIMEOUT,
                 strategy: str = "PACK", transport: str = "auto",
                 allow_nonfinite: bool = False) -> None:
        if trace is not None:
            raise KernccError.single("--trace is not recorded with --placement ray yet")
        if devices:
            raise KernccError.single("--placement ray places one GPU per stage by itself; "
                                     "--devices is for the thread and process placements")
        if strategy not in STRATEGIES:
            raise KernccError.single(f"unknown placement strategy `{strategy}` "
                                     f"(known: {', '.join(STRATEGIES)})")
        ray = self._ray = import_ray()
        self.bundle = open_bundle(bundle)
        self.trace, self.items, self.timeout = None, 0, float(timeout)
        self.backend_name, self.fault = backend, None
        self.token_capacity = chain_token_capacity((s.manifest for s in self.bundle.stages),
                                                   token_capacity)
        # Every actor has a GPU of its own: NCCL whenever the links can have it.
        self.kinds = {(e["from"], e["to"]): link_kind(transport, backend, e["from"], e["to"])
                      for e in self.bundle.edges}
        if not ray.is_initialized():
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError) as err:
                raise KernccError.single(f"cannot join the Ray cluster at "
                                         f"`{address or 'auto'}`: {err}") from None
        self._group, self._actors = None, []
        try:
            self._place(backend, checkpoint, interpret, graphs, allow_nonfinite, strategy,
                        start_timeout)
        except BaseException:
            self.close()
            raise

    def _place(self, backend: str, checkpoint: CheckpointLike, interpret: bool,
               graphs: bool | str, allow_nonfinite: bool, strategy: str,
               start_timeout: float) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        stages = len(self.bundle.stages)
        gpus = 1 if backend == "cuda" else 0
        shape = {"CPU": 1, **({"GPU": 1} if gpus else {})}
        self._group = placement_group([shape] * stages, strategy=strategy)
        try:
            ray.get(self._group.ready(), timeout=start_timeout)
        except ray.exceptions.GetTimeoutError:
            raise KernccError.single(f"the Ray cluster has no room for {stages} stage(s) of "
                                     f"{shape} within {start_timeout:g} s") from None
        actor = ray.remote(StageActor)
        for k in range(stages):
            placed = PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=k)
            self._actors.append(actor.options(num_cpus=1, num_gpus=gpus,
                                              scheduling_strategy=placed).remote(
                os.fspath(self.bundle.dir), k, backend,
                picklable(self.bundle.checkpoint if checkpoint is None else checkpoint),
                self.token_capacity, interpret, graphs, allow_nonfinite,
                {pair: kind for pair, kind in self.kinds.items() if k in pair}))
        hellos = self._get_all([a.hello.remote() for a in self._actors], start_timeout)
        ids = {pair: uid for hello in hellos for pair, uid in hello[5].items()}
        # The NCCL set-up is collective: every actor joins its links at the same time.
        self._get_all([a.open_links.remote(ids) for a in self._actors], start_timeout)
        self.sessions = [StageView(self.bundle.stages[k], capacity, sites, programs, pid,
                                   backend, None)
                         for k, pid, capacity, sites, programs, _ in hellos]

    def __repr__(self) -> str:
        links = sorted(set(self.kinds.values()))
        return (f"RayChain({self.bundle!r}, {len(self._actors)} actors, {self.backend_name}"
                + (f", {'/'.join(links)} links" if links else "") + ")")

    def _get_all(self, refs: list[Any], timeout: float) -> list[Any]:
        ray = self._ray
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.RayTaskError as err:
            raise _cause(err) from None
        except ray.exceptions.RayActorError as err:  # died loading: the cause is in the text
            raise KernccError.single(f"a stage actor died while loading: "
                                     f"{_first_lines(str(err))}") from None
        except ray.exceptions.GetTimeoutError:
            raise KernccError.single(f"a stage did not load within {timeout:g} s") from None

    # ------------------------------------------------------------------------ serving

    def submit(self, program: str, inputs: Mapping[str, Any] | None = None,
               vars: Mapping[str, int] | None = None, rows: int | None = None,
               outputs: bool | Collection[str] = True) -> RayPending:
        if self.fault is not None:
            raise KernccError.single(f"the Ray chain is down: {self.fault}")
        inputs, vars = dict(inputs or {}), dict(vars or {})
        self._check_names(inputs, vars)
        check_vars(self.sessions, vars)
        runs = running_stages(self.sessions, program, self.programs)
        wanted = outputs if outputs is True or outputs is False else sorted(outputs)
        item, self.items = self.items, self.items + 1
        crossing: dict[int, Any] = {}
        refs = []
        for k, (view, actor) in enumerate(zip(self.sessions, self._actors)):
            host = {n: np.asarray(v) for n, v in inputs.items() if n in view.stage.host_inputs}
            upstream = sorted({e["from"] for e in self.bundle.edges if e["to"] == k})
            cross, out = actor.item.options(num_returns=2).remote(
                item, program, vars, host, wanted if k == runs[-1] else None,
                *(crossing[j] for j in upstream))
            crossing[k] = cross
            refs.append(out)
        return RayPending(self, item, refs, runs[-1])

    def _wait(self, item: int, refs: list[Any], last: int) -> dict[str, np.ndarray]:
        ray = self._ray
        if self.fault is not None:
            raise KernccError.single(f"the Ray chain is down: {self.fault}")
        try:
            return ray.get(refs[last], timeout=self.timeout)
        except ray.exceptions.RayActorError:
            self._down(f"{self._dead_stage(refs)} died")
        except ray.exceptions.RayTaskError as err:
            raise _cause(err) from None
        except ray.exceptions.GetTimeoutError:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            first = next(k for k, ref in enumerate(refs) if ref not in ready)
            self._down(f"stage {first} did not answer item {item} within {self.timeout:g} s")
        raise AssertionError("unreachable")

    def _dead_stage(self, refs: list[Any]) -> str:
        ray = self._ray
        for k, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError:
                return f"stage {k} (pid {self.sessions[k].pid})"
            except Exception:  # noqa: BLE001, S112 - not this stage's death
                continue
        return "a stage"

    def _down(self, message: str) -> None:
        self.fault = message
        self.close()
        raise KernccError.single(f"the Ray chain is down: {message}")

    def sync(self) -> None:
        """Nothing to wait for beyond `result()`: each call answers when its stage is done."""

    def close(self) -> None:
        ray = self._ray
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._group)
            self._group = None


def _cause(err: Any) -> KernccError:
    """The KernccError a stage raised inside a Ray call, or one naming what it raised."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, KernccError):
        return KernccError(cause.headline, cause.diagnostics)
    return KernccError.single(f"a Ray stage failed: {cause or err}")


def _first_lines(text: str, count: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[:count])
