"""What ``/v1/responses`` answers: the ``response`` object, or its stream of typed events.

A stream goes ``response.created`` → ``response.in_progress`` →
``response.output_item.added`` → ``response.content_part.added`` →
``response.output_text.delta``… → ``response.output_text.done`` →
``response.content_part.done`` → ``response.output_item.done`` → ``response.completed``
(``response.incomplete`` when ``max_output_tokens`` cut the answer), each event numbered
by ``sequence_number``. A request that fails mid-stream ends with ``error`` and
``response.failed``. Pure functions of a ``ResponsesRequest`` and what the run produced.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from services.gateway.assembler import ChoiceDelta
from services.gateway.errors import APIError

if TYPE_CHECKING:
    from services.gateway.responses_api import ResponsesRequest

CUT = {"reason": "max_output_tokens"}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def output_item(req: ResponsesRequest, text: str | None, status: str) -> dict[str, Any]:
    """The answer's one message item; no content yet while it starts."""
    return {"id": req.item_id, "type": "message", "status": status, "role": "assistant",
            "content": [] if text is None else [output_text(text)]}


def response_usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    """The chat usage (``responses.usage``) in the Responses API's names."""
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def envelope(req: ResponsesRequest, status: str, output: list[dict[str, Any]],
             usage: dict[str, Any] | None, *, incomplete_details: dict | None = None,
             error: dict | None = None) -> dict[str, Any]:
    """The ``response`` object around an output, at any status."""
    p = req.parsed
    return {"id": p.request_id, "object": "response", "created_at": p.created,
            "status": status, "completed_at": int(time.time()) if status == "completed" else None,
            "background": False, "error": error, "incomplete_details": incomplete_details,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata, "model": p.model, "output": output,
            "parallel_tool_calls": True, "previous_response_id": None, "reasoning": None,
            "store": False, "temperature": p.params.temperature, "top_p": p.params.top_p,
            "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
            "truncation": "disabled", "usage": usage, "user": p.user}


def response_object(req: ResponsesRequest, text: str, finish_reason: str | None,
                    usage: Mapping[str, Any]) -> dict[str, Any]:
    """The finished response: incomplete when the token budget cut it."""
    cut = finish_reason == "length"
    status = "incomplete" if cut else "completed"
    return envelope(req, status, [output_item(req, text, status)], response_usage(usage),
                    incomplete_details=CUT if cut else None)


class ResponsesStream:
    """The events of one streamed response (a ``run.StreamFormat``)."""

    def __init__(self, req: ResponsesRequest) -> None:
        self.req = req
        self.sequence_number = 0
        self.texts: list[str] = []
        self.finish_reason: str | None = None
        self.where = {"item_id": req.item_id, "output_index": 0, "content_index": 0}

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {payload}\n\n".encode()

    def start(self) -> Iterable[bytes]:
        snapshot = envelope(self.req, "in_progress", [], None)
        return (self.event("response.created", response=snapshot),
                self.event("response.in_progress", response=snapshot),
                self.event("response.output_item.added", output_index=0,
                           item=output_item(self.req, None, "in_progress")),
                self.event("response.content_part.added", **self.where, part=output_text("")))

    def delta(self, d: ChoiceDelta) -> Iterable[bytes]:
        self.finish_reason = d.finish_reason or self.finish_reason
        if not d.text:
            return ()
        self.texts.append(d.text)
        return (self.event("response.output_text.delta", **self.where, delta=d.text,
                           logprobs=[]),)

    def end(self, usage: dict[str, Any]) -> Iterable[bytes]:
        text = "".join(self.texts)
        final = response_object(self.req, text, self.finish_reason, usage)
        [item] = final["output"]
        last = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return (self.event("response.output_text.done", **self.where, text=text, logprobs=[]),
                self.event("response.content_part.done", **self.where, part=item["content"][0]),
                self.event("response.output_item.done", output_index=0, item=item),
                self.event(last, response=final))

    def error(self, e: APIError) -> Iterable[bytes]:
        code = e.code or e.type
        failed = envelope(self.req, "failed", [], None,
                          error={"code": code, "message": e.message})
        return (self.event("error", code=code, message=e.message, param=e.param),
                self.event("response.failed", response=failed))
