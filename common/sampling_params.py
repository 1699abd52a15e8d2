"""What a client may ask of one generation, validated once at the edge.

``SamplingParams.from_dict`` is the single parser used by ``tandem generate`` and the
gateway: it rejects unknown value types and out-of-range values with a ``ValueError``
that names the field, so every entry point reports bad input the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from common.errors import InvalidRequestError
from common.structured import StructuredOutput

MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 1024  # entries: every message carrying the params carries them all


class SamplingError(InvalidRequestError):
    """A sampling field has a bad value; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}", param=param)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int | None = 16  # None = up to the context limit
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None = no logprobs; k = the chosen token plus k alternatives
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    prompt_logprobs: int | None = None  # None = none; k = each prompt token plus k alternatives
    priority: int = 0  # vLLM's semantics: lower is served earlier
    structured: StructuredOutput | None = None  # a constraint on the output (common.structured)

    def __post_init__(self) -> None:
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(self.top_k >= -1, "top_k", "must be -1, 0 (disabled) or a positive integer")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
               "logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               "min_tokens", "must not exceed max_tokens")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} strings")
        _check(all(s for s in self.stop), "stop", "stop strings must be non-empty")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0")
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias",
               f"allows at most {MAX_LOGIT_BIAS} entries")
        _check(all(t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias),
               "logit_bias", "token ids must be >= 0 and biases in [-100, 100]")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
               "prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        _check(-2**31 <= self.priority < 2**31, "priority", "must fit in 32 bits")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_top_k(self) -> int:
        """1 for greedy, 0 when top-k is off."""
        return 1 if self.greedy else max(self.top_k, 0)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SamplingParams:
        """Parse the sampling fields of a JSON request; unknown keys are left alone."""
        known = {f.name for f in fields(cls)} - {"structured"}  # built by the gateway
        values: dict[str, Any] = {}
        for name in known & raw.keys():
            if raw[name] is not None:
                values[name] = _coerce(name, raw[name])
        top = raw.get("top_logprobs")
        if top is not None:
            # The chat API's spelling: logprobs=true plus top_logprobs=k.
            if values.get("logprobs") is None:
                raise SamplingError("top_logprobs", "requires logprobs to be true")
            values["logprobs"] = _as_int("top_logprobs", top)
        return cls(**values)


_INT_FIELDS = {"max_tokens", "top_k", "seed", "n", "min_tokens", "priority"}
_FLOAT_FIELDS = {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"}
_BOOL_FIELDS = {"ignore_eos", "skip_special_tokens", "include_stop_str_in_output"}


def _coerce(name: str, value: Any) -> Any:
    if name in _INT_FIELDS:
        return _as_int(name, value)
    if name in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise SamplingError(name, f"must be a number, got {value!r}")
        return float(value)
    if name in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise SamplingError(name, f"must be true or false, got {value!r}")
        return value
    if name == "prompt_logprobs":
        return _as_int(name, value)
    if name == "logit_bias":
        return _logit_bias(value)
    if name == "logprobs":
        # OpenAI completions send an int; chat sends a bool plus top_logprobs.
        return 0 if value is True else None if value is False else _as_int(name, value)
    if name == "stop":
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not all(isinstance(s, str) for s in items):
            raise SamplingError(name, "must be a string or a list of strings")
        return tuple(items)
    if name == "stop_token_ids":
        if not isinstance(value, list | tuple):
            raise SamplingError(name, "must be a list of token ids")
        return tuple(_as_int(name, t) for t in value)
    raise AssertionError(name)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` (keys are strings in JSON) as sorted pairs."""
    if not isinstance(value, Mapping):
        raise SamplingError("logit_bias", "must be an object of token id to bias")
    pairs = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise SamplingError("logit_bias", f"key {key!r} is not a token id") from None
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
            raise SamplingError("logit_bias", f"bias for {token} must be a number")
        pairs.append((token, float(bias)))
    return tuple(sorted(pairs))


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingError(name, f"must be an integer, got {value!r}")
    return value


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingError(param, message)
