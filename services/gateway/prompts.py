"""The prompt shapes the gateway accepts, shared with ``tandem generate``.

``messages`` (roles and text, strings or arrays of text parts, and tool turns: see
``tool_prompts``) through the chat template,
a completions ``prompt`` (a string, [string], token ids or [token ids]), and bare token
ids. Each raises ``APIError`` naming the offending field; nothing else escapes, so a CLI
line and an HTTP body are judged alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common.errors import InvalidRequestError
from common.model.tokenizer import ChatTemplateError, Tokenizer
from common.rules import check_token_ids
from services.gateway.errors import APIError, shown, unicode_text
from services.gateway.tool_parsers import DEFAULT_PARSER, RenderingParser, rendering_parser
from services.gateway.tool_prompts import assistant_calls, prepare, tool_result
from services.gateway.tools import Tool

ROLES = ("system", "user", "assistant", "tool", "developer")
_UNSUPPORTED_PARTS = ("image_url", "input_audio", "file", "image", "audio", "video")

def chat_prompt(messages: Any, tokenizer: Tokenizer | None, tools: Sequence[Tool] = (),
                parser: RenderingParser | None = None, **template: bool) -> list[int]:
    """A ``messages`` value (and the ``tools`` it may call) through the chat template, as
    token ids (``render_chat``)."""
    return render_chat(parse_messages(messages), tokenizer, tools, parser, **template)


def render_chat(messages: list[dict[str, Any]], tokenizer: Tokenizer | None,
                tools: Sequence[Tool] = (), parser: RenderingParser | None = None,
                **template: bool) -> list[int]:
    """Checked messages (``parse_messages``) through the chat template; ``parser``'s format
    is the one asked for where the template knows no tools (``tool_prompts``).
    ``template``: ``add_generation_prompt`` and ``add_special_tokens`` for
    ``Tokenizer.apply_chat_template``."""
    if tokenizer is None:
        raise APIError.invalid("this model has no tokenizer: send the prompt as token ids",
                               "messages")
    messages, listed = prepare(messages, tools, tokenizer.template_supports_tools,
                               parser or rendering_parser(DEFAULT_PARSER))
    try:
        return tokenizer.apply_chat_template(messages, tools=listed, **template)
    except ChatTemplateError as e:
        raise APIError.invalid(str(e), "messages") from e


def parse_messages(value: Any) -> list[dict[str, Any]]:
    """Messages reduced to role and text: all the chat template needs, nothing unchecked."""
    if value is None:
        raise APIError.invalid("Missing required parameter: 'messages'.", "messages")
    if not isinstance(value, list):
        raise APIError.invalid(f"messages must be an array, got {shown(value)}", "messages")
    if not value:
        raise APIError.invalid("messages must contain at least one message", "messages")
    return [_message(i, m) for i, m in enumerate(value)]


def _message(i: int, m: Any) -> dict[str, Any]:
    where = f"messages.[{i}]"
    if not isinstance(m, Mapping):
        raise APIError.invalid(f"{where} must be an object, got {shown(m)}", where)
    role = m.get("role")
    if role is None:
        raise APIError.invalid(f"Missing required parameter: '{where}.role'.", f"{where}.role")
    if role not in ROLES:  # a list or dict role is "not in" as well, never a TypeError
        raise APIError.invalid(f"{where}.role: invalid value {shown(role)}; supported values "
                               f"are {', '.join(ROLES)}", f"{where}.role")
    if role == "assistant" and m.get("tool_calls"):  # its content may be null then
        content = m.get("content")
        text = "" if content is None else _content(content, f"{where}.content")
        return {"role": role, "content": text, "tool_calls": assistant_calls(m, where)}
    out = {"role": role, "content": _content(m.get("content"), f"{where}.content")}
    return out | tool_result(m, where) if role == "tool" else out


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return unicode_text(value, where)
    if not isinstance(value, list):
        raise APIError.invalid(f"{where} must be a string or an array of text parts, got "
                               f"{shown(value)}", where)
    texts = []
    for j, part in enumerate(value):
        at = f"{where}.[{j}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in _UNSUPPORTED_PARTS:
            raise APIError.invalid(f"{at}: content parts of type '{kind}' are not supported "
                                   "(this model reads text only)", at)
        if kind != "text" or not isinstance(part.get("text"), str):
            raise APIError.invalid(f"{at} must be a text part {{\"type\": \"text\", \"text\": "
                                   "\"...\"}", at)
        texts.append(unicode_text(part["text"], at))
    return "\n".join(texts)  # how vLLM joins text parts


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # None when the prompt came as token ids


def parse_prompt(value: Any, tokenizer: Tokenizer | None, vocab: int | None) -> Prompt:
    """A completions ``prompt``: a string, [string], token ids or [token ids]."""
    if value is None:
        raise APIError.invalid("Missing required parameter: 'prompt'.", "prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, list) and any(isinstance(v, str | list) for v in value):
        raise APIError.invalid("several prompts in one request are not supported yet; send one "
                               "prompt per request", "prompt")
    if isinstance(value, list):
        return Prompt(parse_token_ids(value, vocab), None)
    if not isinstance(value, str):
        raise APIError.invalid(f"prompt must be a string or an array of token ids, got "
                               f"{shown(value)}", "prompt")
    if tokenizer is None:
        raise APIError.invalid("this model has no tokenizer: send the prompt as token ids",
                               "prompt")
    ids = tokenizer.encode(unicode_text(value, "prompt"))
    if not ids:
        raise APIError.invalid("prompt must not be empty", "prompt")
    return Prompt(ids, value)


def parse_token_ids(value: list[Any], vocab: int | None) -> list[int]:
    """A non-empty list of ids, each in the vocabulary when its size is known."""
    try:
        check_token_ids(value, vocab)
    except InvalidRequestError as e:
        raise APIError.from_invalid_request(e) from None
    return list(value)


