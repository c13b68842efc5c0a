"""kir tree -> the manifest's raw JSON, with the kir line:col of every JSON pointer it writes.

One walk over the lark tree (`kerncc.kir.parse` makes it) builds exactly the JSON object the
canonical writer would print, so the typed parse that follows is `kerncc.manifest.reader`'s own. Checked
here is what only kir can get wrong: a name declared twice, a call number that is not the call's
position, and call args, whose kind and direction are read against the op's interface
(`infer_arg`, which the printer asks too, so that whatever it prints bare reads back the same).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import lark

from kerncc import manifest as m
from kerncc.diagnostics import Diagnostic, Location, escape_pointer_token
from kerncc.manifest.jsonsource import TOO_DEEP
from kerncc.manifest.reader import parse_param_type

KIND_WORDS = "`buf`, `state`, `var`, `expr`, `i32`, `i64`, `f32`, `u8` or `rank`"
# The declarations that are a name and `key=value` attributes, and their manifest section.
ATTR_SECTIONS = {"var": "vars", "state": "states", "module": "modules"}

Position = tuple[int, int]


def build(tree: lark.Tree, file: str | None) -> tuple[dict, dict[str, Position], list[Diagnostic]]:
    """The raw JSON, each pointer's position, and the kir-only errors found on the way."""
    walk = _Build(file)
    try:
        walk.manifest(tree)
    except RecursionError:  # no put had the stack left to record it: where it ran away
        node, ptr = walk.runaway or (tree, "")
        walk.error(TOO_DEEP, node, ptr)
    return walk.raw, walk.pos, walk.diags

# ---------------------------------------------------------------------------- call args


def infer_arg(param: m.ParamType | None, value: Any, offset: int | None) -> dict | None:
    """The call arg a bare value stands for at this interface param; None when it needs a kind.

    A bare name is the buffer, state or var the param takes (a buffer when the param is
    unknown); a bare number or expression is a literal or `expr` for a scalar param.
    """
    if isinstance(value, str):
        if param is None or param.kind in ("buffer", "bytes"):
            return _with_offset({"buf": value}, offset)
        if param.kind == "state":
            return _with_offset({"state": value}, offset)
        return {"var": value} if offset is None else None
    if param is None or param.kind != "scalar" or offset is not None:
        return None
    if isinstance(value, dict):
        return {"expr": value}
    return {param.scalar: value}


def _with_offset(arg: dict, offset: int | None) -> dict:
    if offset is not None:
        arg["offset"] = offset
    return arg


def raw_param_type(raw_ops: dict, op: str, index: int) -> m.ParamType | None:
    """Param #index of the op's interface, None when the op or the param is unknown."""
    params = raw_ops.get(op, {}).get("params", [])
    if not isinstance(params, list) or index >= len(params):
        return None
    return parse_param_type(params[index], lambda message: None)

# ---------------------------------------------------------------------------- tree -> raw JSON


def _where(node: Any) -> Position:
    if isinstance(node, lark.Token):
        return node.line, node.column
    if isinstance(node, lark.Tree) and not node.meta.empty:
        return node.meta.line, node.meta.column
    return 1, 1


def _sub(ptr: str, *tokens: str | int) -> str:
    return ptr + "".join("/" + escape_pointer_token(t) for t in tokens)


def _present(children: list) -> list:
    """Children without the placeholders that absent optional parts leave."""
    return [c for c in children if c is not None]


class _Build:
    """One walk over the tree: the raw JSON, each pointer's position, the kir-only errors."""

    def __init__(self, file: str | None) -> None:
        self.file = file
        self.raw: dict[str, Any] = {}
        self.pos: dict[str, Position] = {}
        self.diags: list[Diagnostic] = []
        self.runaway: tuple[Any, str] | None = None  # the innermost put a runaway left

    def error(self, message: str, node: Any, ptr: str = "") -> None:
        line, col = _where(node)
        self.diags.append(Diagnostic(message, Location(ptr, self.file, line, col)))

    def mark(self, ptr: str, node: Any) -> None:
        self.pos.setdefault(ptr, _where(node))

    def put(self, out: dict, key: str, ptr: str, node: Any, build: Callable[[str], Any]) -> None:
        """out[key] = build(pointer), once: a second one is kern's `duplicate name`."""
        child = _sub(ptr, key)
        if key in out:
            self.error(f"duplicate name `{key}`", node, child)
            return
        self.mark(child, node)
        try:
            out[key] = build(child)
        except RecursionError:  # the innermost put around a runaway expression or list
            if self.runaway is None:
                self.runaway = (node, child)  # an assignment: room for it at the stack's end
            # Recording may itself run out of stack; then an outer put records this place.
            self.error(TOO_DEEP, *self.runaway)
            self.runaway = None

    # -------------------------------------------------------------- declarations

    def manifest(self, tree: lark.Tree) -> None:
        programs = []
        for decl in tree.children:
            if decl.data == "program":
                programs.append(decl)  # calls read op interfaces: every op first
            elif decl.data in ATTR_SECTIONS:
                self.entry_of_attrs(ATTR_SECTIONS[decl.data], decl)
            else:
                getattr(self, f"decl_{decl.data}")(decl)
        for decl in programs:
            self.decl_program(decl)
        for section in ("buffers", "modules", "ops", "programs"):
            self.raw.setdefault(section, {})

    def entry(self, section: str, name_node: lark.Tree, build: Callable[[str], Any]) -> None:
        self.mark(f"/{section}", name_node)
        self.put(self.raw.setdefault(section, {}), self.name(name_node), f"/{section}",
                 name_node, build)

    def decl_schema(self, node: lark.Tree) -> None:
        self.put(self.raw, "schema_version", "", node, lambda p: int(node.children[0]))

    def decl_model(self, node: lark.Tree) -> None:
        self.put(self.raw, "model", "", node, lambda p: self.name(node.children[0]))

    def decl_topology(self, node: lark.Tree) -> None:
        self.put(self.raw, "topology", "", node,
                 lambda p: {"groups": self.attrs(node.children[0], _sub(p, "groups"))})

    def decl_cut(self, node: lark.Tree) -> None:
        self.put(self.raw, "cut", "", node, lambda p: self.attrs(node.children[0], p))

    def entry_of_attrs(self, section: str, node: lark.Tree) -> None:
        """`var`, `state`, `module`: a name and `key=value` attributes, nothing else."""
        name, attrs = node.children
        self.entry(section, name, lambda p: self.attrs(attrs, p))

    def decl_buffer(self, node: lark.Tree) -> None:
        name, dtype, shape, kind, attrs, binds = node.children

        def build(ptr: str) -> dict:
            out: dict[str, Any] = {}
            self.put(out, "dtype", ptr, dtype, lambda p: self.name(dtype))
            self.put(out, "shape", ptr, shape, lambda p: self.shape(shape, p))
            self.put(out, "kind", ptr, kind, lambda p: self.name(kind))
            self.attrs(attrs, ptr, out)
            if binds is not None:
                self.put(out, "bind", ptr, binds, lambda p: [
                    self.bind(b, _sub(p, i)) for i, b in enumerate(binds.children)])
            return out
        self.entry("buffers", name, build)

    def shape(self, node: lark.Tree, ptr: str) -> list:
        return [self.value(d, _sub(ptr, i)) for i, d in enumerate(_present(node.children))]

    def bind(self, node: lark.Tree, ptr: str) -> dict:
        tensor, attrs = node.children
        self.mark(ptr, node)
        out: dict[str, Any] = {}
        self.put(out, "tensor", ptr, tensor, lambda p: self.value(tensor, p, "tensor"))
        return self.attrs(attrs, ptr, out)

    # -------------------------------------------------------------- ops

    def decl_op(self, node: lark.Tree) -> None:
        name, *rest = _present(node.children)
        params = [c for c in rest if c.data == "ptype"]
        items = [c for c in rest if c.data != "ptype"]

        def build(ptr: str) -> dict:
            self.mark(_sub(ptr, "impl"), name)
            return {"params": self.ptypes(params, _sub(ptr, "params")),
                    "impl": self.impl(items, _sub(ptr, "impl"))}
        self.entry("ops", name, build)

    def ptypes(self, nodes: list[lark.Tree], ptr: str) -> list[str]:
        for i, node in enumerate(nodes):
            self.mark(_sub(ptr, i), node)
        return [_param_text(node) for node in nodes]

    def impl(self, items: list[lark.Tree], ptr: str) -> dict:
        out: dict[str, Any] = {}
        scratch = [s for s in items if s.data == "scratch"]
        if scratch:
            out["scratch"] = {}
            for node in scratch:
                self.put(out["scratch"], self.name(node.children[0]), _sub(ptr, "scratch"),
                         node.children[0], lambda p, n=node: self.scratch(n, p))
        launches = [x for x in items if x.data == "launch"]
        out["launches"] = [self.launch(x, _sub(ptr, "launches", i))
                           for i, x in enumerate(launches)]
        return out

    def scratch(self, node: lark.Tree, ptr: str) -> dict:
        _, dtype, shape = node.children
        self.mark(_sub(ptr, "dtype"), dtype)
        self.mark(_sub(ptr, "shape"), shape)
        return {"dtype": self.name(dtype), "shape": self.shape(shape, _sub(ptr, "shape"))}

    def launch(self, node: lark.Tree, ptr: str) -> dict:
        entry, *items = node.children
        self.mark(ptr, node)
        out: dict[str, Any] = {}
        self.put(out, "entry", ptr, entry, lambda p: self.name(entry))
        for item in items:
            self.launch_item(item, ptr, out)
        return out

    def launch_item(self, item: lark.Tree, ptr: str, out: dict) -> None:
        if item.data == "params":
            nodes = _present(item.children)
            self.put(out, "params", ptr, item, lambda p: self.ptypes(nodes, p))
        elif item.data == "args":
            nodes = _present(item.children)
            self.put(out, "args", ptr, item, lambda p: [
                self.source(a, _sub(p, i)) for i, a in enumerate(nodes)])
        else:
            self.attr(item, ptr, out)

    def source(self, node: lark.Tree, ptr: str) -> dict:
        """A launch arg or a pack field's source: a one-key object."""
        self.mark(ptr, node)
        kind, first = node.data, node.children[0] if node.children else None
        if kind == "pack":
            return {"pack": self.pack(node, _sub(ptr, "pack"))}
        if kind == "literal":
            return self.literal(node, ptr)
        if kind == "param_ref":
            return self.keyed(ptr, "param", first, int(first[1:]))
        if kind == "tensormap":
            return self.keyed(ptr, "tensormap", node, self.tensormap(node, _sub(ptr, "tensormap")))
        if kind == "expr_ref":
            return self.keyed(ptr, "expr", first, self.value(first, _sub(ptr, "expr")))
        key = {"scratch_ref": "scratch", "var_ref": "var", "rank": "rank"}[kind]
        return self.keyed(ptr, key, first, self.name(first))

    def keyed(self, ptr: str, key: str, node: Any, value: Any) -> dict:
        self.mark(_sub(ptr, key), node)
        return {key: value}

    def literal(self, node: lark.Tree, ptr: str) -> dict:
        scalar, number = node.children
        return self.keyed(ptr, str(scalar.children[0]), number, _number(number))

    def pack(self, node: lark.Tree, ptr: str) -> dict:
        size, *fields = _present(node.children)
        self.mark(ptr, node)
        self.mark(_sub(ptr, "size"), size)
        return {"size": int(size),
                "fields": [self.field(f, _sub(ptr, "fields", i)) for i, f in enumerate(fields)]}

    def field(self, node: lark.Tree, ptr: str) -> dict:
        at, width, source = node.children
        self.mark(ptr, node)
        out = self.keyed(ptr, "at", at, int(at))
        if width is not None:
            out.update(self.keyed(ptr, "width", width, int(width.children[0])))
        out.update(self.source(source, ptr))  # its key is never `at` or `width`
        return out

    def tensormap(self, node: lark.Tree, ptr: str) -> dict:
        param, attrs = node.children
        out = self.keyed(ptr, "param", param, int(param[1:]))
        return self.attrs(attrs, ptr, out)

    # -------------------------------------------------------------- programs

    def decl_program(self, node: lark.Tree) -> None:
        name, attrs, *calls = node.children
        program = self.name(name)

        def build(ptr: str) -> dict:
            out = self.attrs(attrs, ptr)
            self.put(out, "calls", ptr, name, lambda p: [
                self.call(c, _sub(p, i), i, program) for i, c in enumerate(calls)])
            return out
        self.entry("programs", name, build)

    def call(self, node: lark.Tree, ptr: str, index: int, program: str) -> dict:
        number, label, op, *args = node.children
        self.mark(ptr, node)
        if number is not None and int(number[1:]) != index:
            self.error(f"call {number} of program `{program}` is its call #{index}", number, ptr)
        out: dict[str, Any] = {}
        if label is not None:
            self.put(out, "label", ptr, label, lambda p: self.name(label))
        op_name = self.name(op)
        self.put(out, "op", ptr, op, lambda p: op_name)
        args = _present(args)
        self.put(out, "args", ptr, node, lambda p: [
            self.call_arg(a, _sub(p, i), op_name, i) for i, a in enumerate(args)])
        return out

    def call_arg(self, node: lark.Tree, ptr: str, op: str, index: int) -> dict:
        direction, body = node.children
        self.mark(ptr, node)
        param = raw_param_type(self.raw.get("ops", {}), op, index)
        if direction is not None:
            self.check_direction(direction, ptr, param, self.param_words(op, index, param))
        if body.data == "bare":
            return self.bare(body, ptr, op, index, param)
        if body.data == "bare_float":
            return self.inferred(body, ptr, op, index, param, _number(body.children[0]), None)
        if body.data in ("buf_ref", "state_ref"):
            name, offset = body.children
            arg = {"buf" if body.data == "buf_ref" else "state": self.name(name)}
            self.mark(_sub(ptr, next(iter(arg))), name)
            return _with_offset(arg, self.offset(offset, ptr))
        return self.source(body, ptr)

    def bare(self, node: lark.Tree, ptr: str, op: str, index: int,
             param: m.ParamType | None) -> dict:
        value_node, offset = node.children
        value = self.value(value_node, ptr)
        return self.inferred(node, ptr, op, index, param, value, self.offset(offset, ptr))

    def inferred(self, node: lark.Tree, ptr: str, op: str, index: int,
                 param: m.ParamType | None, value: Any, offset: int | None) -> dict:
        arg = infer_arg(param, value, offset)
        if arg is not None:
            return arg
        if offset is not None:
            self.error(f"an offset (`@{offset}`) follows only a buffer or a state; "
                       f"{self.param_words(op, index, param)}", node, ptr)
        else:
            self.error(f"the kind of this arg is unclear: {self.param_words(op, index, param)}; "
                       f"write it ({KIND_WORDS})", node, ptr)
        return {}

    def offset(self, node: lark.Tree | None, ptr: str) -> int | None:
        if node is None:
            return None
        self.mark(_sub(ptr, "offset"), node)
        return int(node.children[0])

    def param_words(self, op: str, index: int, param: m.ParamType | None) -> str:
        """Which interface param an arg meets, in words, for messages."""
        if param is not None:
            return f"param #{index} of op `{op}` is `{param}`"
        ops = self.raw.get("ops", {})
        if op not in ops:
            return f"op `{op}` is not declared"
        count = len(ops[op].get("params", []))
        if index >= count:
            return f"op `{op}` has {count} params"
        return f"param #{index} of op `{op}` is `{ops[op]['params'][index]}`"

    def check_direction(self, token: lark.Tree, ptr: str, param: m.ParamType | None,
                        words: str) -> None:
        direction = str(token.children[0])
        if param is None:
            return  # an undeclared op or a bad param is reported where it is declared
        if not param.is_pointer:
            self.error(f"`{direction}` is a direction, but {words}", token, ptr)
        elif param.direction != direction:
            self.error(f"direction `{direction}` disagrees with the op: {words}", token, ptr)

    # -------------------------------------------------------------- attributes and values

    def attrs(self, node: lark.Tree, ptr: str, out: dict | None = None) -> dict:
        """`key=value` and flag attributes (of a line, or of a `{...}` value) into `out`."""
        out = {} if out is None else out
        for attr in _present(node.children):
            self.attr(attr, ptr, out)
        return out

    def attr(self, node: lark.Tree, ptr: str, out: dict) -> None:
        if node.data == "flag_attr":
            self.put(out, str(node.children[0].children[0]), ptr, node, lambda p: True)
            return
        if node.data in ("module_pair", "var_pair"):
            key, value = node.data.split("_")[0], node.children[0]
        else:
            key_node, value = node.children
            key = self.name(key_node) if key_node.data == "name" else str(key_node.children[0])
        self.put(out, key, ptr, node, lambda p: self.value(value, p, key))

    def value(self, node: lark.Tree, ptr: str, key: str = "") -> Any:
        self.mark(ptr, node)
        kind = node.data
        if kind in ("int", "float"):
            return _number(node.children[0])
        if kind == "name":
            return self.name(node)
        if kind == "boolean":
            return str(node.children[0]) == "true"
        if kind in ("add", "mul", "ceil_div"):
            return self.expr(node, ptr)
        if kind == "dict":
            return self.attrs(node, ptr)
        if kind == "ranked":
            return self.ranked(node, ptr, key)
        items = _present(node.children)  # list or range
        return [self.value(v, _sub(ptr, i), key) for i, v in enumerate(items)]

    def expr(self, node: lark.Tree, ptr: str) -> dict:
        left, right = node.children
        inner = _sub(ptr, node.data)
        self.mark(inner, node)
        if node.data == "add":
            return {"add": [self.value(left, _sub(inner, 0)), self.value(right, _sub(inner, 1))]}
        self.mark(_sub(inner, 1), right)
        return {node.data: [self.value(left, _sub(inner, 0)), int(right)]}

    def ranked(self, node: lark.Tree, ptr: str, key: str) -> dict:
        """`per g [...]`: tensor names per rank, or row/column ranges per rank."""
        group, items = node.children
        what = "ranges" if key in ("rows", "cols") else "tensors"
        self.mark(_sub(ptr, "group"), group)
        return {"group": self.name(group), what: self.value(items, _sub(ptr, what), key)}

    def name(self, node: lark.Tree) -> str:
        token = node.children[0]
        if token.type != "STRING":
            return str(token)
        try:
            return json.loads(token)
        except json.JSONDecodeError as err:
            self.error(f"invalid string: {err.msg.lower()}", token)
            return str(token)[1:-1]


def _number(token: lark.Token) -> int | float:
    return float(token) if token.type == "FLOAT" else int(token)


def _param_text(node: lark.Tree) -> str:
    """The param type string kern reads: `in buffer<bf16>`, `bytes<16>`, `i32`."""
    *words, angle = node.children
    text = " ".join(str(w.children[0]) for w in words)
    return text if angle is None else f"{text}<{angle.children[0]}>"
