"""The prefix-block hash chain, shared by the router and every worker.

A full block of ``block_size`` tokens is named by ``H(parent hash, its token ids, extra
keys)``, so equal hashes mean equal prefixes up to and including that block. The hash is
a keyed BLAKE2b digest over a fixed byte encoding: stable across processes, machines and
Python versions (never Python's salted ``hash()``).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # 16 bytes

_ROOT = b"tandem-prefix-v1"


_KEYED = hashlib.blake2b(digest_size=16, key=_ROOT)  # copied per block: keying costs a round


@functools.lru_cache(maxsize=64)
def _packer(num_tokens: int) -> struct.Struct:
    return struct.Struct(f"<{num_tokens}I")


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash one full block given the hash of the block before it (None for the first)."""
    h = _KEYED.copy()
    h.update(parent or b"\0" * 16)
    h.update(_packer(len(token_ids)).pack(*token_ids))
    h.update(extra)
    return h.digest()


def hash_prefix_blocks(
    token_ids: Sequence[int], block_size: int, extra: bytes = b"",
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of every *full* block of ``token_ids`` (a trailing partial block has none)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes
