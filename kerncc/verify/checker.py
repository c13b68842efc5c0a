"""The verifier's shared state (spec §2): the `Checker`, `Verified`, limits and pointers.

`kerncc.verify.verify(manifest)` (the package) returns a `Verified` (the only way to make one) or raises a KernccError headed
`manifest failed verification:` with one diagnostic per problem, each carrying kern's message
(with kern's context prefix, e.g. ``buffer `b`: zero-sized dimension``) and the JSON pointer of
the offending value. The rule groups run in kern's code order; they share a `Checker` holding
the manifest, the var environments and the record of what is used (rule 9).

Rule groups live beside this module: `decls` and `buffers` (1-6: versions, vars, topology, cut,
states, buffers, modules), `ops` with `wiring` and `packs` (7: ops, launches,
packs, tensormaps), `programs` (8: programs, calls,
dataflow), `decls` again (9: unused declarations); expression checks (10) are shared here.
"""

from __future__ import annotations

import attrs

from kerncc import manifest as m
from kerncc.diagnostics import Diagnostics, pointer

HEADLINE = "manifest failed verification:"

GRID_LIMITS = (2**31 - 1, 65535, 65535)
MAX_BLOCK_THREADS = 1024
MAX_BLOCK_Z = 64
MAX_SHARED_MEM = 232448
MAX_CLUSTER_BLOCKS = 16


@attrs.frozen
class Verified:
    """A manifest that passed `verify()`; the cut, the protocol and the runtime take only this."""

    manifest: m.Manifest


@attrs.define
class Usage:
    """What the manifest uses, gathered while checking, for rule 9 (unused declarations)."""

    vars: set[str] = attrs.field(factory=set)
    buffers: set[str] = attrs.field(factory=set)
    states: set[str] = attrs.field(factory=set)
    ops: set[str] = attrs.field(factory=set)
    modules: set[str] = attrs.field(factory=set)
    groups: set[str] = attrs.field(factory=set)


class Checker:
    """Shared state of one verification run: the manifest, envs, diagnostics, usage."""

    def __init__(self, manifest: m.Manifest) -> None:
        self.m = manifest
        self.diags = Diagnostics()
        self.used = Usage()
        self.env_max = manifest.vars_max()
        self.env_min = manifest.vars_min()

    def error(self, message: str, ptr: str = "") -> None:
        self.diags.error(message, ptr)

    # ------------------------------------------------------------ shared checks

    def check_expr(self, ptr: str, context: str, expr: m.Expr) -> bool:
        """Rule 10 on one expression: unknown vars, division by zero, multiplication by zero.

        Marks its vars used; returns whether the expression is well formed.
        """
        ok = True
        for name in m.expr_vars(expr):
            self.used.vars.add(name)
            if name not in self.m.vars:
                self.error(f"{context}: unknown var `{name}`", ptr)
                ok = False
        for node in _walk(expr):
            if isinstance(node, m.CeilDiv) and node.divisor == 0:
                self.error(f"{context}: division by zero", ptr)
                ok = False
            if isinstance(node, m.Mul) and node.factor == 0:
                self.error(f"{context}: multiplication by constant zero", ptr)
                ok = False
        return ok

    def eval(self, expr: m.Expr, env: dict[str, int]) -> int | str:
        """The value, or kern's evaluation error text (`arithmetic overflow`...)."""
        try:
            return m.eval_expr(expr, env)
        except m.ExprError as err:
            return str(err)

    def check_shape(self, ptr: str, context: str, dtype: str,
                    shape: tuple[m.Dim, ...]) -> int | None:
        """Shape rules shared by buffers and scratch; the byte size at var max when valid."""
        if not shape:
            self.error(f"{context}: shape must not be empty", ptr)
            return None
        size, ok = m.DTYPE_SIZES[dtype], True
        for i, dim in enumerate(shape):
            if isinstance(dim, str):
                self.used.vars.add(dim)
                if dim not in self.m.vars:
                    self.error(f"{context}: unknown var `{dim}` in shape", f"{ptr}/{i}")
                    ok = False
                    continue
                dim = self.env_max[dim]
            if dim == 0:
                self.error(f"{context}: zero-sized dimension", f"{ptr}/{i}")
                ok = False
            size *= dim
        if ok and size > m.U64_MAX:
            self.error(f"{context}: byte size overflows u64 at var upper bounds", ptr)
            return None
        return size if ok else None

    def check_group(self, ptr: str, context: str, group: str) -> None:
        """A topology group reference (peer group, rank args and fields, ranked binds)."""
        self.used.groups.add(group)
        if self.m.topology is None:
            self.error(f"{context}: group `{group}` but the manifest declares no topology", ptr)
        elif group not in self.m.topology:
            self.error(f"{context}: unknown topology group `{group}`", ptr)


def _walk(expr: m.Expr):
    yield expr
    if isinstance(expr, (m.CeilDiv, m.Mul)):
        yield from _walk(expr.expr)
    elif isinstance(expr, m.Add):
        yield from _walk(expr.left)
        yield from _walk(expr.right)


def buffer_ptr(name: str, *rest: str | int) -> str:
    return pointer("buffers", name, *rest)


@attrs.define
class OpFlow:
    """What the launches of one op wrote so far, in launch order; what scratch they used."""

    name: str
    op: m.Op
    written: list[bool]
    scratch_written: set[str] = attrs.field(factory=set)
    scratch_used: set[str] = attrs.field(factory=set)

    @classmethod
    def start(cls, name: str, op: m.Op) -> OpFlow:
        # The caller provides `in`/`inout` params (and scalars); only `out` starts unwritten.
        return cls(name, op, [p.direction != "out" for p in op.params])
