"""The engine: one step = schedule → run → sample → postprocess.

``Engine`` owns a model runner, a scheduler and a sampler, and turns sampled tokens into
per-request updates (text deltas, finish reasons). It is synchronous and single-threaded;
services drive it from their own loop, ``generate`` drives it offline.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.config import EngineConfig, available_cpus
from common.engine.block_pool import BlockPool, KVEvent
from common.engine.constraints import Constraints
from common.engine.cpu_share import CpuShare
from common.engine.handoff import Handoff, KVLayout, build_handoff, live_seqs, rebuild_request
from common.engine.intake import PrefilledIntake
from common.engine.kv_cache_manager import KVCacheManager
from common.engine.prompt_logprobs import record as record_prompt_logprobs
from common.engine.request import FinishReason, Request, SeqStatus, Sequence, TokenLogprob
from common.engine.runner import ModelRunner
from common.engine.sampler import Sampler
from common.engine.scheduler import Scheduler
from common.engine.setup import LoadedModel, load_model, plan_cache
from common.engine.speculative import SpecStats, Speculator, verify
from common.errors import InvalidRequestError
from common.hashing import BlockHash
from common.model.tokenizer import Detokenizer
from common.rules import blocks_for_tokens, check_context, check_logit_bias, check_token_ids
from common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from common.shared_memory import SharedSegment

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SeqUpdate:
    """What one step did for one choice of a request."""

    request_id: str
    choice: int
    index: int  # position of token_ids[0] in the choice's output
    token_ids: list[int]  # new tokens
    text: str  # new text (empty without a tokenizer)
    logprobs: list[TokenLogprob]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0  # of the prompt, served from the prefix cache
    prompt_logprobs: list[TokenLogprob] | None = None  # choice 0's first update, when asked
    error: str | None = None  # the request failed (finish_reason ABORT): every choice ended


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What an engine reports to its service: load, cache and counters so far."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_usage: float  # fraction of blocks held by requests
    prefix_queries: int  # prompt tokens looked up in the prefix cache, ever
    prefix_hits: int  # of those, found
    num_preemptions: int
    num_draft_tokens: int = 0  # speculative tokens verified, ever
    num_accepted_tokens: int = 0  # of those, accepted
    num_computed_tokens: int = 0  # tokens whose KV the steps computed, ever
    cpu_wait_seconds: float = 0.0  # steps waited for a CPU other workers held, ever (--share-cpus)
    step_threads: int = 0  # threads the last step ran on

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


@dataclass(slots=True)
class Choice:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    choices: list[Choice]
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None  # when asked: prompt tokens 1.. scored


@dataclass(slots=True)
class _Tracked:
    request: Request
    streams: dict[int, Detokenizer] = field(default_factory=dict)
    texts: dict[int, list[str]] = field(default_factory=dict)


def _cpu_share(config: EngineConfig) -> CpuShare | None:
    if not config.share_cpus or not hasattr(os, "sched_getaffinity"):
        return None
    try:
        return CpuShare(sorted(os.sched_getaffinity(0)), torch.get_num_threads())
    except OSError as e:  # no writable board directory: every step on all our threads
        log.warning("--share-cpus is off: no CPU board (%s)", e)
        return None


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 detokenize: bool = True) -> None:
        """``detokenize=False`` leaves text and stop strings to the caller (the gateway)."""
        torch.set_num_threads(config.threads or available_cpus())
        self._cpu_share = _cpu_share(config)
        self.config = config
        self.detokenize = detokenize
        # The last step found nothing it could compute (its requests wait for blocks).
        self.stalled = False
        self.loaded = loaded or load_model(config.model)
        self.tokenizer = self.loaded.tokenizer
        self.spec = self.loaded.spec
        self.cache_plan = plan_cache(config, self.loaded)
        self.max_model_len = self.cache_plan.max_model_len
        pool = BlockPool(self.cache_plan.num_blocks, config.cache.enable_prefix_caching)
        self.pool = pool
        self.kv = KVCacheManager(pool, config.cache.block_size)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.runner = ModelRunner(self.loaded.model, self.kv, self.cache_plan.num_blocks,
                                  self.cache_plan.dtype, self.loaded.backend,
                                  config.cache.shared_memory)
        self.sampler = Sampler(self.eos_token_ids, config.seed)
        self.constraints = Constraints(self.tokenizer, self.spec.vocab_size, self.eos_token_ids)
        self.speculator = (Speculator(config.speculative, config.scheduler.max_num_batched_tokens,
                                      self.max_model_len) if config.speculative else None)
        self.intake = PrefilledIntake(self.kv, self.runner, self.scheduler)
        self._requests: dict[str, _Tracked] = {}
        self._handoffs_taken: set[str] = set()
        self._ids = itertools.count()
        log.info("%s", self.describe())

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = self.tokenizer.eos_token_ids if self.tokenizer else ()
        return tuple(dict.fromkeys(ids + self.spec.eos_token_ids))

    def describe(self) -> str:
        p = self.cache_plan
        return (f"model {self.loaded.name}: {self.spec.num_params() / 1e6:.1f}M params, "
                f"{self.loaded.dtype}, {self.runner.device}, attention {self.loaded.backend.name}, "
                f"C kernels: {', '.join(self.loaded.model.cpu_kernels) or 'none'}, "
                f"{torch.get_num_threads()} threads; KV cache {p.num_blocks} blocks x "
                f"{self.config.cache.block_size} tokens = {p.num_tokens} tokens "
                f"({p.nbytes / 2**30:.2f} GiB); max model len {self.max_model_len}")

    # ---- requests -------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, prefill_only: bool = False) -> str:
        """Queue a request. ``prefill_only``: stop after the first token and keep the KV
        for a handoff (see ``take_handoffs``)."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        max_tokens = self._check_prompt(prompt_token_ids, params)
        request = Request(request_id, list(prompt_token_ids), params, max_tokens,
                          prefill_only=prefill_only)
        self._requests[request_id] = _Tracked(request)
        self.scheduler.add(request.seqs[0])
        return request_id

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is, freeing its blocks (also ends a handoff)."""
        tracked = self._requests.pop(request_id, None)
        self._handoffs_taken.discard(request_id)
        if tracked is None:
            return self.intake.release(request_id)  # its KV was still arriving
        for seq in tracked.request.seqs:
            self.scheduler.finish(seq, FinishReason.ABORT)
        return True

    def take_handoffs(self) -> list[Handoff]:
        """Prefill-only requests whose every choice has its first token, each once."""
        ready = []
        for rid, tracked in self._requests.items():
            request = tracked.request
            if request.prefill_only and rid not in self._handoffs_taken and request.ready_for_handoff:
                self._handoffs_taken.add(rid)
                detached = next(s for s in request.seqs if s.status is SeqStatus.DETACHED)
                ready.append(build_handoff(request, self.kv.block_ids(detached)))
        return ready

    def prefilling_blocks(self) -> list[tuple[str, list[int]]]:
        """Prefill-only requests still computing their prompt, each with its full, computed
        prompt blocks so far (never the prompt's last block): what a KV stream may ship
        before the first token. A preempted request shows none until it is recomputed."""
        out = []
        for rid, tracked in self._requests.items():
            request = tracked.request
            seq = request.seqs[0]
            if request.prefill_only and seq.status is SeqStatus.RUNNING \
                    and seq.num_computed_tokens < seq.num_prompt_tokens:
                full = seq.num_computed_tokens // self.block_size
                out.append((rid, self.kv.block_ids(seq)[:full]))
        return out

    def lend_blocks(self, block_ids: list[int]) -> None:
        """Keep blocks from reuse while a transfer reads them, whatever becomes of their
        request (preempted, aborted, finished), until ``return_blocks``."""
        self.kv.lend(block_ids)

    def return_blocks(self, block_ids: list[int]) -> None:
        self.kv.give_back(block_ids)

    # ---- KV import (the decode side of a handoff): reserve → fill → commit -----------

    def add_prefilled(self, handoff: Handoff, payload: list[memoryview]) -> bool:
        """Take in a request prefilled elsewhere, its KV in one piece; False when the cache
        has no room yet. All or nothing: on any error (raised) the engine holds nothing
        of the request."""
        request = self._rebuild(handoff)
        if not live_seqs(request):
            self._requests[request.request_id] = _Tracked(request)
            return True
        need = blocks_for_tokens(len(handoff.prompt_token_ids), self.block_size)
        if len(payload) != need:
            raise InvalidRequestError(f"{len(payload)} KV blocks sent for a prompt of {need}")
        if not self.reserve_prefilled(handoff.request_id, len(handoff.prompt_token_ids)):
            return False
        self.intake.commit(handoff, request, 0, payload)
        self._requests[request.request_id] = _Tracked(request)
        return True

    def reserve_prefilled(self, request_id: str, num_prompt_tokens: int) -> bool:
        """Reserve every block of a prompt whose KV will arrive in pieces; False (nothing
        taken) while the cache has no room."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        return self.intake.reserve(request_id, num_prompt_tokens)

    def fill_prefilled(self, request_id: str, first_block: int, payload: list[memoryview]) -> None:
        """Copy one piece's blocks into the request's reservation."""
        self.intake.fill(request_id, first_block, payload)

    def commit_prefilled(self, handoff: Handoff, first_block: int, payload: list[memoryview]) -> None:
        """The final piece: the request joins the batch once every block is filled. On any
        error (raised) its reservation is released and the engine holds nothing of it."""
        try:
            request = self._rebuild(handoff)
        except BaseException:
            self.intake.release(handoff.request_id)
            raise
        self.intake.commit(handoff, request, first_block, payload)
        self._requests[request.request_id] = _Tracked(request)

    def _rebuild(self, handoff: Handoff) -> Request:
        if handoff.request_id in self._requests:
            raise InvalidRequestError(f"request id {handoff.request_id!r} is already in use")
        return rebuild_request(handoff, self._check_prompt(handoff.prompt_token_ids, handoff.params))

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def request_ids(self) -> list[str]:
        return list(self._requests)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def has_work(self) -> bool:
        """A step would compute something: a sequence is running or waiting. (Not one
        detached for a KV handoff, which only waits for its transfer to end.)"""
        return bool(self.scheduler.running or self.scheduler.waiting)

    def close(self) -> None:
        """Withdraw from the CPU board (a worker leaves by ``os._exit``, which runs no
        finalizer); the rest of the engine goes with the process."""
        if self._cpu_share is not None:
            self._cpu_share.close()
            self._cpu_share = None

    def rest(self) -> None:
        """Tell the workers sharing our CPUs that we compute nothing until the next step
        (``--share-cpus``; the worker's loop calls it whenever it goes idle)."""
        if self._cpu_share is not None:
            self._cpu_share.rest()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens the engine has computed so far (prompt and output): what a step did."""
        return self.scheduler.stats.computed_tokens

    def take_kv_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def cached_block_hashes(self) -> list[BlockHash]:
        return self.pool.cached_hashes()

    def stats(self) -> EngineStats:
        s = self.scheduler.stats
        spec = self.speculator.stats if self.speculator else SpecStats()
        share = self._cpu_share
        return EngineStats(self.num_running, self.num_waiting, self.pool.num_free_blocks,
                           self.pool.num_blocks, self.pool.usage, s.prefix_queries,
                           s.prefix_hits, self.scheduler.num_preemptions,
                           spec.num_draft_tokens, spec.num_accepted_tokens, s.computed_tokens,
                           share.waited_s if share is not None else 0.0, torch.get_num_threads())

    # ---- KV export (the prefill side of a handoff) -----------------------------------

    @property
    def kv_layout(self) -> KVLayout:
        return self.runner.layout

    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    @property
    def block_nbytes(self) -> int:
        return self.runner.block_nbytes

    @property
    def kv_segment(self) -> SharedSegment | None:
        """The shared-memory segment the KV cache lives in (``shared_memory`` config), or None."""
        return self.runner.kv_segment

    def export_blocks(self, block_ids: list[int]) -> list[memoryview]:
        """Views of a handoff's blocks; they stay valid until the request is aborted."""
        return self.runner.block_views(block_ids)

    # ---- the step -------------------------------------------------------------------

    def step(self) -> list[SeqUpdate]:
        drafts = self.speculator.propose(self.scheduler.running) if self.speculator else None
        out = self.scheduler.schedule(drafts)
        self.stalled = out.is_empty
        if out.is_empty:
            self.rest()
            return []
        if self._cpu_share is not None:
            # Only a prefill worker's step (prompts for a handoff alone) waits for a CPU.
            handoffs_only = all(chunk.seq.request.prefill_only for chunk in out.chunks)
            threads = self._cpu_share.threads(may_wait=handoffs_only)
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        result = self.runner.execute(out)
        record_prompt_logprobs(result.prompt_rows, self.runner.model.logits)
        self.scheduler.advance(out)
        plain_seqs, plain_rows, drafted = self._split(result)
        plain_logits = result.logits[plain_rows] if drafted else result.logits
        seqs, logits = self._expand_forks(plain_seqs, plain_logits)
        self.constraints.prepare(seqs, [(seq, draft) for seq, draft, _ in drafted])
        sampled = self.sampler(logits, seqs)
        now = time.monotonic()
        updates = [self._postprocess(seq, [token], [lp] if lp is not None else [], now)
                   for seq, token, lp in zip(seqs, sampled.token_ids, sampled.logprobs, strict=True)]
        for seq, draft, rows in drafted:
            verified = verify(self.sampler, seq, draft, result.logits[rows])
            self.speculator.observe(seq, len(draft), verified.num_accepted)
            updates.append(self._postprocess(seq, verified.token_ids, verified.logprobs, now))
            self.scheduler.settle_draft(seq, verified.num_accepted)
        self.constraints.clear()
        return self._fail_constrained(updates)

    def _fail_constrained(self, updates: list[SeqUpdate]) -> list[SeqUpdate]:
        """Requests whose structured-output matcher failed this step end, all choices,
        with the error instead of this step's tokens (which the mask forced to EOS)."""
        failed: dict[str, str] = {}
        for seq, reason in self.constraints.take_failures():
            failed.setdefault(seq.request.request_id, reason)
        if not failed:
            return updates
        for request_id, reason in failed.items():
            log.warning("request %s failed: %s", request_id, reason)
            for seq in self._requests[request_id].request.seqs:
                self.scheduler.finish(seq, FinishReason.ABORT)
        kept = [u for u in updates if u.request_id not in failed]
        return kept + [SeqUpdate(rid, 0, 0, [], "", [], FinishReason.ABORT, error=reason)
                       for rid, reason in failed.items()]

    def _split(self, result) -> tuple[list[Sequence], list[int], list[tuple[Sequence, tuple[int, ...], slice]]]:
        """Sequences sampling one row (and their rows) apart from those verifying a draft."""
        plain, plain_rows, drafted, row = [], [], [], 0
        for seq, draft in zip(result.seqs, result.drafts, strict=True):
            if draft:
                drafted.append((seq, draft, slice(row, row + 1 + len(draft))))
            else:
                plain.append(seq)
                plain_rows.append(row)
            row += 1 + len(draft)
        return plain, plain_rows, drafted

    def _expand_forks(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
        """A request with n > 1 forks when its prompt is done; all n choices sample its logits."""
        rows: list[int] = []
        expanded: list[Sequence] = []
        for i, seq in enumerate(seqs):
            rows.append(i)
            expanded.append(seq)
            request = seq.request
            if request.params.n > 1 and len(request.seqs) == 1:
                children = request.fork(seq)
                for child in children:
                    self.kv.fork(seq, child)
                self.scheduler.adopt_forks(seq, children)
                rows.extend([i] * len(children))
                expanded.extend(children)
        if len(rows) == len(seqs):
            return seqs, logits
        return expanded, logits[torch.tensor(rows)]

    def _postprocess(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob],
                     now: float) -> SeqUpdate:
        """Append the step's tokens (several after a verified draft) up to a stop."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        tracked = self._requests[seq.request.request_id]
        stream = self._stream(tracked, seq)
        kept, text, reason, stop = self._append_tokens(seq, stream, tokens)
        lps = logprobs[: len(kept)]
        seq.logprobs.extend(lps)
        if stream is not None:
            text += stream.finish().text if reason is not None else ""
            tracked.texts.setdefault(seq.choice, []).append(text)
        if reason is not None:
            seq.stop_reason = stop
            self.scheduler.finish(seq, reason)
        elif seq.request.prefill_only:
            self.scheduler.detach(seq)
        index = seq.num_output_tokens - len(kept)
        return SeqUpdate(seq.request.request_id, seq.choice, index, kept, text, lps, reason, stop,
                         seq.num_cached_tokens, _first_prompt_logprobs(seq, index))

    def _append_tokens(self, seq: Sequence, stream: Detokenizer | None, tokens: list[int]
                       ) -> tuple[list[int], str, FinishReason | None, str | int | None]:
        """The tokens kept (through the first that stops the sequence), their text, the stop."""
        kept: list[int] = []
        texts: list[str] = []
        reason, stop = None, None
        for token in tokens:
            seq.token_ids.append(token)
            kept.append(token)
            reason, stop = self._check_stop(seq, token)
            # The EOS or stop token that ends a sequence has no text (vLLM's rule), unless
            # include_stop_str_in_output.
            if stream is not None and (reason is not FinishReason.STOP
                                       or seq.params.include_stop_str_in_output):
                delta = stream.push(token)
                if delta.stop is not None and reason is None:
                    reason, stop = FinishReason.STOP, delta.stop
                texts.append(delta.text)
            if reason is not None:
                break
        return kept, "".join(texts), reason, stop

    def _check_stop(self, seq: Sequence, token: int) -> tuple[FinishReason | None, int | None]:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP, None
        if token in p.stop_token_ids:
            return FinishReason.STOP, token
        if seq.num_output_tokens >= seq.request.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def _stream(self, tracked: _Tracked, seq: Sequence) -> Detokenizer | None:
        if self.tokenizer is None or not self.detokenize:
            return None
        stream = tracked.streams.get(seq.choice)
        if stream is None:
            p = seq.params
            stream = Detokenizer(self.tokenizer, seq.request.prompt_token_ids, p.stop,
                                 p.skip_special_tokens, p.include_stop_str_in_output)
            tracked.streams[seq.choice] = stream
        return stream

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> int:
        """The request's max_tokens, resolved against the context (raises on bad input)."""
        check_token_ids(ids, self.spec.vocab_size)
        check_logit_bias(params.logit_bias, self.spec.vocab_size)
        self.constraints.check(params, len(ids))
        return check_context(len(ids), params.max_tokens, self.max_model_len)

    # ---- results --------------------------------------------------------------------

    def finished_output(self, request_id: str) -> RequestOutput | None:
        """The final result of a finished request (and forget it), else None."""
        tracked = self._requests.get(request_id)
        if tracked is None or not tracked.request.is_finished:
            return None
        del self._requests[request_id]
        request = tracked.request
        choices = [
            Choice(seq.choice, "".join(tracked.texts.get(seq.choice, [])), seq.output_token_ids,
                   seq.finish_reason.value if seq.finish_reason else None, seq.stop_reason,
                   seq.logprobs if request.params.logprobs is not None else None)
            for seq in request.seqs
        ]
        first = request.seqs[0]
        prompt_lps = first.prompt_logprobs if request.params.prompt_logprobs is not None else None
        return RequestOutput(request_id, request.prompt_token_ids, choices, first.num_cached_tokens,
                             prompt_lps)

    def generate(self, prompts: Iterable[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion (offline use); results in input order."""
        prompts = list(prompts)
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, all_params, strict=True)]
        results: dict[str, RequestOutput] = {}
        while len(results) < len(ids):
            for update in self.step():
                if update.error is not None:
                    raise InvalidRequestError(update.error)
                if update.finish_reason is not None:
                    done = self.finished_output(update.request_id)
                    if done is not None:
                        results[update.request_id] = done
        return [results[i] for i in ids]


def _first_prompt_logprobs(seq: Sequence, index: int) -> list[TokenLogprob] | None:
    """A request's prompt logprobs travel once: with its choice 0's first tokens."""
    if seq.params.prompt_logprobs is None or seq.choice != 0 or index != 0:
        return None
    return list(seq.prompt_logprobs)
