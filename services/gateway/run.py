"""One admitted request, from its first token to its last, its failure, or its abort.

``RequestRun`` reads the request's token channel, feeds the ``ResponseAssembler``, and
answers as one JSON body (``collect``) or as server-sent events (``sse``). When the worker
serving it dies it continues the request elsewhere (``services.gateway.resume``); when the
client leaves (``ClientWatch``) or a stop string ends it, the workers are told at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from common.metrics import RequestPhases
from common.protocol import Rejected, Tokens
from services.gateway import responses
from services.gateway.assembler import ChoiceDelta, ResponseAssembler
from services.gateway.disconnect import ClientGone, ClientWatch
from services.gateway.errors import APIError
from services.gateway.parsing import ParsedRequest
from services.gateway.prompt_logprobs import PromptLogprobs, prompt_logprobs_for
from services.gateway.resume import MOVE_ADMISSION_S, Attempt, continuations
from services.gateway.router_link import RouterUnavailable
from services.gateway.timeline import RequestTrace

if TYPE_CHECKING:
    from fastapi import Request

    from services.gateway.app import Gateway

log = logging.getLogger("tandem.gateway")
# A full response body from the request, its finished choices and its usage.
BuildBody = Callable[[ParsedRequest, Sequence[responses.ChoiceResult], dict], dict]


class StreamFormat(Protocol):
    """How one stream's server-sent events are written (chat and completions chunks, or
    the Responses API's events). Each method returns the events to send, in order."""

    def start(self) -> Iterable[bytes]: ...  # before the first token

    def delta(self, d: ChoiceDelta) -> Iterable[bytes]: ...

    def end(self, usage: dict[str, Any]) -> Iterable[bytes]: ...  # after the last token

    def error(self, e: APIError) -> Iterable[bytes]: ...  # the request failed mid-stream


class ChunkStream:
    """Chat and completions streams: a chunk per delta, usage if asked, then [DONE]."""

    def __init__(self, parsed: ParsedRequest,
                 prompt: Callable[[], PromptLogprobs | None] = lambda: None) -> None:
        """``prompt``: the prompt's logprobs once they arrived (completions' first chunks)."""
        self.parsed, self.fmt = parsed, responses.ChunkFormatter(parsed)
        self._prompt = prompt

    def start(self) -> Iterable[bytes]:
        return ()

    def delta(self, d: ChoiceDelta) -> Iterable[bytes]:
        lps = d.tokens if self.parsed.logprobs_mode else None
        chunk = self.fmt.chunk(d.index, d.text, lps, d.finish_reason, self._prompt())
        return () if chunk is None else (responses.sse(chunk),)  # None: tool-call markup held

    def end(self, usage: dict[str, Any]) -> Iterable[bytes]:
        chunk = self.fmt.usage_chunk(usage)
        return (responses.SSE_DONE,) if chunk is None else (responses.sse(chunk), responses.SSE_DONE)

    def error(self, e: APIError) -> Iterable[bytes]:
        return (responses.sse(e.body()), responses.SSE_DONE)


class RequestRun:
    """One admitted request until its last token, its failure, or its abort. The watch
    aborts it the moment its client leaves; ``collect`` / ``sse`` close the watch when
    they end."""

    def __init__(self, gw: Gateway, parsed: ParsedRequest, assembler: ResponseAssembler,
                 channel: asyncio.Queue[Tokens], watch: ClientWatch,
                 trace: RequestTrace | None = None) -> None:
        self.gw, self.parsed, self.assembler, self.channel = gw, parsed, assembler, channel
        self.trace = trace  # its row in the gateway's timeline (/dashboard)
        # The live tries by request id: the original, or the continuations of its choices.
        self.attempts: dict[str, Attempt] = {parsed.request_id: Attempt(parsed.request_id)}
        self.watch = watch
        watch.on_gone = self._abort
        self.ended = False  # finished or aborted: the abort is sent at most once
        # TTFT and e2e count from the Submit, the router's queue included (as vLLM's count
        # from arrival); the prefill time from admission.
        self.admitted = time.monotonic()
        self.start = trace.submitted if trace is not None else self.admitted
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.ended_here = False  # a choice was cut by a stop string: workers must be told
        self.finish_reason: str | None = None  # the first choice's, for the metrics
        self._prompt: PromptLogprobs | None = None

    async def deltas(self, request: Request) -> AsyncIterator[ChoiceDelta]:
        timeout = self.gw.settings.request_timeout
        while not self.assembler.finished:
            msg = await self._next(request, timeout)
            attempt = self.attempts.get(msg.request_id)
            if attempt is None:
                continue  # a late message of a try that was moved on
            if msg.error:
                why_not = await self._move(attempt) if msg.retryable else "it cannot be retried"
                if why_not is None:
                    continue  # the rest comes from other workers
                raise APIError.unavailable(f"{msg.error} ({why_not})")
            if self.trace is not None and msg.token_ids:
                self.trace.saw_tokens(msg.worker_id, len(msg.token_ids), time.monotonic())
            if attempt.choice is not None:  # a continuation: put its tokens back in place
                msg = dataclasses.replace(msg, choice=attempt.choice,
                                          index=msg.index + attempt.offset)
            for delta in self.assembler.feed(msg):
                self._observe(delta, msg)
                yield delta

    async def _move(self, failed: Attempt) -> str | None:
        """Continue a failed try's choices on other workers; None when every continuation
        was placed, else why not (the caller fails the request, which aborts the rest)."""
        nxt = continuations(self.parsed, failed, self.assembler.delivered,
                            self.assembler.unfinished())
        if isinstance(nxt, str):
            return nxt
        del self.attempts[failed.request_id]
        self.gw.link.release(failed.request_id)
        self.assembler.forget_held([c.attempt.choice for c in nxt])
        for cont in nxt:
            try:
                admission = await self.gw.link.submit(
                    cont.attempt.request_id, cont.prompt_token_ids, cont.params,
                    min(self.gw.settings.admission_timeout, MOVE_ADMISSION_S), self.channel)
            except RouterUnavailable as e:
                return f"no worker could take it over: {e}"
            if isinstance(admission.verdict, Rejected):
                return f"no worker could take it over: {admission.verdict.reason}"
            self.attempts[cont.attempt.request_id] = cont.attempt
            if self.ended:  # the client left while the move was being placed
                await self._abort_tries([cont.attempt.request_id])
        log.info("%s moved to other workers (%s)", self.parsed.request_id,
                 ", ".join(f"choice {c.attempt.choice} after {c.attempt.offset} tokens" for c in nxt))
        self.gw.migrations.inc()
        return None

    async def _next(self, request: Request, timeout: float) -> Tokens:
        """The next message, raced against the client leaving (``ClientGone``)."""
        if self.watch.gone:
            raise ClientGone()
        if not self.channel.empty():  # the common case while generating: no task to race
            return self.channel.get_nowait()
        try:
            return await self.watch.race(self.channel.get(), timeout)
        except TimeoutError:
            raise APIError.unavailable(f"no output for {timeout:g} s") from None

    def _observe(self, delta: ChoiceDelta, msg: Tokens) -> None:
        now = time.monotonic()
        m = self.gw.metrics
        if delta.tokens and self.first_token is None:
            self.first_token = now
            m.ttft.observe(now - self.start)
        elif delta.tokens and delta.index == 0 and self.last_token is not None:
            m.itl.observe(now - self.last_token)
        if delta.tokens and delta.index == 0:
            self.last_token = now
        if delta.finish_reason is not None and msg.finish_reason is None:
            self.ended_here = True
        if delta.finish_reason is not None and delta.index == 0:
            self.finish_reason = delta.finish_reason

    async def collect(self, request: Request, build: BuildBody | None = None) -> dict:
        """The whole answer as one body: ``build`` (chat or completion by default)."""
        texts = {i: [] for i in range(self.parsed.params.n)}
        logprobs = {i: [] for i in range(self.parsed.params.n)}
        reasons: dict[int, str | None] = {}
        try:
            async for d in self.deltas(request):
                texts[d.index].append(d.text)
                logprobs[d.index].extend(d.tokens)
                reasons[d.index] = d.finish_reason
        except ClientGone:
            await self._abort()
            return {}
        except BaseException:
            await self._abort()
            raise
        finally:
            self.watch.close()
        await self._finish()
        choices = [responses.ChoiceResult(i, "".join(texts[i]), reasons.get(i),
                                    logprobs[i] if self.parsed.logprobs_mode else None)
                   for i in range(self.parsed.params.n)]
        if build is None:
            chat = self.parsed.kind == "chat"
            build = responses.chat_completion if chat else self._text_completion
        return build(self.parsed, choices, self._usage())

    def _text_completion(self, parsed: ParsedRequest, choices: Sequence[responses.ChoiceResult],
                         usage: dict) -> dict:
        return responses.text_completion(parsed, choices, usage, self._prompt_logprobs())

    async def sse(self, request: Request, fmt: StreamFormat | None = None) -> AsyncIterator[bytes]:
        """The answer as server-sent events, written by ``fmt`` (chunks by default)."""
        fmt = fmt or ChunkStream(self.parsed, self._prompt_logprobs)
        try:
            for event in fmt.start():
                yield event
            async for d in self.deltas(request):
                for event in fmt.delta(d):
                    yield event
            for event in fmt.end(self._usage()):
                yield event
            await self._finish()
        except APIError as e:
            await self._abort()
            for event in fmt.error(e):
                yield event
        except ClientGone:  # nobody to tell: end the stream quietly
            await self._abort()
        except BaseException:  # cancelled by the server, or a bug: abort and let it rise
            await self._abort()
            raise
        finally:
            self.watch.close()

    def _prompt_logprobs(self) -> PromptLogprobs | None:
        """Formatted once, when the records arrive (with choice 0's first tokens)."""
        if self._prompt is None and self.assembler.prompt_logprobs is not None:
            self._prompt = prompt_logprobs_for(self.parsed, self.assembler.prompt_logprobs,
                                               self.gw.tokenizer.token_text)
        return self._prompt

    def _usage(self) -> dict:
        a = self.assembler
        return responses.usage(a.num_prompt_tokens, a.num_completion_tokens, a.num_cached_tokens)

    async def _finish(self) -> None:
        if self.ended:
            return
        self.ended = True
        m, now = self.gw.metrics, time.monotonic()
        m.e2e.observe(now - self.start)
        m.prompt_tokens.inc(self.assembler.num_prompt_tokens)
        m.generation_tokens.inc(self.assembler.num_completion_tokens)
        reason = "stop" if self.ended_here else self.finish_reason or "stop"
        m.success.labels(reason).inc()
        m.observe_request(RequestPhases(self.admitted, self.first_token, now,
                                        self.assembler.num_prompt_tokens,
                                        self.assembler.num_completion_tokens))
        if self.trace is not None:
            self.gw.timeline.end(self.trace, reason)
        if self.ended_here:
            await self._abort_tries(list(self.attempts), "stop string")
        else:
            for request_id in self.attempts:
                self.gw.link.release(request_id)

    async def _abort(self) -> None:
        if self.ended:
            return
        self.ended = True
        self.gw.metrics.success.labels("abort").inc()
        if self.trace is not None:
            self.gw.timeline.end(self.trace, "abort")
        await self._abort_tries(list(self.attempts))

    async def _abort_tries(self, request_ids: list[str], reason: str = "client") -> None:
        for request_id in request_ids:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.gw.link.abort(request_id, reason))

