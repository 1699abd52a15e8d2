"""Continuous batching with chunked prefill, priorities, preemption by recompute.

Both queues are kept in the order of ``serving_key``: (priority, arrival), lower first —
vLLM's semantics, where every request's default priority 0 makes this plain FCFS.
Each step has a token budget (``max_num_batched_tokens``), of which prompt chunks may take
at most ``max_num_prefill_tokens`` (a decode worker sets it low). Running sequences are served
first, in that order: a decode takes one token, an unfinished prefill its next chunk.
What budget remains admits waiting sequences, also in that order, each with as large
a chunk as fits. When the cache cannot hold a running sequence's next tokens, the last
running sequence in that order (the lowest priority, then the latest arrival) is
preempted: its blocks are freed and it goes back to the queue in its place, to be
recomputed (mostly from the prefix cache) later.

A decoding sequence may bring a draft (speculative decoding): its chunk is then its last
token plus the draft tokens, verified in one step. Drafts take budget and blocks only
when both are to spare (a draft never preempts anyone); after verification
``settle_draft`` keeps the accepted tokens' KV and gives back the blocks that only
rejected tokens used. Draft tokens never enter ``seq.token_ids``, so no block is ever
hashed into the prefix cache with tokens that were not accepted.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

from common.config import SchedulerConfig
from common.engine.kv_cache_manager import CachedPrefix, KVCacheManager
from common.engine.prompt_logprobs import needs_prompt_logprobs
from common.engine.request import FinishReason, SeqStatus, Sequence


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step
    num_new_tokens: int  # draft tokens included
    draft: tuple[int, ...] = ()  # provisional tokens after the sequence's last one

    @property
    def end(self) -> int:
        """The sequence's known tokens computed through, once the step ran (drafts excluded)."""
        return self.start + self.num_new_tokens - len(self.draft)

    @property
    def samples(self) -> bool:
        """The step reaches the end of the sequence's known tokens, so it yields a token."""
        return self.end == self.seq.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step feeds the model: known ones, then the draft."""
        return self.seq.token_ids[self.start : self.end] + list(self.draft)


@dataclass(slots=True)
class SchedulerStats:
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_hits: int = 0  # of those, found cached
    computed_tokens: int = 0  # tokens whose KV a step computed, ever (drafts included)


@dataclass(slots=True)
class StepBudget:
    """What is left of one step's budget: tokens in all, and of those for prompt chunks."""

    tokens: int
    prefill: int

    def fit(self, wanted: int, is_prefill: bool) -> int:
        return min(wanted, self.tokens, self.prefill) if is_prefill else min(wanted, self.tokens)

    def take(self, n: int, is_prefill: bool) -> None:
        self.tokens -= n
        if is_prefill:
            self.prefill -= n


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


def serving_key(seq: Sequence) -> tuple[int, float, int]:
    """The order both queues keep: priority (lower first), arrival, then choice."""
    return seq.params.priority, seq.request.arrival_time, seq.choice


def _insert(queue: list[Sequence], seq: Sequence) -> None:
    """In ``serving_key`` order, after any equal key (so equal keys stay FCFS)."""
    bisect.insort_right(queue, seq, key=serving_key)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.stats = SchedulerStats()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        _insert(self.waiting, seq)

    def adopt_forks(self, parent: Sequence, children: list[Sequence]) -> None:
        """Forked sequences join the running batch right behind their parent."""
        at = self.running.index(parent) + 1
        for child in children:
            child.status = SeqStatus.RUNNING
        self.running[at:at] = children

    def schedule(self, drafts: Mapping[Sequence, list[int]] | None = None) -> SchedulerOutput:
        """``drafts``: proposed tokens of decoding sequences, taken as far as room allows."""
        out = SchedulerOutput()
        c = self.config
        budget = StepBudget(c.max_num_batched_tokens, c.max_num_prefill_tokens or c.max_num_batched_tokens)
        self._schedule_running(out, budget, drafts or {})
        if not out.preempted:  # a cache that just ran out takes no newcomers
            self._schedule_waiting(out, budget)
        out.block_copies = self.kv.take_copies()
        return out

    def advance(self, out: SchedulerOutput) -> None:
        """Record that the step computed its chunks' KV."""
        self.stats.computed_tokens += out.num_tokens
        for chunk in out.chunks:
            chunk.seq.num_computed_tokens = chunk.end
            self.kv.cache_computed_blocks(chunk.seq)

    def settle_draft(self, seq: Sequence, num_accepted: int) -> None:
        """After verification (the accepted tokens already appended): their KV counts as
        computed, blocks that held only rejected tokens are freed."""
        if seq.status is not SeqStatus.RUNNING:
            return  # finished within the accepted run: every block is already freed
        seq.num_computed_tokens += num_accepted
        self.kv.cache_computed_blocks(seq)
        self.kv.trim(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.is_finished:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        self.kv.free(seq)

    def detach(self, seq: Sequence) -> None:
        """Take a running sequence out of the batch but keep its blocks (KV handoff)."""
        self.running.remove(seq)
        seq.status = SeqStatus.DETACHED

    def add_running(self, seqs: list[Sequence]) -> None:
        """Sequences whose KV arrived already computed join the batch directly."""
        for seq in seqs:
            seq.status = SeqStatus.RUNNING
            _insert(self.running, seq)

    def _schedule_running(self, out: SchedulerOutput, budget: StepBudget,
                          drafts: Mapping[Sequence, list[int]]) -> None:
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            seq = self.running[i]
            is_prefill = seq.num_uncomputed_tokens > 1
            if is_prefill and budget.prefill <= 0:
                i += 1  # its turn comes next step; the decodes behind it still run
                continue
            draft = self._fit_draft(seq, drafts.get(seq), budget.tokens, len(self.running) - i - 1)
            num_new = budget.fit(seq.num_uncomputed_tokens, is_prefill) + len(draft)
            if not self._make_room(seq, num_new, out):
                break  # seq itself was preempted; everything after it is gone too
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_new, draft))
            budget.take(num_new, is_prefill)
            i += 1

    def _fit_draft(self, seq: Sequence, draft: list[int] | None, budget: int,
                   num_after: int) -> tuple[int, ...]:
        """The part of a draft that fits the budget, if its blocks leave one free block for
        each running sequence after it (so drafting never causes a preemption)."""
        if not draft or seq.num_uncomputed_tokens != 1:
            return ()
        draft = draft[: budget - 1]
        if draft and self.kv.blocks_needed(seq, 1 + len(draft)) + num_after > self.kv.pool.num_free_blocks:
            return ()
        return tuple(draft)

    def _make_room(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv.can_allocate(seq, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        self.kv.allocate(seq, num_new)
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: StepBudget) -> None:
        while (self.waiting and min(budget.tokens, budget.prefill) > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            prefix = self._cached_prefix(seq)
            remaining = seq.num_tokens - prefix.num_tokens
            if not self.config.enable_chunked_prefill and remaining > budget.tokens:
                break
            num_new = budget.fit(remaining, is_prefill=True)
            if not self.kv.can_allocate(seq, num_new, prefix):
                break
            self._admit(seq, num_new, prefix, out)
            budget.take(num_new, is_prefill=True)

    def _cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """A hit skips computing its positions: none for a prompt still to be scored."""
        if needs_prompt_logprobs(seq):
            return CachedPrefix([], 0)
        return self.kv.find_cached_prefix(seq)

    def _admit(self, seq: Sequence, num_new: int, prefix: CachedPrefix, out: SchedulerOutput) -> None:
        self.kv.allocate(seq, num_new, prefix)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = prefix.num_tokens
            self.stats.prefix_queries += seq.num_tokens
            self.stats.prefix_hits += prefix.num_tokens
        self.waiting.pop(0)
        seq.status = SeqStatus.RUNNING
        _insert(self.running, seq)
        out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_new))

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        _insert(self.waiting, seq)
