"""N-gram speculative decoding: who drafts, what they draft, and what of it is accepted.

``propose_ngram`` is prompt lookup: the longest suffix of a sequence's tokens (prompt and
output) that occurred earlier, continued with what followed its most recent earlier
occurrence. ``Speculator`` decides each step which decoding sequences draft (the
switch-offs: a large batch, a request whose acceptance has been low) and keeps the
counters. ``verify`` turns the 1 + k rows of logits of a verified draft into the tokens
the sequence keeps:

- greedy: the draft tokens while they equal the target's argmax, then the argmax at the
  first mismatch (or a bonus token after all k);
- sampling: rejection sampling for a one-hot draft. Draft token t is accepted with
  probability p(t) under the sampler's processed distribution p; on rejection the token
  is drawn from p with t removed. So each emitted token has exactly the distribution p.

Drafts live only in the scheduled chunk (``ScheduledChunk.draft``), never in the
sequence's tokens; the scheduler's ``settle_draft`` rolls back what was rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.config import SpeculativeConfig
from common.engine.request import Sequence, TokenLogprob
from common.engine.sampler import Sampler, argmax_rows


def propose_ngram(tokens: list[int], k: int, max_n: int, min_n: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
    suffix of ``tokens`` (``max_n`` down to ``min_n`` long); [] when none occurred.

    Where what followed runs into the end of ``tokens`` before ``k``, the draft goes on as
    the span repeats (period: the match's distance from the end): a sequence caught in a
    loop drafts the whole ``k``, not the few tokens left before its end."""
    if k < 1 or len(tokens) < min_n + 1:
        return []
    arr = np.asarray(tokens)
    last = len(arr) - 1
    ends = np.flatnonzero(arr[:last] == arr[last])  # earlier occurrences of the last token
    length = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, min(max_n, last)):  # extend every candidate match one token back
        alive &= ends >= j
        alive[alive] = arr[ends[alive] - j] == arr[last - j]
        length += alive
    if not len(ends) or length.max() < min_n:
        return []
    best = ends[np.flatnonzero(length == length.max())[-1]]  # the most recent longest
    # Tokens best + 1 .. last followed the match; past the end they repeat with that period.
    return arr[best + 1 + np.arange(k) % (last - best)].tolist()


@dataclass(slots=True)
class SpecStats:
    num_drafts: int = 0  # verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class _SeqState:
    rate: float = 1.0  # exponential moving average of the accepted fraction
    backoff_until: int = 0  # the step before which the sequence drafts nothing


class Speculator:
    """Proposes drafts for a step's decoding sequences and learns how well they fare."""

    def __init__(self, config: SpeculativeConfig, max_num_batched_tokens: int, max_model_len: int) -> None:
        self.config = config
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.stats = SpecStats()
        self._states: dict[str, _SeqState] = {}
        self._step = 0

    def propose(self, running: list[Sequence]) -> dict[Sequence, list[int]]:
        """Drafts for the sequences that decode this step; none when the batch is large."""
        self._step += 1
        self._states = {s.seq_id: st for s in running if (st := self._states.get(s.seq_id))}
        decoding = [s for s in running if s.num_uncomputed_tokens == 1 and not s.request.prefill_only]
        c = self.config
        if len(decoding) > c.disable_by_batch_size or \
                len(decoding) * (1 + c.num_speculative_tokens) > self.max_num_batched_tokens:
            return {}
        drafts = {}
        for seq in decoding:
            k = self._room(seq)
            if k > 0 and (draft := propose_ngram(seq.token_ids, k, c.prompt_lookup_max, c.prompt_lookup_min)):
                drafts[seq] = draft
        return drafts

    def observe(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        """Record one verified draft; a request whose average falls too low backs off."""
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_draft
        self.stats.num_accepted_tokens += num_accepted
        st = self._states.setdefault(seq.seq_id, _SeqState())
        a = self.config.acceptance_smoothing
        st.rate = a * num_accepted / num_draft + (1 - a) * st.rate
        if st.rate < self.config.min_acceptance_rate:
            # The average is kept: after the pause one more poor draft backs off again.
            st.backoff_until = self._step + 1 + self.config.backoff_steps

    def _room(self, seq: Sequence) -> int:
        """How many draft tokens this sequence may take now (0: it does not draft)."""
        p = seq.params
        st = self._states.get(seq.seq_id)
        if st is not None and self._step < st.backoff_until:
            return 0
        # Penalties and min_tokens depend on the tokens before each row; drafts skip them.
        if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty \
                or seq.num_output_tokens < p.min_tokens:
            return 0
        left = min(seq.request.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        return min(self.config.num_speculative_tokens, left - 1)


@dataclass(slots=True)
class Verified:
    token_ids: list[int]  # accepted draft tokens, then one token of the target's
    logprobs: list[TokenLogprob]  # one per token when the request asked for them

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


@torch.inference_mode()
def verify(sampler: Sampler, seq: Sequence, draft: tuple[int, ...], logits: torch.Tensor) -> Verified:
    """logits: [1 + len(draft), V], row j predicting the token after draft[:j]."""
    rows = [seq] * logits.shape[0]
    adjusted = sampler.adjust(logits.float(), rows)
    if seq.params.greedy:
        tokens = _accept_greedy(draft, argmax_rows(adjusted).tolist())
    else:
        tokens = _accept_sampled(sampler, seq, draft, sampler.target_probs(adjusted, rows))
    n = len(tokens)
    lps = sampler.token_logprobs(logits[:n], tokens, rows[:n]) if seq.params.logprobs is not None else []
    return Verified(tokens, [lp for lp in lps if lp is not None])


def _accept_greedy(draft: tuple[int, ...], argmax: list[int]) -> list[int]:
    accepted = 0
    while accepted < len(draft) and draft[accepted] == argmax[accepted]:
        accepted += 1
    return list(draft[:accepted]) + [argmax[accepted]]


def _accept_sampled(sampler: Sampler, seq: Sequence, draft: tuple[int, ...], probs: torch.Tensor) -> list[int]:
    """probs: [1 + len(draft), V] the target distribution (unnormalised) at each row."""
    probs = probs / probs.sum(dim=-1, keepdim=True)
    for j, t in enumerate(draft):
        if sampler.uniform(seq) < float(probs[j, t]):
            continue
        residual = probs[j].clone()
        residual[t] = 0.0  # p with t removed; the draw renormalises
        return list(draft[:j]) + [int(sampler.draw(residual.unsqueeze(0), [seq])[0])]
    return list(draft) + [int(sampler.draw(probs[-1:], [seq])[0])]
