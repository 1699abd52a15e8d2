"""The closed sets that name a process's part in serving a request."""

from __future__ import annotations

import enum


class WorkerRole(str, enum.Enum):
    PREFILL = "prefill"  # runs prompts, ships their KV to a decode worker
    DECODE = "decode"  # takes prefilled requests in and generates the rest
    COLOCATED = "colocated"  # both, in one engine

    @property
    def can_prefill(self) -> bool:
        return self is not WorkerRole.DECODE

    @property
    def can_decode(self) -> bool:
        return self is not WorkerRole.PREFILL


class FinishStage(str, enum.Enum):
    """What a worker is done with when it reports ``Finished``."""

    PREFILL = "prefill"  # the KV was handed off; the request lives on at the decode worker
    REQUEST = "request"  # the whole request (or its failure)
