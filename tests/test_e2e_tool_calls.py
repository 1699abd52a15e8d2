"""Tool calling end to end through the openai SDK on real clusters: a tiny Qwen2 whose chat
template renders tools (colocated), and the tiny Llama with SmolLM2's template, which has
none (the default rendering; prefill and decode workers).

Forced calls (``required`` and a named function) are held to the tools' schemas by the
engine's structured-output mask (``common.engine.constraints``), so they always parse.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from common.model.tokenizer import Tokenizer
from services.gateway.parsing import parse_chat
from tests.cluster import Cluster

ASK = [{"role": "user", "content": "What time is it in Paris?"}]
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                             "enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
UNITS = {"type": "function", "function": {
    "name": "convert", "parameters": {
        "type": "object", "properties": {"unit": {"type": "string", "enum": ["C", "F"]},
                                         "round": {"type": "boolean"}},
        "required": ["unit", "round"], "additionalProperties": False}}}
TOOLS = [TIME, UNITS]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
HISTORY = [*ASK,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_0", "type": "function",
                "function": {"name": "get_time", "arguments": "{\"zone\": \"CET\"}"}}]},
           {"role": "tool", "tool_call_id": "call_0", "content": "14:05"}]


@pytest.fixture(scope="module")
def qwen(tiny_qwen2_tools_dir):
    with Cluster(str(tiny_qwen2_tools_dir), colocated=1) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def default(tiny_model_dir):
    with Cluster(str(tiny_model_dir)) as cluster:  # one prefill and one decode worker
        yield cluster


def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)


def model(cluster: Cluster) -> str:
    return client(cluster).models.list().data[0].id


def local_prompt(model_dir, **body) -> list[int]:
    """The prompt the gateway should build, rendered here with the same tokenizer."""
    return parse_chat(body, Tokenizer(model_dir), "m", 1024).prompt_token_ids


def assemble(chunks) -> tuple[str, list[tuple[str, str]], str | None]:
    """Content, calls (name, arguments) and the finish reason of a streamed choice."""
    content, calls, reason = [], {}, None
    for c in chunks:
        if not c.choices:
            continue
        delta = c.choices[0].delta
        content.append(delta.content or "")
        for t in delta.tool_calls or []:
            entry = calls.setdefault(t.index, [t.function.name, ""])
            entry[1] += t.function.arguments or ""
        reason = c.choices[0].finish_reason or reason
    return "".join(content), [tuple(v) for _, v in sorted(calls.items())], reason


def check_call(call_name: str, arguments: str, expected: str | None = None) -> None:
    assert call_name in SCHEMAS and (expected is None or call_name == expected)
    jsonschema.validate(json.loads(arguments), SCHEMAS[call_name])


# ---------------------------------------------------------------- a template with tools

def test_tools_go_through_the_models_template_and_it_generates(qwen, tiny_qwen2_tools_dir):
    out = client(qwen).chat.completions.create(model=model(qwen), messages=ASK, tools=TOOLS,
                                               max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert out.usage.completion_tokens > 0
    assert out.usage.prompt_tokens == len(local_prompt(tiny_qwen2_tools_dir, messages=ASK,
                                                       tools=TOOLS))
    # the template's own tools section, not the default one
    text = Tokenizer(tiny_qwen2_tools_dir).decode(
        local_prompt(tiny_qwen2_tools_dir, messages=ASK, tools=TOOLS), skip_special_tokens=False)
    assert "# Tools" in text and '"get_time"' in text


def test_a_conversation_with_tool_turns_renders_and_generates(qwen, tiny_qwen2_tools_dir):
    out = client(qwen).chat.completions.create(model=model(qwen), messages=HISTORY,
                                               tools=TOOLS, max_tokens=8, temperature=0)
    assert out.usage.completion_tokens > 0
    ids = local_prompt(tiny_qwen2_tools_dir, messages=HISTORY, tools=TOOLS)
    assert out.usage.prompt_tokens == len(ids)
    text = Tokenizer(tiny_qwen2_tools_dir).decode(ids, skip_special_tokens=False)
    assert "<tool_response>\n14:05\n</tool_response>" in text and '"zone": "CET"' in text


def test_a_stream_with_tools_adds_up_to_the_whole_answer(qwen):
    c = client(qwen)
    body = {"model": model(qwen), "messages": ASK, "tools": TOOLS, "max_tokens": 16,
            "temperature": 0}
    whole = c.chat.completions.create(**body).choices[0]
    content, calls, reason = assemble(c.chat.completions.create(**body, stream=True))
    assert content == (whole.message.content or "")
    assert calls == [(t.function.name, t.function.arguments)
                     for t in whole.message.tool_calls or []]
    assert reason == whole.finish_reason


def test_bad_tools_and_tool_choice_are_400s(qwen):
    c = client(qwen)
    for kwargs, param in [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}]},
         "tools.[0].function.parameters"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model=model(qwen), messages=ASK, max_tokens=4, **kwargs)
        assert info.value.status_code == 400 and info.value.body["param"] == param


def test_the_default_rendering_generates_for_a_conversation(default, tiny_model_dir):
    out = client(default).chat.completions.create(model=model(default), messages=HISTORY,
                                                  tools=TOOLS, max_tokens=8, temperature=0)
    assert out.usage.completion_tokens > 0
    assert out.usage.prompt_tokens == len(local_prompt(tiny_model_dir, messages=HISTORY,
                                                       tools=TOOLS))


# ---------------------------------------------------------------- forced calls

CLUSTERS = ["qwen", "default"]


@pytest.mark.parametrize("name", CLUSTERS)
@pytest.mark.parametrize("function", ["get_time", "convert"])
def test_a_named_choice_is_always_a_valid_call_of_that_function(request, name, function):
    cluster = request.getfixturevalue(name)
    out = client(cluster).chat.completions.create(
        model=model(cluster), messages=ASK, tools=TOOLS, max_tokens=64, temperature=1.0, seed=3,
        n=2, tool_choice={"type": "function", "function": {"name": function}})
    for choice in out.choices:
        [call] = choice.message.tool_calls
        check_call(call.function.name, call.function.arguments, function)
        assert choice.finish_reason == "tool_calls" and call.id.startswith("call_")


@pytest.mark.parametrize("name", CLUSTERS)
def test_required_is_always_one_valid_call_without_parallel_calls(request, name):
    cluster = request.getfixturevalue(name)
    out = client(cluster).chat.completions.create(
        model=model(cluster), messages=ASK, tools=TOOLS, max_tokens=64, temperature=0,
        tool_choice="required", parallel_tool_calls=False)
    [call] = out.choices[0].message.tool_calls
    check_call(call.function.name, call.function.arguments)
    assert out.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("name", CLUSTERS)
def test_a_forced_call_streams_as_tool_call_deltas(request, name):
    cluster = request.getfixturevalue(name)
    body = {"model": model(cluster), "messages": ASK, "tools": TOOLS, "max_tokens": 64,
            "temperature": 0, "tool_choice": "required", "parallel_tool_calls": False}
    c = client(cluster)
    whole = c.chat.completions.create(**body).choices[0].message.tool_calls
    content, calls, reason = assemble(c.chat.completions.create(**body, stream=True))
    assert content == "" and reason == "tool_calls"
    assert calls == [(t.function.name, t.function.arguments) for t in whole]
    check_call(*calls[0])


@pytest.mark.parametrize("name", CLUSTERS)
def test_the_sdks_parse_helper_reads_a_forced_pydantic_call(request, name):
    """``client.chat.completions.parse`` with ``openai.pydantic_function_tool``: a strict
    schema with "$defs" references, read back as the model class."""
    from typing import Literal

    import pydantic

    class Place(pydantic.BaseModel):
        zone: Literal["UTC", "CET"]

    class Meeting(pydantic.BaseModel):
        place: Place
        online: bool

    cluster = request.getfixturevalue(name)
    tool = openai.pydantic_function_tool(Meeting)
    assert "$defs" in tool["function"]["parameters"]
    out = client(cluster).chat.completions.parse(
        model=model(cluster), messages=ASK, tools=[tool], tool_choice="required",
        parallel_tool_calls=False, max_tokens=64, temperature=0)
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "Meeting"
    assert isinstance(call.function.parsed_arguments, Meeting)
