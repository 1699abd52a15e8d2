"""What generation produces, in the one shape every process uses: a token's logprob
record and why a choice ended. The engine creates them, the wire carries them as they
are (``common.protocol``), the gateway and the CLI format them."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first
    rank: int | None = None  # the token's 1-based rank in its distribution (prompt logprobs)
