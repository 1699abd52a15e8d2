"""Moving a request to another worker when the one serving it dies.

The gateway is the one process that has seen every token a client was sent, so it is the
one that can continue a request. Each unfinished choice is continued by a request of its
own (``n = 1``): its prompt is the original prompt plus the tokens that choice already
delivered, its budget what is left of ``max_tokens``, and its tokens are put back in place
(choice index restored, token indices shifted by what was delivered), so the client sees
one uninterrupted stream. With greedy sampling a continuation produces exactly the tokens
an undisturbed run would have (the same model over the same tokens); seeded sampling goes
on with a fresh random stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from common.sampling_params import SamplingParams
from services.gateway.parsing import ParsedRequest

MAX_MOVES = 2  # a request that kills two workers in a row is not tried on a third
# How long a moved request may wait to be placed (never longer than --admission-timeout):
# long enough for a supervisor to bring a lone worker back (a SmolLM2 worker restarts in
# about 25 s on 2 cores), short enough that a client with no worker left hears so soon.
MOVE_ADMISSION_S = 30.0


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try at serving a request: the id the router and workers know it by."""

    request_id: str
    choice: int | None = None  # None: the original, all choices; else the one it continues
    offset: int = 0  # that choice's output tokens delivered before this attempt began
    number: int = 0  # moves before this one


@dataclass(frozen=True, slots=True)
class Continuation:
    attempt: Attempt
    prompt_token_ids: list[int]
    params: SamplingParams


def continuations(parsed: ParsedRequest, failed: Attempt, delivered: Callable[[int], list[int]],
                  unfinished: Sequence[int]) -> list[Continuation] | str:
    """The requests that pick up where ``failed`` stopped, or why there are none."""
    if failed.number >= MAX_MOVES:
        return f"moved {MAX_MOVES} times already"
    choices = list(unfinished) if failed.choice is None else [failed.choice]
    out = []
    for choice in choices:
        done = delivered(choice)
        left = parsed.params.max_tokens - len(done)
        if left < 1:
            return f"choice {choice} has nothing left to generate"
        params = replace(parsed.params, n=1, max_tokens=left,
                         min_tokens=max(0, parsed.params.min_tokens - len(done)),
                         # came with the first tokens already: a longer prompt is not the client's
                         prompt_logprobs=None if done else parsed.params.prompt_logprobs)
        if params.structured is not None:  # its matcher first reads what was delivered
            params = replace(params, structured=replace(params.structured,
                                                        num_output_in_prompt=len(done)))
        attempt = Attempt(f"{parsed.request_id}~{failed.number + 1}.{choice}", choice, len(done),
                          failed.number + 1)
        out.append(Continuation(attempt, parsed.prompt_token_ids + done, params))
    return out
