"""Random manifests for property tests, in the spirit of kern's cut property test (spec §3.9).

`random_manifest(choose)` builds a small verified-by-construction manifest from a chooser
`choose(n) -> int in [0, n)`: hypothesis drives it in the tests (`data.draw`), and kern's
xorshift drives it for seeded reproductions. Beyond kern's generator it can add more driven
programs, per-layer states, once programs that initialise state regions and carries, and
derive programs that turn sources into carries, with names whose sort order breaks a slicer that
walks programs one by one (`init_a` produces what `init_b` consumes only if run in reverse),
and partial writes (`out` at an offset: the rest of the old value stays, so its producer is
still needed; the dataflow graph's partial-write edge, tests/property/test_graph_queries.py).
"""

from __future__ import annotations

from typing import Any, Callable

Chooser = Callable[[int], int]
PARTIAL_OFFSET = 8  # bytes: bf16-aligned, inside every generated buffer

OPS: dict[str, list[str]] = {
    "f1": ["in buffer<bf16>", "out buffer<bf16>"],
    "f2": ["in buffer<bf16>", "in buffer<bf16>", "out buffer<bf16>"],
    "g": ["inout buffer<bf16>"],
    "sw": ["in buffer<bf16>", "inout state"],
    "sr": ["in state", "in buffer<bf16>", "out buffer<bf16>"],
    "z": ["out buffer<bf16>"],
    "zs": ["out state"],
    "rs": ["in state", "out buffer<bf16>"],
}


class Xorshift:
    """kern's RNG (spec §3.9): xorshift64, next(n) = (x >> 33) % n."""

    def __init__(self, seed: int) -> None:
        self.x = (seed * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF or 1

    def __call__(self, n: int) -> int:
        x = self.x
        x ^= (x << 13) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 7
        x ^= (x << 17) & 0xFFFFFFFFFFFFFFFF
        self.x = x
        return (x >> 33) % n


class _Builder:
    def __init__(self, choose: Chooser, per_layer_states: bool, partial: bool = False) -> None:
        self.choose = choose
        self.per_layer = per_layer_states
        self.partial = partial
        self.buffers: dict[str, dict] = {}
        self.states: dict[str, dict] = {}
        self.ops: set[str] = set()

    def pick(self, items: list[str]) -> str:
        return items[self.choose(len(items))]

    def buf(self, name: str, kind: str, shape: list | None = None) -> dict:
        self.buffers.setdefault(name, {"dtype": "bf16", "shape": shape or ["tokens", 8],
                                       "kind": kind})
        return {"buf": name}

    def state(self, layer: int) -> dict:
        name = f"s{layer}" if self.per_layer else "s"
        self.states[name] = {"bytes_per_token": 16}
        return {"state": name, "offset": 0 if self.per_layer else 4 * layer}

    def call(self, op: str, args: list[dict], label: str | None) -> dict:
        self.ops.add(op)
        out: dict[str, Any] = {"op": op, "args": args}
        if label is not None:
            out = {"label": label, **out}
        return out


def _driven_calls(b: _Builder, prefix: str, carries: list[str], extra_reads: int) -> list[dict]:
    ws = [f"w{i}" for i in range(4)]
    readable = ["x"] + carries[:extra_reads]
    first = b.pick(ws)
    calls = [b.call("f1", [b.buf("x", "input"), b.buf(first, "workspace")], f"{prefix}0")]
    readable.append(first)
    for i in range(1, 4 + b.choose(9)):
        region, out, kind = i // 3, b.pick(ws), b.choose(6 if b.partial else 5)
        label = f"{prefix}{i}"
        pick = lambda: _arg(b, b.pick(readable))  # noqa: E731
        if kind == 0:
            calls.append(b.call("f1", [pick(), b.buf(out, "workspace")], label))
        elif kind == 1:
            calls.append(b.call("f2", [pick(), pick(), b.buf(out, "workspace")], label))
        elif kind == 2:
            own = [r for r in readable if r not in carries and r != "x"]
            calls.append(b.call("g", [b.buf(b.pick(own), "workspace")], label))
        elif kind == 3:
            calls.append(b.call("sw", [pick(), b.state(region)], label))
        elif kind == 5:  # half of `out` (8 bytes in): its older bytes stay live
            b.buf(out, "workspace")
            calls.append(b.call("f1", [pick(), {"buf": out, "offset": PARTIAL_OFFSET}], label))
        else:
            calls.append(b.call("sr", [b.state(region), pick(), b.buf(out, "workspace")], label))
        if kind in (0, 1, 4, 5) and out not in readable:
            readable.append(out)
    calls.append(b.call("f1", [_arg(b, b.pick(readable)), b.buf("y", "output")], f"{prefix}end"))
    return calls


def _arg(b: _Builder, name: str) -> dict:
    return {"buf": name}


def _init_programs(b: _Builder, layers: int) -> dict[str, dict]:
    """Once programs whose name order is the wrong way round for a one-by-one slicer."""
    b.buf("c", "carry", [8])
    b.buf("e", "carry", [8])
    init_a = [b.call("z", [b.buf("c", "carry", [8])], "i_c")]
    init_b = [b.call("f1", [{"buf": "c"}, b.buf("e", "carry", [8])], "i_e")]
    for layer in range(layers):
        if b.choose(2):
            init_b.append(b.call("zs", [b.state(layer)], f"i_s{layer}"))
    if b.partial:  # `once: full(c); half(c@8)`: both feed `i_e` (or the half is overwritten)
        half = b.call("z", [{"buf": "c", "offset": PARTIAL_OFFSET}], "i_c_half")
        init_a.insert(b.choose(2), half)
    # `init_a` produces `c`, which only `init_b` reads: a slicer that walks the programs one
    # by one in name order has dropped `i_c` before it learns that `i_e` needs it.
    return {"init_a": {"once": True, "calls": init_a}, "init_b": {"once": True, "calls": init_b}}


def _derive_programs(b: _Builder) -> dict[str, dict]:
    b.buffers["src0"] = {"dtype": "bf16", "shape": [8], "kind": "source",
                         "bind": [{"tensor": "t.src0"}]}
    b.buffers["src1"] = {"dtype": "bf16", "shape": [8], "kind": "source",
                         "bind": [{"tensor": "t.src1"}]}
    b.buf("h", "carry", [8])
    b.buf("k", "carry", [8])
    derive_a = [b.call("f2", [{"buf": "src0"}, {"buf": "src1"}, b.buf("h", "carry", [8])], "d_h")]
    derive_b = [b.call("f1", [{"buf": "src1"}, b.buf("k", "carry", [8])], "d_k")]
    if b.partial:
        derive_b.append(b.call("f1", [{"buf": "src0"}, {"buf": "k", "offset": PARTIAL_OFFSET}],
                               "d_k_half"))
    return {"derive_a": {"derive": True, "calls": derive_a},
            "derive_b": {"derive": True, "calls": derive_b}}


def random_manifest(choose: Chooser, *, driven: int = 1, inits: bool = False,
                    derives: bool = False, per_layer_states: bool = False,
                    partial: bool = False) -> dict:
    """A manifest (as raw JSON) that verifies; see the module docstring."""
    b = _Builder(choose, per_layer_states, partial)
    programs: dict[str, dict] = {}
    carries: list[str] = []
    if inits:
        programs.update(_init_programs(b, 4))
        carries += ["c", "e"]
    if derives:
        programs.update(_derive_programs(b))
        carries += ["h", "k"]
    names = ["p", "q", "r"][:driven]
    for i, name in enumerate(names):
        calls = _driven_calls(b, f"{name}.c", carries, b.choose(len(carries) + 1))
        programs[name] = {"batch": {"groups": 1 + i, "rows": 1}, "calls": calls}
    if not inits:
        programs["init"] = {"once": True, "calls": [
            b.call("z", [b.buf("c", "carry", [8])], "i0"),
            b.call("z", [b.buf("d", "carry", [8])], "i1")]}
    return _manifest(b, programs)


def _manifest(b: _Builder, programs: dict[str, dict]) -> dict:
    ops = {name: {"params": OPS[name], "impl": {"launches": [{"entry": "extern:x"}]}}
           for name in sorted(b.ops)}
    return {"schema_version": 5, "model": "random",
            "vars": {"tokens": {"max": 4, "axis": "rows"}},
            "states": b.states, "buffers": b.buffers, "modules": {}, "ops": ops,
            "programs": programs}


def random_points(choose: Chooser, calls: int) -> list[int]:
    """kern's choice of cut points (spec §3.9)."""
    a = 1 + choose(calls - 1)
    if a + 1 < calls and choose(2) == 0:
        return [a, a + 1 + choose(calls - a - 1)]
    return [a]


def examples(ci: int, long: int) -> int:
    """How many hypothesis examples a property test runs under the current profile."""
    from kerncc import config

    return long if config.hypothesis_profile() == "long" else ci
