"""The symbolic interpreter: proves that a pipeline's stages, run in sequence, compute the whole.

Every call is an uninterpreted function of (op, label, scalar args, what it reads): its result
is a 64-bit hash of those parts, written to every buffer and state region it writes (the
buffer at argument position j gets hash([h, j])). kern's harness (spec §3.9) hashes with
FNV-1a 64 byte by byte; the proof only asks of the hash that different inputs give different
values, and a byte loop in Python was half of a 36-layer check, so this is BLAKE2b with 8-byte
digests (as the cut id, passes/cut.py), over the same little-endian u64 parts. A machine holds
buffer values and state-region values; it runs derive programs, then once programs (name
order), then the driven programs one after another (name order), with buffers and states
persisting.

The whole manifest runs on one machine. The stages run on one machine each, fresh (each with
its own, possibly sliced, derive and once programs); for each driven program, stage s runs its
part, and the next stage is seeded, by name, with what stage s holds of its arriving buffers
(nothing else). Afterwards every output and carry written, and every state region written, is
compared; a difference names the value, both provenances (program, call, label, stage) and
where it was read.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from typing import Any

import attrs

from kerncc import manifest as m
from kerncc.manifest import writer
from kerncc.analysis.access import CallAccess, program_access
from kerncc.diagnostics import Diagnostic, KernccError, Location, pointer
from kerncc.ir import execution_order

HEADLINE = "the stages do not compute the whole:"


def hash_parts(parts: list[int]) -> int:
    """A 64-bit hash of u64 parts: BLAKE2b-64 over their little-endian bytes."""
    digest = hashlib.blake2b(struct.pack(f"<{len(parts)}Q", *parts), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@functools.lru_cache(maxsize=65536)
def name_hash(text: str) -> int:
    """kern's name_hash: the parts are the string's bytes, each widened to a u64 (cached: op
    names, labels and scalar reprs repeat every layer)."""
    return hash_parts(list(text.encode()))


@attrs.frozen
class Origin:
    """Where a value came from: a call of a program (on a stage), or the host."""

    program: str
    call: int
    label: str | None
    stage: int | None = None

    def __str__(self) -> str:
        where = f"stage {self.stage} " if self.stage is not None else ""
        label = f" ({self.label})" if self.label else ""
        return f"{where}program `{self.program}` call #{self.call}{label}"


@attrs.define
class Machine:
    """Buffer and state-region values of one running manifest, with the origin of each."""

    manifest: m.Manifest
    stage: int | None = None
    buffers: dict[str, int] = attrs.field(factory=dict)
    regions: dict[tuple[str, int], int] = attrs.field(factory=dict)
    # Each value's first origin as Origin's fields (program, call, label, stage): only an
    # error names one, so the Origin is made then.
    origins: dict[int, tuple[str, int, str | None, int | None]] = attrs.field(factory=dict)
    written_buffers: set[str] = attrs.field(factory=set)
    written_regions: set[tuple[str, int]] = attrs.field(factory=set)
    driving: bool = False
    reads: dict[tuple[str, int], list[int]] = attrs.field(factory=dict)
    driven_regions: set[tuple[str, int]] = attrs.field(factory=set)
    driven_writes: set[str] = attrs.field(factory=set)
    # hash_parts results by their parts, shared by the machines of one check: a stage runs the
    # whole's calls on the same values when the proof holds, so it hashes nothing anew.
    hashes: dict[tuple[int, ...], int] = attrs.field(factory=dict)
    # Each call's identity parts (op, label, scalars) by the call object, shared the same way
    # (stages hold the whole's Call objects); the entry holds the call, so its id stays its.
    identities: dict[int, tuple[m.Call, tuple[int, int, int]]] = attrs.field(factory=dict)

    def seed_host(self) -> None:
        """Inputs, weights, sources, peers: what the host provides, one value per name."""
        for name, buf in self.manifest.buffers.items():
            if buf.kind in ("input", "inout", "weight", "source", "peer"):
                self.buffers.setdefault(name, name_hash(name))

    def run_program(self, name: str, first_index: int = 0) -> None:
        """Run a program; driven calls are numbered from `first_index` (their whole index)."""
        program = self.manifest.programs[name]
        self.driving = program.driven
        # The accesses through this manifest's ops, cached per manifest and program.
        accesses = program_access(self.manifest, program)
        for index, (call, acc) in enumerate(zip(program.calls, accesses)):
            self.run_call(name, first_index + index, call, acc)

    def run_call(self, program: str, index: int, call: m.Call, acc: CallAccess) -> None:
        reads = [self._read(a) for a in acc.reading]
        if self.driving:
            self.reads[(program, index)] = reads
            self.driven_regions |= acc.regions
            self.driven_writes |= acc.buffer_writes
        h = self._hash((*self._identity(call), *reads))
        if h not in self.origins:
            self.origins[h] = (program, index, call.label, self.stage)
        for a in acc.writing:
            self._write(a, self._hash((h, a.position)), h)

    def _identity(self, call: m.Call) -> tuple[int, int, int]:
        found = self.identities.get(id(call))
        if found is None or found[0] is not call:
            parts = (name_hash(call.op), name_hash(call.label or ""), _scalars_hash(call))
            found = self.identities[id(call)] = (call, parts)
        return found[1]

    def _hash(self, parts: tuple[int, ...]) -> int:
        found = self.hashes.get(parts)
        if found is None:
            found = self.hashes[parts] = hash_parts(list(parts))
        return found

    def _read(self, a) -> int:
        if a.kind != "buffer":
            return self.regions.get(a.region, 0)
        value = self.buffers.get(a.name)
        return name_hash("unset:" + a.name) if value is None else value

    def _write(self, a, value: int, call_hash: int) -> None:
        self.origins.setdefault(value, self.origins[call_hash])
        if a.kind == "buffer":
            self.buffers[a.name] = value
            self.written_buffers.add(a.name)
        else:
            self.regions[a.region] = value
            self.written_regions.add(a.region)

    def origin(self, value: int | None) -> str:
        if value is None:
            return "nothing (never written)"
        found = self.origins.get(value)
        return str(Origin(*found)) if found else "the host"


def _scalars_hash(call: m.Call) -> int:
    """Scalar arguments are part of a call's identity (kern's model ignores them; we don't)."""
    scalars = [writer.call_arg(a) for a in call.args if not isinstance(a, (m.BufArg, m.StateArg))]
    return name_hash(repr(scalars))


def init_programs(man: m.Manifest) -> list[str]:
    return [p for p in execution_order(man) if man.programs[p].derive or man.programs[p].once]


@attrs.frozen
class Proof:
    """What was checked: programs run, values compared."""

    programs: tuple[str, ...]
    outputs: int
    carries: int
    regions: int

    def to_json(self) -> dict[str, Any]:
        return {"checked": True, "programs": list(self.programs), "outputs": self.outputs,
                "carries": self.carries, "state_regions": self.regions}


def run_whole(whole: m.Manifest, driven: list[str], shared: Machine | None = None) -> Machine:
    """The whole manifest run on one machine (`shared`: a machine whose memos it shares)."""
    machine = _machine(whole, None, shared)
    machine.seed_host()
    for name in init_programs(whole):
        machine.run_program(name)
    for name in driven:
        machine.run_program(name)
    return machine


def run_stages(stages: list[m.Manifest], driven: list[str], shared: Machine | None = None
               ) -> list[Machine]:
    """Each stage on its own machine, handing over between them (`shared`: as run_whole)."""
    machines = [_machine(s, i, shared) for i, s in enumerate(stages)]
    for machine in machines:
        machine.seed_host()
        for name in init_programs(machine.manifest):
            machine.run_program(name)
    for name in driven:
        first = 0
        for i, machine in enumerate(machines):
            if i > 0:
                _hand_over(machines[i - 1], machine)
            if name in machine.manifest.programs:
                machine.run_program(name, first)
                first += len(machine.manifest.programs[name].calls)
    return machines


def _machine(man: m.Manifest, stage: int | None, shared: Machine | None) -> Machine:
    # The memos hold results of pure functions of their keys: sharing them is always safe.
    if shared is None:
        return Machine(man, stage=stage)
    return Machine(man, stage=stage, hashes=shared.hashes, identities=shared.identities)


def _hand_over(previous: Machine, machine: Machine) -> None:
    """Seed, by name, the arriving buffers (exported inputs/inouts) from the previous stage."""
    for name, buf in machine.manifest.buffers.items():
        if buf.kind in ("input", "inout") and buf.export and name in previous.buffers:
            machine.buffers[name] = previous.buffers[name]


def check_stages(whole: m.Manifest, stages: list[m.Manifest]) -> Proof:
    """Raise KernccError naming every differing value, or return what was proved."""
    driven = whole.driven_programs()
    expected = run_whole(whole, driven)
    machines = run_stages(stages, driven, shared=expected)
    problems, counts = _compare(whole, expected, machines)
    if problems:
        raise KernccError(HEADLINE, problems)
    return Proof(tuple(driven), *counts)


def _compare(whole: m.Manifest, expected: Machine, machines: list[Machine]
             ) -> tuple[list[Diagnostic], tuple[int, int, int]]:
    """Every driven call reads what it reads in the whole; outputs, carries and the regions the
    driven calls touch end equal. A state region is compared in the stage whose driven calls
    touch it (each stage holds its own copy of a state; only the owner's copy is served)."""
    problems = _compare_reads(whole, expected, machines)
    written = {b: m for m in machines for b in m.driven_writes}
    compared = sorted(b for b in expected.driven_writes | set(written)
                      if whole.buffers[b].kind in ("output", "carry"))
    for b in compared:
        got = (written[b].buffers.get(b), written[b]) if b in written else None
        problems += _differs(f"{whole.buffers[b].kind} buffer `{b}`", pointer("buffers", b),
                             expected, expected.buffers.get(b), got)
    owners = {r: m for m in machines for r in m.driven_regions}
    regions = sorted(expected.driven_regions | set(owners))
    for r in regions:
        got = (owners[r].regions.get(r), owners[r]) if r in owners else None
        problems += _differs(f"state `{r[0]}`+{r[1]}", pointer("states", r[0]),
                             expected, expected.regions.get(r), got)
    outputs = sum(whole.buffers[b].kind == "output" for b in compared)
    return problems, (outputs, len(compared) - outputs, len(regions))


def _compare_reads(whole: m.Manifest, expected: Machine, machines: list[Machine]
                   ) -> list[Diagnostic]:
    problems: list[Diagnostic] = []
    got = {key: (reads, mach) for mach in machines for key, reads in mach.reads.items()}
    for key, want in sorted(expected.reads.items()):
        have, mach = got.get(key, (None, None))
        if have == want:
            continue
        program, index = key
        ptr = pointer("programs", program, "calls", index)
        if have is None:
            problems.append(Diagnostic(f"program `{program}` call #{index} runs in no stage",
                                       Location(ptr)))
            continue
        slot = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), None)
        if slot is None:
            problems.append(Diagnostic(f"program `{program}` call #{index} reads {len(have)} "
                                       f"values in its stage, {len(want)} in the whole",
                                       Location(ptr)))
            continue
        problems.append(Diagnostic(
            f"program `{program}` call #{index} reads a different value (its read #{slot}): "
            f"the whole manifest reads the value of {expected.origin(want[slot])}, stage "
            f"{mach.stage} reads the value of {mach.origin(have[slot])}", Location(ptr)))
    return problems


def _differs(what: str, ptr: str, expected: Machine, want: int | None,
             got: tuple[int | None, Machine] | None) -> list[Diagnostic]:
    value, machine = got if got else (None, None)
    if value == want:
        return []
    have = machine.origin(value) if machine else "nothing (no stage writes it)"
    message = (f"{what} differs: the whole manifest holds the value of {expected.origin(want)}, "
               f"the stages hold the value of {have}")
    return [Diagnostic(message, Location(ptr))]
