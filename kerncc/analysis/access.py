"""What each call reads and writes: the one shared walk under liveness, the cut, slicing and proofs.

Direction comes from the op's interface param (`in`, `out`, `inout`); non-pointer params carry
no dataflow. A buffer access is (name, offset); a state access is a *region* (state, offset),
the unit kern's cut assigns to stages (spec §3.5). `kills` follows kern's rule (spec §3.3): only
an `out` access at offset 0 is assumed to write the whole buffer.
"""

from __future__ import annotations

from functools import cached_property, lru_cache

import attrs

from kerncc import manifest as m
from kerncc.analysis.cache import memo

Region = tuple[str, int]


@attrs.frozen
class Access:
    """One pointer argument of a call: a buffer or a state region, with its direction."""

    kind: str          # "buffer" | "state"
    name: str
    offset: int
    direction: str     # in | out | inout
    position: int      # argument index in the call

    @property
    def reads(self) -> bool:
        return self.direction in ("in", "inout")

    @property
    def writes(self) -> bool:
        return self.direction in ("out", "inout")

    @property
    def kills(self) -> bool:
        return self.kind == "buffer" and self.direction == "out" and self.offset == 0

    @property
    def region(self) -> Region:
        return (self.name, self.offset)


@attrs.frozen
class CallAccess:
    """All pointer accesses of one call, split the ways every analysis needs them (each split
    computed once: a CallAccess is shared through the lru cache below)."""

    accesses: tuple[Access, ...]

    @cached_property
    def reading(self) -> tuple[Access, ...]:
        """The accesses that read, in argument order."""
        return tuple(a for a in self.accesses if a.reads)

    @cached_property
    def writing(self) -> tuple[Access, ...]:
        """The accesses that write, in argument order."""
        return tuple(a for a in self.accesses if a.writes)

    @cached_property
    def buffer_reads(self) -> frozenset[str]:
        return frozenset(a.name for a in self.accesses if a.kind == "buffer" and a.reads)

    @cached_property
    def buffer_writes(self) -> frozenset[str]:
        return frozenset(a.name for a in self.accesses if a.kind == "buffer" and a.writes)

    @cached_property
    def buffer_kills(self) -> frozenset[str]:
        return frozenset(a.name for a in self.accesses if a.kills)

    @cached_property
    def buffers(self) -> frozenset[str]:
        return frozenset(a.name for a in self.accesses if a.kind == "buffer")

    @cached_property
    def region_reads(self) -> frozenset[Region]:
        return frozenset(a.region for a in self.accesses if a.kind == "state" and a.reads)

    @cached_property
    def region_writes(self) -> frozenset[Region]:
        return frozenset(a.region for a in self.accesses if a.kind == "state" and a.writes)

    @cached_property
    def regions(self) -> frozenset[Region]:
        return frozenset(a.region for a in self.accesses if a.kind == "state")

    @cached_property
    def states(self) -> frozenset[str]:
        return frozenset(a.name for a in self.accesses if a.kind == "state")


def call_access(call: m.Call, op: m.Op | None) -> CallAccess:
    """The accesses of `call` through `op`'s interface (no op: no accesses)."""
    if op is None:
        return CallAccess(())
    # Stages share their Call objects with the whole, so look up by identity first: hashing
    # a frozen Call (the lru key below) walks all its args, on every call.
    key = (id(call), id(op.params))
    hit = _BY_IDENTITY.get(key)
    if hit is not None and hit[0] is call and hit[1] is op.params:
        return hit[2]
    found = _call_access(call, op.params)
    if len(_BY_IDENTITY) >= _IDENTITY_LIMIT:
        _BY_IDENTITY.clear()
    _BY_IDENTITY[key] = (call, op.params, found)  # holding them keeps their ids unique
    return found


_IDENTITY_LIMIT = 65536
_BY_IDENTITY: dict[tuple[int, int], tuple[m.Call, tuple[m.ParamType, ...], CallAccess]] = {}


@lru_cache(maxsize=65536)
def _call_access(call: m.Call, params: tuple[m.ParamType, ...]) -> CallAccess:
    found: list[Access] = []
    for position, (arg, param) in enumerate(zip(call.args, params)):
        if not param.is_pointer:
            continue
        if isinstance(arg, m.BufArg) and param.kind == "buffer":
            found.append(Access("buffer", arg.name, arg.offset or 0, param.direction, position))
        elif isinstance(arg, m.StateArg) and param.kind == "state":
            found.append(Access("state", arg.name, arg.offset or 0, param.direction, position))
    return CallAccess(tuple(found))


def program_access(man: m.Manifest, program: m.Program) -> tuple[CallAccess, ...]:
    """The accesses of each call of `program` through `man`'s ops, cached per manifest object."""
    # Keyed by the program object too (callers may pass an edited copy); the memo holds it.
    held, found = memo(man, ("program_access", id(program)),
                       lambda: (program, tuple(call_access(c, man.ops.get(c.op))
                                               for c in program.calls)))
    if held is program:
        return found
    return tuple(call_access(c, man.ops.get(c.op)) for c in program.calls)
