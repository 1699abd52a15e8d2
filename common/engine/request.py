"""Requests and the sequences the scheduler moves between queues.

A ``Request`` is what a client submitted; it owns ``n`` ``Sequence``s (its choices). It
starts with one sequence; when that sequence's prompt is computed the engine forks the
other ``n - 1`` from it, sharing its prompt blocks.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.hashing import BlockHash
from common.outputs import FinishReason, TokenLogprob
from common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from common.engine.constraints import SeqConstraint


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    DETACHED = "detached"  # prefill done, blocks kept for a KV handoff
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: str
    request: Request
    choice: int  # index among the request's n choices
    token_ids: list[int]  # prompt followed by output
    num_prompt_tokens: int
    generator: torch.Generator | None = None  # private stream of a seeded choice
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of the prompt, served from the prefix cache at admission
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # common.engine.prompt_logprobs
    block_hashes: list[BlockHash] = field(default_factory=list)  # of its full blocks, so far
    num_preemptions: int = 0
    first_token_time: float | None = None
    constraint: SeqConstraint | None = None  # its structured-output matcher (engine.constraints)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against the context limit
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    prefill_only: bool = False  # stop after the first token and hand the KV off

    def __post_init__(self) -> None:
        if not self.seqs:
            self.seqs.append(self._new_seq(0, list(self.prompt_token_ids)))

    @property
    def is_finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)

    @property
    def ready_for_handoff(self) -> bool:
        """Every choice has its first token and some still need decoding elsewhere."""
        done = len(self.seqs) == self.params.n and all(
            s.status in (SeqStatus.DETACHED, SeqStatus.FINISHED) for s in self.seqs)
        return done and any(s.status is SeqStatus.DETACHED for s in self.seqs)

    def fork(self, parent: Sequence) -> list[Sequence]:
        """Create the remaining choices as copies of ``parent`` (prompt computed, no output)."""
        children = [self._new_seq(i, list(parent.token_ids)) for i in range(1, self.params.n)]
        for child in children:
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.status = parent.status
            child.block_hashes = list(parent.block_hashes)
        self.seqs.extend(children)
        return children

    def _new_seq(self, choice: int, token_ids: list[int]) -> Sequence:
        seq_id = self.request_id if self.params.n == 1 else f"{self.request_id}/{choice}"
        return Sequence(seq_id, self, choice, token_ids, len(self.prompt_token_ids),
                        generator=_seeded_generator(self.params.seed, choice))


def _seeded_generator(seed: int | None, choice: int) -> torch.Generator | None:
    if seed is None:
        return None
    # Distinct, reproducible streams per choice, independent of what else is batched.
    return torch.Generator().manual_seed((seed * 1_000_003 + choice) & 0xFFFF_FFFF_FFFF_FFFF)
