"""The prompt's logprobs in a completions response, in the two shapes clients know.

The engine scores the prompt once (``common.engine.prompt_logprobs``: one record per
prompt token after the first, with its rank and the best alternatives) and the record
list arrives with choice 0's first tokens. From it:

- vLLM's ``prompt_logprobs`` field: ``[null, {token_id: {logprob, rank, decoded_token}},
  ...]``, per position the prompt token itself first, then its ``k`` best alternatives;
- OpenAI's ``echo`` with ``logprobs``: the prompt's tokens lead the choice's legacy
  logprobs, the first with a null logprob and null alternatives (nothing precedes it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from common.outputs import TokenLogprob
from services.gateway.parsing import ParsedRequest
from services.gateway.responses import LogprobEntry, finite_logprob


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    echoed: list[LogprobEntry] | None  # echo with logprobs: one entry per prompt token
    vllm: list[dict[str, Any] | None] | None  # the prompt_logprobs field


def prompt_logprobs_for(req: ParsedRequest, records: Sequence[TokenLogprob] | None,
                        token_text: Callable[[int], str]) -> PromptLogprobs | None:
    """What the response shows of the prompt's logprobs (None: nothing was asked)."""
    echo_k = req.params.logprobs if req.echo and req.logprobs_mode else None
    if records is None or (echo_k is None and req.prompt_logprobs is None):
        return None
    echoed = None if echo_k is None else echo_entries(req.prompt_token_ids, records, echo_k,
                                                       token_text)
    vllm = None if req.prompt_logprobs is None else vllm_prompt_logprobs(
        records, req.prompt_logprobs, token_text)
    return PromptLogprobs(echoed, vllm)


def echo_entries(prompt_ids: Sequence[int], records: Sequence[TokenLogprob], k: int,
                 token_text: Callable[[int], str]) -> list[LogprobEntry]:
    first = LogprobEntry(prompt_ids[0], token_text(prompt_ids[0]), None)
    return [first] + [LogprobEntry.from_engine(TokenLogprob(r.token_id, r.logprob, r.top[:k]),
                                               token_text) for r in records]


def vllm_prompt_logprobs(records: Sequence[TokenLogprob], k: int,
                         token_text: Callable[[int], str]) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = [None]
    for r in records:
        position = {str(r.token_id): _entry(r.logprob, r.rank, token_text(r.token_id))}
        for rank, (token, logprob) in enumerate(r.top[:k], start=1):
            position.setdefault(str(token), _entry(logprob, rank, token_text(token)))
        out.append(position)
    return out


def _entry(logprob: float, rank: int | None, text: str) -> dict[str, Any]:
    return {"logprob": finite_logprob(logprob), "rank": rank, "decoded_token": text}
