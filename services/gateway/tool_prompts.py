"""Tools and tool turns in a chat prompt.

Two jobs. Reading: an assistant message's ``tool_calls`` and a ``tool`` message's
``tool_call_id``, validated (``assistant_calls``, ``tool_result``), with each call's
arguments as an object (the shape chat templates expect). Rendering (``prepare``): when
the model's chat template handles tools (its source mentions ``tools``), the tools and
the tool turns go to it as they are; otherwise the documented default, Hermes-style:

- the tools are listed, one JSON object per line, inside ``<tools></tools>`` in the
  system prompt (appended to the conversation's own system message, or as a new one),
  followed by the output parser's instructions (``<tool_call>{"name": ..., "arguments":
  ...}</tool_call>`` for ``hermes``);
- an assistant turn's calls are written in that same format after its text;
- a tool result becomes a user turn wrapped as ``<tool_response>...</tool_response>``
  (such templates know no ``tool`` role).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from services.gateway.errors import APIError, is_text, shown
from services.gateway.tool_parsers import RenderingParser
from services.gateway.tools import Tool

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_PREAMBLE = ("You can call functions to help with the request. Each one is described by a "
             "JSON object inside <tools></tools>:")
_RESULTS = (f"The results of your calls come back inside {RESPONSE_OPEN}{RESPONSE_CLOSE}. "
            "Call a function only when it helps; otherwise answer in plain text.")


def assistant_calls(m: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, each with its arguments parsed."""
    value = m.get("tool_calls")
    if not isinstance(value, list):
        raise APIError.invalid(f"{where}.tool_calls must be an array, got {shown(value)}",
                               f"{where}.tool_calls")
    return [_call(v, f"{where}.tool_calls.[{j}]") for j, v in enumerate(value)]


def _call(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise APIError.invalid(f"{where} must be an object, got {shown(value)}", where)
    if value.get("type", "function") != "function":
        raise APIError.invalid(f"{where}.type must be 'function'", f"{where}.type")
    call_id = value.get("id")
    if call_id is not None and not is_text(call_id):
        raise APIError.invalid(f"{where}.id must be a string, got {shown(call_id)}", f"{where}.id")
    function = value.get("function")
    if not isinstance(function, Mapping):
        raise APIError.invalid(f"{where}.function must be an object, got {shown(function)}",
                               f"{where}.function")
    name = function.get("name")
    if not is_text(name) or not name:
        raise APIError.invalid(f"{where}.function.name must be a string, got {shown(name)}",
                               f"{where}.function.name")
    raw = function.get("arguments", "{}")
    arguments = _arguments(raw) if is_text(raw) else None
    if not isinstance(arguments, dict) or not is_text(json.dumps(arguments, ensure_ascii=False)):
        raise APIError.invalid(f"{where}.function.arguments must be a JSON object as a "
                               "string", f"{where}.function.arguments")
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        out["id"] = call_id
    return out


def _arguments(raw: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def tool_result(m: Mapping[str, Any], where: str) -> dict[str, str]:
    """The fields a tool message adds to its role and content."""
    call_id = m.get("tool_call_id")
    if call_id is None:
        return {}
    if not is_text(call_id):
        raise APIError.invalid(f"{where}.tool_call_id must be a string, got {shown(call_id)}",
                               f"{where}.tool_call_id")
    return {"tool_call_id": call_id}


def prepare(messages: list[dict[str, Any]], tools: Sequence[Tool], template_has_tools: bool,
            parser: RenderingParser) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template: as they are for a template with tools,
    else in the default rendering (tools in the system prompt, turns as plain text)."""
    if template_has_tools:
        return messages, [t.as_openai() for t in tools] or None
    out = [_plain_turn(m, parser) for m in messages]
    if tools:
        section = tools_section(tools, parser)
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out, None


def tools_section(tools: Sequence[Tool], parser: RenderingParser) -> str:
    listed = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return f"{_PREAMBLE}\n<tools>\n{listed}\n</tools>\n{parser.instructions}\n{_RESULTS}"


def _plain_turn(m: dict[str, Any], parser: RenderingParser) -> dict[str, Any]:
    """A turn as a template without tools can render it: role and text only."""
    if m["role"] == "tool":
        return {"role": "user", "content": f"{RESPONSE_OPEN}\n{m['content']}\n{RESPONSE_CLOSE}"}
    if m.get("tool_calls"):
        calls = parser.render_calls([(c["function"]["name"], c["function"]["arguments"])
                                     for c in m["tool_calls"]])
        text = f"{m['content']}\n{calls}" if m["content"] else calls
        return {"role": m["role"], "content": text}
    return {"role": m["role"], "content": m["content"]}
