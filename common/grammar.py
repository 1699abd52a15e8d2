"""From a ``StructuredOutput`` to an llguidance grammar, checked once, compiled once.

The gateway calls ``check`` on every constrained request before it is queued, so a bad
schema, regex, choice list or grammar is a 400 naming the problem, never a failure deep in
a worker. Workers call ``compiled`` to get a matcher template per spec (compiling is the
expensive part; a new sequence gets a ``deep_copy`` of the template) and ``ll_tokenizer``
for the llguidance view of the model's HF tokenizer (built once per tokenizer).

JSON is compact by default (no free whitespace: ``,`` and ``:`` without spaces) so a small
model cannot spend its budget rambling in whitespace; a schema may override this with
llguidance's own ``x-guidance`` options. Keywords llguidance does not implement are
ignored unless the client asked for ``strict`` (then they are an error).
"""

from __future__ import annotations

import copy
import functools
import json
import re
import threading
from typing import TYPE_CHECKING, Any

import llguidance

from common.errors import InvalidRequestError
from common.structured import StructuredKind, StructuredOutput

if TYPE_CHECKING:
    from common.model.tokenizer import Tokenizer

MAX_SPEC_CHARS = 256 * 1024  # a schema or grammar larger than this is refused
MAX_CHOICES = 1024
# Applied before a schema's own "x-guidance" options, so a schema can override them.
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ",",
                                 "key_separator": ":", "lenient": True}
_KIND_FIELD = {StructuredKind.JSON: "json_schema", StructuredKind.JSON_OBJECT: "json_object",
               StructuredKind.REGEX: "regex", StructuredKind.CHOICE: "choice",
               StructuredKind.GRAMMAR: "grammar"}


class GrammarError(InvalidRequestError):
    """A structured-output spec llguidance cannot use; the message says what is wrong."""

    def __init__(self, kind: StructuredKind, message: str) -> None:
        super().__init__(f"invalid {_KIND_FIELD[kind]}: {message}", param=_KIND_FIELD[kind])
        self.kind = kind


# ---- building specs (the gateway's side) ----------------------------------------------

def structured_from_json_schema(schema: Any, strict: bool = False) -> StructuredOutput:
    """A JSON-schema constraint. ``strict``: keywords llguidance cannot enforce are an
    error instead of being ignored (OpenAI's ``strict: true``)."""
    if isinstance(schema, bool) or not isinstance(schema, dict):
        raise GrammarError(StructuredKind.JSON, "the schema must be a JSON object")
    if strict:
        options = schema.get("x-guidance")
        options = options if isinstance(options, dict) else {}
        schema = {**schema, "x-guidance": {**options, "lenient": False}}
    return StructuredOutput(StructuredKind.JSON, json.dumps(schema))


def structured_from_choices(choices: Any) -> StructuredOutput:
    if not isinstance(choices, list | tuple) or not all(isinstance(c, str) for c in choices):
        raise GrammarError(StructuredKind.CHOICE, "must be a list of strings")
    return StructuredOutput(StructuredKind.CHOICE, json.dumps(list(choices)))


# ---- checking and compiling -----------------------------------------------------------

def check(structured: StructuredOutput) -> None:
    """Raise ``GrammarError`` naming the problem unless ``structured`` can be compiled."""
    grammar_of(structured)


def grammar_of(structured: StructuredOutput) -> str:
    """The llguidance grammar of ``structured``; raises ``GrammarError`` for a bad spec."""
    return _grammar_of(structured.kind, structured.spec)


@functools.lru_cache(maxsize=256)  # clients repeat their schemas
def _grammar_of(kind: StructuredKind, spec: str) -> str:
    if len(spec) > MAX_SPEC_CHARS:
        raise GrammarError(kind, f"longer than {MAX_SPEC_CHARS} characters")
    try:
        grammar = _grammar(kind, spec)
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except GrammarError:
        raise
    except (ValueError, TypeError, OverflowError, RecursionError) as e:
        # What the checks above do not name: a schema nested past the parser's depth, a
        # number llguidance cannot hold. Still the client's 400, never a worker's crash.
        raise GrammarError(kind, f"cannot be compiled: {_first_line(str(e)) or type(e).__name__}") from None
    if error:
        raise GrammarError(kind, _first_line(error))
    return grammar


def _grammar(kind: StructuredKind, spec: str) -> str:
    if kind is StructuredKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if kind is StructuredKind.JSON:
        return llguidance.LLMatcher.grammar_from_json_schema(_json_schema(spec), defaults=JSON_DEFAULTS)
    if kind is StructuredKind.REGEX:
        if not spec:
            raise GrammarError(kind, "the regex is empty")
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind is StructuredKind.CHOICE:
        return llguidance.LLMatcher.grammar_from_lark(_choice_lark(spec))
    if kind is StructuredKind.GRAMMAR:
        if not spec.strip():
            raise GrammarError(kind, "the grammar is empty")
        try:  # Lark, or GBNF (llama.cpp's) converted to Lark
            return llguidance.grammar_from("grammar", spec)
        except ValueError as e:
            raise GrammarError(kind, _first_line(str(e))) from None
    raise AssertionError(kind)


def _json_schema(spec: str) -> dict[str, Any]:
    import jsonschema  # only here: the engine's hot path never needs it

    try:
        schema = json.loads(spec)
    except ValueError as e:
        raise GrammarError(StructuredKind.JSON, f"the schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError(StructuredKind.JSON, "the schema must be a JSON object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise GrammarError(StructuredKind.JSON, f"at {where}: {e.message}") from None
    return schema


def _choice_lark(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except ValueError:
        choices = None
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise GrammarError(StructuredKind.CHOICE, "must be a list of strings")
    if not choices:
        raise GrammarError(StructuredKind.CHOICE, "the list of choices is empty")
    if len(choices) > MAX_CHOICES:
        raise GrammarError(StructuredKind.CHOICE, f"at most {MAX_CHOICES} choices")
    if any(not c for c in choices):
        raise GrammarError(StructuredKind.CHOICE, "a choice is an empty string")
    return "start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(choices))


def _first_line(error: str) -> str:
    """llguidance's message without the grammar source it echoes (``  1 | start: ...``)."""
    lines = []
    for line in error.strip().splitlines():
        if re.match(r"\s*\d+ \|", line) or line.startswith("<state>"):
            break
        if line.strip() and line.strip() != "^":
            lines.append(line.strip())
    return " ".join(lines)[:500] or "rejected by llguidance"


# ---- the worker's side: tokenizer and compiled templates ------------------------------

_TOKENIZERS: dict[tuple[str, int, tuple[int, ...]], llguidance.LLTokenizer] = {}
_TOKENIZERS_LOCK = threading.Lock()


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer, its vocabulary the logits' width
    (``vocab_size``: rows past the tokenizer's own tokens are never allowed). Built once
    per (tokenizer, width, EOS set): building one takes a fraction of a second."""
    key = (str(tokenizer.hf.name_or_path), vocab_size, eos_token_ids)
    with _TOKENIZERS_LOCK:
        if key not in _TOKENIZERS:
            backend = copy.copy(tokenizer.hf.backend_tokenizer)  # a fast (Rust) tokenizer
            backend.no_padding()
            backend.no_truncation()
            _TOKENIZERS[key] = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                                      eos_token=list(eos_token_ids))
        return _TOKENIZERS[key]


class GrammarCache:
    """Compiled matchers by spec, for one tokenizer: a sequence starts from a copy."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, max_entries: int = 128) -> None:
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self._templates: dict[tuple[StructuredKind, str], llguidance.LLMatcher] = {}

    def new_matcher(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher at the start of ``structured``; raises ``GrammarError`` for a
        spec that does not compile (a worker must fail only that request)."""
        key = structured.key
        template = self._templates.pop(key, None)  # re-inserted: most recent last
        if template is None:
            grammar = grammar_of(structured)
            try:
                template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            except (ValueError, TypeError, OverflowError, RecursionError) as e:
                raise GrammarError(structured.kind, _first_line(str(e)) or type(e).__name__) from None
            if template.is_error():
                raise GrammarError(structured.kind, _first_line(template.get_error()))
        self._templates[key] = template
        while len(self._templates) > self.max_entries:
            del self._templates[next(iter(self._templates))]
        return template.deep_copy()
