"""The placement flags of `kerncc run` and `kerncc serve`: where the stages run.

`add_arguments(parser)` adds `--backend`, `--devices`, `--placement thread|process|ray`
(default thread: every stage in this process), `--transport`, `--stage-timeout`,
`--ray-address` and `--kv-tokens` (the KV pool's size); `make(args, bundle, **chain_options)`
builds the runner they ask for through kerncc.runtime.placement.make_runner. A flag the
chosen placement does not read, or --devices without the cuda backend, is a usage error
(`unread`, which kerncc.cli.main calls after parsing): the thread placement has no links and
no stage processes, and only Ray joins a cluster.
"""

from __future__ import annotations

import argparse
from typing import Any

from kerncc import config
from kerncc.cli.args import devices, positive, positive_seconds

PLACEMENTS = ("thread", "process", "ray")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("cpu", "cuda"), default=config.default_backend(),
                   help="where the kernels run (default: $KERNCC_BACKEND, else cpu; now "
                   f"{config.default_backend()})")
    p.add_argument("--devices", type=devices, metavar="0,1",
                   help="GPUs to spread the stages over, in order (cuda backend)")
    p.add_argument("--placement", choices=PLACEMENTS, default="thread",
                   help="where the stages run: all in this process (thread, the default), each "
                   "in its own process on this host (process), or as Ray actors (ray)")
    # No defaults here (None: not given), so that `unread` can tell a flag given from one
    # left alone; the runners own the defaults the help states.
    p.add_argument("--transport", choices=("auto", "host", "nccl"),
                   help="how crossing buffers go between stage processes or actors (auto, the "
                   "default: NCCL between distinct GPUs when nccl4py is installed, else the "
                   "host; --placement process or ray)")
    p.add_argument("--stage-timeout", type=positive_seconds, metavar="SECONDS",
                   help="a stage process silent or stuck this long counts as dead (default 60; "
                   "--placement process or ray)")
    p.add_argument("--ray-address", metavar="ADDRESS",
                   help="the Ray cluster for --placement ray (default: the one ray.init finds)")
    p.add_argument("--kv-tokens", type=positive, metavar="N",
                   help="token slots of the KV pool, all sequences together (default: every "
                   "sequence at the bundle's context bound, cut with --placement thread to "
                   "what the devices' free memory holds, less 5%%)")
    p.set_defaults(check_usage=unread)


# The runner option each flag sets, for each placement that reads it.
READ_BY = {"process": {"transport": "transport", "stage_timeout": "timeout"},
           "ray": {"transport": "transport", "stage_timeout": "timeout",
                   "ray_address": "address"}}
FLAGS = {"transport": "--transport", "stage_timeout": "--stage-timeout",
         "ray_address": "--ray-address"}


def unread(args: argparse.Namespace) -> str | None:
    """The usage error of placement flags given that the chosen placement does not read, and
    of --devices without the cuda backend."""
    placement = getattr(args, "placement", "thread")
    read = READ_BY.get(placement, {})
    cuda = args.backend == "cuda"
    problems = [] if cuda or not args.devices else ["--devices needs --backend cuda"]
    for dest, flag in FLAGS.items():
        if getattr(args, dest, None) is None or dest in read:
            continue
        takers = [name for name, names in READ_BY.items() if dest in names]
        problems.append(f"{flag}: only --placement {' or '.join(takers)} takes it "
                        f"(got --placement {placement})")
    return "; ".join(problems) or None


def options(args: argparse.Namespace) -> dict[str, Any]:
    """The runner options the placement flags give (none for thread); a flag not given
    leaves the runner's default."""
    read = READ_BY.get(getattr(args, "placement", "thread"), {})
    return {option: getattr(args, dest) for dest, option in read.items()
            if getattr(args, dest, None) is not None}


def make(args: argparse.Namespace, bundle: Any, **chain_options: Any) -> Any:
    """The runner of `bundle` that the flags ask for (a Chain to every caller)."""
    from kerncc.runtime.placement import make_runner

    if getattr(args, "kv_tokens", None) is not None:
        chain_options = {**chain_options, "token_capacity": args.kv_tokens}
    return make_runner(bundle, args.backend, args.devices, getattr(args, "placement", "thread"),
                       **chain_options, **options(args))
