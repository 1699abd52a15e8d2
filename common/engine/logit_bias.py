"""OpenAI's ``logit_bias``: per-request additive biases on chosen token ids.

Applied first among the sampler's adjustments (before penalties, masks, temperature), so
a bias of +100 makes its token the greedy choice and -100 all but bans it, as OpenAI
documents. Token ids were checked against the vocabulary before (the gateway and the
engine both call ``common.rules.check_logit_bias``); an id past the logits' width is
skipped rather than indexed, so a mismatch can never crash a step.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from common.engine.request import Sequence


def apply_logit_bias(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """[S, V] logits → the same with each row's biases added (a copy only if any)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    vocab = logits.shape[1]
    for i, s in enumerate(seqs):
        for token, bias in s.params.logit_bias:
            if token < vocab:
                rows.append(i)
                cols.append(token)
                values.append(bias)
    if not rows:
        return logits
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    bias = torch.tensor(values, dtype=logits.dtype, device=logits.device)
    return logits.index_put(index, bias, accumulate=True)
