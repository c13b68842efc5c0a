"""Chains: every stage of a bundle run in order, on one backend or spread over GPUs.

A `Chain` holds one `Session` per stage and hands each edge's crossing buffers from stage k
to stage k+1 by name (bundle.json's `edges`). On one backend the stages run one after the
other on it. With `backend="cuda", devices=[0, 1]` each GPU runs its stages on its own stream
and the crossing buffers move GPU to GPU (`CudaBackend.send`: a peer copy ordered by events,
no host round trip), and since `submit` returns once everything is issued, stage 1 works on
item k while stage 0 already works on item k+1: chunked prefill is pipelined. `trace` (a
`Timeline`) records every stage's items and every transfer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Self

import numpy as np

from kerncc.diagnostics import KernccError
from kerncc.runtime.backends import make_backend
from kerncc.runtime.backends.base import Backend
from kerncc.runtime.bundle import Bundle
from kerncc.runtime.footprint import check_fits, fitting_capacity, stage_footprint
from kerncc.runtime.memory import chain_token_capacity
from kerncc.runtime.session import (Pending, Session, as_mapping, check_token_capacity,
                                    open_backend, open_bundle, stage_vars)
from kerncc.runtime.trace import Timeline
from kerncc.runtime.weights import CheckpointLike


class Chain:
    """Every stage of a bundle run in order, crossing buffers handed from stage to stage.

    On one backend the stages run in sequence on it. With `backend="cuda"` and `devices`
    (e.g. [0, 1]) the stages are spread over the GPUs in order (stage k on
    devices[k * len(devices) // stages]), each GPU with its own stream: crossing buffers move
    GPU to GPU, and `submit` returns as soon as everything is issued, so stage 1 works on item
    k while stage 0 already works on item k+1. `trace` (a `Timeline`) records every stage's
    item and every transfer.
    """

    in_process = True  # every stage in this process: inputs staged ahead, fed on the device

    def __init__(self, bundle: Bundle | str | os.PathLike, backend: str | Backend = "cpu",
                 checkpoint: CheckpointLike = None, token_capacity: int | None = None,
                 interpret: bool = False, devices: Sequence[int] | None = None,
                 graphs: bool | str = "auto", trace: Timeline | None = None,
                 allow_nonfinite: bool = False) -> None:
        self.bundle = open_bundle(bundle)
        check_token_capacity(token_capacity)
        if trace is not None and not isinstance(trace, Timeline):
            raise KernccError.single(f"trace: expected a Timeline or None, got "
                                     f"{type(trace).__name__}")
        stages = len(self.bundle.stages)
        self.backends = _stage_backends(backend, devices, stages)
        self._owns_backends = isinstance(backend, str)  # made here, so closed here
        self.backend = self.backends[0]
        self.token_capacity = chain_token_capacity((s.manifest for s in self.bundle.stages),
                                                   token_capacity)
        if token_capacity is None:  # none given: the pool the devices hold, at most the default
            self.token_capacity = _fitted(self.bundle, self.backends, self.token_capacity)
        _check_devices(self.bundle, self.backends, self.token_capacity)
        self.sessions = [Session(self.bundle, k, self.backends[k], checkpoint,
                                 self.token_capacity, interpret, graphs, allow_nonfinite)
                         for k in range(stages)]
        for edge in self.bundle.edges:
            sender, receiver = self.backends[edge["from"]], self.backends[edge["to"]]
            if sender is not receiver and hasattr(sender, "enable_peer"):
                sender.enable_peer(receiver)
                receiver.enable_peer(sender)
        self.trace = trace
        self.items = 0

    def __repr__(self) -> str:
        devices = sorted({b.name if not hasattr(b, "index") else f"{b.name}:{b.index}"
                          for b in self.backends})
        return f"Chain({self.bundle!r}, {', '.join(devices)})"

    def run(self, program: str, inputs: Mapping[str, Any] | None = None,
            vars: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
        """Run `program` on every stage in order; the last stage's outputs."""
        return self.submit(program, inputs, vars).result()

    def submit(self, program: str, inputs: Mapping[str, Any] | None = None,
               vars: Mapping[str, int] | None = None, rows: int | None = None,
               outputs: bool | Collection[str] = True) -> Pending:
        """Issue `program` on every stage in order without waiting; `result()` waits for the
        last stage's `outputs` (see Session.submit)."""
        inputs, vars = dict(as_mapping(inputs, "inputs")), dict(as_mapping(vars, "vars"))
        self._check_program(program)
        self._check_names(inputs, vars)
        item, self.items = self.items, self.items + 1
        pending = Pending({})
        for k, session in enumerate(self.sessions):
            own_vars = stage_vars(session.manifest, vars)
            self._receive(k, own_vars, item)
            if program not in session.sites:
                continue
            host = {n: v for n, v in inputs.items() if n in session.stage.host_inputs}
            issued = time.perf_counter()
            start = session.backend.mark() if self.trace else None
            last = k == max(j for j, s in enumerate(self.sessions) if program in s.sites)
            pending = session.submit(program, host, own_vars, outputs=outputs if last else False)
            if self.trace is not None:
                self.trace.span(session.backend, f"stage {k}", f"{program} #{item}", issued,
                                start, session.backend.mark(),
                                {"stage": k, "item": item, "program": program, "rows": rows})
        return pending

    def stage_inputs(self, inputs: Mapping[str, Any],
                     vars: Mapping[str, int] | None = None) -> None:
        """`Session.stage_inputs` on every stage that takes some of `inputs` (each on its own
        stream, after the items issued to it so far). Stages of this process only: the
        placements' chains (runtime/placement) send inputs with each item."""
        inputs, vars = dict(as_mapping(inputs, "inputs")), dict(as_mapping(vars, "vars"))
        self._check_names(inputs, vars)
        for session in self.sessions:
            host = {n: v for n, v in inputs.items() if n in session.stage.host_inputs}
            if host:
                session.stage_inputs(host, stage_vars(session.manifest, vars))

    def _check_program(self, program: str) -> None:
        """Some stage has `program` (a stage without it is skipped: with none, all were)."""
        if isinstance(program, str) and any(program in s.sites for s in self.sessions):
            return
        raise KernccError.single(f"no stage of the bundle has program `{program}` (programs: "
                                 f"{', '.join(self.programs)})")

    def _check_names(self, inputs: dict, vars: dict) -> None:
        taken = {n for s in self.bundle.stages for n in s.host_inputs}
        known_vars = {v for s in self.sessions for v in s.manifest.vars}
        for name in inputs:
            if name not in taken:
                raise KernccError.single(f"no stage of the bundle takes input `{name}` "
                                         f"(host inputs: {', '.join(sorted(taken))})")
        for name in vars:
            if name not in known_vars:
                raise KernccError.single(f"no stage of the bundle has var `{name}`")

    def _receive(self, k: int, vars: dict[str, int], item: int) -> None:
        for edge in self.bundle.edges:
            if edge["to"] != k:
                continue
            source = self.sessions[edge["from"]]
            issued = time.perf_counter()
            start = source.backend.mark() if self.trace else None
            source.transfer(edge["buffer"], self.sessions[k], vars)
            if self.trace is not None:
                self.trace.span(source.backend, f"copy {edge['from']}->{k}",
                                f"{edge['buffer']} #{item}", issued, start,
                                source.backend.mark(), {"item": item, "buffer": edge["buffer"]})

    def sample(self, buffer: str, rows: Sequence[int], params: Sequence[Any],
               counters: Sequence[tuple[int, int]]) -> np.ndarray:
        """`Session.sample` on the last stage that has buffer `buffer` (the logits)."""
        for session in reversed(self.sessions):
            if buffer in session.manifest.buffers:
                return session.sample(buffer, rows, params, counters)
        raise KernccError.single(f"no stage of the chain has a buffer `{buffer}` to sample")

    def sync(self) -> None:
        for backend in dict.fromkeys(self.backends):
            backend.activate()
            backend.sync()

    def close(self) -> None:
        """Give back the device memory of the backends this chain made (a backend passed in
        stays its caller's): on the cuda backend its weights, states and buffers, pinned host
        buffers and modules. A chain nobody holds does the same when it is collected; close
        says when. Using the chain after it is an error. `with Chain(...) as chain:` closes at
        the end of the block."""
        if self._owns_backends:
            for backend in dict.fromkeys(self.backends):
                close = getattr(backend, "close", None)
                if close is not None:
                    close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def programs(self) -> list[str]:
        return sorted({p for s in self.sessions for p in s.programs}, key=str.encode)


def _stage_backends(backend: str | Backend, devices: Sequence[int] | None,
                    stages: int) -> list[Backend]:
    """The backend of every stage: one shared, or one per GPU of `devices`."""
    placed = stage_devices(backend, devices, stages)
    if placed is None:
        shared = open_backend(backend)
        return [shared] * stages
    by_device = {d: make_backend("cuda", device=d) for d in dict.fromkeys(placed)}
    return [by_device[d] for d in placed]


def stage_devices(backend: str | Backend, devices: Sequence[int] | None, stages: int
                  ) -> list[int] | None:
    """The GPU of every stage, `devices` spread over the stages in order (several stages may
    share one); None when no devices are given. A Chain and the stage processes alike."""
    if not devices:
        return None
    if not isinstance(backend, str) or backend != "cuda":
        raise KernccError.single("--devices needs the cuda backend")
    if len(set(devices)) != len(devices):
        raise KernccError.single(f"devices {list(devices)} repeat a device")
    if len(devices) > stages:
        raise KernccError.single(f"{len(devices)} devices for {stages} stage(s): each device "
                                 "runs at least one stage")
    return [devices[k * len(devices) // stages] for k in range(stages)]


def _device_groups(backends: Sequence[Backend]) -> list[list[int]]:
    """The stages of each device (a backend shared by stages is one device)."""
    groups: dict[int, list[int]] = {}
    for k, backend in enumerate(backends):
        groups.setdefault(id(backend), []).append(k)
    return list(groups.values())


def _fitted(bundle: Bundle, backends: Sequence[Backend], default: int) -> int:
    """The largest token capacity, at most `default`, that every device's stages fit
    (footprint.fitting_capacity): one pool of page ids serves every stage."""
    return min(fitting_capacity([(k, bundle.stages[k].manifest, bundle.stages[k].plan)
                                 for k in ks], backends[ks[0]].free_bytes(), default,
                                backends[ks[0]].device_bytes)
               for ks in _device_groups(backends))


def _check_devices(bundle: Bundle, backends: Sequence[Backend], token_capacity: int) -> None:
    """Every device's stages together fit its free memory, checked before any stage loads."""
    for ks in _device_groups(backends):
        backend = backends[ks[0]]
        footprints = [stage_footprint(k, bundle.stages[k].manifest, bundle.stages[k].plan,
                                      token_capacity) for k in ks]
        check_fits(footprints, backend.free_bytes(), repr(backend), backend.device_bytes)
