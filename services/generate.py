"""``tandem generate``: run a JSONL file of prompts through the engine, offline.

Each input line is ``{"messages": [...]}`` (chat template applied), ``{"prompt": "..."}``
or ``{"prompt_token_ids": [...]}``, plus any sampling fields. Each output line, in input
order, carries ``text``, ``token_ids``, ``finish_reason`` (and ``logprobs`` when asked),
or ``choices`` for ``n > 1``, or an ``error`` for a line that could not be served. Bad
lines are reported on stderr, one line each, and make the exit status 1; the other lines
are still generated.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Any

from common.engine.engine import Choice, Engine, RequestOutput
from common.errors import InvalidRequestError
from common.model.tokenizer import Tokenizer
from common.sampling_params import SamplingParams


@dataclass(slots=True)
class _Line:
    index: int
    request_id: str | None = None
    error: str | None = None


def prompt_token_ids(obj: dict[str, Any], tokenizer: Tokenizer | None) -> list[int]:
    """The prompt of one request as token ids (chat template, text, or ids as given)."""
    given = [k for k in ("messages", "prompt", "prompt_token_ids") if k in obj]
    if len(given) != 1:
        raise InvalidRequestError("give exactly one of messages, prompt or prompt_token_ids", "prompt")
    key = given[0]
    if key == "prompt_token_ids":
        ids = obj[key]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError("prompt_token_ids must be a list of integers", key)
        return ids
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer: send prompt_token_ids", key)
    if key == "prompt":
        if not isinstance(obj[key], str):
            raise InvalidRequestError("prompt must be a string", key)
        return tokenizer.encode(obj[key])
    return tokenizer.apply_chat_template(_messages(obj[key]))


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("messages must be a non-empty list", "messages")
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidRequestError("each message needs a string role and string content", "messages")
    return value


def run(engine: Engine, lines: list[str], default_max_tokens: int) -> tuple[list[dict], list[str]]:
    """Generate every line; returns the output records and the error lines."""
    entries = [_submit(engine, i, line, default_max_tokens) for i, line in enumerate(lines)]
    pending = {e.request_id for e in entries if e.request_id}
    results: dict[str, RequestOutput] = {}
    while pending:
        for update in engine.step():
            if update.finish_reason is not None and (done := engine.finished_output(update.request_id)):
                results[done.request_id] = done
                pending.discard(done.request_id)
    records = [_record(e, results, engine.tokenizer) for e in entries]
    errors = [f"line {e.index + 1}: {e.error}" for e in entries if e.error]
    return records, errors


def _submit(engine: Engine, index: int, line: str, default_max_tokens: int) -> _Line:
    try:
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise InvalidRequestError("each line must be a JSON object")
        obj.setdefault("max_tokens", default_max_tokens)
        params = SamplingParams.from_dict(obj)
        ids = prompt_token_ids(obj, engine.tokenizer)
        return _Line(index, request_id=engine.add_request(ids, params, request_id=f"line-{index}"))
    except json.JSONDecodeError as e:
        return _Line(index, error=f"invalid JSON: {e}")
    except InvalidRequestError as e:
        return _Line(index, error=str(e))


def _record(entry: _Line, results: dict[str, RequestOutput], tok: Tokenizer | None) -> dict:
    if entry.error:
        return {"index": entry.index, "error": entry.error}
    out = results[entry.request_id]
    usage = {"prompt_tokens": len(out.prompt_token_ids),
             "completion_tokens": sum(len(c.token_ids) for c in out.choices),
             "cached_tokens": out.num_cached_tokens}
    choices = [_choice(c, tok) for c in out.choices]
    if len(choices) == 1:
        return {"index": entry.index, **{k: v for k, v in choices[0].items() if k != "index"}, "usage": usage}
    return {"index": entry.index, "choices": choices, "usage": usage}


def _choice(c: Choice, tok: Tokenizer | None) -> dict:
    record: dict[str, Any] = {"index": c.index, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason}
    if c.stop_reason is not None:
        record["stop_reason"] = c.stop_reason
    if c.logprobs is not None:
        text = tok.token_text if tok else str
        record["logprobs"] = [
            {"token": text(lp.token_id), "token_id": lp.token_id, "logprob": lp.logprob,
             "top_logprobs": [{"token": text(t), "token_id": t, "logprob": v} for t, v in lp.top]}
            for lp in c.logprobs]
    return record


def main(engine: Engine, prompts_path: str, out_path: str, default_max_tokens: int) -> int:
    with open(prompts_path) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    start = time.perf_counter()
    records, errors = run(engine, lines, default_max_tokens)
    elapsed = time.perf_counter() - start
    with open(out_path, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    for e in errors:
        print(f"tandem generate: {prompts_path}: {e}", file=sys.stderr)
    tokens = sum(r.get("usage", {}).get("completion_tokens", 0) for r in records)
    print(f"tandem generate: {len(records) - len(errors)}/{len(records)} prompts, {tokens} tokens "
          f"in {elapsed:.1f} s ({tokens / max(elapsed, 1e-9):.1f} tok/s) -> {out_path}", file=sys.stderr)
    return 1 if errors else 0
