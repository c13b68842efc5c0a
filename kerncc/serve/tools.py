"""Tool calling: a chat request's `tools`, `tool_choice` and `chat_template_kwargs`, the tool
messages of its history, the grammar that forces a call, and the model's answer parsed back
into OpenAI's `tool_calls`.

The tools reach the model through its own chat template, and the call comes back in the format
that template teaches, read off the template's text (`template_format`: `qwen3` or `llama3`).
docs/serving.md ("Tools") gives both formats and every `tool_choice`; a forced call's syntax
goes through kerncc.serve.grammar, its arguments following the function's JSON schema.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import attrs

from kerncc.serve.fields import FieldError

QWEN3, LLAMA3 = "qwen3", "llama3"
MAX_TOOLS = 128
MAX_KWARGS = 32  # chat_template_kwargs entries
MAX_KWARG_TEXT = 4096  # characters of one chat_template_kwargs string
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
KWARG_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
# Template variables a request may not set: the render's own.
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "documents", "bos_token",
                      "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                      "mask_token", "raise_exception", "strftime_now"})
PYTHON_TAG = "<|python_tag|>"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The arguments as json.dumps and the templates' `tojson` write them.
SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_BETWEEN = re.compile(r"\s*;?\s*")  # whitespace and one `;` between two Llama 3 calls


ToolError = FieldError  # a tool field refused: answered as any other field (a 400 naming it)


# ---------------------------------------------------------------------------------------------
# The template's format


def template_format(template: str | None) -> tuple[str | None, str]:
    """The tool-call format a chat template teaches (QWEN3, LLAMA3), or None and why not."""
    if not template or not re.search(r"\btools\b", template):
        return None, "the model's chat template does not render `tools`"
    if OPEN in template:
        return QWEN3, ""
    if PYTHON_TAG in template or '"parameters"' in template:
        return LLAMA3, ""
    return None, ("the model's chat template renders tools in a call format kerncc does not "
                  "parse (it parses Qwen3's <tool_call> and Llama 3's {\"name\", "
                  "\"parameters\"})")


# ---------------------------------------------------------------------------------------------
# The request


@attrs.frozen
class Plan:
    """What a chat request asks of its tools: rendered, parsed back, perhaps forced."""

    format: str
    tools: tuple[dict, ...]  # as the request gave them: the template renders these
    choice: str  # "auto", "required" or "named"
    name: str | None = None  # the named function
    parallel: bool = True

    def grammar(self) -> str | None:
        """The Lark grammar (llguidance's) a forced call follows; None for `auto`."""
        if self.choice == "auto":
            return None
        functions = [t["function"] for t in self.tools
                     if self.choice == "required" or t["function"]["name"] == self.name]
        rules, names = [], []
        for i, function in enumerate(functions):
            schema = {**_parameters(function), "x-guidance": SEPARATORS}
            head = f'{{"name": "{function["name"]}", ' + \
                ('"arguments": ' if self.format == QWEN3 else '"parameters": ')
            if self.format == QWEN3:
                rules.append(f"call_{i}: {_lark(OPEN + chr(10) + head)} args_{i} "
                             f"{_lark('}' + chr(10) + CLOSE)}")
            else:
                rules.append(f"call_{i}: {_lark(head)} args_{i} {_lark('}')}")
            rules.append(f"args_{i}: %json {json.dumps(schema)}")
            names.append(f"call_{i}")
        # a named function is called once; Llama 3 writes one call a turn; Qwen3 several
        several = self.parallel and self.format == QWEN3 and self.choice == "required"
        start = f"call ({_lark(chr(10))} call)*" if several else "call"
        return "\n".join([f"start: {start}", f"call: {' | '.join(names)}", *rules]) + "\n"


def _lark(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)


def _parameters(function: dict) -> dict:
    """The function's arguments schema; no `parameters` is an empty argument list."""
    params = function.get("parameters")
    return params if params else {"type": "object", "properties": {},
                                  "additionalProperties": False}


def plan(body: dict, template: str | None) -> Plan | None:
    """The request's tool plan, checked (a ToolError names the field); None when no tool is
    rendered or parsed (no tools, or `tool_choice` none)."""
    tools = _tools(body.get("tools"))
    choice, name = _choice(body.get("tool_choice"), tools)
    if choice == "none":
        return None
    fmt, why = template_format(template)
    if fmt is None:
        raise ToolError("tools", f"`tools`: {why}")
    parallel = body.get("parallel_tool_calls")
    return Plan(fmt, tuple(tools), choice, name, parallel is None or bool(parallel))


def _tools(value: Any) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise ToolError("tools", f"`tools` must be a list of up to {MAX_TOOLS} functions")
    names = set()
    for i, tool in enumerate(value):
        where = f"`tools[{i}]`"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or not isinstance(function, dict):
            raise ToolError("tools", f"{where} must be {{\"type\": \"function\", \"function\": "
                            "{...}}")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ToolError("tools", f"{where}: a function's `name` must be 1 to 64 letters, "
                            "digits, _ or -")
        if name in names:
            raise ToolError("tools", f"{where}: two functions are named `{name}`")
        names.add(name)
        if function.get("parameters") is not None \
                and not isinstance(function["parameters"], dict):
            raise ToolError("tools", f"{where}: `parameters` must be a JSON-schema object")
        if function.get("description") is not None \
                and not isinstance(function["description"], str):
            raise ToolError("tools", f"{where}: `description` must be a string")
    return value


def _choice(value: Any, tools: list[dict]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise ToolError("tool_choice", "`tool_choice` `required` needs `tools`")
        return (value if tools else "none"), None  # `auto` of no tools (tools: []) is none
    name = value.get("function", {}).get("name") if isinstance(value, dict) \
        and value.get("type") == "function" and isinstance(value.get("function"), dict) \
        else None
    if not isinstance(name, str):
        raise ToolError("tool_choice", "`tool_choice` must be \"none\", \"auto\", \"required\" "
                        "or {\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in {t["function"]["name"] for t in tools}:
        raise ToolError("tool_choice", f"`tool_choice` names `{name}`, which is not one of "
                        "the request's `tools`")
    return "named", name


def template_variables(body: dict, plan: Plan | None) -> dict[str, Any]:
    """What the chat template gets beyond the messages: `chat_template_kwargs` (a bounded
    dict of JSON scalars) and the tools when they are rendered."""
    value = body.get("chat_template_kwargs")
    if value is None:
        value = {}
    if not isinstance(value, dict) or len(value) > MAX_KWARGS:
        raise ToolError("chat_template_kwargs", f"`chat_template_kwargs` must be an object of "
                        f"up to {MAX_KWARGS} entries")
    for key, item in value.items():
        if not KWARG_NAME.fullmatch(key) or key in RESERVED:
            raise ToolError("chat_template_kwargs", f"`chat_template_kwargs`: `{key[:64]}` is "
                            "not a name a request may set (a letter, then letters, digits or _; "
                            "not the render's own variables)")
        if not (item is None or isinstance(item, (bool, int, float))
                or isinstance(item, str) and len(item) <= MAX_KWARG_TEXT):
            raise ToolError("chat_template_kwargs", f"`chat_template_kwargs.{key}` must be a "
                            f"string (up to {MAX_KWARG_TEXT} characters), number, boolean or "
                            "null")
    return {**value, **({"tools": list(plan.tools)} if plan is not None else {})}


def messages(value: Any) -> list[dict[str, Any]]:
    """A chat request's `messages` as the template gets them: {role, content} strings, an
    assistant's `tool_calls` (their arguments decoded to objects, as the templates of Qwen3
    and Llama 3 write them) and a tool result's `tool_call_id`."""
    if not isinstance(value, list) or not value:
        raise ToolError("messages", "`messages` must be a non-empty list of {role, content} "
                        "strings")
    return [_message(i, m) for i, m in enumerate(value)]


def _message(i: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ToolError("messages", "`messages` must be a non-empty list of {role, content} "
                        "strings")
    role, content = message["role"], message.get("content")
    calls = message.get("tool_calls")
    if role == "assistant" and calls:
        if content is not None and not isinstance(content, str):
            raise ToolError("messages", f"`messages[{i}].content` must be a string or null")
        return {"role": role, "content": content or "", "tool_calls": _history_calls(i, calls)}
    if not isinstance(content, str):
        raise ToolError("messages", f"`messages[{i}].content` must be a string (content-part "
                        "arrays are not served)")
    out = {"role": role, "content": content}
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise ToolError("messages", f"`messages[{i}]`: a tool message needs its "
                            "`tool_call_id`")
        out["tool_call_id"] = call_id
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _history_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    where = f"`messages[{i}].tool_calls`"
    if not isinstance(calls, list) or len(calls) > MAX_TOOLS:
        raise ToolError("messages", f"{where} must be a list of calls")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments"), str):
            raise ToolError("messages", f"{where}: each call must be {{\"id\", \"type\": "
                            "\"function\", \"function\": {\"name\", \"arguments\"}}")
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise ToolError("messages", f"{where}: the arguments of `{function['name'][:64]}` "
                            "are not a JSON object")
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


# ---------------------------------------------------------------------------------------------
# The answer


def call(name: str, arguments: Any) -> dict[str, Any]:
    """One call in OpenAI's shape."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                    ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": text}}


def _object_call(value: Any, key: str) -> dict[str, Any] | None:
    """{"name": str, key: object} as a call, else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(key, value.get("arguments", {}))
    return call(value["name"], arguments) if isinstance(arguments, dict) else None


def parse(fmt: str, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The content and the calls of an answer in the format `fmt`. Text that is not a call
    stays content; None when nothing but calls (and whitespace) was written."""
    return parse_qwen3(text) if fmt == QWEN3 else parse_llama3(text)


def parse_qwen3(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    calls, kept, at = [], [], 0
    while (start := text.find(OPEN, at)) >= 0:
        end = text.find(CLOSE, start)
        stop = len(text) if end < 0 else end + len(CLOSE)  # an answer may end unclosed
        try:
            found = _object_call(json.loads(text[start + len(OPEN):stop - (
                0 if end < 0 else len(CLOSE))]), "arguments")
        except ValueError:
            found = None
        kept.append(text[at:start] if found is not None else text[at:stop])
        if found is not None:
            calls.append(found)
        at = stop
    kept.append(text[at:])
    content = "".join(kept)
    return (content.strip() or None) if calls else content, calls


def parse_llama3(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A call is the whole answer: JSON objects (after an optional <|python_tag|>) separated
    by `;`; anything else is content."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        found = _object_call(value, "parameters")
        if found is None:
            return text, []
        calls.append(found)
        at = _BETWEEN.match(body, at).end()
    return (None, calls) if calls else (text, [])


def limited(plan: Plan, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return calls if plan.parallel else calls[:1]


class Stream:
    """One streamed choice's text as content and calls: text streams as content until a call
    may have begun; from there it is held, and the calls go out once complete (Qwen3's at
    each </tool_call>, Llama 3's at the end of the answer, which is the call)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.held = ""  # text not yet handed out
        self.calls = 0
        self.leading = True  # Llama 3: nothing but whitespace handed out yet

    def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.held += text
        if self.plan.format == LLAMA3:
            return self._push_llama3()
        content, calls = "", []
        while True:
            start = self.held.find(OPEN)
            if start < 0:  # hold back what may be the start of <tool_call>
                keep = max((n for n in range(1, len(OPEN)) if self.held.endswith(OPEN[:n])),
                           default=0)
                content += self.held[:len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                break
            end = self.held.find(CLOSE, start)
            if end < 0:
                content += self.held[:start]
                self.held = self.held[start:]
                break
            stop = end + len(CLOSE)
            got, found = parse_qwen3(self.held[start:stop])
            content += self.held[:start] + (got or "" if not found else "")
            calls += found
            self.held = self.held[stop:]
        return content, self._counted(calls)

    def _push_llama3(self) -> tuple[str, list[dict[str, Any]]]:
        if not self.leading:
            out, self.held = self.held, ""
            return out, []
        body = self.held.lstrip()
        if not body or body[0] == "{" or PYTHON_TAG.startswith(body) \
                or body.startswith(PYTHON_TAG):
            return "", []  # a call may be under way
        self.leading = False
        out, self.held = self.held, ""
        return out, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is still held, as content and calls, at the end of the answer."""
        held, self.held = self.held, ""
        content, calls = parse(self.plan.format, held)
        return content or "", self._counted(calls)

    def _counted(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not self.plan.parallel:
            calls = calls[:max(0, 1 - self.calls)]
        self.calls += len(calls)
        return calls
