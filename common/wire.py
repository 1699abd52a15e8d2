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
from collections.abc import Callable
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
    values = [getattr(msg, name) if plain else _to_wire(getattr(msg, name))
              for name, plain in _encoding(type(msg))]
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
    schema = _decoding(cls)
    if not isinstance(values, list) or len(values) != len(schema):
        raise ProtocolError(f"{where} needs {len(schema)} fields")
    converted = [convert(v, f"{where}.{name}") for (name, convert), v in zip(schema, values, strict=True)]
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


# Both directions are planned once per class from its type hints (the codec's hot path:
# a prompt's thousands of token ids must not cost a Python call each).

@functools.cache
def _encoding(cls: type) -> tuple[tuple[str, bool], ...]:
    """Each field, and whether its values go to msgpack as they are (no enum or record
    inside, which ``_to_wire`` would turn into its value or its fields)."""
    return tuple((name, _plain(hint)) for name, hint in _schema(cls))


@functools.cache
def _decoding(cls: type) -> tuple[tuple[str, Callable[[Any, str], Any]], ...]:
    return tuple((name, _converter(hint)) for name, hint in _schema(cls))


_PLAIN_SCALARS = (int, float, str, bytes, bool, type(None))


@functools.cache
def _plain(hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType, list, tuple, dict):
        return all(_plain(arm) for arm in typing.get_args(hint) if arm is not Ellipsis)
    return hint in _PLAIN_SCALARS


def _to_wire(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [getattr(value, name) if plain else _to_wire(getattr(value, name))
                for name, plain in _encoding(type(value))]
    if isinstance(value, list | tuple):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


def _from_wire(value: Any, hint: Any, where: str) -> Any:
    """``value`` as the type ``hint`` names, or a ProtocolError naming the field."""
    return _converter(hint)(value, where)


def _wrong_type(value: Any, where: str) -> ProtocolError:
    return ProtocolError(f"{where} has the wrong type ({type(value).__name__})")


@functools.cache
def _converter(hint: Any) -> Callable[[Any, str], Any]:
    """The function that converts a wire value to ``hint`` (or raises ProtocolError)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _union(typing.get_args(hint))
    if origin in (list, tuple, dict):
        return _container(origin, typing.get_args(hint))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        def to_enum(value: Any, where: str) -> Any:
            try:
                return hint(value)
            except ValueError:
                raise ProtocolError(f"{where}: {value!r} is not a {hint.__name__}") from None
        return to_enum
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return lambda value, where: _record(hint, value, where)
    return _scalar(hint)


def _union(arms: tuple) -> Callable[[Any, str], Any]:
    converters = [_converter(arm) for arm in arms]
    # None can only be the None arm's, unless an arm takes anything
    none_first = type(None) in arms and Any not in arms

    def union(value: Any, where: str) -> Any:
        if value is None and none_first:
            return None
        for convert in converters:
            try:
                return convert(value, where)
            except ProtocolError:
                continue
        raise _wrong_type(value, where)

    return union


def _container(origin: type, args: tuple) -> Callable[[Any, str], Any]:
    if origin is dict:
        item = _converter(args[1])

        def to_dict(value: Any, where: str) -> Any:
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise ProtocolError(f"{where} must be a map with string keys")
            return {k: item(v, f"{where}.{k}") for k, v in value.items()}
        return to_dict
    if origin is list:
        return _list(args[0])
    if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]
        item = _converter(args[0])

        def to_tuple(value: Any, where: str) -> Any:
            if not isinstance(value, list):
                raise ProtocolError(f"{where} must be an array")
            return tuple(item(v, f"{where}[{i}]") for i, v in enumerate(value))
        return to_tuple
    items = [_converter(a) for a in args]

    def to_fixed_tuple(value: Any, where: str) -> Any:
        if not isinstance(value, list):
            raise ProtocolError(f"{where} must be an array")
        if len(value) != len(items):
            raise ProtocolError(f"{where} needs {len(items)} items")
        return tuple(convert(v, f"{where}[{i}]") for i, (v, convert) in enumerate(zip(value, items, strict=True)))
    return to_fixed_tuple


def _list(arg: Any) -> Callable[[Any, str], Any]:
    item = _converter(arg)
    # Token ids, block offsets, block hashes: thousands per message, checked in one pass
    # (exact types: msgpack makes no subclasses, and bool is not an int here).
    exact = {arg} if arg in (int, str, bytes) else None

    def to_list(value: Any, where: str) -> Any:
        if not isinstance(value, list):
            raise ProtocolError(f"{where} must be an array")
        if exact is not None and set(map(type, value)) <= exact:
            return value
        return [item(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return to_list


def _scalar(hint: Any) -> Callable[[Any, str], Any]:
    if hint is Any:
        return lambda value, where: value

    def scalar(value: Any, where: str) -> Any:
        if _scalar_ok(value, hint):
            return float(value) if hint is float else value
        raise _wrong_type(value, where)
    return scalar


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
