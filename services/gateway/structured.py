"""The structured-output fields of a request body, as one checked ``StructuredOutput``.

Three spellings ask for the same thing, on both generation routes:

- OpenAI's ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, object or JSON text),
  ``regex``, ``choice`` (a list of strings), ``grammar`` (Lark or GBNF), ``json_object``;
- vLLM's older top-level ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar`` (and ``guided_json_object``).

A body may ask for one constraint at most. Every spec is compiled here once
(``common.grammar.check``), so a bad schema, regex, choice list or grammar is a 400 that
names the field and says what is wrong, before anything is queued.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from common.grammar import GrammarError, check, structured_from_choices, structured_from_json_schema
from common.structured import StructuredKind, StructuredOutput
from services.gateway.errors import APIError, shown

# structured_outputs keys that choose nothing we do not already do (vLLM's backend choice,
# its fallback switch; our JSON never has free whitespace).
_IGNORED_KEYS = {"backend", "disable_fallback", "disable_any_whitespace"}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar", "guided_json_object": "json_object"}
_IGNORED_GUIDED = {"guided_decoding_backend"}


def parse_structured(body: Mapping[str, Any]) -> StructuredOutput | None:
    """The body's one output constraint, checked, or None; an ``APIError`` (400) names the
    field of anything wrong."""
    found: list[tuple[str, StructuredOutput]] = []
    if (fmt := body.get("response_format")) is not None:
        found += _response_format(fmt)
    if (so := body.get("structured_outputs")) is not None:
        found += _structured_outputs(so)
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _one(kind, body[name], name)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError.invalid(f"ask for one output constraint at most, got {names}", found[1][0])
    name, structured = found[0]
    try:
        check(structured)
    except GrammarError as e:
        raise APIError.invalid(f"{name}: {e.message}", name) from None
    return structured


def _response_format(fmt: Any) -> list[tuple[str, StructuredOutput]]:
    where = "response_format"
    if not isinstance(fmt, Mapping):
        raise APIError.invalid(f"{where} must be an object, got {shown(fmt)}", where)
    kind = fmt.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [(where, StructuredOutput(StructuredKind.JSON_OBJECT))]
    if kind != "json_schema":
        raise APIError.invalid(f"{where}.type must be text, json_object or json_schema, got "
                               f"{shown(kind)}", f"{where}.type")
    spec = fmt.get("json_schema")
    where += ".json_schema"
    if not isinstance(spec, Mapping):
        raise APIError.invalid(f"{where} must be an object with the schema, got {shown(spec)}",
                               where)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise APIError.invalid(f"{where}.name must be a non-empty string", f"{where}.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise APIError.invalid(f"{where}.strict must be a boolean, got {shown(strict)}",
                               f"{where}.strict")
    schema = spec.get("schema")
    if schema is None:  # OpenAI's schema is optional: then any JSON object
        return [(where, StructuredOutput(StructuredKind.JSON_OBJECT))]
    return [(f"{where}.schema", _json(schema, f"{where}.schema", bool(strict)))]


def _structured_outputs(so: Any) -> list[tuple[str, StructuredOutput]]:
    where = "structured_outputs"
    if not isinstance(so, Mapping):
        raise APIError.invalid(f"{where} must be an object, got {shown(so)}", where)
    chosen = [k for k in ("json", "regex", "choice", "grammar", "json_object")
              if not (so.get(k) is None or so.get(k) is False)]  # 0 is not "absent"
    unknown = sorted(set(so) - {"json", "regex", "choice", "grammar", "json_object"} - _IGNORED_KEYS)
    if unknown:
        raise APIError.invalid(f"{where}.{unknown[0]} is not supported by this server",
                               f"{where}.{unknown[0]}")
    if len(chosen) > 1:
        raise APIError.invalid(f"{where} takes one of json, regex, choice, grammar, "
                               f"json_object; got {', '.join(chosen)}", where)
    if not chosen:
        return []
    return [(f"{where}.{chosen[0]}", _one(chosen[0], so[chosen[0]], f"{where}.{chosen[0]}"))]


def _one(kind: str, value: Any, where: str) -> StructuredOutput:
    if kind == "json":
        return _json(value, where, strict=False)
    if kind == "json_object":
        if value is not True:
            raise APIError.invalid(f"{where} must be true, got {shown(value)}", where)
        return StructuredOutput(StructuredKind.JSON_OBJECT)
    if kind == "choice":
        try:
            return structured_from_choices(value)
        except GrammarError as e:
            raise APIError.invalid(f"{where}: {e.message}", where) from None
    if not isinstance(value, str):
        raise APIError.invalid(f"{where} must be a string, got {shown(value)}", where)
    return StructuredOutput(StructuredKind.REGEX if kind == "regex" else StructuredKind.GRAMMAR, value)


def _json(schema: Any, where: str, strict: bool) -> StructuredOutput:
    """A schema sent as an object or as JSON text (vLLM takes both)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise APIError.invalid(f"{where} is not valid JSON: {e}", where) from None
        except RecursionError:
            raise APIError.invalid(f"{where} cannot be compiled: nested too deeply", where) from None
    try:
        return structured_from_json_schema(schema, strict=strict)
    except GrammarError as e:
        raise APIError.invalid(f"{where}: {e.message}", where) from None
