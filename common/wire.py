"""The wire codec under every Tandem message: a registry of message classes by tag and
version, and the conversion between typed records and msgpack.

A message is a frozen dataclass registered with ``@message(tag, version)``. On the wire
it is the msgpack array ``[tag, version, field values in declaration order]``. Fields
are typed all the way down: a nested record (``SamplingParams``, ``TokenLogprob``)
travels as the array of its own fields, an enum as its value, a tuple as an array, and
each is rebuilt as its own type on arrival. ``decode`` bounds the size, rejects unknown
tags and versions, converts every field against its type hint, then constructs the
message, whose ``__post_init__`` checks what the types cannot (lengths that must agree).
Anything wrong is a ``ProtocolError``. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import msgpack

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


def registered() -> dict[str, type[Message]]:
    """Every message class by tag (a copy)."""
    return dict(_REGISTRY)


def encode(msg: Message) -> bytes:
    values = [_to_wire(getattr(msg, f.name)) for f in dataclasses.fields(msg)]
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
    return _record(cls, values, tag)


def _record(cls: type, values: Any, where: str) -> Any:
    """Rebuild a dataclass (a message or a nested record) from its field values."""
    schema = _schema(cls)
    if not isinstance(values, list) or len(values) != len(schema):
        raise ProtocolError(f"{where} needs {len(schema)} fields")
    converted = [_from_wire(v, hint, f"{where}.{name}") for (name, hint), v in zip(schema, values, strict=True)]
    try:
        return cls(*converted)  # runs the record's own checks
    except ProtocolError:
        raise
    except (ValueError, TypeError) as e:
        raise ProtocolError(f"{where}: {e}") from e


@functools.cache
def _schema(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))


def _to_wire(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value):
        return [_to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, list | tuple):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


def _from_wire(value: Any, hint: Any, where: str) -> Any:
    """``value`` as the type ``hint`` names, or a ProtocolError naming the field."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(hint):
            try:
                return _from_wire(value, arm, where)
            except ProtocolError:
                continue
        raise ProtocolError(f"{where} has the wrong type ({type(value).__name__})")
    if origin in (list, tuple, dict):
        return _container(value, origin, typing.get_args(hint), where)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise ProtocolError(f"{where}: {value!r} is not a {hint.__name__}") from None
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _record(hint, value, where)
    if _scalar_ok(value, hint):
        return float(value) if hint is float else value
    raise ProtocolError(f"{where} has the wrong type ({type(value).__name__})")


def _container(value: Any, origin: type, args: tuple, where: str) -> Any:
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ProtocolError(f"{where} must be a map with string keys")
        return {k: _from_wire(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if not isinstance(value, list):
        raise ProtocolError(f"{where} must be an array")
    if origin is list:
        if args[0] is int:  # token ids, block offsets: thousands per header, checked in one pass
            if not all(type(v) is int for v in value):
                bad = next(i for i, v in enumerate(value) if type(v) is not int)
                raise ProtocolError(f"{where}[{bad}] has the wrong type ({type(value[bad]).__name__})")
            return value
        return [_from_wire(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]
        return tuple(_from_wire(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    if len(value) != len(args):
        raise ProtocolError(f"{where} needs {len(args)} items")
    return tuple(_from_wire(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))


def _scalar_ok(value: Any, hint: Any) -> bool:
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(hint, type) and isinstance(value, hint)


def require(ok: bool, problem: str) -> None:
    """A message's own consistency check: raise ProtocolError with ``problem`` unless ``ok``."""
    if not ok:
        raise ProtocolError(problem)
