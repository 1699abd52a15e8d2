"""``tandem generate``: run a JSONL file of prompts through the engine, offline.

Each input line is ``{"messages": [...]}`` (chat template applied), ``{"prompt": "..."}``
or ``{"prompt_token_ids": [...]}``, plus any sampling fields. Each output line, in input
order, carries ``text``, ``token_ids``, ``finish_reason`` (and ``logprobs`` when asked),
or ``choices`` for ``n > 1``, or an ``error`` for a line that could not be served. Bad
lines are reported on stderr, one line each, and make the exit status 1; the other lines
are still generated.

A line's JSON and its prompt are judged by the gateway's own parsers
(``services.gateway.parsing.parse_json`` and ``services.gateway.prompts``), so every
message shape the HTTP API takes works here too. Sampling fields are not: they go
straight to ``SamplingParams`` (see ``_submit``).
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
from services.gateway.errors import APIError
from services.gateway.parsing import parse_json
from services.gateway.prompts import chat_prompt, parse_prompt, parse_token_ids


@dataclass(slots=True)
class _Line:
    index: int
    request_id: str | None = None
    error: str | None = None


def prompt_token_ids(obj: dict[str, Any], tokenizer: Tokenizer | None,
                     vocab_size: int | None = None) -> list[int]:
    """The prompt of one line as token ids: chat template, a prompt, or ids as given."""
    given = [k for k in ("messages", "prompt", "prompt_token_ids") if k in obj]
    if len(given) != 1:
        raise InvalidRequestError("give exactly one of messages, prompt or prompt_token_ids",
                                  "prompt")
    key = given[0]
    if key == "messages":
        return chat_prompt(obj[key], tokenizer)
    if key == "prompt":  # as /v1/completions takes it: text, [text], ids or [ids]
        return parse_prompt(obj[key], tokenizer, vocab_size).token_ids
    if not isinstance(obj[key], list):
        raise InvalidRequestError("prompt_token_ids must be a list of integers", key)
    return parse_token_ids(obj[key], vocab_size)


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
        obj = parse_json(line)
        if not isinstance(obj, dict):
            raise InvalidRequestError("each line must be a JSON object")
        obj.setdefault("max_tokens", default_max_tokens)
        # Not the gateway's sampling checks, on purpose: offline, the CLI keeps
        # SamplingParams' own limits (16 stop strings where OpenAI allows 4, logprobs up to
        # 20 for every prompt shape where /v1/completions allows 5), and no int64 bounds,
        # since these params never cross the msgpack wire. The engine checks the context.
        params = SamplingParams.from_dict(obj)
        ids = prompt_token_ids(obj, engine.tokenizer, engine.spec.vocab_size)
        return _Line(index, request_id=engine.add_request(ids, params, request_id=f"line-{index}"))
    except (InvalidRequestError, APIError) as e:
        return _Line(index, error=str(e))
    except OverflowError:  # SamplingParams.from_dict on an integer too large for a float
        return _Line(index, error="a sampling field holds a number too large to use")


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
    stats = engine.stats()
    if stats.acceptance_rate is not None:
        print(f"tandem generate: speculative decoding accepted {stats.num_accepted_tokens} of "
              f"{stats.num_draft_tokens} draft tokens ({100 * stats.acceptance_rate:.0f}%)", file=sys.stderr)
    return 1 if errors else 0
