"""A tolerant JSON scanner for tool calls in model text: where values end, without judging.

``scan_object`` reads the top level of one call object as far as the text goes (its
name once whole, where its arguments object starts and ends, where the object ends);
``scan_sequence`` reads several, separated by ``;`` or ``,``. Nothing here raises on any
text: an incomplete value is "not yet" (None), a wrong shape is ``bad``. Whether the
finished call is JSON at all is ``valid_call``'s question, answered with ``json``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

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


def string_end(text: str, i: int) -> int | None:
    """Past the string starting with the quote at ``i``; None when the text ends first."""
    m = _STRING_BODY.match(text, i + 1)
    return m.end() if m else None


class _Resume:
    """Where unfinished scans of objects and arrays stopped: (start, the text scanned, the
    position, the depth). A stream asks again about the same growing text after each
    piece; starting from where the last scan stopped, once the scanned text is checked
    unchanged (a compare in C), keeps each piece's cost to its own characters instead of
    the whole call's, so a long streamed call is linear, not quadratic. The state after a
    stretch of text depends only on that text, so entries are shared: concurrent streams
    calling one function start their arguments at one offset, and each finds its own."""

    MAX_ENTRIES = 128

    def __init__(self) -> None:
        self._entries: list[tuple[int, str, int, int]] = []

    def get(self, text: str, i: int) -> tuple[int, int]:
        best = None
        for entry in self._entries:
            if entry[0] == i and (best is None or entry[2] > best[2]) and text.startswith(entry[1], i):
                best = entry
        return (best[2], best[3]) if best is not None else (i, 0)

    def put(self, text: str, i: int, j: int, depth: int) -> None:
        if j - i < 4096:  # short scans are cheap to redo
            return
        # What this scan extends is superseded by it.
        self._entries = [e for e in self._entries if not (e[0] == i and text.startswith(e[1], i))]
        self._entries.append((i, text[i:j], j, depth))
        del self._entries[:-self.MAX_ENTRIES]


_RESUME = _Resume()


def value_end(text: str, i: int) -> int | None:
    """Past the JSON value starting at ``i``; None when the text ends before it does."""
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c not in "{[":
        end = _PRIMITIVE.match(text, i).end()
        return end if end < len(text) else None  # "12" may still become "123"
    j, depth = _RESUME.get(text, i)
    while (m := _INTERESTING.search(text, j)) is not None:
        at = m.start()
        if text[at] == '"':
            end = string_end(text, at)
            if end is None:
                _RESUME.put(text, i, j, depth)  # before the open string
                return None
            j = end
            continue
        depth += 1 if text[at] in "{[" else -1
        j = at + 1
        if depth == 0:
            return j
    _RESUME.put(text, i, j, depth)
    return None


def skip_space(text: str, i: int) -> int:
    return _SPACE.match(text, i).end()


@dataclass(slots=True)
class CallScan:
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


def scan_object(text: str, start: int) -> CallScan:
    """The top level of the call object at ``start`` (which holds ``{``)."""
    scan, i = CallScan(start), skip_space(text, start + 1)
    while i < len(text):
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != '"':
            scan.bad = True
            return scan
        key_end = string_end(text, i)
        if key_end is None:
            return scan
        key = text[i + 1:key_end - 1]
        i = skip_space(text, key_end)
        if i >= len(text):
            return scan
        if text[i] != ":":
            scan.bad = True
            return scan
        i = skip_space(text, i + 1)
        if i >= len(text):
            return scan
        after = value_end(text, i)
        if key == "name" and scan.name is None:
            if text[i] != '"':
                scan.bad = True
                return scan
            if after is not None:
                scan.name = loads(text[i:after])
        elif key in _ARGUMENT_KEYS and scan.args_start is None:
            if text[i] != "{":
                scan.bad = True
                return scan
            scan.args_start, scan.args_end = i, after
        if after is None:
            return scan
        i = skip_space(text, after)
        if i < len(text) and text[i] == ",":
            i = skip_space(text, i + 1)
        elif i < len(text) and text[i] != "}":
            scan.bad = True
            return scan
    return scan


def loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def valid_call(scan: CallScan, src: str) -> CallText | None:
    """The finished call, when the object is JSON of the shape {name, arguments: {...}}."""
    if scan.bad or scan.end is None or scan.args_end is None or not isinstance(scan.name, str):
        return None
    whole = loads(src[scan.start:scan.end])
    args = loads(src[scan.args_start:scan.args_end])
    if not isinstance(whole, dict) or not isinstance(args, dict):
        return None
    return CallText(scan.name, src[scan.args_start:scan.args_end], True)


def scan_sequence(text: str, i: int, sep: str, close: str | None) -> tuple[list[CallScan], int | None]:
    """Call objects from ``i`` on, separated by ``sep``; also where the sequence ended well
    (past ``close`` when given, else past the last object), None when it did not (yet)."""
    scans: list[CallScan] = []
    while True:
        i = skip_space(text, i)
        if i >= len(text):
            return scans, None
        if text[i] != "{":
            return scans, None
        scan = scan_object(text, i)
        scans.append(scan)
        if scan.end is None or scan.bad:
            return scans, None
        i = skip_space(text, scan.end)
        if i < len(text) and text[i] == sep:
            i += 1
            continue
        if close is None:
            return scans, i
        return scans, (i + 1 if text.startswith(close, i) else None)


def held_back(text: str, marker: str) -> str:
    """``text`` less any ending that could be the start of ``marker``, less trailing space."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            text = text[:-k]
            break
    return text.rstrip()


def partial_calls(scans: list[CallScan], text: str) -> tuple[CallText, ...]:
    """The calls begun, stopping at the first one not yet shown (calls stream in order)."""
    out = []
    for scan in scans:
        call = scan.text(text)
        if call is None:
            break
        out.append(call)
    return tuple(out)
