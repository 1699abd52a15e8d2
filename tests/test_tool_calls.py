"""Tool calling without a cluster: the request fields, the prompts they render, the forced
calls' schemas, the parsers on fixed model texts, and responses and streams shaped from
those texts (streams assembled character by character equal the non-streamed answer)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from common.model.loader import resolve_model
from common.model.tokenizer import Tokenizer
from common.sampling_params import SamplingParams
from common.structured import StructuredKind, StructuredOutput
from services.gateway.errors import APIError
from services.gateway.parsing import parse_chat
from services.gateway.responses import ChoiceResult, ChunkFormatter, chat_completion, usage
from services.gateway.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    NamedParser,
    RequiredParser,
    rendering_parser,
)
from services.gateway.tool_stream import ToolCallStream, shape
from services.gateway.tools import ChoiceKind, Tool, ToolRequest, parse_tools

MODEL = "m"
MAX_LEN = 2048
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}
NO_PARAMS = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, TIME]
HISTORY = [*ASK,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(resolve_model(None).directory)  # SmolLM2's template: no tools


@pytest.fixture(scope="module")
def qwen_tok(tiny_qwen2_tools_dir) -> Tokenizer:
    return Tokenizer(tiny_qwen2_tools_dir)


def chat(tok: Tokenizer, parser: str = "hermes", **fields):
    return parse_chat({"messages": ASK, **fields}, tok, MODEL, MAX_LEN, tool_call_parser=parser)


def text_of(tok: Tokenizer, req) -> str:
    return tok.decode(req.prompt_token_ids, skip_special_tokens=False)


# ---------------------------------------------------------------- request fields

def tools_with(**function) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", **function}}]


BAD = [
    # (fields, param, message substring)
    ({"tools": {"a": 1}}, "tools", "must be an array"),
    ({"tools": ["f"]}, "tools.[0]", "must be an object"),
    ({"tools": [{"type": "retrieval"}]}, "tools.[0].type", "'function'"),
    ({"tools": [{"type": "function"}]}, "tools.[0].function", "must be an object"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools.[0].function.name", "letters"),
    ({"tools": tools_with(name="a b")}, "tools.[0].function.name", "letters"),
    ({"tools": tools_with(name="x" * 65)}, "tools.[0].function.name", "1 to 64"),
    ({"tools": [WEATHER, WEATHER]}, "tools.[1].function.name", "given twice"),
    ({"tools": tools_with(description=5)}, "tools.[0].function.description", "a string"),
    ({"tools": tools_with(parameters=[1])}, "tools.[0].function.parameters", "JSON schema object"),
    ({"tools": tools_with(parameters={"type": 5})}, "tools.[0].function.parameters",
     "not a valid JSON schema"),
    ({"tools": tools_with(parameters={"properties": {"a": {"minimum": "x"}}})},
     "tools.[0].function.parameters", "not a valid JSON schema"),
    ({"tools": tools_with(parameters={"\ud800": 1})}, "tools.[0].function.parameters",
     "not a valid JSON schema"),
    ({"tools": [WEATHER] * 129}, "tools", "at most 128"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be 'none'"),
    ({"tools": TOOLS, "tool_choice": 1}, "tool_choice", "must be 'none'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function.name",
     "must be a string"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice.function.name", "not in tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "a boolean"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": {"a": 1}}]},
     "messages.[1].tool_calls", "must be an array"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [5]}]},
     "messages.[1].tool_calls.[0]", "must be an object"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                            "arguments": "{"}}]}]},
     "messages.[1].tool_calls.[0].function.arguments", "JSON object"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                            "arguments": "[1]"}}]}]},
     "messages.[1].tool_calls.[0].function.arguments", "JSON object"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}]},
     "messages.[1].tool_calls.[0].function.name", "a string"),
    # lone surrogates (valid JSON escapes) the tokenizer could not take: 400s, not 500s
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"function": {
        "name": "f", "arguments": '{"a": "\\ud800"}'}}]}]},
     "messages.[1].tool_calls.[0].function.arguments", "JSON object"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"function": {"name": "\ud800"}}]}]},
     "messages.[1].tool_calls.[0].function.name", "a string"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "\ud800", "content": "x"}]},
     "messages.[1].tool_call_id", "a string"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": 1, "function": {
        "name": "f"}}]}]}, "messages.[1].tool_calls.[0].id", "a string"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"type": "x", "function": {
        "name": "f"}}]}]}, "messages.[1].tool_calls.[0].type", "'function'"),
    ({"messages": [*ASK, {"role": "assistant", "content": None}]}, "messages.[1].content",
     "string or an array"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": 7, "content": "x"}]},
     "messages.[1].tool_call_id", "a string"),
]


@pytest.mark.parametrize(("fields", "param", "message"), BAD, ids=[b[1] for b in BAD])
def test_bad_tool_fields_are_400s_naming_the_field(tok, fields, param, message):
    with pytest.raises(APIError) as info:
        parse_chat({"messages": ASK, **fields}, tok, MODEL, MAX_LEN)
    e = info.value
    assert (e.status, e.param) == (400, param), e.message
    assert message in e.message
    json.dumps(e.body(), ensure_ascii=False).encode("utf-8")  # the body can be sent


def test_tool_fields_fuzz_only_api_errors(tok):
    values = [None, True, 0, "", "auto", "none", "required", "x", [], [None], {}, [{}],
              {"type": "function"}, {"type": "function", "function": {"name": "get_weather"}},
              [WEATHER], [NO_PARAMS, TIME], [{"type": "function", "function": {"name": "f",
                                                                               "parameters": 1}}],
              [{"role": "assistant", "tool_calls": [{}]}], [{"role": "tool", "content": "r"}]]
    rng = random.Random(0)
    for _ in range(1500):
        body = {"messages": ASK}
        for key in rng.sample(["tools", "tool_choice", "parallel_tool_calls", "messages"], 2):
            body[key] = rng.choice(values)
        try:
            req = parse_chat(body, tok, MODEL, MAX_LEN)
        except APIError as e:
            assert e.status == 400 and e.param
        else:
            assert req.prompt_token_ids


def test_tool_choice_defaults_and_kinds():
    assert parse_tools({}) is None and parse_tools({"tools": []}) is None
    assert parse_tools({"tool_choice": "none"}) is None
    assert parse_tools({"tool_choice": "auto"}) is None  # as clients send it with no tools
    auto = parse_tools({"tools": TOOLS})
    assert (auto.choice, auto.parallel, [t.name for t in auto.tools]) == (
        ChoiceKind.AUTO, True, ["get_weather", "get_time"])
    named = parse_tools({"tools": TOOLS, "parallel_tool_calls": False,
                         "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert (named.choice, named.function, named.parallel) == (ChoiceKind.NAMED, "get_time", False)
    ping = parse_tools({"tools": [NO_PARAMS]}).tools[0]
    assert ping.parameters == {"type": "object", "properties": {}} and ping.description is None


# ---------------------------------------------------------------- rendering

def test_default_rendering_lists_the_tools_in_the_system_prompt(tok):
    text = text_of(tok, chat(tok, tools=TOOLS))
    assert text.startswith("<|im_start|>system\nYou can call functions")
    assert "helpful AI assistant named SmolLM" not in text  # the tools' system turn instead
    for tool in TOOLS:
        assert json.dumps(tool) in text
    assert "<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments object>}" in text
    assert text.endswith("What is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_default_rendering_keeps_the_conversations_system_prompt(tok):
    messages = [{"role": "system", "content": "Be brief."}, *ASK]
    text = text_of(tok, chat(tok, messages=messages, tools=[WEATHER]))
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions")
    assert text.count("<|im_start|>system") == 1


def test_default_rendering_of_tool_turns(tok):
    text = text_of(tok, chat(tok, messages=HISTORY, tools=[WEATHER]))
    assert ("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
            "{\"city\": \"Paris\"}}\n</tool_call><|im_end|>") in text
    assert ("<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n") in text
    assert "<|im_start|>tool" not in text


def test_default_rendering_follows_the_parser(tok):
    text = text_of(tok, chat(tok, "llama3_json", messages=HISTORY, tools=[WEATHER]))
    assert '{"name": <function name>, "parameters": <arguments object>}' in text
    assert ('<|im_start|>assistant\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
            '<|im_end|>') in text


def test_tool_choice_none_renders_no_tools(tok):
    plain = chat(tok)
    none = chat(tok, tools=TOOLS, tool_choice="none")
    assert none.prompt_token_ids == plain.prompt_token_ids and none.tool_parser is None
    assert none.params.structured is None


def test_a_template_with_tools_renders_them_itself(qwen_tok):
    assert qwen_tok.template_supports_tools
    text = text_of(qwen_tok, chat(qwen_tok, messages=HISTORY, tools=[WEATHER]))
    assert text.startswith("<|im_start|>system\n# Tools\nYou may call these functions")
    assert json.dumps(WEATHER, ensure_ascii=False) in text or '"get_weather"' in text
    assert "You can call functions" not in text  # not the default rendering
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>') in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text


def test_the_default_template_does_not_support_tools(tok):
    assert not tok.template_supports_tools


# ---------------------------------------------------------------- forced calls

def test_a_named_choice_is_constrained_to_the_functions_arguments(tok):
    req = chat(tok, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    spec = req.params.structured
    assert spec.kind is StructuredKind.JSON
    schema = json.loads(spec.spec)
    assert schema == WEATHER["function"]["parameters"]
    jsonschema.validate({"city": "Paris"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"town": "Paris"}, schema)
    assert isinstance(req.tool_parser, NamedParser) and req.tool_parser.function == "get_weather"


def test_required_is_an_array_of_calls_of_any_tool(tok):
    schema = json.loads(chat(tok, tools=[*TOOLS, NO_PARAMS], tool_choice="required")
                        .params.structured.spec)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}},
            {"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "ping", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}],
                [{"name": "nope", "parameters": {}}], [{"name": "ping"}],
                [{"name": "ping", "parameters": []}],
                [{"name": "get_time", "parameters": {"zone": "PST"}}], {"name": "ping"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(chat(tok, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
                        .params.structured.spec)
    jsonschema.validate(good[:1], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good[:2], single)


def test_a_schema_without_a_type_is_held_to_objects():
    tool = Tool("f", {"properties": {"a": {"type": "integer"}}})
    schema = ToolRequest((tool,), ChoiceKind.NAMED, "f").schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(5, schema)


def test_auto_and_none_constrain_nothing_and_forced_calls_exclude_response_format():
    params = SamplingParams(max_tokens=8)
    tools = (Tool("f", {"type": "object"}),)
    assert ToolRequest(tools, ChoiceKind.AUTO).constrain(params) is params
    assert ToolRequest(tools, ChoiceKind.NONE).constrain(params) is params
    taken = SamplingParams(max_tokens=8, structured=StructuredOutput(StructuredKind.JSON_OBJECT))
    with pytest.raises(APIError) as info:
        ToolRequest(tools, ChoiceKind.REQUIRED).constrain(taken)
    assert info.value.param == "tool_choice"


# ---------------------------------------------------------------- parsers on fixed texts

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TRICKY_ARGS = '{"q": "a } ] \\" <tool_call> {", "n": [1, {"x": null}], "ok": true}'
HERMES = [
    # (text, content, [(name, arguments)])
    (CALL, None, [("get_weather", '{"city": "Paris"}')]),
    ("Let me look.\n\n" + CALL, "Let me look.", [("get_weather", '{"city": "Paris"}')]),
    (CALL + "\n" + CALL.replace("Paris", "Rome") + "\n", None,
     [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]),
    ('<tool_call>{"arguments": {}, "name": "get_time"}</tool_call>', None, [("get_time", "{}")]),
    (f'<tool_call>{{"name": "f", "arguments": {TRICKY_ARGS}}}</tool_call>', None,
     [("f", TRICKY_ARGS)]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}', None,  # no closing tag
     [("get_time", '{"zone": "UTC"}')]),
    ('<tool_call>{"name": "caf\\u00e9", "arguments": {"x": "\\u00e9t\\u00e9"}}</tool_call>', None,
     [("café", '{"x": "\\u00e9t\\u00e9"}')]),
    ("Hi " + CALL + " and text after the calls", "Hi",  # text after the calls is dropped
     [("get_weather", '{"city": "Paris"}')]),
]
HERMES_PLAIN = [
    "Just text, no calls.",
    "",
    "Compare a < b and <tool a>.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # one }
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',  # arguments a string
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
    '<tool_call>[1, 2]</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>',  # not JSON
    CALL + '\n<tool_call>{"name": "g", "arguments": {]}</tool_call>',  # the second is broken
    '<tool_call>{"name": "f", "arguments": {}} and more',  # an unclosed block must be last
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES)
def test_hermes_reads_calls(text, content, calls):
    out = HermesParser().parse(text)
    assert out.content == content
    assert [(c.name, c.arguments) for c in out.calls] == calls
    assert all(isinstance(json.loads(c.arguments), dict) for c in out.calls)


@pytest.mark.parametrize("text", HERMES_PLAIN)
def test_hermes_leaves_text_without_valid_calls_as_content(text):
    out = HermesParser().parse(text)
    assert (out.content, out.calls) == (text, ())


LLAMA = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}', None,
     [("a", "{}"), ("b", '{"x": 1}')]),
    ('Checking.<|python_tag|>{"name": "a", "parameters": {"s": ";"}}', "Checking.",
     [("a", '{"s": ";"}')]),
    ('  {"name": "a", "parameters": {}} ;{"name": "a", "parameters": {}}  ', None,
     [("a", "{}"), ("a", "{}")]),
]
LLAMA_PLAIN = ["The answer is {x}.", '{"answer": 42}', '{"name": "a", "parameters": {}} trailing',
               '{"name": "a", "parameters": {}}; {"name": "b"', '{"name": "a", "parameters": 3}',
               "", "<|python_tag|>", '{"name": "a", "parameters": {}};']


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA)
def test_llama3_json_reads_calls(text, content, calls):
    out = Llama3JsonParser().parse(text)
    assert out.content == content
    assert [(c.name, c.arguments) for c in out.calls] == calls


@pytest.mark.parametrize("text", LLAMA_PLAIN)
def test_llama3_json_leaves_text_without_valid_calls_as_content(text):
    assert Llama3JsonParser().parse(text).calls == ()
    assert Llama3JsonParser().parse(text).content == text


def test_forced_outputs_parse_as_calls():
    named = NamedParser("get_weather").parse(' {"city": "Paris"}\n')
    assert [(c.name, c.arguments) for c in named.calls] == [("get_weather", '{"city": "Paris"}')]
    assert named.content is None
    assert NamedParser("f").parse('"Paris"').calls == ()
    required = RequiredParser().parse('[{"name": "get_time", "parameters": {"zone": "UTC"}}, '
                                      '{"name": "ping", "parameters": {}}]')
    assert [(c.name, c.arguments) for c in required.calls] == [
        ("get_time", '{"zone": "UTC"}'), ("ping", "{}")]
    for text in ("[]", '{"name": "ping", "parameters": {}}', '[{"name": "ping", "parameters": {}}',
                 '[{"name": "ping", "parameters": {}}] x'):
        assert RequiredParser().parse(text).calls == ()


def test_the_registry_names_the_choices():
    assert rendering_parser("hermes").name == "hermes"
    assert rendering_parser("llama3_json").name == "llama3_json"
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        rendering_parser("mistral")


# ---------------------------------------------------------------- streams equal the whole

def streamed(parser, text: str, pieces: list[int]) -> tuple[str, list[dict]]:
    """Content and calls assembled from a stream fed ``text`` in pieces of these sizes."""
    stream, content, calls, i = ToolCallStream(parser), [], {}, 0
    deltas = []
    for size in pieces:
        deltas.append(stream.push(text[i:i + size]))
        i += size
    deltas.append(stream.push(text[i:]))
    deltas.append(stream.finish())
    for d in deltas:
        content.append(d.content)
        for t in d.tool_calls:
            if "id" in t:  # the header comes first, once per call
                assert t["index"] == len(calls) and t["type"] == "function"
                assert t["id"].startswith("call_") and t["function"]["name"]
                calls[t["index"]] = {"name": t["function"]["name"],
                                     "arguments": t["function"]["arguments"]}
            else:
                assert set(t) == {"index", "function"} and set(t["function"]) == {"arguments"}
                calls[t["index"]]["arguments"] += t["function"]["arguments"]
    return "".join(content), [calls[k] for k in sorted(calls)]


ALL_TEXTS = ([(HermesParser(), t) for t, _, _ in HERMES] + [(HermesParser(), t) for t in HERMES_PLAIN]
             + [(Llama3JsonParser(), t) for t, _, _ in LLAMA]
             + [(Llama3JsonParser(), t) for t in LLAMA_PLAIN]
             + [(NamedParser("f"), ' {"a": [1, 2], "b": "}"} '),
                (RequiredParser(), '[{"name": "x", "parameters": {"a": 1}}, {"name": "y", '
                                   '"parameters": {}}]')])


@pytest.mark.parametrize(("parser", "text"), ALL_TEXTS)
def test_a_stream_character_by_character_adds_up_to_the_whole(parser, text):
    whole = shape(parser, text, "stop")
    content, calls = streamed(parser, text, [1] * len(text))
    assert (content or None) == (whole.content or None)  # always, calls or not
    if whole.tool_calls:
        assert calls == [c["function"] for c in whole.tool_calls]
        assert "<tool_call>" not in content and "python_tag" not in content
        assert whole.finish_reason == "tool_calls"
    else:
        assert content == text and whole.finish_reason == "stop"


def test_only_a_call_that_breaks_after_it_began_differs_from_the_whole():
    """The one difference a stream cannot avoid: a call whose name and first arguments were
    sent before its JSON broke, or was cut off, or was followed by text, stays in the
    stream (the content is the same: the whole text)."""
    differing = [t for p, t in ALL_TEXTS
                 if not shape(p, t, "stop").tool_calls and streamed(p, t, [1] * len(t))[1]]
    assert sorted(differing) == sorted([
        HERMES_PLAIN[3], HERMES_PLAIN[4], HERMES_PLAIN[9], HERMES_PLAIN[10], HERMES_PLAIN[11],
        LLAMA_PLAIN[2], LLAMA_PLAIN[3], LLAMA_PLAIN[7]])



@pytest.mark.parametrize("seed", range(20))
def test_a_stream_in_random_pieces_adds_up_to_the_whole(seed):
    rng = random.Random(seed)
    parser, text = rng.choice([x for x in ALL_TEXTS if shape(x[0], x[1], "stop").tool_calls])
    pieces = [rng.randint(0, 6) for _ in range(len(text))]
    whole = shape(parser, text, "stop")
    content, calls = streamed(parser, text, pieces)
    assert (content or None) == whole.content
    assert calls == [c["function"] for c in whole.tool_calls]


def test_a_call_streams_its_arguments_in_fragments():
    stream = ToolCallStream(HermesParser())
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    deltas = [stream.push(ch) for ch in text]
    headers = [t for d in deltas for t in d.tool_calls if "id" in t]
    fragments = [t["function"]["arguments"] for d in deltas for t in d.tool_calls if "id" not in t]
    assert len(headers) == 1 and headers[0]["function"]["arguments"] == "{"
    assert len(fragments) > 5 and "{" + "".join(fragments) == '{"city": "Paris"}'
    assert "".join(d.content for d in deltas) == "Sure."
    # nothing shows before the name is whole: the header comes once the arguments begin
    first = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert text[:first + 1].endswith('"arguments": {')


# ---------------------------------------------------------------- responses, as the SDK reads them

TWO_CALLS = ('I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
             '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
             '</tool_call>')


def test_a_response_with_calls_reads_as_openai_tool_calls(tok):
    req = chat(tok, tools=TOOLS)
    body = chat_completion(req, [ChoiceResult(0, TWO_CALLS, "stop"),
                                 ChoiceResult(1, "No calls needed.", "stop"),
                                 ChoiceResult(2, CALL[:30], "length")], usage(10, 5))
    out = ChatCompletion.model_validate(body)
    first, plain, cut = out.choices
    assert first.finish_reason == "tool_calls" and first.message.content == "I will check both."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in first.message.tool_calls] \
        == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    ids = [c.id for c in first.message.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert plain.message.tool_calls is None and plain.message.content == "No calls needed."
    assert "tool_calls" not in body["choices"][1]["message"]
    assert (cut.finish_reason, cut.message.content, cut.message.tool_calls) == ("length", CALL[:30], None)


def test_parallel_false_keeps_the_first_call(tok):
    req = chat(tok, tools=TOOLS, parallel_tool_calls=False)
    body = chat_completion(req, [ChoiceResult(0, TWO_CALLS, "stop")], usage(1, 1))
    assert [c["function"]["name"] for c in body["choices"][0]["message"]["tool_calls"]] == [
        "get_weather"]


def test_a_forced_named_response(tok):
    req = chat(tok, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    body = chat_completion(req, [ChoiceResult(0, '{"zone": "UTC"}', "stop")], usage(1, 1))
    msg = ChatCompletion.model_validate(body).choices[0].message
    assert msg.content is None and msg.tool_calls[0].function.name == "get_time"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"zone": "UTC"}


def test_a_stream_reads_as_openai_chunks_and_adds_up_to_the_response(tok):
    req = chat(tok, tools=TOOLS, stream=True)
    fmt = ChunkFormatter(req)
    every = [fmt.chunk(0, ch) for ch in TWO_CALLS] + [fmt.chunk(0, "", finish_reason="stop")]
    chunks = [c for c in every if c is not None]  # None: markup held back, nothing to send
    assert len(chunks) < len(every)
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.content or c.choices[0].delta.tool_calls for c in parsed[1:-1])
    content = "".join(c.choices[0].delta.content or "" for c in parsed)
    calls: dict[int, dict] = {}
    for c in parsed:
        for t in c.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(t.index, {"id": t.id, "name": t.function.name, "arguments": ""})
            entry["arguments"] += t.function.arguments or ""
    assert parsed[-1].choices[0].finish_reason == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in parsed[:-1])
    whole = chat_completion(req, [ChoiceResult(0, TWO_CALLS, "stop")], usage(1, 1))
    message = whole["choices"][0]["message"]
    assert content == message["content"]
    assert [(v["name"], v["arguments"]) for _, v in sorted(calls.items())] == [
        (t["function"]["name"], t["function"]["arguments"]) for t in message["tool_calls"]]
    assert all(v["id"].startswith("call_") for v in calls.values())


def test_a_stream_without_calls_is_plain_content(tok):
    req = chat(tok, tools=TOOLS, stream=True)
    fmt = ChunkFormatter(req)
    text = "A plain answer < with brackets >."
    chunks = [fmt.chunk(0, ch) for ch in text] + [fmt.chunk(0, "", finish_reason="stop")]
    chunks = [c for c in chunks if c is not None]  # "<" waits to see whether a call begins
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)


# ---------------------------------------------------------------- over HTTP, fixed model text

class ScriptedLink:
    """Stands in for the gateway's router link: every request is admitted and "generates"
    the tokens of ``text`` one message per token, so the real gateway (parsing, assembler,
    responses, SSE) serves a known model output to a real client."""

    def __init__(self, real, tokenizer: Tokenizer) -> None:
        self.real, self.tok = real, tokenizer
        self.text = ""
        self.submitted: list[SamplingParams] = []
        self.last_status = None
        self.reply_to = real.reply_to

    async def submit(self, request_id, prompt, params, timeout, channel=None):
        import asyncio

        from common.outputs import FinishReason
        from common.protocol import Admitted, Tokens
        from services.gateway.router_link import Admission

        self.submitted.append(params)
        channel = channel if channel is not None else asyncio.Queue()
        ids = self.tok.hf.encode(self.text, add_special_tokens=False)
        for choice in range(params.n):
            for i, token in enumerate(ids):
                last = i == len(ids) - 1
                channel.put_nowait(Tokens(request_id, choice, i, [token],
                                          finish_reason=FinishReason.STOP if last else None,
                                          num_prompt_tokens=len(prompt)))
        return Admission(Admitted(request_id), channel)

    async def abort(self, request_id, reason="client") -> None:
        pass

    def release(self, request_id) -> None:
        pass

    async def status(self, timeout: float = 2.0):
        return None

    async def close(self) -> None:
        await self.real.close()


@pytest.fixture(scope="module")
def scripted(tiny_model_dir):
    from services.gateway.app import GatewaySettings
    from tests.test_gateway_http import ServedGateway, nobody_listens

    with ServedGateway(GatewaySettings(router=nobody_listens(), model=str(tiny_model_dir))) as gw:
        state = gw.app.state.gateway
        state.link = ScriptedLink(state.link, state.tokenizer)
        yield gw, state.link


def sdk(gw):
    import openai

    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)


def test_the_openai_sdk_reads_tool_calls_unchanged(scripted):
    gw, link = scripted
    link.text = TWO_CALLS
    out = sdk(gw).chat.completions.create(model=_served(gw), messages=ASK, tools=TOOLS,
                                          max_tokens=64)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will check both."
    call = choice.message.tool_calls[0]
    assert (call.type, call.function.name) == ("function", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.message.tool_calls[1].function.name == "get_time"
    assert link.submitted[-1].structured is None  # auto: nothing forced


def test_the_sdk_stream_helper_assembles_the_same_calls(scripted):
    gw, link = scripted
    link.text = TWO_CALLS
    client = sdk(gw)
    whole = client.chat.completions.create(model=_served(gw), messages=ASK, tools=TOOLS,
                                           max_tokens=64).choices[0].message
    with client.chat.completions.stream(model=_served(gw), messages=ASK, tools=TOOLS,
                                        max_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == whole.content
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls]
    pieces = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(pieces) > 10  # the arguments came in fragments, not at the end
    contents = "".join(e.delta for e in events if e.type == "content.delta")
    assert "<tool_call>" not in contents and contents == "I will check both."


def test_a_forced_call_sends_its_schema_to_the_workers(scripted):
    gw, link = scripted
    link.text = '{"zone": "CET"}'
    out = sdk(gw).chat.completions.create(
        model=_served(gw), messages=ASK, tools=TOOLS, max_tokens=16,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    spec = link.submitted[-1].structured
    assert spec.kind is StructuredKind.JSON
    assert json.loads(spec.spec) == TIME["function"]["parameters"]
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"zone": "CET"}


def test_bad_tools_over_http_are_400s_with_the_param(scripted):
    import openai

    gw, _ = scripted
    client = sdk(gw)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=_served(gw), messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "x"}})
    assert info.value.body["param"] == "tool_choice.function.name"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=_served(gw), messages=ASK,
                                       tools=[{"type": "function", "function": {"name": "a b"}}])
    assert info.value.body["param"] == "tools.[0].function.name"


def _served(gw) -> str:
    return gw.app.state.gateway.model_name


# ---------------------------------------------------------------- the --tool-call-parser option

def test_the_gateway_setting_and_flags_choose_the_parser(tiny_model_dir):
    from cli.main import build_parser
    from services import launcher
    from services.gateway.app import GatewaySettings

    assert GatewaySettings(router="tcp://127.0.0.1:1").tool_call_parser == "hermes"
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json"):
        GatewaySettings(router="tcp://127.0.0.1:1", tool_call_parser="mistral")
    args = build_parser().parse_args(["gateway", "--tool-call-parser", "llama3_json"])
    assert args.tool_call_parser == "llama3_json"
    assert build_parser().parse_args(["gateway"]).tool_call_parser == "hermes"
    up = build_parser().parse_args(["up", "--model", str(tiny_model_dir),
                                    "--tool-call-parser", "llama3_json"])
    [gateway] = [c for c in launcher.plan(up) if c.name == "gateway"]
    assert gateway.argv[gateway.argv.index("--tool-call-parser") + 1] == "llama3_json"
    plain = build_parser().parse_args(["up", "--model", str(tiny_model_dir)])
    [gateway] = [c for c in launcher.plan(plain) if c.name == "gateway"]
    assert "--tool-call-parser" not in gateway.argv  # the gateway's own default


def test_a_llama3_json_gateway_reads_llama_calls(tok):
    req = chat(tok, "llama3_json", tools=TOOLS)
    text = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
    body = chat_completion(req, [ChoiceResult(0, text, "stop")], usage(1, 1))
    [call] = body["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}


PYDANTIC_STYLE = {"type": "function", "function": {"name": "book", "parameters": {
    "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}},
                        "required": ["city"]}},
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Place"},
                                     "via": {"type": "array", "items": {"$ref": "#/$defs/Place"}}},
    "required": ["to"]}}}


def test_required_keeps_references_in_a_tools_schema_resolving(tok):
    """pydantic writes "#/$defs/..." references relative to the parameters' own root:
    inside the array of calls they must still point at the tool's definitions."""
    schema = json.loads(chat(tok, tools=[PYDANTIC_STYLE, TIME], tool_choice="required")
                        .params.structured.spec)
    good = [{"name": "book", "parameters": {"to": {"city": "Rome"}, "via": [{"city": "Bern"}]}}]
    jsonschema.validate(good, schema)
    for bad in ([{"name": "book", "parameters": {"to": {"town": "Rome"}}}],
                [{"name": "book", "parameters": {"to": {"city": "Rome"}, "via": [{"c": 1}]}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert "$defs" not in json.loads(chat(tok, tools=[TIME], tool_choice="required")
                                     .params.structured.spec)  # nothing to move: inline
    named = json.loads(chat(tok, tools=[PYDANTIC_STYLE], tool_choice={
        "type": "function", "function": {"name": "book"}}).params.structured.spec)
    jsonschema.validate(good[0]["parameters"], named)


def test_a_schema_the_grammar_compiler_refuses_is_a_400_on_tools(tok):
    tools = tools_with(parameters={"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(?<=x)a"}}})  # look-behind: llguidance has none
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(APIError) as info:
            chat(tok, tools=tools, tool_choice=choice)
        assert (info.value.status, info.value.param) == (400, "tools")
        assert "look-behind" in info.value.message or "look-around" in info.value.message
    assert chat(tok, tools=tools).tool_parser is not None  # auto forces nothing: no check


def test_a_forced_call_with_response_format_is_a_400(tok):
    with pytest.raises(APIError) as info:
        chat(tok, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert (info.value.status, info.value.param) == (400, "tool_choice")
    auto = chat(tok, tools=TOOLS, response_format={"type": "json_object"})
    assert auto.params.structured.kind is StructuredKind.JSON_OBJECT  # auto: the format rules


def test_tokenize_counts_a_conversation_with_tools_as_chat_is_charged(scripted, tok):
    import httpx

    gw, _ = scripted
    body = {"messages": HISTORY, "tools": TOOLS}
    r = httpx.post(f"{gw.url}/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == chat(tok, messages=HISTORY, tools=TOOLS).prompt_token_ids
    bad = httpx.post(f"{gw.url}/tokenize", json={**body, "tools": [{"type": "x"}]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools.[0].type"


def test_long_calls_streamed_side_by_side_assemble_to_their_own_arguments():
    """Calls long enough that the scanner resumes where its last look stopped, two streams
    at once whose texts share the offset and the first part but then differ: each one's
    deltas add up to its own arguments, as the non-streamed parse reads them."""
    def args(tag: str) -> str:
        late = tag if tag == "one" else [tag, [tag, {"e": tag}]]  # other lengths and depths
        rows = [{"k": i, "v": "x{}" * 3, "n": [i, {"d": late if i > 400 else "same"}]}
                for i in range(800)]
        return json.dumps({"rows": rows, "s": 'a " quote } and ] in a string'})

    texts = {tag: f'<tool_call>{{"name": "f", "arguments": {args(tag)}}}</tool_call>'
             for tag in ("one", "two")}
    assert 20000 < len(texts["one"]) < len(texts["two"])
    streams = {tag: ToolCallStream(HermesParser()) for tag in texts}
    pieces: dict[str, list[str]] = {tag: [] for tag in texts}
    for i in range(0, len(texts["two"]), 7):
        for tag, text in texts.items():  # interleaved: one shared scanner memo, two texts
            delta = streams[tag].push(text[i:i + 7])
            pieces[tag] += [c["function"].get("arguments", "") for c in delta.tool_calls]
    for tag, stream in streams.items():
        pieces[tag] += [c["function"].get("arguments", "") for c in stream.finish().tool_calls]
        [call] = HermesParser().parse(texts[tag]).calls
        assert "".join(pieces[tag]) == call.arguments == args(tag)
