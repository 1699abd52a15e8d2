"""OpenAI's ``logit_bias``: per-request additive biases on chosen token ids.

Applied first among the sampler's adjustments (before penalties, masks, temperature), so
a bias of +100 makes its token the greedy choice and -100 all but bans it, as OpenAI
documents. Token ids were checked against the vocabulary before (the gateway and the
engine both call ``common.rules.check_logit_bias``); an id past the logits' width is
skipped rather than indexed, so a mismatch can never crash a step.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence as Seq

import torch

from common.engine.request import Sequence


@functools.lru_cache(maxsize=1024)  # one entry per distinct bias map (clients repeat theirs)
def _columns(bias: tuple[tuple[int, float], ...], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's (token ids, biases) as CPU tensors, ids past the logits' width left out."""
    kept = [(t, b) for t, b in bias if t < vocab]
    return (torch.tensor([t for t, _ in kept], dtype=torch.long),
            torch.tensor([b for _, b in kept], dtype=torch.float32))


def apply_logit_bias(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """[S, V] logits → the same with each row's biases added (a copy only if any)."""
    rows: list[torch.Tensor] = []
    cols: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    vocab = logits.shape[1]
    for i, s in enumerate(seqs):
        if s.params.logit_bias:
            c, v = _columns(s.params.logit_bias, vocab)
            rows.append(torch.full_like(c, i))
            cols.append(c)
            values.append(v)
    if not rows:
        return logits
    device = logits.device
    index = (torch.cat(rows).to(device), torch.cat(cols).to(device))
    bias = torch.cat(values).to(device=device, dtype=logits.dtype)
    return logits.index_put(index, bias, accumulate=True)
