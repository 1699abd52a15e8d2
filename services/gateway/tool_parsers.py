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
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

_ARGUMENT_KEYS = ("arguments", "parameters")
_INTERESTING = re.compile(r'["{}\[\]]')
_STRING_BODY = re.compile(r'(?:[^"\\]|\\.)*"', re.DOTALL)
_PRIMITIVE = re.compile(r'[^,}\]\s;]*')
_SPACE = re.compile(r"\s*")


@dataclass(frozen=True, slots=True)
class CallText:
    """One call as the model wrote it: its name, and its arguments' JSON text so far."""

    name: str
    arguments: str
    complete: bool = False


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


# ---- a tolerant JSON scanner: where values end, without judging them -----------------

def _string_end(text: str, i: int) -> int | None:
    """Past the string starting with the quote at ``i``; None when the text ends first."""
    m = _STRING_BODY.match(text, i + 1)
    return m.end() if m else None


def _value_end(text: str, i: int) -> int | None:
    """Past the JSON value starting at ``i``; None when the text ends before it does."""
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c not in "{[":
        end = _PRIMITIVE.match(text, i).end()
        return end if end < len(text) else None  # "12" may still become "123"
    depth, j = 0, i
    while (m := _INTERESTING.search(text, j)) is not None:
        j = m.start()
        if text[j] == '"':
            end = _string_end(text, j)
            if end is None:
                return None
            j = end
            continue
        depth += 1 if text[j] in "{[" else -1
        j += 1
        if depth == 0:
            return j
    return None


def _skip(text: str, i: int) -> int:
    return _SPACE.match(text, i).end()


@dataclass(slots=True)
class _Scan:
    """What is known of one call object starting at ``start``."""

    start: int
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    end: int | None = None  # past the closing brace, once the object is whole
    bad: bool = False  # not the shape of a call (or not JSON): no call here

    def text(self, src: str) -> CallText | None:
        """The call so far, once its name is known and its arguments object has begun."""
        if self.bad or self.name is None or self.args_start is None:
            return None
        return CallText(self.name, src[self.args_start:self.args_end], self.end is not None)


def _scan_object(text: str, start: int) -> _Scan:
    """The top level of the call object at ``start`` (which holds ``{``)."""
    scan, i = _Scan(start), _skip(text, start + 1)
    while i < len(text):
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != '"':
            scan.bad = True
            return scan
        key_end = _string_end(text, i)
        if key_end is None:
            return scan
        key = text[i + 1:key_end - 1]
        i = _skip(text, key_end)
        if i >= len(text):
            return scan
        if text[i] != ":":
            scan.bad = True
            return scan
        i = _skip(text, i + 1)
        if i >= len(text):
            return scan
        value_end = _value_end(text, i)
        if key == "name" and scan.name is None:
            if text[i] != '"':
                scan.bad = True
                return scan
            if value_end is not None:
                scan.name = _loads(text[i:value_end])
        elif key in _ARGUMENT_KEYS and scan.args_start is None:
            if text[i] != "{":
                scan.bad = True
                return scan
            scan.args_start, scan.args_end = i, value_end
        if value_end is None:
            return scan
        i = _skip(text, value_end)
        if i < len(text) and text[i] == ",":
            i = _skip(text, i + 1)
        elif i < len(text) and text[i] != "}":
            scan.bad = True
            return scan
    return scan


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _valid(scan: _Scan, src: str) -> CallText | None:
    """The finished call, when the object is JSON of the shape {name, arguments: {...}}."""
    if scan.bad or scan.end is None or scan.args_end is None or not isinstance(scan.name, str):
        return None
    whole = _loads(src[scan.start:scan.end])
    args = _loads(src[scan.args_start:scan.args_end])
    if not isinstance(whole, dict) or not isinstance(args, dict):
        return None
    return CallText(scan.name, src[scan.args_start:scan.args_end], True)


def _scan_sequence(text: str, i: int, sep: str, close: str | None) -> tuple[list[_Scan], int | None]:
    """Call objects from ``i`` on, separated by ``sep``; also where the sequence ended well
    (past ``close`` when given, else past the last object), None when it did not (yet)."""
    scans: list[_Scan] = []
    while True:
        i = _skip(text, i)
        if i >= len(text):
            return scans, None
        if text[i] != "{":
            return scans, None
        scan = _scan_object(text, i)
        scans.append(scan)
        if scan.end is None or scan.bad:
            return scans, None
        i = _skip(text, scan.end)
        if i < len(text) and text[i] == sep:
            i += 1
            continue
        if close is None:
            return scans, i
        return scans, (i + 1 if text.startswith(close, i) else None)


def _held(text: str, marker: str) -> str:
    """``text`` less any ending that could be the start of ``marker``, less trailing space."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            text = text[:-k]
            break
    return text.rstrip()


def _partial_calls(scans: list[_Scan], text: str) -> tuple[CallText, ...]:
    """The calls begun, stopping at the first one not yet shown (calls stream in order)."""
    out = []
    for scan in scans:
        call = scan.text(text)
        if call is None:
            break
        out.append(call)
    return tuple(out)


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

    def _blocks(self, text: str) -> tuple[list[_Scan], bool]:
        """The block's call objects, and whether every block is whole and well formed."""
        scans, i = [], text.find(self.OPEN)
        while i >= 0:
            j = _skip(text, i + len(self.OPEN))
            if j >= len(text):
                return scans, False
            if text[j] != "{":
                scans.append(_Scan(j, bad=True))
                return scans, False
            scan = _scan_object(text, j)
            scans.append(scan)
            if scan.end is None or scan.bad:
                return scans, False
            k = _skip(text, scan.end)
            if not text.startswith(self.CLOSE, k):
                return scans, text[k:].strip() == ""  # unclosed last block
            i = text.find(self.OPEN, k + len(self.CLOSE))
        return scans, True

    def parse(self, text: str) -> ToolParse:
        start = text.find(self.OPEN)
        if start < 0:
            return plain(text)
        scans, whole = self._blocks(text)
        calls = [_valid(s, text) for s in scans]
        if not whole or not calls or any(c is None for c in calls):
            return plain(text)
        return ToolParse(text[:start].rstrip() or None, tuple(calls))

    def partial(self, text: str) -> ToolParse:
        start = text.find(self.OPEN)
        if start < 0:
            return ToolParse(_held(text, self.OPEN))
        scans, _ = self._blocks(text)
        return ToolParse(text[:start].rstrip(), _partial_calls(scans, text))


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
        first = _skip(text, 0)
        return (0, first) if text.startswith("{", first) else None

    def parse(self, text: str) -> ToolParse:
        where = self._start(text)
        if where is None:
            return plain(text)
        scans, end = _scan_sequence(text, where[1], ";", None)
        calls = [_valid(s, text) for s in scans]
        if end is None or text[end:].strip() or not calls or any(c is None for c in calls):
            return plain(text)
        return ToolParse(text[:where[0]].rstrip() or None, tuple(calls))

    def partial(self, text: str) -> ToolParse:
        where = self._start(text)
        if where is None:
            return ToolParse(_held(text, self.TAG))
        scans, _ = _scan_sequence(text, where[1], ";", None)
        return ToolParse(text[:where[0]].rstrip(), _partial_calls(scans, text))


class NamedParser:
    """A forced call of one function: the whole output is its arguments object."""

    def __init__(self, function: str) -> None:
        self.name = f"named:{function}"
        self.function = function

    def parse(self, text: str) -> ToolParse:
        args = text.strip()
        if not isinstance(_loads(args), dict):
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
        start = _skip(text, 0)
        if not text.startswith("[", start):
            return plain(text)
        scans, end = _scan_sequence(text, start + 1, ",", "]")
        calls = [_valid(s, text) for s in scans]
        if end is None or text[end:].strip() or not calls or any(c is None for c in calls):
            return plain(text)
        return ToolParse(None, tuple(calls))

    def partial(self, text: str) -> ToolParse:
        start = _skip(text, 0)
        if not text.startswith("[", start):
            return ToolParse("")
        scans, _ = _scan_sequence(text, start + 1, ",", "]")
        return ToolParse("", _partial_calls(scans, text))


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
