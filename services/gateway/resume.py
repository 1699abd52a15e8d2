"""Moving a request to another worker when the one serving it dies.

The gateway is the one process that has seen every token a client was sent, so it is the
one that can continue a request: the continuation's prompt is the original prompt plus
the tokens already delivered, its budget what is left of ``max_tokens``, and its token
indices are shifted by what was delivered, so the client sees one uninterrupted stream.
With greedy sampling the continuation produces exactly the tokens an undisturbed run
would have (the same model over the same tokens); seeded sampling continues with a fresh
random stream, and requests with ``n > 1`` are not moved (each choice would need its own
continuation) — they fail with a clear error instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from common.sampling_params import SamplingParams
from services.gateway.parsing import ParsedRequest

MAX_MOVES = 2  # a request that kills two workers in a row is not tried on a third
# How long a moved request may wait to be placed: long enough for a supervisor to bring a
# lone worker back, short enough that a client with no worker left hears so soon.
MOVE_ADMISSION_S = 10.0


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try at serving a request: the id the router and workers know it by."""

    request_id: str
    offset: int = 0  # output tokens delivered before this attempt began
    number: int = 0  # 0 for the original submission


@dataclass(frozen=True, slots=True)
class Continuation:
    attempt: Attempt
    prompt_token_ids: list[int]
    params: SamplingParams


def continuation(parsed: ParsedRequest, current: Attempt, delivered: list[int]) -> Continuation | str:
    """The request that picks up where ``current`` stopped, or why there is none."""
    params = parsed.params
    if params.n != 1:
        return "requests with n > 1 are not moved to another worker"
    if current.number >= MAX_MOVES:
        return f"moved {MAX_MOVES} times already"
    left = params.max_tokens - len(delivered)
    if left < 1:
        return "nothing left to generate"
    moved = replace(params, max_tokens=left, min_tokens=max(0, params.min_tokens - len(delivered)))
    attempt = Attempt(f"{parsed.request_id}~{current.number + 1}", len(delivered), current.number + 1)
    return Continuation(attempt, parsed.prompt_token_ids + delivered, moved)
