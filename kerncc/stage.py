"""Assembling a stage manifest from the calls it keeps (spec §3.6 steps 4-9), shared by every pass.

Passes decide *which calls* a stage keeps; this module derives everything else from that
choice, so the IR after any pass verifies (ARCHITECTURE §4: declarations no call uses are
pruned): the buffers, states, ops, modules and vars the kept calls use, the kinds and `export`
of crossing buffers, and page/line tables re-pointed when their state is gone (step 6).
Names are never rewritten: a stage is the whole manifest minus what it does not use.
"""

from __future__ import annotations

import attrs

from kerncc import manifest as m
from kerncc.analysis.access import call_access


def host_inputs(stage: m.Manifest, arriving: set[str]) -> list[str]:
    """Inputs of a stage the host must write: its input and inout buffers that do not arrive
    from an earlier stage (`arriving`), in name order."""
    return sorted(name for name, b in stage.buffers.items()
                  if b.kind in ("input", "inout") and name not in arriving)


def keep_programs(whole: m.Manifest, calls: dict[str, tuple[m.Call, ...]]) -> dict[str, m.Program]:
    """The programs of a stage: each named program with its kept calls (empty ones vanish)."""
    return {name: attrs.evolve(whole.programs[name], calls=kept)
            for name, kept in calls.items() if kept}


def assemble(whole: m.Manifest, programs: dict[str, m.Program],
             kinds: dict[str, str], cut: m.Cut | None) -> m.Manifest:
    """A stage manifest that keeps `programs` and exactly the declarations they use.

    `kinds` re-kinds crossing buffers (spec §3.4); `export` follows (spec §3.6 step 4).
    """
    ops = {name: whole.ops[name] for name in _used_ops(programs) if name in whole.ops}
    buffer_names, state_names = _used_memory(whole, programs, ops)
    buffers = {name: _rekind(whole.buffers[name], kinds.get(name)) for name in buffer_names}
    states = {name: whole.states[name] for name in state_names}
    buffers = {name: _repoint(whole, buf, buffers, states) for name, buf in buffers.items()}
    modules = {name: whole.modules[name] for name in _used_modules(ops) if name in whole.modules}
    stage = attrs.evolve(whole, topology=None if cut else whole.topology, cut=cut,
                         buffers=buffers, states=states, ops=ops, modules=modules,
                         programs=programs, vars={})
    used = used_vars(stage)
    return attrs.evolve(stage, vars={k: v for k, v in whole.vars.items() if k in used})


def unchanged_or(old: m.Manifest, new: m.Manifest) -> m.Manifest:
    """`old` when a pass's re-assembled stage equals it, else `new`.

    Analyses (verification first) are cached per manifest object, so handing an unchanged
    stage on as the same object keeps them; comparing is cheap (attrs compares shared parts by
    identity first), verifying again is not.
    """
    return old if new == old else new


def crossing_kinds(whole: m.Manifest, stage: m.Manifest) -> dict[str, str]:
    """The re-kinded buffers of a stage (what `cut` changed), to keep through re-assembly."""
    return {name: b.kind for name, b in stage.buffers.items()
            if name in whole.buffers and whole.buffers[name].kind != b.kind}


def _used_ops(programs: dict[str, m.Program]) -> set[str]:
    return {call.op for p in programs.values() for call in p.calls}


def _used_modules(ops: dict[str, m.Op]) -> set[str]:
    return {launch.module for op in ops.values() for launch in op.launches
            if isinstance(launch, m.KernelLaunch)}


def _used_memory(whole: m.Manifest, programs: dict[str, m.Program],
                 ops: dict[str, m.Op]) -> tuple[set[str], set[str]]:
    buffers: set[str] = set()
    states: set[str] = set()
    for program in programs.values():
        for call in program.calls:
            acc = call_access(call, ops.get(call.op))
            buffers |= acc.buffers
            states |= acc.states
    # A peer buffer names the exported memory it holds addresses `of`: keep that too.
    for name in list(buffers):
        target = whole.buffers[name].of
        if target in whole.buffers:
            buffers.add(target)
        elif target in whole.states:
            states.add(target)
    return {b for b in buffers if b in whole.buffers}, {s for s in states if s in whole.states}


def _rekind(buf: m.Buffer, kind: str | None) -> m.Buffer:
    if kind is None:
        return buf
    return attrs.evolve(buf, kind=kind, export=kind != "output")


def _repoint(whole: m.Manifest, buf: m.Buffer, buffers: dict[str, m.Buffer],
             states: dict[str, m.State]) -> m.Buffer:
    """Spec §3.6 step 6: a table whose target is gone indexes a kept state of the same kind."""
    target = buf.domain.index_into if buf.domain else None
    if target is None or target in buffers or target in states:
        return buf
    triple = whole.states[target].kind_triple if target in whole.states else None
    same = [name for name in sorted(states, key=lambda s: s.encode())
            if triple is not None and states[name].kind_triple == triple]
    if same:
        return attrs.evolve(buf, domain=attrs.evolve(buf.domain, index_into=same[0]))
    return attrs.evolve(buf, domain=None)


def used_vars(man: m.Manifest) -> set[str]:
    """Vars the manifest uses in kern's rule-9 sense (shapes, domains, grids, calls, batches)."""
    found: set[str] = set()
    for buf in man.buffers.values():
        found |= {d for d in buf.shape if isinstance(d, str)}
        found |= _domain_vars(buf.domain)
    for op in man.ops.values():
        found |= _op_vars(op)
    for program in man.programs.values():
        found |= _program_vars(program)
    return found


def _domain_vars(domain: m.Domain | None) -> set[str]:
    if domain is None:
        return set()
    bounds = [b for b in (domain.min, domain.max) if b is not None and not isinstance(b, float)]
    return {v for bound in bounds for v in m.expr_vars(bound)}


def _arg_vars(arg: object) -> set[str]:
    if isinstance(arg, m.VarArg):
        return {arg.name}
    if isinstance(arg, m.ExprArg):
        return set(m.expr_vars(arg.expr))
    return set()


def _op_vars(op: m.Op) -> set[str]:
    found = {d for s in op.scratch.values() for d in s.shape if isinstance(d, str)}
    for launch in op.launches:
        if launch.when is not None:
            found.add(launch.when.var)
        if isinstance(launch, m.KernelLaunch):
            shared = (launch.shared_mem,) if launch.shared_mem is not None else ()
            found |= {v for e in launch.grid + shared for v in m.expr_vars(e)}
        found |= {v for arg in launch.args or () if isinstance(arg, m.Pack)
                  for v in _pack_vars(arg)}
    return found


def _pack_vars(pack: m.Pack) -> set[str]:
    return {v for f in pack.fields for v in _arg_vars(f.source)}


def _program_vars(program: m.Program) -> set[str]:
    found: set[str] = set()
    if program.batch is not None:
        b = program.batch
        found |= {v for v in (b.span, b.context) if v is not None}
        if isinstance(b.rows, str):
            found.add(b.rows)
    # Most arguments are buffers: test the two kinds that name vars rather than building an
    # empty set for every argument of every call.
    for call in program.calls:
        for arg in call.args:
            if isinstance(arg, m.VarArg):
                found.add(arg.name)
            elif isinstance(arg, m.ExprArg):
                found.update(m.expr_vars(arg.expr))
    return found
