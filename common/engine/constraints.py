"""Structured outputs in the engine: one llguidance matcher per constrained sequence, and
each step's token masks for all of them at once.

A sequence's matcher is built lazily, the first time the sequence samples, and before
every step it is brought level with the sequence's output tokens (``Constraints.prepare``).
That one rule covers every path a sequence can take: a fork of ``n > 1`` builds its own;
a decode worker's copy of a prefilled request consumes the first token the prefill worker
sampled; a preempted sequence keeps its matcher (its tokens are kept too) and resumes it
after the recompute; chunked prefill and prefix hits never touch the output.

Speculative decoding: the mask for draft position ``j`` is the matcher's state after the
draft's first ``j`` tokens (llguidance computes these and rolls the matcher back itself),
so a draft token the grammar forbids is never accepted. The verified tokens reach the
matcher through the same catch-up next step; a sequence whose output no longer extends
what its matcher consumed (never, unless a caller rewinds tokens) is rolled back first.

Masks are one int32 bitmask ``[rows, ceil(V / 32)]`` per step, filled by llguidance's
parallel executor with the GIL released; ``apply_masks`` (the sampler's one line) expands
it with a few tensor ops. A matcher that fails (a grammar too complex for this tokenizer,
a token it cannot take) fails its request alone: its row allows only EOS, and the engine
ends the request with the error (``take_failures``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import llguidance
import numpy as np
import torch

from common.config import available_cpus
from common.engine.request import Sequence
from common.errors import InvalidRequestError
from common.grammar import GrammarCache, ll_tokenizer
from common.model.tokenizer import Tokenizer
from common.sampling_params import SamplingParams

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


@dataclass(slots=True, eq=False)
class SeqConstraint:
    """One sequence's matcher: it has consumed ``consumed`` (a prefix of the sequence's
    output) but for the EOS tokens after its end, unless ``error`` says it broke."""

    matcher: llguidance.LLMatcher | None
    consumed: list[int] = field(default_factory=list)
    num_after_stop: int = 0  # of those, the last ones that came after the grammar ended
    error: str | None = None
    mask: torch.Tensor | None = None  # this step's bitmask rows [1 + len(draft), words]


class Constraints:
    """The engine's structured-output state: the grammar cache and the step's masks."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: tuple[int, ...],
                 num_threads: int | None = None) -> None:
        self.tokenizer = tokenizer
        # The mask covers the logits and every token of the tokenizer, whichever is wider.
        self.vocab_size = max(vocab_size, tokenizer.vocab_size if tokenizer else 0)
        self.eos_token_ids = eos_token_ids
        self.words = (self.vocab_size + 31) // 32
        self._num_threads = num_threads or max(1, min(8, available_cpus()))
        self._grammars: GrammarCache | None = None
        self._pool: llguidance.LLExecutor | None = None
        self._failed: list[tuple[Sequence, str]] = []
        self._masked: list[SeqConstraint] = []

    def check(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """Refuse a constrained request this engine cannot serve (raises at add time)."""
        if params.structured is None:
            return
        if self.tokenizer is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer, and this "
                                      "model directory has none", "response_format")
        if not 0 <= params.structured.num_output_in_prompt <= num_prompt_tokens:
            raise InvalidRequestError("structured.num_output_in_prompt exceeds the prompt")

    # ---- each step --------------------------------------------------------------------

    def prepare(self, seqs: list[Sequence], drafts: list[tuple[Sequence, tuple[int, ...]]]) -> None:
        """Bring every constrained sequence's matcher level with its output and compute
        this step's masks: one row for each of ``seqs``, 1 + k for a draft of k."""
        self.clear()
        work = [(s, ()) for s in seqs if s.params.structured is not None]
        work += [(s, d) for s, d in drafts if s.params.structured is not None]
        live: list[tuple[Sequence, SeqConstraint, int, list[int]]] = []
        rows = 0
        for seq, draft in work:
            c = self._synced(seq)
            if c.error is not None:
                self._fail(seq, c, 1 + len(draft))
                continue
            live.append((seq, c, rows, list(draft)))
            rows += 1 + len(draft)
        if not live:
            return
        bitmask = np.full((rows, self.words), -1, dtype=np.int32)
        # Drops the GIL and spreads the matchers over its threads; each draft position's
        # row is the state after the draft's earlier tokens, and the matcher is rolled back.
        plain = [(c.matcher, row) for _, c, row, draft in live if not draft]
        drafted = [(c.matcher, row, draft) for _, c, row, draft in live if draft]
        if plain:
            self._executor().unsafe_compute_mask_ptr(plain, bitmask.ctypes.data, self.words * 4, rows)
        if drafted:
            self._executor().unsafe_compute_mask_ptr_with_draft_token(
                drafted, bitmask.ctypes.data, self.words * 4, rows)
        masks = torch.from_numpy(bitmask)
        for seq, c, row, draft in live:
            if c.matcher.is_error():
                c.error = _matcher_error(c.matcher)
                self._fail(seq, c, 1 + len(draft))
            else:
                c.mask = masks[row : row + 1 + len(draft)]
                self._masked.append(c)

    def clear(self) -> None:
        """Forget the previous step's masks."""
        for c in self._masked:
            c.mask = None
        self._masked.clear()

    def take_failures(self) -> list[tuple[Sequence, str]]:
        """Sequences whose matcher failed since the last call, with the reason."""
        failed, self._failed = self._failed, []
        return failed

    # ---- one sequence -------------------------------------------------------------------

    def _synced(self, seq: Sequence) -> SeqConstraint:
        """The sequence's matcher, built if new and fed the output it has not consumed."""
        c = seq.constraint
        if c is None:
            try:
                c = SeqConstraint(self._grammar_cache().new_matcher(seq.params.structured))
            except InvalidRequestError as e:  # a spec that compiles for no tokenizer of ours
                c = SeqConstraint(None, error=e.message)
            except Exception as e:  # noqa: BLE001 - a peer's spec must fail its request, not the step
                c = SeqConstraint(None, error=f"the output constraint cannot be compiled: {e!r}"[:500])
            seq.constraint = c
        if c.error is None:
            self._catch_up(seq, c)
        return c

    def _catch_up(self, seq: Sequence, c: SeqConstraint) -> None:
        ids = seq.token_ids
        start = seq.num_prompt_tokens - seq.params.structured.num_output_in_prompt
        done = len(c.consumed)
        if done > len(ids) - start or (done and ids[start + done - 1] != c.consumed[-1]):
            # The output no longer extends what was consumed: rewind to what they share.
            done = _common_prefix(c.consumed, ids[start:])
            fed = len(c.consumed) - c.num_after_stop
            c.matcher.rollback(max(0, fed - done))
            c.num_after_stop = max(0, c.num_after_stop - (len(c.consumed) - max(done, fed)))
            del c.consumed[done:]
        for i in range(start + done, len(ids)):  # only what is new: no copy of the output
            token = ids[i]
            if c.matcher.is_stopped():  # complete: what follows is EOS (ignore_eos goes on)
                c.num_after_stop += 1
            elif not c.matcher.consume_token(token):
                c.error = _matcher_error(c.matcher)
                return
            c.consumed.append(token)

    def _fail(self, seq: Sequence, c: SeqConstraint, rows: int) -> None:
        """Its rows allow only EOS this step; the engine ends the request with the error."""
        c.mask = self._eos_only(rows)
        self._masked.append(c)
        self._failed.append((seq, c.error or "structured output failed"))

    def _eos_only(self, rows: int) -> torch.Tensor:
        mask = torch.zeros((rows, self.words), dtype=torch.int32)
        for t in self.eos_token_ids:
            if t < self.vocab_size:
                mask[:, t // 32] |= _bit(t % 32)
        return mask

    # ---- built on first use: a worker that never sees a constrained request pays nothing

    def _grammar_cache(self) -> GrammarCache:
        if self._grammars is None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured outputs need the model's tokenizer")
            self._grammars = GrammarCache(ll_tokenizer(self.tokenizer, self.vocab_size,
                                                       self.eos_token_ids))
        return self._grammars

    def _executor(self) -> llguidance.LLExecutor:
        if self._pool is None:
            self._pool = llguidance.LLExecutor(num_threads=self._num_threads)
        return self._pool


def apply_masks(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """[S, V] logits with each constrained row's forbidden tokens at -inf. A sequence that
    appears several times in a row (a verified draft) takes its mask rows in order."""
    picks: list[torch.Tensor] = []
    rows: list[int] = []
    seen: dict[int, int] = {}
    for i, seq in enumerate(seqs):
        c = seq.constraint
        if c is None or c.mask is None:
            continue
        j = seen.get(id(seq), 0)
        seen[id(seq)] = j + 1
        picks.append(c.mask[min(j, c.mask.shape[0] - 1)])
        rows.append(i)
    if not rows:
        return logits
    forbidden = forbidden_tokens(torch.stack(picks), logits.shape[1], logits.device)  # [R, V]
    if len(rows) == logits.shape[0]:  # every row constrained: one pass, no gather
        return _fall_back_to_allowed(logits.masked_fill(forbidden, float("-inf")), forbidden)
    index = torch.tensor(rows, device=logits.device)
    logits = logits.clone()
    logits[index] = _fall_back_to_allowed(logits[index].masked_fill(forbidden, float("-inf")), forbidden)
    return logits


def _fall_back_to_allowed(masked: torch.Tensor, forbidden: torch.Tensor) -> torch.Tensor:
    """A row whose every allowed token another rule banned (min_tokens bans EOS, and the
    grammar is complete) takes its allowed tokens evenly instead: the grammar wins."""
    dead = masked.amax(dim=-1) == float("-inf")  # [R]
    if bool(dead.any()):
        masked[dead] = torch.zeros_like(masked[dead]).masked_fill(forbidden[dead], float("-inf"))
    return masked


def forbidden_tokens(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, words] int32 bitmask (bit b of word w allows token 32 w + b) → [R, vocab_size]
    bool, True where a token is forbidden, on ``device``."""
    if device.type == "cpu":  # numpy's unpackbits is one C loop
        bits = np.unpackbits((~bitmask.numpy()).view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, :vocab_size]).view(torch.bool)
    return ~unpack_bitmask(bitmask.to(device, non_blocking=True), vocab_size)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, words] int32 → [R, vocab_size] bool, True where a token is allowed."""
    shifts = _BIT_SHIFTS.to(bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, words, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _bit(b: int) -> int:
    """Bit ``b`` of an int32 word, as the signed value torch stores."""
    return (1 << b) - (1 << 32) if b == 31 else 1 << b


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _matcher_error(matcher: llguidance.LLMatcher) -> str:
    text = matcher.get_error().strip()
    first = text.splitlines()[0] if text else "the matcher stopped"
    return f"structured output failed: {first[:300]}"
