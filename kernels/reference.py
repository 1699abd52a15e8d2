"""Plain-torch versions of the attention hot path: the test oracle for every kernel.

Cache layout (owned by the runner, see ``common/engine/runner.py``): one tensor per
layer and K/V, viewed as ``[num_blocks, block_size, num_kv_heads, head_dim]``. The view
may be strided in its block dimension (the runner keeps all layers of a block together
so a block ships as one contiguous buffer); these functions accept any such view.

A *slot* is ``block_id * block_size + offset``.
"""

from __future__ import annotations

import torch


def write_kv(
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,  # [NB, BS, KVH, D]
    slot_mapping: torch.Tensor,  # [T] int
) -> None:
    """Store each token's key and value into its cache slot (in place)."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


def gather_kv(
    cache: torch.Tensor,  # [NB, BS, KVH, D]
    block_ids: torch.Tensor,  # [nb] int
    num_tokens: int,
) -> torch.Tensor:  # [num_tokens, KVH, D]
    """The first ``num_tokens`` cached positions of one sequence, made contiguous."""
    blocks = cache.index_select(0, block_ids.long())  # [nb, BS, KVH, D]
    return blocks.flatten(0, 1)[:num_tokens]


def _attend(
    q: torch.Tensor,  # [Q, H, D]
    k: torch.Tensor,  # [K, KVH, D]
    v: torch.Tensor,  # [K, KVH, D]
    scale: float,
    first_position: int,  # position of q[0]; key j is visible to query i iff j <= first_position + i
) -> torch.Tensor:  # [Q, H, D]
    num_q, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1).float()  # [H, K, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1).float()
    scores = torch.matmul(q.transpose(0, 1).float(), k.transpose(1, 2)) * scale  # [H, Q, K]
    q_pos = first_position + torch.arange(num_q).unsqueeze(1)
    k_pos = torch.arange(k.shape[1]).unsqueeze(0)
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1), v)  # [H, Q, D]
    return out.transpose(0, 1).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D], one query per sequence, at position context_lens-1
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int; entries past a sequence's blocks are ignored
    context_lens: torch.Tensor,  # [B] int, tokens in cache including the query's own
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """Each query attends to every cached position of its sequence."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    for i, n in enumerate(context_lens.tolist()):
        ids = block_tables[i, : -(-n // block_size)]
        k, v = gather_kv(k_cache, ids, n), gather_kv(v_cache, ids, n)
        out[i] = _attend(q[i : i + 1], k, v, scale, first_position=n - 1)[0]
    return out


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D], the new tokens of all sequences, back to back
    k_cache: torch.Tensor,  # [NB, BS, KVH, D], already holding the new tokens' K/V
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int
    query_start: torch.Tensor,  # [S+1] int, q rows of sequence s are query_start[s]:query_start[s+1]
    context_lens: torch.Tensor,  # [S] int, cached tokens of s including its new ones
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each sequence's new tokens over its whole paged context.

    The new tokens are the last ``q_len`` positions of the context, so a query at
    position p sees keys 0..p: the cached prefix and the new tokens up to itself.
    """
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    starts = query_start.tolist()
    for s, n in enumerate(context_lens.tolist()):
        lo, hi = starts[s], starts[s + 1]
        ids = block_tables[s, : -(-n // block_size)]
        k, v = gather_kv(k_cache, ids, n), gather_kv(v_cache, ids, n)
        out[lo:hi] = _attend(q[lo:hi], k, v, scale, first_position=n - (hi - lo))
    return out


def dense_causal_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Naive attention over one contiguous sequence: the ground truth for the tests."""
    return _attend(q, k, v, scale, first_position=0)
