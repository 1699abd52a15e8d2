"""A choice's text shaped as OpenAI tool calls: whole (``shape``) or as stream deltas.

``ToolCallStream`` re-reads the choice's text so far with its parser's ``partial`` after
each piece and sends only what grew: content, a call's header (``index``, ``id``,
``type``, ``function.name`` with the arguments known so far), then argument fragments.
Tool-call markup never reaches the content. Because ``partial`` is prefix-stable (see
``tool_parsers``), the deltas add up to what ``shape`` gives for the finished text.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from services.gateway.tool_parsers import CallText, ToolParse, ToolParser


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_object(call_id: str, call: CallText) -> dict[str, Any]:
    """A call as OpenAI's ``message.tool_calls`` entries read."""
    return {"id": call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


@dataclass(frozen=True, slots=True)
class ShapedChoice:
    content: str | None
    tool_calls: list[dict[str, Any]]  # empty: no call
    finish_reason: str | None


def finish_reason(reason: str | None, called: bool) -> str | None:
    """A choice that stopped after making calls finished with them (OpenAI's reason)."""
    return "tool_calls" if called and reason == "stop" else reason


def shape(parser: ToolParser, text: str, reason: str | None) -> ShapedChoice:
    """The finished text of one choice, as a non-streamed response's message."""
    parsed = parser.parse(text)
    calls = [call_object(new_call_id(), c) for c in parsed.calls]
    return ShapedChoice(parsed.content, calls, finish_reason(reason, bool(calls)))


@dataclass(slots=True)
class ToolDelta:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class ToolCallStream:
    """One streamed choice: text in (``push``), what the client may see now out."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._text: list[str] = []
        self._content_sent = 0
        self._ids: list[str] = []  # one per call whose header was sent
        self._args_sent: list[int] = []

    @property
    def called(self) -> bool:
        return bool(self._ids)

    def push(self, text: str) -> ToolDelta:
        self._text.append(text)
        return self._delta(self.parser.partial("".join(self._text)))

    def finish(self) -> ToolDelta:
        """The rest, from the finished text (``parse``, as the non-streamed answer)."""
        return self._delta(self.parser.parse("".join(self._text)))

    def _delta(self, now: ToolParse) -> ToolDelta:
        out = ToolDelta()
        content = now.content or ""
        if len(content) > self._content_sent:
            out.content = content[self._content_sent:]
            self._content_sent = len(content)
        for k, call in enumerate(now.calls):
            if k == len(self._ids):  # a new call: its header first
                self._ids.append(new_call_id())
                self._args_sent.append(len(call.arguments))
                out.tool_calls.append({"index": k, **call_object(self._ids[k], call)})
            elif len(call.arguments) > self._args_sent[k]:
                out.tool_calls.append({"index": k, "function": {
                    "arguments": call.arguments[self._args_sent[k]:]}})
                self._args_sent[k] = len(call.arguments)
        return out
