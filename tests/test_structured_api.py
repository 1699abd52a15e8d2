"""The structured-output fields of the OpenAI API, parsed without HTTP: every spelling
(``response_format``, vLLM's ``structured_outputs`` and ``guided_*``) on both routes
becomes one checked ``StructuredOutput``; anything wrong is a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from common.structured import StructuredKind, StructuredOutput
from services.gateway.errors import APIError
from tests.test_openai_api import chat, comp, parse, tok  # noqa: F401  (the fixture)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def structured_of(kind: str, body: dict, tok) -> StructuredOutput | None:  # noqa: F811
    return parse(kind, body, tok).params.structured


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(("fields", "want_kind", "want_spec"), [
    ({"response_format": {"type": "json_object"}}, StructuredKind.JSON_OBJECT, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     StructuredKind.JSON, SCHEMA),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     StructuredKind.JSON_OBJECT, None),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredKind.JSON, SCHEMA),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredKind.JSON, SCHEMA),
    ({"structured_outputs": {"regex": "[0-9]+", "backend": "guidance"}}, StructuredKind.REGEX, "[0-9]+"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredKind.CHOICE, ["a", "b"]),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, StructuredKind.GRAMMAR, 'start: "x"'),
    ({"structured_outputs": {"json_object": True}}, StructuredKind.JSON_OBJECT, None),
    ({"guided_json": SCHEMA}, StructuredKind.JSON, SCHEMA),
    ({"guided_regex": "a|b"}, StructuredKind.REGEX, "a|b"),
    ({"guided_choice": ["yes", "no"], "guided_decoding_backend": "x"}, StructuredKind.CHOICE,
     ["yes", "no"]),
    ({"guided_grammar": 'root ::= "a"'}, StructuredKind.GRAMMAR, 'root ::= "a"'),
])
def test_every_spelling_on_both_routes(tok, kind, fields, want_kind, want_spec):  # noqa: F811
    body = chat(**fields) if kind == "chat" else comp(**fields)
    got = structured_of(kind, body, tok)
    assert got is not None and got.kind is want_kind
    if isinstance(want_spec, dict | list):
        spec = json.loads(got.spec)
        if isinstance(spec, dict):
            spec.pop("x-guidance", None)
        assert spec == want_spec
    elif want_spec is not None:
        assert got.spec == want_spec


def test_strict_is_carried_into_the_schema(tok):  # noqa: F811
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    got = structured_of("chat", chat(response_format=fmt), tok)
    assert json.loads(got.spec)["x-guidance"] == {"lenient": False}


def test_text_and_absent_ask_for_nothing(tok):  # noqa: F811
    assert structured_of("chat", chat(response_format={"type": "text"}), tok) is None
    assert structured_of("completion", comp(), tok) is None
    assert structured_of("chat", chat(structured_outputs={}), tok) is None


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {}}, "response_format.type", "text, json_object or json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name", "non-empty string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes",
                                                                 "schema": SCHEMA}}},
     "response_format.json_schema.strict", "boolean"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema", "JSON object"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format.json_schema.schema", "properties/a/type"),
    ({"structured_outputs": {"json": "{"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "must be a string"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "empty"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice", "list of strings"),
    ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs.grammar",
     "unknown name"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "one of"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag",
     "not supported"),
    ({"structured_outputs": [1]}, "structured_outputs", "must be an object"),
    ({"structured_outputs": {"choice": 0}}, "structured_outputs.choice", "list of strings"),
    # what only llguidance refuses (a number past 64 bits, a lone surrogate): still a 400
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "minLength": 10**30}}}}, "response_format.json_schema.schema",
     "cannot be compiled"),
    ({"structured_outputs": {"regex": "\ud800"}}, "structured_outputs.regex", "cannot be compiled"),
    ({"structured_outputs": {"json": "[" * 50000}}, "structured_outputs.json", "cannot be compiled"),
    ({"guided_regex": "[a-", }, "guided_regex", "unclosed character class"),
    ({"guided_choice": [1, 2]}, "guided_choice", "list of strings"),
    ({"guided_json": {"type": 3}}, "guided_json", "invalid json_schema"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "one output constraint at most"),
])
def test_bad_specs_are_400_naming_the_field(tok, fields, param, words):  # noqa: F811
    for kind, body in (("chat", chat(**fields)), ("completion", comp(**fields))):
        with pytest.raises(APIError) as e:
            parse(kind, body, tok)
        assert e.value.status == 400 and e.value.param == param, e.value.body()
        assert words in e.value.message, e.value.message
        json.dumps(e.value.body())
