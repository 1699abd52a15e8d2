"""Placement: filter → score → pick, every step one async signature.

A step takes the request and the surviving candidates and returns the candidates that
remain, with their scores adjusted; ``place`` folds the steps and picks the best score
(ties go to the earlier candidate). Policies are just lists of steps, so a new rule is
one function, and no step knows which policy it is part of.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from common.hashing import BlockHash
from common.rules import decode_blocks_needed
from services.router.prefix_index import PrefixIndex
from services.router.registry import WorkerInfo


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    request_id: str
    num_prompt_tokens: int
    block_hashes: Sequence[BlockHash]  # the prompt's full blocks, in the workers' block size
    block_size: int


@dataclass(slots=True)
class Candidate:
    worker: WorkerInfo
    score: float = 0.0
    cached_tokens: int = 0  # of this prompt, already in the worker's prefix cache


Step = Callable[[PlacementRequest, list[Candidate]], Awaitable[list[Candidate]]]


async def place(req: PlacementRequest, workers: Sequence[WorkerInfo], steps: Sequence[Step]) -> Candidate | None:
    candidates = [Candidate(w) for w in workers]
    for step in steps:
        candidates = await step(req, candidates)
        if not candidates:
            return None
    return max(candidates, key=lambda c: c.score)  # max keeps the first of equal scores


# ---- prefill steps --------------------------------------------------------------------

def with_cached_prefix(index: PrefixIndex) -> Step:
    """Annotate each candidate with how much of the prompt it has cached (scores nothing)."""

    async def step(req: PlacementRequest, cands: list[Candidate]) -> list[Candidate]:
        matched = index.matches(req.block_hashes)  # only the workers holding its first block
        for c in cands:
            c.cached_tokens = min(matched.get(c.worker.worker_id, 0) * req.block_size,
                                  req.num_prompt_tokens)
        return cands

    return step


def within_token_budget(budget: int) -> Step:
    """Drop workers whose outstanding prompt work would exceed ``budget`` tokens.

    An idle worker always qualifies, so a prompt larger than the budget still runs.
    """

    async def step(req: PlacementRequest, cands: list[Candidate]) -> list[Candidate]:
        return [c for c in cands
                if c.worker.outstanding_tokens == 0
                or c.worker.outstanding_tokens + req.num_prompt_tokens - c.cached_tokens <= budget]

    return step


def prefix_affinity(load_weight: float) -> Step:
    """Cached tokens saved, minus the work already queued there (both in tokens).

    A hot prefix keeps attracting its requests only while its worker is not much busier
    than the others: past ``cached / load_weight`` outstanding tokens, an idle worker wins.
    """

    async def step(req: PlacementRequest, cands: list[Candidate]) -> list[Candidate]:
        for c in cands:
            c.score += c.cached_tokens - load_weight * c.worker.outstanding_tokens
        return cands

    return step


def least_loaded() -> Step:
    async def step(req: PlacementRequest, cands: list[Candidate]) -> list[Candidate]:
        for c in cands:
            c.score -= c.worker.outstanding_tokens + c.worker.num_waiting + c.worker.num_running
        return cands

    return step


def round_robin() -> Step:
    """Each placement starts one worker further along the (sorted) list."""
    turn = itertools.count()

    async def step(req: PlacementRequest, cands: list[Candidate]) -> list[Candidate]:
        ordered = sorted(cands, key=lambda c: c.worker.worker_id)
        start = next(turn) % len(ordered)
        for rank, c in enumerate(ordered[start:] + ordered[:start]):
            c.score -= rank
        return cands

    return step


class RoutingPolicy(str, enum.Enum):
    """How the router picks a prefill worker."""

    PREFIX = "prefix"  # the longest cached prefix, weighed against load
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"


def prefill_policy(name: RoutingPolicy | str, index: PrefixIndex, token_budget: int,
                   load_weight: float = 1.0) -> list[Step]:
    try:
        policy = RoutingPolicy(name)
    except ValueError:
        choices = ", ".join(p.value for p in RoutingPolicy)
        raise ValueError(f"unknown routing policy {name!r} ({choices})") from None
    budget = within_token_budget(token_budget)
    if policy is RoutingPolicy.PREFIX:
        return [with_cached_prefix(index), budget, prefix_affinity(load_weight)]
    if policy is RoutingPolicy.ROUND_ROBIN:
        return [budget, round_robin()]
    return [budget, least_loaded()]


# ---- decode steps ---------------------------------------------------------------------

def has_room_for_prompt() -> Step:
    """The decode worker can take the prompt's blocks plus one for the next token."""

    async def step(req: PlacementRequest, cands: list[Candidate]) -> list[Candidate]:
        need = decode_blocks_needed(req.num_prompt_tokens, req.block_size)
        return [c for c in cands if c.worker.available_blocks >= need]

    return step


def most_free_blocks() -> Step:
    async def step(req: PlacementRequest, cands: list[Candidate]) -> list[Candidate]:
        for c in cands:
            c.score += c.worker.available_blocks / max(c.worker.num_blocks, 1)
        return cands

    return step


def quickest_steps(weight: float) -> Step:
    """Penalise slow steps: ``weight`` × step time / the slowest candidate's (0 to weight).

    A decode worker's step time is what each of its requests waits per token, so between
    two with room, the one stepping faster serves a newcomer sooner. Relative, so it is
    scale-free; a worker not measured yet counts as the quickest.
    """

    async def step(req: PlacementRequest, cands: list[Candidate]) -> list[Candidate]:
        slowest = max((c.worker.step_seconds or 0.0 for c in cands), default=0.0)
        if slowest > 0:
            for c in cands:
                c.score -= weight * (c.worker.step_seconds or 0.0) / slowest
        return cands

    return step


def decode_policy(step_weight: float = 1.0) -> list[Step]:
    """Room for the prompt, then the free KV fraction (0..1) less the relative step time
    (0..``step_weight``): at weight 1, a worker half as full but twice as slow ties."""
    return [has_room_for_prompt(), most_free_blocks(), quickest_steps(step_weight)]
