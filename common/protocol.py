"""Every message that crosses a socket between Tandem processes.

A message is a frozen dataclass registered under a tag with a version. On the wire it is
the msgpack array ``[tag, version, field values in declaration order]``; tensors never go
inside it — KV blocks travel as separate raw frames after the header (see
``common/connector``). ``decode`` bounds the size, rejects unknown tags and versions, and
checks every field's type, so a malformed peer gets a ``ProtocolError``, never a crash
somewhere downstream. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgpack

from common.sampling_params import SamplingParams

MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # a header; a 100k-token prompt is ~500 KB


class ProtocolError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Message:
    TAG: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1


_REGISTRY: dict[str, type[Message]] = {}
M = TypeVar("M", bound=type[Message])


def message(tag: str, version: int = 1):
    """Register a message class under ``tag``."""

    def register(cls: M) -> M:
        if tag in _REGISTRY:
            raise ValueError(f"duplicate message tag {tag!r}")
        cls.TAG, cls.VERSION = tag, version
        _REGISTRY[tag] = cls
        return cls

    return register


# ---- gateway <-> router ---------------------------------------------------------------

@message("submit")
@dataclass(frozen=True, slots=True)
class Submit(Message):
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams fields; see params_to_wire
    reply_to: str  # the gateway's token-stream address
    arrival_time: float  # wall clock at the gateway, for queue-time metrics


@message("admitted")
@dataclass(frozen=True, slots=True)
class Admitted(Message):
    request_id: str


@message("rejected")
@dataclass(frozen=True, slots=True)
class Rejected(Message):
    request_id: str
    status: int  # the HTTP status the gateway should answer with (429, 503, 400)
    reason: str
    retry_after: float | None = None


@message("abort")
@dataclass(frozen=True, slots=True)
class Abort(Message):
    request_id: str
    reason: str = "client"


@message("ping")
@dataclass(frozen=True, slots=True)
class Ping(Message):
    nonce: int


@message("status")
@dataclass(frozen=True, slots=True)
class Status(Message):
    """The router's answer to a ping: what it can serve right now."""

    nonce: int
    prefill_workers: int  # prefill-capable (prefill + colocated)
    decode_workers: int  # decode-capable (decode + colocated)
    queue_length: int
    max_model_len: int  # the smallest limit among live workers (0 = none)


# ---- router -> workers ----------------------------------------------------------------

@message("task")
@dataclass(frozen=True, slots=True)
class Task(Message):
    """Run a request: prefill only (``handoff_addr`` set) or to completion (colocated)."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    reply_to: str
    handoff_worker: str | None = None  # decode worker id
    handoff_addr: str | None = None  # its KV receiver address


@message("reregister")
@dataclass(frozen=True, slots=True)
class Reregister(Message):
    """The router does not know this worker (it was declared dead): register anew."""

    worker_id: str


# ---- workers -> gateway ---------------------------------------------------------------

@message("tokens")
@dataclass(frozen=True, slots=True)
class Tokens(Message):
    request_id: str
    choice: int
    index: int  # position of token_ids[0] in the choice's output, for reordering
    token_ids: list[int]
    logprobs: list[list[Any]] | None = None  # per token: [logprob, [[id, logprob], ...]]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None  # set when the request failed on the server side


# ---- workers -> router ----------------------------------------------------------------

@message("register")
@dataclass(frozen=True, slots=True)
class Register(Message):
    worker_id: str
    role: str  # prefill | decode | colocated
    kv_addr: str | None  # decode/colocated workers: where KV handoffs arrive
    metrics_url: str
    num_blocks: int
    block_size: int
    max_model_len: int
    model: str


@message("heartbeat")
@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    worker_id: str
    num_running: int
    num_waiting: int
    free_blocks: int
    total_blocks: int


@message("kv_events")
@dataclass(frozen=True, slots=True)
class KVEvents(Message):
    worker_id: str
    stored: list[bytes] = field(default_factory=list)
    evicted: list[bytes] = field(default_factory=list)
    cleared: bool = False  # the worker forgot its whole cache (e.g. restarted)


@message("finished")
@dataclass(frozen=True, slots=True)
class Finished(Message):
    """A worker is done with a request: ``stage`` is prefill (KV handed off) or request."""

    request_id: str
    worker_id: str
    stage: str
    error: str | None = None


# ---- prefill -> decode (KV connector control) -----------------------------------------

@message("kv_handoff")
@dataclass(frozen=True, slots=True)
class KVHandoff(Message):
    """Header of a KV transfer; ``num_blocks`` raw frames of ``block_nbytes`` follow."""

    transfer_id: str
    request_id: str
    prompt_token_ids: list[int]
    first_tokens: list[int]  # one per choice, sampled by the prefill worker
    first_logprobs: list[list[Any] | None]
    generator_states: list[bytes | None]  # seeded choices continue their random stream
    params: dict[str, Any]
    reply_to: str
    num_cached_tokens: int
    num_blocks: int
    block_nbytes: int
    layout: list[int]  # [num_layers, block_size, kv_heads, head_dim, element_size]


@message("kv_ack")
@dataclass(frozen=True, slots=True)
class KVAck(Message):
    transfer_id: str
    ok: bool
    reason: str = ""


# ---- encoding -------------------------------------------------------------------------

def encode(msg: Message) -> bytes:
    values = [getattr(msg, f.name) for f in dataclasses.fields(msg)]
    return msgpack.packb([msg.TAG, msg.VERSION, values], use_bin_type=True)


def decode(data: bytes | memoryview) -> Message:
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        tag, version, values = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise ProtocolError(f"undecodable message: {e}") from e
    cls = _REGISTRY.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message tag {tag!r}")
    if type(version) is not int or version != cls.VERSION:
        raise ProtocolError(f"{tag} version {version} is not the supported {cls.VERSION}")
    schema = _schema(cls)
    if not isinstance(values, list) or len(values) != len(schema):
        raise ProtocolError(f"{tag} needs {len(schema)} fields")
    for (name, hint), v in zip(schema, values, strict=True):
        if not _type_ok(v, hint):
            raise ProtocolError(f"{tag}.{name} has the wrong type ({type(v).__name__})")
    return cls(*values)


@functools.cache
def _schema(cls: type[Message]) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


def params_from_wire(raw: dict[str, Any]) -> SamplingParams:
    """Rebuild sampling params sent by a peer, checking types and ranges again (the same
    parser as client input: never trust the wire)."""
    try:
        params = SamplingParams.from_dict(raw)
        if "max_tokens" in raw and raw["max_tokens"] is None:  # None here means "no limit"
            params = dataclasses.replace(params, max_tokens=None)
        return params
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"bad sampling params: {e}") from e
