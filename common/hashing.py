"""The prefix-block hash chain, shared by the router and every worker.

A full block of ``block_size`` tokens is named by ``H(parent hash, its token ids, extra
keys)``, so equal hashes mean equal prefixes up to and including that block. The hash is
a keyed BLAKE2b digest over a fixed byte encoding: stable across processes, machines and
Python versions (never Python's salted ``hash()``).
"""

from __future__ import annotations

import array
import functools
import hashlib
import struct
import sys
from collections.abc import Sequence

HASH_BYTES = 16
BlockHash = bytes  # HASH_BYTES long

_ROOT = b"tandem-prefix-v1"


_NO_PARENT = b"\0" * HASH_BYTES
_U32 = next(code for code in "IL" if array.array(code).itemsize == 4)  # a token id's typecode
_KEYED = hashlib.blake2b(digest_size=HASH_BYTES, key=_ROOT)  # copied per block: keying costs a round


@functools.lru_cache(maxsize=64)
def _packer(num_tokens: int) -> struct.Struct:
    return struct.Struct(f"<{num_tokens}I")


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash one full block given the hash of the block before it (None for the first)."""
    return _digest(parent, _packer(len(token_ids)).pack(*token_ids), extra)


def _digest(parent: BlockHash | None, block: bytes | memoryview, extra: bytes) -> BlockHash:
    """One block's hash from its packed token ids (little-endian uint32, as ``_packer``)."""
    h = _KEYED.copy()
    h.update(parent or _NO_PARENT)
    h.update(block)
    h.update(extra)
    return h.digest()


def hash_prefix_blocks(
    token_ids: Sequence[int], block_size: int, extra: bytes = b"",
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of every *full* block of ``token_ids`` (a trailing partial block has none)."""
    full = len(token_ids) // block_size * block_size
    if not full:
        return []
    # The whole prompt packed once, as ``hash_block`` packs each block: a block's bytes
    # are then a slice (a prompt's hashes cost half as much as block by block).
    packed = array.array(_U32, token_ids[:full])
    if sys.byteorder != "little":
        packed.byteswap()
    data = memoryview(packed).cast("B")
    step = block_size * 4
    hashes: list[BlockHash] = []
    for start in range(0, full * 4, step):
        parent = _digest(parent, data[start : start + step], extra)
        hashes.append(parent)
    return hashes
