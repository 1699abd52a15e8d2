"""Prompt logprobs (vLLM's ``prompt_logprobs``): each prompt token scored by the model.

The prompt's token ``j`` (from 1; the first has no context) is scored by the logits at
position ``j - 1``, which the prefill pass computes anyway: the runner keeps the hidden
states of those positions for sequences that asked (``wanted_positions``), and
``record`` turns them into one ``TokenLogprob`` per token (its logprob, its 1-based rank
in the distribution, the ``k`` best alternatives), appended to ``seq.prompt_logprobs``
in prompt order. Chunked prefill scores each chunk's positions as it runs.

Prefix hits would skip positions, so a sequence still owed prompt logprobs is never
admitted from the prefix cache (``needs_prompt_logprobs``; the scheduler asks). After a
preemption it recomputes from position 0 and the positions already scored are kept, not
scored again. Logprobs are those of the raw model distribution, like the sampler's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.engine.request import Sequence
from common.outputs import TokenLogprob

ROWS_PER_SLICE = 256  # logits of at most this many positions exist at once ([rows, vocab])


@dataclass(slots=True)
class PromptRows:
    """The hidden states of one chunk's positions that score prompt tokens."""

    seq: Sequence
    first_position: int  # scores prompt token first_position + 1
    hidden: torch.Tensor  # [positions, hidden]


def needs_prompt_logprobs(seq: Sequence) -> bool:
    """Asked for, not every prompt token scored yet, and still before the first output
    token (which the records travel with: a sequence past it — forked, preempted after
    its prompt, or prefilled elsewhere — has nothing left to score)."""
    return (seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0
            and len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1)


def wanted_positions(seq: Sequence, start: int, end: int) -> range:
    """Of the positions ``[start, end)`` a step computes, those that score a prompt token
    not scored yet (empty when none)."""
    if not needs_prompt_logprobs(seq):
        return range(0)
    return range(max(start, len(seq.prompt_logprobs)), min(end, seq.num_prompt_tokens - 1))


def record(rows: list[PromptRows], logits_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Score each chunk's prompt tokens (``logits_of``: hidden [n, H] → logits [n, V])."""
    for r in rows:
        k = r.seq.params.prompt_logprobs
        for lo in range(0, r.hidden.shape[0], ROWS_PER_SLICE):
            hidden = r.hidden[lo : lo + ROWS_PER_SLICE]
            first = r.first_position + lo + 1
            targets = r.seq.token_ids[first : first + hidden.shape[0]]
            r.seq.prompt_logprobs.extend(score(logits_of(hidden), targets, k))


def score(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """[n, V] logits, the n tokens they predict → each token's logprob record."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    index = torch.tensor(targets, device=logprobs.device).unsqueeze(1)  # [n, 1]
    chosen = logprobs.gather(1, index)  # [n, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [n]
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    out = []
    for i, (token, value, rank) in enumerate(zip(targets, chosen[:, 0].tolist(), ranks.tolist(),
                                                 strict=True)):
        top = () if top_ids is None else tuple(zip(top_ids[i].tolist(), top_values[i].tolist(),
                                                   strict=True))
        out.append(TokenLogprob(token, value, top, rank))
    return out


def prompt_rows(chunks: list, hidden: torch.Tensor) -> list[PromptRows]:
    """The hidden rows of a step (``chunks`` in the order their tokens were fed, each
    ``ScheduledChunk`` taking ``num_new_tokens`` rows) that score prompt tokens."""
    out, row = [], 0
    for c in chunks:
        wanted = wanted_positions(c.seq, c.start, c.end)
        if wanted:
            lo = row + wanted.start - c.start
            out.append(PromptRows(c.seq, wanted.start, hidden[lo : lo + len(wanted)]))
        row += c.num_new_tokens
    return out
