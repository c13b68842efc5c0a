"""Placements: where the stages of a bundle run, and how their crossing buffers travel.

`make_runner(bundle, backend, devices, placement, **options)` is the one place a runner is
chosen by name: `thread` (the in-process `Chain`: every stage a Session of this process, the
default), `process` (`ProcessChain`: every stage its own OS process on this host, one GPU each,
crossing buffers over pipes or NCCL) or `ray` (`RayChain`: every stage a Ray actor placed by a
placement group, one GPU each, on any host of the cluster). Every runner is a `Chain` to its
callers (`submit` / `result`, `run`, `sync`, `sessions`), so the serving engine takes any of
them unchanged. docs/runtime.md ("Placements") says more.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kerncc.diagnostics import KernccError

PLACEMENTS = ("thread", "process", "ray")
THREAD_OPTIONS = ("checkpoint", "token_capacity", "interpret", "graphs", "trace",
                  "allow_nonfinite")


def make_runner(bundle: Any, backend: str = "cpu", devices: Sequence[int] | None = None,
                placement: str = "thread", **options: Any) -> Any:
    """A Chain (`thread`), ProcessChain (`process`) or RayChain (`ray`) over `bundle`.

    `options` are Chain's (checkpoint, token_capacity, interpret, graphs, trace,
    allow_nonfinite) and, for
    `process`, `transport` (auto, host, nccl), `timeout` and `start_timeout` (seconds), for
    `ray`, `address`, `timeout`, `strategy` (PACK, SPREAD, ...) and `transport`.
    """
    if placement not in PLACEMENTS:
        raise KernccError.single(f"unknown placement `{placement}` "
                                 f"(known: {', '.join(PLACEMENTS)})")
    if placement == "thread":
        from kerncc.runtime.chain import Chain

        unknown = sorted(set(options) - set(THREAD_OPTIONS))
        if unknown:
            raise KernccError.single(f"option `{unknown[0]}` is not one of the thread "
                                     "placement's")
        return Chain(bundle, backend=backend, devices=devices, **options)
    if placement == "process":
        from kerncc.runtime.placement.process import ProcessChain

        return ProcessChain(bundle, backend=backend, devices=devices, **options)
    from kerncc.runtime.placement.ray_chain import RayChain

    return RayChain(bundle, backend=backend, devices=devices, **options)


__all__ = ["PLACEMENTS", "make_runner"]
