"""Tool calling as users drive it: `tools` / `tool_choice` rendered through the model's chat
template, the answer parsed back into `tool_calls`, a forced call through the grammar engine;
through the official `openai` client against the tiny example on cpu, whose tokenizer is given
a Qwen3-style and a Llama-3-style tool template here. The tiny model's answers are random:
`tool_choice` required or named (or a guided regex writing a call) gets a call for certain.
The parsers are checked on handwritten answers.
"""

from __future__ import annotations

import json
import re
import shutil

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kerncc.example import generate
from kerncc.example.text import CHAT_TEMPLATE
from kerncc.lower import lower_to_bundle
from kerncc.runtime import Chain
from kerncc.serve import tools
from serving import serving

openai = pytest.importorskip("openai")
pytest.importorskip("tokenizers")
pytest.importorskip("llguidance")

MODEL = "kerncc-qwen3-tiny"

# Written for these tests in the formats of Qwen3's and Llama 3.1's templates, short enough
# for the tiny model's 256-token context (so they list the tools' names, not their JSON).
QWEN3_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + tool.function.name }}{%- endfor %}
{{- '\\n</tools>\\nCall as <tool_call>\\n{"name": n, "arguments": a}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + message.content }}
{%- for call in message.tool_calls or [] %}
{%- set call = call.function if call.function is defined else call %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""
LLAMA3_TEMPLATE = """\
{%- if tools is defined and tools %}
{{- '<|im_start|>system\\nReply {"name": function, "parameters": object}\\n' }}
{%- for tool in tools %}{{- tool.function.name + '\\n' }}{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- set call = message.tool_calls[0].function %}
{{- '<|im_start|>assistant\\n{"name": "' + call.name + '", "parameters": ' + (call.arguments | tojson) + '}<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>ipython\\n' + message.content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

CITY = {"type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 4}}}
DAYS = {"type": "object", "additionalProperties": False, "required": ["days"],
        "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9}}}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": CITY}}
FORECAST = {"type": "function", "function": {"name": "fc", "parameters": DAYS}}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    manifest, _ = generate(tmp_path_factory.mktemp("tiny"), "tiny")
    return manifest


@pytest.fixture(scope="module")
def chain(model) -> Chain:
    return Chain(lower_to_bundle(model))


def _codec(model, tmp_path_factory, template: str):
    from kerncc.hf.tokenizer import TextCodec

    folder = tmp_path_factory.mktemp("tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "config.json"):
        shutil.copy(model.parent / name, folder / name)
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    return TextCodec.from_dir(folder)


@pytest.fixture(scope="module", params=[tools.QWEN3, tools.LLAMA3])
def bundle(request, model, chain, tmp_path_factory):
    """(format, client, codec) of a server whose template teaches that format."""
    template = QWEN3_TEMPLATE if request.param == tools.QWEN3 else LLAMA3_TEMPLATE
    codec = _codec(model, tmp_path_factory, template)
    with serving(chain, MODEL, codec) as (url, _):
        yield request.param, openai.OpenAI(base_url=f"{url}/v1", api_key="none",
                                           max_retries=0), codec


@pytest.fixture(scope="module")
def plain(model, chain):
    """The URL of a server with the example's own template, which renders no tools."""
    from kerncc.hf.tokenizer import TextCodec

    with serving(chain, MODEL, TextCodec.from_dir(model.parent)) as (url, _):
        yield url


def _arguments(call, schema) -> dict:
    jsonschema = pytest.importorskip("jsonschema")
    value = json.loads(call.function.arguments)
    jsonschema.validate(value, schema)
    return value


# ------------------------------------------------------------------------- forced calls


def test_a_named_function_is_called_with_arguments_of_its_schema(bundle):
    _, client, _ = bundle
    named = {"type": "function", "function": {"name": "fc"}}
    for seed in range(3):
        chat = client.chat.completions.create(
            model=MODEL, messages=USER, tools=[WEATHER, FORECAST], tool_choice=named,
            temperature=1.0, seed=seed, max_tokens=120)
        choice = chat.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "fc"
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        assert 1 <= _arguments(call, DAYS)["days"] <= 9


def test_required_calls_one_of_the_tools(bundle):
    _, client, _ = bundle
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER, FORECAST], tool_choice="required",
        parallel_tool_calls=False, max_tokens=120, n=4, temperature=1.0, seed=7)
    names = set()
    for choice in chat.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        names.add(call.function.name)
        _arguments(call, CITY if call.function.name == "weather" else DAYS)
    assert names <= {"weather", "fc"}


def test_a_streamed_call_comes_as_delta_tool_calls_like_the_whole_answer(bundle):
    _, client, _ = bundle
    ask = dict(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=120, seed=3,
               temperature=1.0, tool_choice={"type": "function", "function": {"name": "weather"}})
    whole = client.chat.completions.create(**ask).choices[0]
    calls, finish, content = [], None, ""
    for chunk in client.chat.completions.create(stream=True, **ask):
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    (call,) = calls
    assert call.index == 0 and call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, call.function.arguments) == (
        whole.message.tool_calls[0].function.name, whole.message.tool_calls[0].function.arguments)


# ------------------------------------------------------------------------- auto


def _written_call(fmt: str) -> str:
    """A guided regex that makes the model write a call in `fmt` with `auto`."""
    body = r'\{"name": "weather", "' + ("arguments" if fmt == tools.QWEN3 else "parameters") \
        + r'": \{"city": "[a-z]{1,4}"\}\}'
    return r"<tool_call>\n" + body + r"\n</tool_call>" if fmt == tools.QWEN3 else body


def test_auto_parses_a_call_the_model_writes_whole_and_streamed(bundle):
    fmt, client, _ = bundle
    ask = dict(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=120,
               extra_body={"guided_regex": _written_call(fmt)})
    whole = client.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.function.name == "weather"
    _arguments(call, CITY)
    streamed = [c for chunk in client.chat.completions.create(stream=True, **ask)
                for choice in chunk.choices for c in choice.delta.tool_calls or []]
    assert [c.function.arguments for c in streamed] == [call.function.arguments]


def test_auto_returns_text_that_is_no_call_as_content(bundle):
    _, client, _ = bundle
    ask = dict(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=30,
               extra_body={"guided_regex": "[a-z ]{3,12}"})
    whole = client.chat.completions.create(**ask).choices[0]
    assert whole.message.tool_calls is None and whole.finish_reason == "stop"
    assert re.fullmatch("[a-z ]{3,12}", whole.message.content)
    streamed = "".join(choice.delta.content or "" for chunk in client.chat.completions.create(
        stream=True, **ask) for choice in chunk.choices)
    assert streamed == whole.message.content


# ------------------------------------------------------------------------- the template


def test_a_round_trip_renders_the_call_and_its_result(bundle):
    fmt, client, codec = bundle
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER], max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "weather"}})
    call = chat.choices[0].message.tool_calls[0]
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                            max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # what the template got: the tools, the call with its arguments, the result
    arguments = json.loads(call.function.arguments)
    rendered = codec.apply_chat_template(
        [USER[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "weather", "arguments": arguments}}]},
         {"role": "tool", "tool_call_id": call.id, "content": "sunny"}],
        tools=[WEATHER])
    assert "sunny" in rendered and json.dumps(arguments) in rendered
    assert "weather" in rendered.split("<|im_end|>")[0]  # the tools, first
    assert answer.usage.prompt_tokens == len(codec.encode(rendered, add_special_tokens=False))
    plain = client.chat.completions.create(model=MODEL, messages=history, max_tokens=1,
                                           tools=[WEATHER], tool_choice="none")
    assert plain.usage.prompt_tokens < answer.usage.prompt_tokens  # no tools rendered


def test_no_tools_with_auto_is_a_plain_answer(plain):
    answer = httpx.post(f"{plain}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 2, "messages": USER, "tools": [], "tool_choice": "auto"})
    assert answer.status_code == 200, answer.text
    assert "tool_calls" not in answer.json()["choices"][0]["message"]


def test_chat_template_kwargs_reach_the_template(model, chain, tmp_path_factory):
    codec = _codec(model, tmp_path_factory, QWEN3_TEMPLATE)
    with serving(chain, MODEL, codec) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        counts = [client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=1,
            extra_body={"chat_template_kwargs": kwargs}).usage.prompt_tokens
            for kwargs in ({}, {"enable_thinking": False})]
    want = [len(codec.encode(codec.apply_chat_template(USER, **kwargs),
                             add_special_tokens=False))
            for kwargs in ({}, {"enable_thinking": False})]
    assert counts == want and counts[1] > counts[0]


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [WEATHER]}, "tools", "does not render `tools`"),
    ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "weather"}}},
     "tool_choice", "not one of"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "not one of"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "name"),
    ({"chat_template_kwargs": {"enable_thinking": {"deep": 1}}}, "chat_template_kwargs",
     "string"),
    ({"chat_template_kwargs": {"messages": "x"}}, "chat_template_kwargs", "not a name"),
    ({"messages": USER + [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1"}}]}]},
     "messages", "not a JSON object"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(plain, body, param, words):
    answer = httpx.post(f"{plain}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 2, "messages": USER, **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_forced_call_and_a_response_format_are_refused_together(bundle):
    _, client, _ = bundle
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER],
                                       tool_choice="required", max_tokens=4,
                                       response_format={"type": "json_object"})
    assert caught.value.body["param"] == "tool_choice"


# ------------------------------------------------------------------------- parsers


def test_the_template_says_which_format_to_parse():
    assert tools.template_format(QWEN3_TEMPLATE)[0] == tools.QWEN3
    assert tools.template_format(LLAMA3_TEMPLATE)[0] == tools.LLAMA3
    fmt, why = tools.template_format(CHAT_TEMPLATE)
    assert fmt is None and "does not render" in why
    fmt, why = tools.template_format("{% for t in tools %}{{ t }}{% endfor %}")
    assert fmt is None and "format" in why
    assert tools.template_format(None)[0] is None


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_qwen3_calls_are_parsed_out_of_the_text():
    text = ('<think>\nweather first\n</think>\n\n<tool_call>\n{"name": "weather", '
            '"arguments": {"city": "Zürich"}}\n</tool_call>\n<tool_call>\n{"name": "fc", '
            '"arguments": {"days": 3}}\n</tool_call>')
    content, calls = tools.parse_qwen3(text)
    assert content == "<think>\nweather first\n</think>"
    assert _calls(calls) == [("weather", {"city": "Zürich"}), ("fc", {"days": 3})]
    assert calls[0]["function"]["arguments"] == '{"city": "Zürich"}'  # not \u-escaped
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["type"] == "function"
    # a call the answer did not close (it ended on eos) still counts
    assert _calls(tools.parse_qwen3('<tool_call>\n{"name": "f", "arguments": {}}')[1]) \
        == [("f", {})]
    # what is not a call stays content, as written
    broken = "so <tool_call>\n{not json}\n</tool_call> there"
    assert tools.parse_qwen3(broken) == (broken, [])
    assert tools.parse_qwen3("plain answer") == ("plain answer", [])
    assert tools.parse_qwen3('<tool_call>{"arguments": {}}</tool_call>')[1] == []


def test_llama3_calls_are_the_whole_answer():
    content, calls = tools.parse_llama3('{"name": "weather", "parameters": {"city": "Oslo"}}')
    assert content is None and _calls(calls) == [("weather", {"city": "Oslo"})]
    tagged = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}'
    assert _calls(tools.parse_llama3(tagged)[1]) == [("a", {}), ("b", {"x": 1})]
    for text in ('I would call {"name": "a", "parameters": {}}', '{"city": "Oslo"}',
                 '{"name": "a", "parameters": {}} and more', '{"name": "a", "parameters": 3}',
                 "plain"):
        assert tools.parse_llama3(text) == (text, []), text


ANSWERS = [
    ("qwen3", 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}'
              '\n</tool_call>\n<tool_call>\n{"name": "fc", "arguments": {"days": 2}}\n'
              '</tool_call>'),
    ("qwen3", "no call here, only < and <tool_ talk"),
    ("llama3", '<|python_tag|>{"name": "weather", "parameters": {"city": "Rome"}}'),
    ("llama3", '  {"name": "fc", "parameters": {"days": 2}}'),
    ("llama3", "A plain {answer}"),
]


@given(st.sampled_from(ANSWERS), st.lists(st.integers(0, 200), max_size=12))
def test_a_streamed_answer_gives_the_whole_answers_content_and_calls(answer, cuts):
    fmt, text = answer
    plan = tools.Plan(fmt, (WEATHER, FORECAST), "auto")
    stream = tools.Stream(plan)
    content, calls = "", []
    points = sorted({min(c, len(text)) for c in cuts})
    for start, end in zip([0, *points], [*points, len(text)]):
        more, got = stream.push(text[start:end])
        content, calls = content + more, calls + got
    more, got = stream.finish()
    content, calls = content + more, calls + got
    whole_content, whole_calls = tools.parse(fmt, text)
    assert _calls(calls) == _calls(whole_calls)
    assert content.strip() == (whole_content or "").strip()


def test_parallel_tool_calls_false_keeps_one_call():
    plan = tools.Plan(tools.QWEN3, (WEATHER, FORECAST), "auto", parallel=False)
    stream = tools.Stream(plan)
    _, calls = stream.push(ANSWERS[0][1])
    assert _calls(calls) == [("weather", {"city": "Rome"})]
    assert stream.finish()[1] == []
    assert "call_0 | call_1" in tools.Plan(tools.QWEN3, (WEATHER, FORECAST),
                                           "required").grammar()
