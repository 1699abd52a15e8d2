"""Tool calls read back out of a model's text: a small registry of pluggable parsers.

A parser knows one output format: ``hermes`` (``<tool_call>{...}</tool_call>`` blocks, as
Hermes and Qwen models write them) and ``llama3_json`` (JSON objects ``{"name": ...,
"parameters": {...}}``, optionally after ``<|python_tag|>``, several separated by ``;``),
chosen with ``tandem gateway --tool-call-parser``. Forced calls have their own two: the
``named`` function's arguments object alone, and the ``required`` JSON array of calls.

Every parser answers two questions, with one guarantee between them:

- ``parse(text)`` — the finished text: its calls, or (no call, or any call malformed) the
  whole text as plain content.
- ``partial(text)`` — unfinished text: the content safe to show so far and the calls begun.
  It is *prefix-stable*: for any later text, the content and each call's arguments only
  grow by appending, and a name once given never changes, up to ``parse`` of the finished
  text when that finds calls. A stream built from ``partial`` therefore adds up to the
  non-streamed answer (``tool_stream``). A call that turns out malformed after its name
  was streamed is the one case where they differ: a stream cannot take a delta back.

Arguments are the model's own JSON text for the arguments object (not re-serialized), so
every streamed fragment is a piece of the final string.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from services.gateway.tool_scan import (
    CallScan,
    CallText,
    held_back,
    loads,
    partial_calls,
    scan_object,
    scan_sequence,
    skip_space,
    valid_call,
)

__all__ = ["CallText", "ToolParse", "ToolParser", "RenderingParser", "PARSERS", "DEFAULT_PARSER",
           "HermesParser", "Llama3JsonParser", "NamedParser", "RequiredParser", "plain",
           "rendering_parser"]


@dataclass(frozen=True, slots=True)
class ToolParse:
    content: str | None  # what the client sees as message content (None: nothing)
    calls: tuple[CallText, ...] = ()


def plain(text: str) -> ToolParse:
    return ToolParse(text, ())


class ToolParser(Protocol):
    """One output format. ``parse`` and ``partial`` never raise on any text."""

    name: str

    def parse(self, text: str) -> ToolParse: ...

    def partial(self, text: str) -> ToolParse: ...


class RenderingParser(ToolParser, Protocol):
    """A parser a prompt can be written for: how to ask for calls, and how past calls read."""

    instructions: str  # appended to the system prompt after the tools' list

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str: ...


# ---- the parsers -----------------------------------------------------------------------

class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

    Content is the text before the first block; text between and after blocks is dropped.
    A last block without its closing tag counts when its JSON is whole (the model stopped).
    """

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    instructions = (
        "To call a function, answer with one <tool_call></tool_call> block per call, each "
        "holding a JSON object with the function's name and its arguments:\n"
        "<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments object>}\n"
        "</tool_call>")

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "\n".join(f"{self.OPEN}\n{_call_json(n, a, 'arguments')}\n{self.CLOSE}"
                         for n, a in calls)

    def _blocks(self, text: str) -> tuple[list[CallScan], bool]:
        """The block's call objects, and whether every block is whole and well formed."""
        scans, i = [], text.find(self.OPEN)
        while i >= 0:
            j = skip_space(text, i + len(self.OPEN))
            if j >= len(text):
                return scans, False
            if text[j] != "{":
                scans.append(CallScan(j, bad=True))
                return scans, False
            scan = scan_object(text, j)
            scans.append(scan)
            if scan.end is None or scan.bad:
                return scans, False
            k = skip_space(text, scan.end)
            if not text.startswith(self.CLOSE, k):
                return scans, text[k:].strip() == ""  # unclosed last block
            i = text.find(self.OPEN, k + len(self.CLOSE))
        return scans, True

    def parse(self, text: str) -> ToolParse:
        start = text.find(self.OPEN)
        if start < 0:
            return plain(text)
        scans, whole = self._blocks(text)
        calls = [valid_call(s, text) for s in scans]
        if not whole or not calls or any(c is None for c in calls):
            return plain(text)
        return ToolParse(text[:start].rstrip() or None, tuple(calls))

    def partial(self, text: str) -> ToolParse:
        start = text.find(self.OPEN)
        if start < 0:
            return ToolParse(held_back(text, self.OPEN))
        scans, _ = self._blocks(text)
        return ToolParse(text[:start].rstrip(), partial_calls(scans, text))


class Llama3JsonParser:
    """``{"name": ..., "parameters": {...}}`` objects separated by ``;``, after an optional
    ``<|python_tag|>`` (content before the tag stays content) or from the text's start."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    instructions = (
        "To call a function, answer with only a JSON object with the function's name and "
        "its parameters, {\"name\": <function name>, \"parameters\": <arguments object>}; "
        "for several calls, separate the objects with \"; \".")

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "; ".join(_call_json(n, a, "parameters") for n, a in calls)

    def _start(self, text: str) -> tuple[int, int] | None:
        """(end of content, start of the calls), or None when the text holds no calls."""
        tag = text.find(self.TAG)
        if tag >= 0:
            return tag, tag + len(self.TAG)
        first = skip_space(text, 0)
        return (0, first) if text.startswith("{", first) else None

    def parse(self, text: str) -> ToolParse:
        where = self._start(text)
        if where is None:
            return plain(text)
        scans, end = scan_sequence(text, where[1], ";", None)
        calls = [valid_call(s, text) for s in scans]
        if end is None or text[end:].strip() or not calls or any(c is None for c in calls):
            return plain(text)
        return ToolParse(text[:where[0]].rstrip() or None, tuple(calls))

    def partial(self, text: str) -> ToolParse:
        where = self._start(text)
        if where is None:
            return ToolParse(held_back(text, self.TAG))
        scans, _ = scan_sequence(text, where[1], ";", None)
        return ToolParse(text[:where[0]].rstrip(), partial_calls(scans, text))


class NamedParser:
    """A forced call of one function: the whole output is its arguments object."""

    def __init__(self, function: str) -> None:
        self.name = f"named:{function}"
        self.function = function

    def parse(self, text: str) -> ToolParse:
        args = text.strip()
        if not isinstance(loads(args), dict):
            return plain(text)
        return ToolParse(None, (CallText(self.function, args, True),))

    def partial(self, text: str) -> ToolParse:
        args = text.strip()
        if not args.startswith("{"):
            return ToolParse("")
        return ToolParse("", (CallText(self.function, args),))


class RequiredParser:
    """A forced call of any tool: a JSON array of {"name", "parameters"} objects."""

    name = "required"

    def parse(self, text: str) -> ToolParse:
        start = skip_space(text, 0)
        if not text.startswith("[", start):
            return plain(text)
        scans, end = scan_sequence(text, start + 1, ",", "]")
        calls = [valid_call(s, text) for s in scans]
        if end is None or text[end:].strip() or not calls or any(c is None for c in calls):
            return plain(text)
        return ToolParse(None, tuple(calls))

    def partial(self, text: str) -> ToolParse:
        start = skip_space(text, 0)
        if not text.startswith("[", start):
            return ToolParse("")
        scans, _ = scan_sequence(text, start + 1, ",", "]")
        return ToolParse("", partial_calls(scans, text))


def _call_json(name: str, arguments: Any, key: str) -> str:
    return json.dumps({"name": name, key: arguments}, ensure_ascii=False)


PARSERS: dict[str, Callable[[], RenderingParser]] = {
    HermesParser.name: HermesParser,
    Llama3JsonParser.name: Llama3JsonParser,
}
DEFAULT_PARSER = HermesParser.name


def rendering_parser(name: str) -> RenderingParser:
    """The ``--tool-call-parser`` named; ValueError names the choices."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of "
                         f"{', '.join(PARSERS)}")
    return PARSERS[name]()
