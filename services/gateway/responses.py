"""Response bodies of the gateway's OpenAI API, without the web framework.

Full responses (``chat_completion``, ``text_completion``), stream chunks
(``ChunkFormatter`` keeps the little per-choice state a stream needs), logprobs in
the chat and the legacy completions shapes, usage, ``/v1/models`` and SSE framing.
Everything here is a pure function of a ``ParsedRequest`` and what the workers produced.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.outputs import TokenLogprob
from services.gateway.parsing import ParsedRequest
from services.gateway.tool_stream import ToolCallStream, shape
from services.gateway.tool_stream import finish_reason as tool_finish_reason

if TYPE_CHECKING:
    from services.gateway.prompt_logprobs import PromptLogprobs


@dataclass(frozen=True, slots=True)
class LogprobEntry:
    """One output token's logprob and its alternatives, with their text."""

    token_id: int
    token: str
    logprob: float | None  # None: an echoed prompt's first token (nothing scores it)
    top: tuple[tuple[int, str, float], ...] = ()  # (id, text, logprob), best first

    @classmethod
    def from_engine(cls, lp: TokenLogprob, token_text: Callable[[int], str]) -> LogprobEntry:
        """The engine's (and the wire's) record, with the texts a response shows."""
        return cls(lp.token_id, token_text(lp.token_id), lp.logprob,
                   tuple((t, token_text(t), v) for t, v in lp.top))


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    """What a finished choice gives a full (non-streaming) response."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: Sequence[LogprobEntry] | None = None


def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def finite_logprob(logprob: float | None) -> float | None:
    # JSON has no -Infinity; a token the sampler could never pick gets vLLM's -9999.
    return logprob if logprob is None or math.isfinite(logprob) else -9999.0


_finite = finite_logprob


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(entries: Sequence[LogprobEntry]) -> dict[str, Any]:
    return {"content": [
        {"token": e.token, "logprob": _finite(e.logprob), "bytes": _token_bytes(e.token),
         "top_logprobs": [{"token": t, "logprob": _finite(v), "bytes": _token_bytes(t)}
                          for _, t, v in e.top]}
        for e in entries]}


def completion_logprobs(entries: Sequence[LogprobEntry], text_offset: int = 0) -> dict[str, Any]:
    """The legacy shape; ``text_offset`` is where the first token starts in the choice text."""
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": [_top_dict(e) for e in entries],
            "text_offset": offsets}


def _top_dict(e: LogprobEntry) -> dict[str, float] | None:
    # OpenAI always lists the sampled token too; texts can repeat, so the best one wins.
    if e.logprob is None:
        return None  # an echoed prompt's first token
    top: dict[str, float] = {}
    for _, text, lp in (*e.top, (e.token_id, e.token, e.logprob)):
        top.setdefault(text, _finite(lp))
    return top


def chat_completion(req: ParsedRequest, choices: Sequence[ChoiceResult],
                    usage_: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": req.request_id, "object": "chat.completion", "created": req.created,
            "model": req.model, "choices": [_chat_choice(req, c) for c in choices],
            "usage": dict(usage_)}


def _chat_choice(req: ParsedRequest, c: ChoiceResult) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    reason = c.finish_reason
    if req.tool_parser is not None:  # the text may hold tool calls (tool_stream.shape)
        shaped = shape(req.tool_parser, c.text, reason)
        message["content"], reason = shaped.content, shaped.finish_reason
        if shaped.tool_calls:
            message["tool_calls"] = shaped.tool_calls
    return {"index": c.index, "message": message,
            "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs),
            "finish_reason": reason}


def text_completion(req: ParsedRequest, choices: Sequence[ChoiceResult],
                    usage_: Mapping[str, Any], prompt: PromptLogprobs | None = None) -> dict[str, Any]:
    prefix = req.prompt_text if req.echo else ""
    return {"id": req.request_id, "object": "text_completion", "created": req.created,
            "model": req.model,
            "choices": [{"index": c.index, "text": prefix + c.text,
                         "logprobs": None if c.logprobs is None
                         else _choice_logprobs(c.logprobs, len(prefix), prompt),
                         "finish_reason": c.finish_reason,
                         **_prompt_field(req, prompt)} for c in choices],
            "usage": dict(usage_)}


def _choice_logprobs(entries: Sequence[LogprobEntry], text_offset: int,
                     prompt: PromptLogprobs | None) -> dict[str, Any]:
    """With echo, the prompt's tokens lead (their offsets from 0)."""
    if prompt is not None and prompt.echoed is not None:
        return completion_logprobs([*prompt.echoed, *entries], 0)
    return completion_logprobs(entries, text_offset)


def _prompt_field(req: ParsedRequest, prompt: PromptLogprobs | None) -> dict[str, Any]:
    """vLLM's prompt_logprobs, on every choice, when asked for."""
    if req.prompt_logprobs is None:
        return {}
    return {"prompt_logprobs": prompt.vllm if prompt is not None else None}


def _chunk(req: ParsedRequest, choices: list[dict[str, Any]]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    out = {"id": req.request_id, "object": obj, "created": req.created, "model": req.model,
           "choices": choices}
    if req.include_usage:
        out["usage"] = None  # OpenAI: null on every chunk but the last
    return out


def chat_chunk(req: ParsedRequest, index: int, *, role: str | None = None,
               content: str | None = None, logprobs: Sequence[LogprobEntry] | None = None,
               finish_reason: str | None = None,
               tool_calls: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if tool_calls:
        delta["tool_calls"] = [dict(t) for t in tool_calls]
    return _chunk(req, [{"index": index, "delta": delta,
                         "logprobs": None if logprobs is None else chat_logprobs(logprobs),
                         "finish_reason": finish_reason}])


def completion_chunk(req: ParsedRequest, index: int, text: str,
                     logprobs: Sequence[LogprobEntry] | None = None,
                     finish_reason: str | None = None, text_offset: int = 0,
                     prompt: PromptLogprobs | None = None) -> dict[str, Any]:
    """``prompt``: only on a choice's first chunk."""
    return _chunk(req, [{"index": index, "text": text,
                         "logprobs": None if logprobs is None
                         else _choice_logprobs(logprobs, text_offset, prompt),
                         "finish_reason": finish_reason,
                         **(_prompt_field(req, prompt) if prompt is not None else {})}])


def usage_chunk(req: ParsedRequest, usage_: Mapping[str, Any]) -> dict[str, Any]:
    """The last chunk of a stream with stream_options.include_usage."""
    return {**_chunk(req, []), "usage": dict(usage_)}


class ChunkFormatter:
    """Chunks of one streamed request: the first chunk of each choice carries the role
    (chat) or the echoed prompt (completions); completion text offsets run on."""

    def __init__(self, req: ParsedRequest) -> None:
        self.req = req
        self._sent: dict[int, int] = {}  # choice -> characters of text sent so far
        self._tools: dict[int, ToolCallStream] = {}  # choice -> its calls (with tools)

    def chunk(self, index: int, text: str, logprobs: Sequence[LogprobEntry] | None = None,
              finish_reason: str | None = None,
              prompt: PromptLogprobs | None = None) -> dict[str, Any] | None:
        """The chunk for one delta of a choice; None when it has nothing to show (its text
        is tool-call markup held back, and it carries no logprobs). ``prompt``: the prompt's
        logprobs, shown on a completions choice's first chunk."""
        first = index not in self._sent
        sent = self._sent.get(index, 0)
        if self.req.tool_parser is not None:
            return self._tool_chunk(index, first, text, logprobs, finish_reason)
        if self.req.kind == "chat":
            self._sent[index] = sent + len(text)
            # OpenAI's first delta is {"role": "assistant", "content": ""}; later ones omit
            # content when there is none (the finishing chunk has an empty delta).
            return chat_chunk(self.req, index, role="assistant" if first else None,
                              content=text if text or first else None, logprobs=logprobs,
                              finish_reason=finish_reason)
        offset = sent  # where this chunk's first token starts in the choice's text
        if first and self.req.echo:
            text = self.req.prompt_text + text
            offset = len(self.req.prompt_text)
        self._sent[index] = sent + len(text)
        return completion_chunk(self.req, index, text, logprobs, finish_reason, offset,
                                prompt if first else None)

    def _tool_chunk(self, index: int, first: bool, text: str,
                    logprobs: Sequence[LogprobEntry] | None,
                    finish_reason: str | None) -> dict[str, Any] | None:
        """A chat chunk whose text went through the choice's ``ToolCallStream``: content
        and tool-call deltas, never call markup."""
        stream = self._tools.setdefault(index, ToolCallStream(self.req.tool_parser))
        delta = stream.push(text)
        if finish_reason is not None:
            rest = stream.finish()
            delta.content += rest.content
            delta.tool_calls += rest.tool_calls
            finish_reason = tool_finish_reason(finish_reason, stream.called)
        if not (first or delta or logprobs or finish_reason):
            return None
        self._sent[index] = self._sent.get(index, 0) + len(delta.content)
        return chat_chunk(self.req, index, role="assistant" if first else None,
                          content=delta.content if delta.content or first else None,
                          logprobs=logprobs, finish_reason=finish_reason,
                          tool_calls=delta.tool_calls)

    def usage_chunk(self, usage_: Mapping[str, Any]) -> dict[str, Any] | None:
        """None when the client did not ask for usage."""
        return usage_chunk(self.req, usage_) if self.req.include_usage else None


def model_card(name: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "tandem",
            "max_model_len": max_model_len}


def models_list(names: Sequence[str], max_model_len: int, created: int) -> dict[str, Any]:
    """The /v1/models body."""
    return {"object": "list", "data": [model_card(n, max_model_len, created) for n in names]}


def sse(data: Mapping[str, Any] | str) -> bytes:
    """One server-sent event: ``sse(chunk)`` or ``sse("[DONE]")``."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                            separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")
