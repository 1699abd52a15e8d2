"""A chat request's tools: ``tools``, ``tool_choice`` and ``parallel_tool_calls``, validated.

``parse_tools`` turns those fields into a ``ToolRequest`` (or None: no tools, nothing to
do) or an ``APIError`` naming the field. The request then says three things the rest of
the gateway asks: which tools the prompt lists (``rendered``), which parser reads the
output (``parser``), and, for a forced call (``required`` or a named function), the JSON
schema every valid call matches (``schema``), which ``constrain`` hands the engine as a
structured-output constraint, so even a small model's forced call is well formed.

``tool_choice: "none"`` lists no tools and parses nothing: the model is not told of tools
it may not call (vLLM lists them anyway; OpenAI's model knows them).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.grammar import GrammarError, check
from common.sampling_params import SamplingParams
from common.structured import StructuredKind, StructuredOutput
from services.gateway.errors import APIError, is_text, shown
from services.gateway.tool_parsers import (
    NamedParser,
    RequiredParser,
    ToolParse,
    ToolParser,
    rendering_parser,
)

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ChoiceKind(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"  # {"type": "function", "function": {"name": ...}}


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: Mapping[str, Any]  # a JSON schema for the arguments object
    description: str | None = None

    def as_openai(self) -> dict[str, Any]:
        """The shape chat templates (and OpenAI) know: {"type": "function", "function": ...}."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}

    def arguments_schema(self) -> dict[str, Any]:
        """The parameters schema, held to objects (arguments are always an object)."""
        schema = dict(self.parameters)
        schema.setdefault("type", "object")
        return schema


@dataclass(frozen=True, slots=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: ChoiceKind = ChoiceKind.AUTO
    function: str | None = None  # the named function (ChoiceKind.NAMED)
    parallel: bool = True  # parallel_tool_calls: more than one call per answer

    @property
    def rendered(self) -> tuple[Tool, ...]:
        """The tools the prompt lists."""
        return () if self.choice is ChoiceKind.NONE else self.tools

    def parser(self, auto_parser: str) -> ToolParser | None:
        """What reads the output: None (plain text) for ``none``."""
        if self.choice is ChoiceKind.NONE:
            return None
        if self.choice is ChoiceKind.NAMED:
            return NamedParser(self.function)
        parser = RequiredParser() if self.choice is ChoiceKind.REQUIRED else rendering_parser(auto_parser)
        return parser if self.parallel else FirstCall(parser)

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema a forced call's output matches; None when nothing is forced."""
        if self.choice is ChoiceKind.NAMED:
            return next(t for t in self.tools if t.name == self.function).arguments_schema()
        if self.choice is not ChoiceKind.REQUIRED:
            return None
        defs: dict[str, Any] = {}
        calls = [{"type": "object", "properties": {"name": {"type": "string", "const": t.name},
                                                   "parameters": _placed(t, i, defs)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for i, t in enumerate(self.tools)]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the forced call's schema as their structured-output constraint."""
        schema = self.schema()
        if schema is None:
            return params
        if params.structured is not None:
            raise APIError.invalid("a forced tool call (tool_choice 'required' or a named "
                                   "function) cannot be combined with response_format",
                                   "tool_choice")
        spec = StructuredOutput(StructuredKind.JSON, json.dumps(schema, ensure_ascii=False))
        _check_compiles(spec)
        return dataclasses.replace(params, structured=spec)


def _check_compiles(spec: StructuredOutput) -> None:
    """A schema the engine's grammar compiler refuses is the client's 400, not a worker's
    failure."""
    try:
        check(spec)
    except GrammarError as e:
        raise APIError.invalid(f"tools: a forced call cannot be enforced with these "
                               f"parameters schemas ({e.message})", "tools") from None


def _placed(tool: Tool, i: int, defs: dict[str, Any]) -> dict[str, Any]:
    """A tool's arguments schema inside the ``required`` schema. One with references
    ("#/$defs/..." as pydantic writes them, relative to its own root) moves to
    ``$defs/tool_<i>`` with its references re-rooted there, so they still resolve."""
    schema = tool.arguments_schema()
    if not _has_ref(schema):
        return schema
    base = f"#/$defs/tool_{i}"
    defs[f"tool_{i}"] = _rerooted(schema, base)
    return {"$ref": base}


def _has_ref(value: Any) -> bool:
    if isinstance(value, Mapping):
        return isinstance(value.get("$ref"), str) or any(_has_ref(v) for v in value.values())
    return isinstance(value, list) and any(_has_ref(v) for v in value)


def _rerooted(value: Any, base: str) -> Any:
    if isinstance(value, list):
        return [_rerooted(v, base) for v in value]
    if not isinstance(value, Mapping):
        return value
    out = {k: _rerooted(v, base) for k, v in value.items()}
    ref = value.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    return out


class FirstCall:
    """parallel_tool_calls false: a parser whose answers keep only their first call."""

    def __init__(self, parser: ToolParser) -> None:
        self.inner, self.name = parser, parser.name

    def parse(self, text: str) -> ToolParse:
        out = self.inner.parse(text)
        return ToolParse(out.content, out.calls[:1])

    def partial(self, text: str) -> ToolParse:
        out = self.inner.partial(text)
        return ToolParse(out.content, out.calls[:1])


# ---- parsing the request fields ----------------------------------------------------------

def parse_tools(body: Mapping[str, Any]) -> ToolRequest | None:
    """The tool fields of a chat body; None when it has no tools (and asks for none)."""
    tools = _tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError.invalid(f"parallel_tool_calls must be a boolean, got {shown(parallel)}",
                               "parallel_tool_calls")
    choice, function = _choice(body.get("tool_choice"), tools)
    if not tools:
        return None
    return ToolRequest(tools, choice, function, parallel is not False)


def _tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise APIError.invalid(f"tools must be an array, got {shown(value)}", "tools")
    if len(value) > MAX_TOOLS:
        raise APIError.invalid(f"tools allows at most {MAX_TOOLS} tools, got {len(value)}",
                               "tools")
    tools = tuple(_tool(f"tools.[{i}]", t) for i, t in enumerate(value))
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise APIError.invalid(f"tools: the function name '{tool.name}' is given twice",
                                   f"tools.[{i}].function.name")
        seen.add(tool.name)
    return tools


def _tool(where: str, value: Any) -> Tool:
    if not isinstance(value, Mapping):
        raise APIError.invalid(f"{where} must be an object, got {shown(value)}", where)
    if value.get("type") != "function":
        raise APIError.invalid(f"{where}.type must be 'function', got {shown(value.get('type'))}",
                               f"{where}.type")
    function = value.get("function")
    if not isinstance(function, Mapping):
        raise APIError.invalid(f"{where}.function must be an object, got {shown(function)}",
                               f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise APIError.invalid(f"{where}.function.name must be 1 to 64 letters, digits, '_' or "
                               f"'-', got {shown(name)}", f"{where}.function.name")
    description = function.get("description")
    if description is not None and not is_text(description):
        raise APIError.invalid(f"{where}.function.description must be a string, got "
                               f"{shown(description)}", f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = _NO_PARAMETERS
    _check_schema(parameters, f"{where}.function.parameters")
    return Tool(name, parameters, description)


def _check_schema(schema: Any, where: str) -> None:
    from jsonschema import Draft202012Validator, SchemaError

    if not isinstance(schema, Mapping):
        raise APIError.invalid(f"{where} must be a JSON schema object, got {shown(schema)}", where)
    try:
        Draft202012Validator.check_schema(schema)
        json.dumps(schema, ensure_ascii=False).encode("utf-8")
    except SchemaError as e:
        raise APIError.invalid(f"{where} is not a valid JSON schema: {e.message}", where) from None
    except (ValueError, TypeError, RecursionError):  # e.g. a lone surrogate in a key
        raise APIError.invalid(f"{where} is not a valid JSON schema", where) from None


def _choice(value: Any, tools: tuple[Tool, ...]) -> tuple[ChoiceKind, str | None]:
    if value is None:
        return (ChoiceKind.AUTO if tools else ChoiceKind.NONE), None
    if isinstance(value, str) and value in ("none", "auto", "required"):
        kind = ChoiceKind(value)
        if kind is ChoiceKind.REQUIRED and not tools:
            raise APIError.invalid(f"tool_choice '{value}' needs tools", "tool_choice")
        return kind, None
    if isinstance(value, Mapping) and value.get("type") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str):
            raise APIError.invalid("tool_choice.function.name must be a string, got "
                                   f"{shown(name)}", "tool_choice.function.name")
        if name not in {t.name for t in tools}:
            raise APIError.invalid(f"tool_choice names the function {shown(name)}, which is "
                                   "not in tools", "tool_choice.function.name")
        return ChoiceKind.NAMED, name
    raise APIError.invalid("tool_choice must be 'none', 'auto', 'required' or {\"type\": "
                           f"\"function\", \"function\": {{\"name\": ...}}}}, got {shown(value)}",
                           "tool_choice")
