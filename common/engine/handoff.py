"""Moving a prefilled request between engines: what leaves a prefill engine and how a
decode engine takes it in.

A prefill-only request stops after its first token: its sequences are *detached* (out of
the batch, blocks kept) and ``Handoff`` describes them. After the transfer the prefill
engine releases the blocks. The decode engine allocates its own blocks, copies the
payload in, and its sequences join the running batch with the prompt already computed —
so the next step computes the first token's KV and samples the second.

This module is also the one place where a ``Handoff`` becomes the wire's ``KVHandoff``
header and back (``to_wire`` / ``from_wire``): every per-choice field crosses, including
which choices already finished at their first token.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from common.engine.request import Request, SeqStatus, Sequence, TokenLogprob
from common.protocol import KVHandoff
from common.sampling_params import SamplingParams


@dataclass(slots=True)
class Handoff:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]  # the prompt's blocks, shared by every choice
    first_tokens: list[int]  # per choice
    first_logprobs: list[TokenLogprob | None]
    generator_states: list[bytes | None]  # seeded choices continue their random stream
    finished: list[bool]  # choices that already ended at their first token
    num_cached_tokens: int


def build_handoff(request: Request, block_ids: list[int]) -> Handoff:
    seqs = request.seqs
    return Handoff(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        params=request.params,
        block_ids=block_ids,
        first_tokens=[s.token_ids[s.num_prompt_tokens] for s in seqs],
        first_logprobs=[s.logprobs[0] if s.logprobs else None for s in seqs],
        generator_states=[_state(s.generator) for s in seqs],
        finished=[s.status is SeqStatus.FINISHED for s in seqs],
        num_cached_tokens=seqs[0].num_cached_tokens,
    )


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a peer's cache must match for blocks to be copied byte for byte.

    ``kv_dtype`` is the ``--kv-cache-dtype`` the bytes are in (float32, bfloat16, float16,
    int8, fp8): int8 and fp8 blocks have the same sizes but cannot be read as each other.
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    element_size: int  # bytes per cached value (1 for int8 / fp8 codes)
    kv_dtype: str

    def as_list(self) -> list[int]:
        return [self.num_layers, self.block_size, self.num_kv_heads, self.head_dim,
                self.element_size]

    def mismatch(self, theirs: Seq[int], their_dtype: str) -> str | None:
        """Why a peer's layout cannot be copied into this one, or None."""
        if their_dtype != self.kv_dtype:
            return (f"KV cache dtype {their_dtype} of the sender does not match this worker's "
                    f"{self.kv_dtype}: run prefill and decode with the same --kv-cache-dtype")
        if list(theirs) != self.as_list():
            return f"KV layout {list(theirs)} does not match this worker's {self.as_list()}"
        return None


def to_wire(h: Handoff, transfer_id: str, reply_to: str, layout: KVLayout,
            block_nbytes: int, *, stream_id: str | None = None, first_block: int = 0,
            num_pieces: int = 0) -> KVHandoff:
    """The transfer header for a handoff whose blocks from ``first_block`` on follow as
    frames (the stream ``stream_id``'s ``num_pieces`` pieces carried those before)."""
    return KVHandoff(transfer_id, h.request_id, h.prompt_token_ids, h.first_tokens,
                     h.first_logprobs, h.generator_states, h.finished, h.params, reply_to,
                     h.num_cached_tokens, len(h.block_ids) - first_block, block_nbytes,
                     layout.as_list(), layout.kv_dtype, stream_id, first_block, num_pieces)


def from_wire(header: KVHandoff) -> Handoff:
    """The decode side's handoff (its blocks are the payload, not ids of this cache)."""
    return Handoff(header.request_id, header.prompt_token_ids, header.params, [],
                   header.first_tokens, header.first_logprobs, header.generator_states,
                   header.finished, header.num_cached_tokens)


def rebuild_request(h: Handoff, max_tokens: int) -> Request:
    """The decode side's copy of the request: every choice holds its first token."""
    request = Request(h.request_id, list(h.prompt_token_ids), h.params, max_tokens)
    parent = request.seqs[0]
    if h.params.n > 1:
        request.fork(parent)
    for seq, token, lp, state, done in zip(request.seqs, h.first_tokens, h.first_logprobs,
                                           h.generator_states, h.finished, strict=True):
        seq.token_ids.append(token)
        seq.num_computed_tokens = len(h.prompt_token_ids)
        seq.num_cached_tokens = h.num_cached_tokens
        if lp is not None:
            seq.logprobs.append(lp)
        if state is not None and seq.generator is not None:
            seq.generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        if done:
            seq.status = SeqStatus.FINISHED
    return request


def live_seqs(request: Request) -> list[Sequence]:
    return [s for s in request.seqs if s.status is not SeqStatus.FINISHED]


def _state(generator: torch.Generator | None) -> bytes | None:
    return None if generator is None else bytes(generator.get_state().numpy())
