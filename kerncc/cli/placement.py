"""The placement flags of `kerncc run` (and `kerncc serve`): where the stages run.

`add_arguments(parser)` adds `--placement thread|process|ray` (default thread: every stage in
this process), `--transport`, `--stage-timeout` and `--ray-address`; `make(args, bundle,
**chain_options)` builds the runner they ask for through kerncc.runtime.placement.make_runner.
"""

from __future__ import annotations

import argparse
from typing import Any

PLACEMENTS = ("thread", "process", "ray")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got `{text}`") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--placement", choices=PLACEMENTS, default="thread",
                   help="where the stages run: all in this process (thread, the default), each "
                   "in its own process on this host (process), or as Ray actors (ray)")
    p.add_argument("--transport", choices=("auto", "host", "nccl"), default="auto",
                   help="how crossing buffers go between stage processes or actors (auto: "
                   "NCCL between distinct GPUs when nccl4py is installed, else the host)")
    p.add_argument("--stage-timeout", type=_seconds, default=60.0, metavar="SECONDS",
                   help="a stage process silent or stuck this long counts as dead (default 60)")
    p.add_argument("--ray-address", metavar="ADDRESS",
                   help="the Ray cluster for --placement ray (default: the one ray.init finds)")


def options(args: argparse.Namespace) -> dict[str, Any]:
    """The runner options the placement flags give (none for thread)."""
    placement = getattr(args, "placement", "thread")
    if placement == "process":
        return {"transport": args.transport, "timeout": args.stage_timeout}
    if placement == "ray":
        return {"address": args.ray_address, "timeout": args.stage_timeout,
                "transport": args.transport}
    return {}


def make(args: argparse.Namespace, bundle: Any, **chain_options: Any) -> Any:
    """The runner of `bundle` that the flags ask for (a Chain to every caller)."""
    from kerncc.runtime.placement import make_runner

    return make_runner(bundle, args.backend, args.devices, getattr(args, "placement", "thread"),
                       **chain_options, **options(args))
