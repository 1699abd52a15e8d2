"""Taking in requests prefilled by another engine: reserve → fill → commit.

A request's KV may arrive whole (one transfer) or as a stream of pieces (a long prompt
shipped chunk by chunk while it was computed). Either way the engine admits it whole or
not at all:

- ``reserve`` takes every block the prompt needs at once (or nothing, when too few are
  free), so a request never holds part of its room;
- ``fill`` copies a piece's blocks into their reserved places, each block exactly once;
- ``commit`` copies the final blocks, checks that every block is filled, and only then
  rebuilds the request and joins its sequences to the running batch;
- ``release`` gives the reservation back (an abort, a failed stream, a failed commit).

The blocks themselves belong to the ``KVCacheManager`` (and its ``BlockPool``) throughout:
this object only remembers which reserved block has been filled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from common.engine.handoff import Handoff, live_seqs
from common.engine.kv_cache_manager import KVCacheManager
from common.engine.request import Request
from common.engine.runner import ModelRunner
from common.engine.scheduler import Scheduler
from common.errors import InvalidRequestError
from common.rules import blocks_for_tokens


@dataclass(slots=True)
class Reservation:
    block_ids: list[int]
    filled: list[bool]

    @property
    def complete(self) -> bool:
        return all(self.filled)


class PrefilledIntake:
    def __init__(self, kv: KVCacheManager, runner: ModelRunner, scheduler: Scheduler) -> None:
        self._kv = kv
        self._runner = runner
        self._scheduler = scheduler
        self._reserved: dict[str, Reservation] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reserved

    def request_ids(self) -> list[str]:
        return list(self._reserved)

    def reserve(self, request_id: str, num_prompt_tokens: int) -> bool:
        """Room for the whole prompt's KV, or False (nothing taken) while the cache is full."""
        if request_id in self._reserved:
            raise InvalidRequestError(f"request id {request_id!r} already has KV arriving")
        need = blocks_for_tokens(num_prompt_tokens, self._kv.block_size)
        if need > self._kv.pool.num_blocks:
            raise InvalidRequestError(f"the prompt needs {need} KV blocks; this worker's cache "
                                      f"has {self._kv.pool.num_blocks}")
        block_ids = self._kv.reserve(request_id, need)
        if block_ids is None:
            return False
        self._reserved[request_id] = Reservation(block_ids, [False] * need)
        return True

    def fill(self, request_id: str, first_block: int, payload: list[memoryview]) -> None:
        """Copy ``payload`` into reserved blocks ``first_block ..``; each block once."""
        r = self._reservation(request_id)
        end = first_block + len(payload)
        if first_block < 0 or end > len(r.block_ids):
            raise InvalidRequestError(f"KV blocks {first_block}..{end - 1} are outside the "
                                      f"prompt's {len(r.block_ids)}")
        if any(r.filled[first_block:end]):
            raise InvalidRequestError(f"KV blocks {first_block}..{end - 1} arrived twice")
        self._runner.write_blocks(r.block_ids[first_block:end], payload)
        r.filled[first_block:end] = [True] * len(payload)

    def commit(self, handoff: Handoff, request: Request, first_block: int,
               payload: list[memoryview]) -> None:
        """The final blocks: fill them, then the request joins the running batch. On any
        error (raised) the reservation is released: nothing of the request stays."""
        try:
            self.fill(handoff.request_id, first_block, payload)
            if not self._reserved[handoff.request_id].complete:
                missing = self._reserved[handoff.request_id].filled.count(False)
                raise InvalidRequestError(f"{missing} KV blocks never arrived")
        except BaseException:
            self.release(handoff.request_id)
            raise
        self._reserved.pop(handoff.request_id)
        self._join(request, len(handoff.prompt_token_ids))

    def release(self, request_id: str) -> bool:
        """Give the reservation back; False when there is none."""
        self._reserved.pop(request_id, None)
        return self._kv.release(request_id)

    def _join(self, request: Request, num_prompt: int) -> None:
        live = live_seqs(request)
        if not live:  # every choice ended at its first token: nothing to decode
            self._kv.release(request.request_id)
            return
        parent = live[0]
        self._kv.adopt(request.request_id, parent)
        parent.num_computed_tokens = num_prompt
        self._kv.cache_computed_blocks(parent)
        for child in live[1:]:
            self._kv.fork(parent, child)
        now = time.monotonic()
        for seq in live:
            seq.first_token_time = now
        self._scheduler.add_running(live)

    def _reservation(self, request_id: str) -> Reservation:
        r = self._reserved.get(request_id)
        if r is None:
            raise InvalidRequestError(f"no KV blocks are reserved for request {request_id!r}")
        return r

