"""Assembling workers' token messages into what a client sees, one choice at a time.

Tokens of one choice can come from two workers (the first from the prefill worker, the
rest from the decode worker) over different connections, so they are put back in order
by their index first. Then each choice is detokenized incrementally, stop strings are
applied (the text is cut, and the choice ends even if workers keep going), and the
result comes out as ``ChoiceDelta``s ready to format.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.model.tokenizer import Detokenizer, Tokenizer
from common.outputs import TokenLogprob
from common.protocol import Tokens
from common.sampling_params import SamplingParams
from services.gateway.responses import LogprobEntry


@dataclass(slots=True)
class ChoiceDelta:
    index: int
    text: str
    tokens: list[LogprobEntry]  # logprob 0.0 and no alternatives unless they were asked for
    finish_reason: str | None


@dataclass(slots=True)
class _Choice:
    text_stream: Detokenizer
    next_index: int = 0
    held: dict[int, tuple[int, TokenLogprob | None, str | None]] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)  # put out so far
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class ResponseAssembler:
    """One request's choices, put back in order, detokenized, and cut at stop strings."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self._tok = tokenizer
        self.params = params
        self.num_prompt_tokens = len(prompt_ids)
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[TokenLogprob] | None = None  # with choice 0's first tokens
        self._choices = [_Choice(Detokenizer(tokenizer, prompt_ids, params.stop, params.skip_special_tokens,
                                             params.include_stop_str_in_output))
                         for _ in range(params.n)]

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self._choices)

    @property
    def num_completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self._choices)

    def delivered(self, choice: int) -> list[int]:
        """The choice's output tokens put out so far, in order (what a new worker continues)."""
        return list(self._choices[choice].token_ids)

    def unfinished(self) -> list[int]:
        return [i for i, c in enumerate(self._choices) if c.finish_reason is None]

    def forget_held(self, choices: list[int]) -> None:
        """Drop tokens waiting for a gap to fill: their worker is gone and the gap never will."""
        for i in choices:
            self._choices[i].held.clear()

    def feed(self, msg: Tokens) -> list[ChoiceDelta]:
        """Accept one message; returns the deltas it completes (possibly none)."""
        if not 0 <= msg.choice < len(self._choices):
            return []
        # A continuation's prompt is longer than the client's: never count beyond the latter.
        self.num_cached_tokens = min(max(self.num_cached_tokens, msg.num_cached_tokens),
                                     self.num_prompt_tokens)
        if msg.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = msg.prompt_logprobs
        choice = self._choices[msg.choice]
        if choice.finish_reason is not None:
            return []  # ended by a stop string; the workers have not heard yet
        for i, token in enumerate(msg.token_ids):
            last = i == len(msg.token_ids) - 1
            lp = msg.logprobs[i] if msg.logprobs else None
            reason = msg.finish_reason.value if last and msg.finish_reason else None
            choice.held[msg.index + i] = (token, lp, reason)
        if not msg.token_ids and msg.finish_reason:  # a bare finish
            choice.held[msg.index] = (-1, None, msg.finish_reason.value)
        delta = self._advance(msg.choice, choice)
        return [delta] if delta is not None else []

    def _advance(self, index: int, choice: _Choice) -> ChoiceDelta | None:
        text, tokens = [], []
        while choice.finish_reason is None and choice.next_index in choice.held:
            token, lp, reason = choice.held.pop(choice.next_index)
            choice.next_index += 1
            if token >= 0:
                choice.token_ids.append(token)
                tokens.append(self._token_info(token, lp))
                if not self._ends_unshown(token, reason):
                    delta = choice.text_stream.push(token)
                    text.append(delta.text)
                    if delta.stop is not None:
                        reason = "stop"
            if reason is not None:
                text.append(choice.text_stream.finish().text)
                choice.finish_reason = reason
        if not tokens and choice.finish_reason is None:
            return None
        return ChoiceDelta(index, "".join(text), tokens, choice.finish_reason)

    def _ends_unshown(self, token: int, reason: str | None) -> bool:
        """The EOS or stop token that ended a choice has no text (vLLM's rule), unless
        include_stop_str_in_output."""
        return (reason == "stop" and not self.params.include_stop_str_in_output
                and (token in self._tok.eos_token_ids or token in self.params.stop_token_ids))

    def _token_info(self, token: int, lp: TokenLogprob | None) -> LogprobEntry:
        return LogprobEntry.from_engine(lp or TokenLogprob(token, 0.0), self._tok.token_text)
