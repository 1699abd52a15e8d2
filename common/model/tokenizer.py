"""Tokenizer, chat template and incremental detokenization with stop strings.

``Tokenizer`` wraps the HF fast tokenizer shipped with the model (and its chat template).
``Detokenizer`` turns one sequence's output tokens into text as they arrive: it handles
multi-byte characters split across tokens, finds stop strings even when they straddle
token boundaries, and holds back the few characters that could still begin a stop
string so a streaming client never sees text that is later cut.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Tokens of the prompt decoded along with the output, so the first output token gets
# its leading space right (SentencePiece drops it at the start of a string).
_CONTEXT_TOKENS = 5


class ChatTemplateError(ValueError):
    pass


class Tokenizer:
    def __init__(self, directory: Path) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(directory))
        self.eos_token_ids = _eos_ids(self.hf, directory)

    @classmethod
    def maybe_load(cls, directory: Path) -> Tokenizer | None:
        """None for a weights-only directory (such models accept token ids only)."""
        names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
        return cls(directory) if any((directory / n).is_file() for n in names) else None

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A completion prompt: special tokens (BOS) added as the model expects."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    @property
    def template_supports_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` list itself (it mentions them)."""
        template = self.hf.chat_template
        return isinstance(template, str) and "tools" in template

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, *,
                            add_special_tokens: bool = False,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        if not self.hf.chat_template:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        try:
            text = self.hf.apply_chat_template(list(messages), tokenize=False,
                                               add_generation_prompt=add_generation_prompt,
                                               tools=list(tools) if tools else None)
        except Exception as e:  # jinja raises on messages the template cannot render
            raise ChatTemplateError(f"the chat template rejected these messages: {e}") from e
        # The template writes BOS itself where the model wants one (hence the default).
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """How one token reads on its own (for logprobs)."""
        return self.hf.decode([token_id], skip_special_tokens=False)


def _eos_ids(hf, directory: Path) -> tuple[int, ...]:
    ids: list[int] = [] if hf.eos_token_id is None else [hf.eos_token_id]
    gen = directory / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        ids += value if isinstance(value, list) else [] if value is None else [value]
    return tuple(dict.fromkeys(ids))


@dataclass(slots=True)
class Delta:
    text: str  # new text safe to show
    stop: str | None = None  # the stop string that ended the sequence, if any


class Detokenizer:
    """Detokenizes one sequence incrementally and watches for stop strings."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, include_stop: bool = False) -> None:
        """``include_stop``: the text keeps the stop string that ended it (vLLM's
        include_stop_str_in_output); nothing is then held back, as all of it is shown."""
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._stop = tuple(stop)
        self._include_stop = include_stop
        self._window = max((len(s) for s in self._stop), default=1) - 1  # a stop may span tokens
        self._holdback = 0 if include_stop else self._window
        self.text = ""  # all output text so far, cut at a stop string
        self._emitted = 0
        self.stopped: str | None = None

    def push(self, token_id: int) -> Delta:
        """Add one output token; returns what can be shown now."""
        if self.stopped is not None:
            return Delta("", self.stopped)
        before = len(self.text)
        self.text += self._decode_next(token_id)
        self._find_stop(before)
        return self._take(final=self.stopped is not None)

    def finish(self) -> Delta:
        """The sequence ended: release any held-back text, and a last character left
        incomplete shows as HF's ``decode`` shows it (U+FFFD), not silently dropped."""
        if self.stopped is None and self._read_offset < len(self._ids):
            prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
            full = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
            self._prefix_offset = self._read_offset = len(self._ids)
            before = len(self.text)
            self.text += full[len(prefix) :]
            self._find_stop(before)
        return self._take(final=True)

    def _decode_next(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 character: wait for the next token
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]

    def _find_stop(self, before: int) -> None:
        if not self._stop:
            return
        start = max(0, before - self._window)
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            index, self.stopped = min(hits)
            self.text = self.text[: index + len(self.stopped) if self._include_stop else index]

    def _take(self, final: bool) -> Delta:
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._holdback)
        delta, self._emitted = self.text[self._emitted : end], end
        return Delta(delta, self.stopped)
