"""Rule group 7 of the verifier: ops, their scratch and their launches (spec §2.1 rule 7).

Owns, per op in name order: the interface (no `bytes<n>`), scratch shapes, each launch's
header (`when`, extern vs kernel entry, `algo`, module, block, grid, shared memory, cluster,
packs on externs, arity), and the verdicts after all launches (every interface `out` param
written, every scratch used). Each launch arg's wiring is `verify/wiring.py`, packs and
tensormaps `verify/packs.py`. Records in `checker.used` the modules kernel launches name and the
vars that grids, shared memory, `when` and pack fields read (groups via `check_group`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kerncc import manifest as m
from kerncc.diagnostics import pointer
from kerncc.verify.checker import (
    GRID_LIMITS,
    MAX_BLOCK_THREADS,
    MAX_BLOCK_Z,
    MAX_CLUSTER_BLOCKS,
    MAX_SHARED_MEM,
)
from kerncc.verify.wiring import OpFlow, check_launch_args, launch_context

if TYPE_CHECKING:
    from kerncc.verify.checker import Checker

AXIS_NAMES = ("x", "y", "z")
# The only launches a GemmAlgo can pin (cuBLASLt heuristics of the bf16 TN GEMM).
ALGO_ENTRIES = frozenset({"extern:cublaslt_bf16_tn", "extern:cublaslt_bf16_tn_acc"})


def check_ops(checker: Checker) -> None:
    """Rule group 7 over every op, in kern's (sorted) order."""
    for name in sorted(checker.m.ops):
        check_op(checker, name, checker.m.ops[name])


def check_op(checker: Checker, name: str, op: m.Op) -> None:
    ctx = f"op `{name}`"
    for i, param in enumerate(op.params):
        if param.kind == "bytes":
            checker.error(f"{ctx}: interface param #{i} is a byte aggregate; packs are "
                          "launch-private, the interface takes the buffers and scalars they are "
                          "assembled from", pointer("ops", name, "params", i))
    for sname in sorted(op.scratch):
        scratch = op.scratch[sname]
        checker.check_shape(pointer("ops", name, "impl", "scratch", sname, "shape"),
                            f"{ctx} scratch `{sname}`", scratch.dtype, scratch.shape)
    if not op.launches:
        checker.error(f"{ctx}: implementation has no launches",
                      pointer("ops", name, "impl", "launches"))
    flow = OpFlow.start(name, op)
    for index, launch in enumerate(op.launches):
        check_launch(checker, flow, index, launch)
    _check_flow_complete(checker, flow)


def _check_flow_complete(checker: Checker, flow: OpFlow) -> None:
    """After all launches: every interface `out` param written, every scratch used."""
    for i, (param, written) in enumerate(zip(flow.op.params, flow.written)):
        if not written:
            checker.error(f"op `{flow.name}`: interface `{param}` param #{i} is never written "
                          "by any launch", pointer("ops", flow.name, "params", i))
    for sname in sorted(flow.op.scratch):
        if sname not in flow.scratch_used:
            checker.error(f"op `{flow.name}`: scratch `{sname}` is never used",
                          pointer("ops", flow.name, "impl", "scratch", sname))


def check_launch(checker: Checker, flow: OpFlow, index: int, launch: m.Launch) -> None:
    """One launch: its header, its arity, then (arity matching) the wiring of every arg."""
    ptr = pointer("ops", flow.name, "impl", "launches", index)
    ctx = launch_context(flow.name, index, launch)
    if launch.when is not None:
        _check_when(checker, ctx, f"{ptr}/when", launch.when)
    if isinstance(launch, m.ExternLaunch):
        _check_extern(checker, ctx, ptr, launch, flow)
    else:
        _check_kernel(checker, ctx, ptr, launch)
    params = m.launch_params(launch, flow.op)
    args = m.launch_args(launch, flow.op)
    if len(args) != len(params):
        where = f"{ptr}/args" if launch.args is not None else ptr
        checker.error(f"{ctx}: takes {len(params)} params, got {len(args)} args", where)
        return
    check_launch_args(checker, flow, ctx, ptr, launch)


def _check_when(checker: Checker, ctx: str, ptr: str, when: m.When) -> None:
    """The range the launch runs in, clamped to the var's own [1, max], must be non-empty."""
    checker.used.vars.add(when.var)
    var = checker.m.vars.get(when.var)
    if var is None:
        checker.error(f"{ctx}: when: unknown var `{when.var}`", f"{ptr}/var")
        return
    if var.max < 1:
        return  # rule 2 reports the var; its range is empty whatever `when` says
    low = max(1 if when.min is None else when.min, 1)
    high = min(var.max if when.max is None else when.max, var.max)
    if low > high:
        checker.error(f"{ctx}: when: `{when.var}` range [{low}, {high}] is empty", ptr)

# ---------------------------------------------------------------------------- externs


def _check_extern(checker: Checker, ctx: str, ptr: str, launch: m.ExternLaunch,
                  flow: OpFlow) -> None:
    if not launch.entry.startswith("extern:"):
        checker.error(f"{ctx}: a launch without a module must be a runtime built-in "
                      "(`extern:<name>`)", f"{ptr}/entry")
    if launch.algo is not None and launch.entry not in ALGO_ENTRIES:
        checker.error(f"{ctx}: `algo` pins a cublaslt_bf16_tn[_acc] launch, not "
                      f"`{launch.entry}`", f"{ptr}/algo")
    params = m.launch_params(launch, flow.op)
    packs = [i for i, p in enumerate(params) if p.kind == "bytes"]
    if packs:
        where = (f"{ptr}/params/{packs[0]}" if launch.params is not None
                 else pointer("ops", flow.name, "params", packs[0]))
        checker.error(f"{ctx}: an extern launch takes pointers and scalars, not a pack", where)

# ---------------------------------------------------------------------------- kernels


def _check_kernel(checker: Checker, ctx: str, ptr: str, launch: m.KernelLaunch) -> None:
    if not launch.entry:
        checker.error(f"{ctx}: empty entry", f"{ptr}/entry")
    if launch.entry.startswith("extern:"):
        checker.error(f"{ctx}: an extern entry has no module or launch geometry", f"{ptr}/entry")
    if launch.module in checker.m.modules:
        checker.used.modules.add(launch.module)
    else:
        checker.error(f"{ctx}: unknown module `{launch.module}`", f"{ptr}/module")
    _check_block(checker, ctx, f"{ptr}/block", launch.block)
    for axis, expr in enumerate(launch.grid):
        _check_grid_axis(checker, ctx, f"{ptr}/grid/{axis}", axis, expr)
    if launch.shared_mem is not None:
        _check_shared_mem(checker, f"{ctx}: shared_mem", f"{ptr}/shared_mem", launch.shared_mem)
    if launch.cluster is not None:
        _check_cluster(checker, ctx, ptr, launch.grid, launch.cluster)


def _check_block(checker: Checker, ctx: str, ptr: str, block: tuple[int, int, int]) -> None:
    if 0 in block or math.prod(block) > MAX_BLOCK_THREADS:
        checker.error(f"{ctx}: block {_list(block)} exceeds {MAX_BLOCK_THREADS} threads or has a "
                      "zero dim", ptr)
    if block[2] > MAX_BLOCK_Z:
        checker.error(f"{ctx}: block.z {block[2]} > {MAX_BLOCK_Z}", f"{ptr}/2")


def _check_grid_axis(checker: Checker, ctx: str, ptr: str, axis: int, expr: m.Expr) -> None:
    """Well formed, within CUDA's limit at var upper bounds, non-zero at var lower bounds."""
    actx = f"{ctx}: grid.{AXIS_NAMES[axis]}"
    # kern reports evaluation errors of a malformed expression a second time; once is enough.
    if not checker.check_expr(ptr, actx, expr):
        return
    value = checker.eval(expr, checker.env_max)
    if isinstance(value, str):
        checker.error(f"{actx}: {value}", ptr)
    elif value > GRID_LIMITS[axis]:
        checker.error(f"{actx}: {value} exceeds CUDA limit {GRID_LIMITS[axis]} at var upper "
                      "bounds", ptr)
    if checker.eval(expr, checker.env_min) == 0:
        checker.error(f"{actx}: evaluates to 0 at var lower bounds", ptr)


def _check_shared_mem(checker: Checker, ctx: str, ptr: str, expr: m.Expr) -> None:
    if not checker.check_expr(ptr, ctx, expr):
        return
    value = checker.eval(expr, checker.env_max)
    if isinstance(value, int) and value > MAX_SHARED_MEM:
        checker.error(f"{ctx}: {value} bytes exceeds opt-in limit {MAX_SHARED_MEM} at var upper "
                      "bounds", ptr)


def _check_cluster(checker: Checker, ctx: str, ptr: str, grid: tuple[m.Expr, ...],
                   cluster: tuple[int, int, int]) -> None:
    """A legal cluster shape, and a grid that is a multiple of it at both var corners."""
    if 0 in cluster or math.prod(cluster) > MAX_CLUSTER_BLOCKS:
        checker.error(f"{ctx}: cluster {_list(cluster)} has a zero dim or more than "
                      f"{MAX_CLUSTER_BLOCKS} blocks", f"{ptr}/cluster")
        return
    corners = ((checker.env_max, "upper"), (checker.env_min, "lower"))
    for axis, (expr, size) in enumerate(zip(grid, cluster)):
        name = AXIS_NAMES[axis]
        for env, bound in corners:
            value = checker.eval(expr, env)
            if isinstance(value, int) and value % size:
                checker.error(f"{ctx}: grid.{name} = {value} at var {bound} bounds is not a "
                              f"multiple of cluster.{name} = {size}", f"{ptr}/grid/{axis}")


def _list(values: tuple[int, ...]) -> str:
    """Rust's `{:?}` of an integer array: `[128, 1, 1]`."""
    return "[" + ", ".join(str(v) for v in values) + "]"
