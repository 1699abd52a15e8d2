"""The gateway's settings: one frozen record that refuses bad values when it is made.

``tandem gateway`` builds it from flags; a ``ValueError`` here is the one-line
"tandem: error: ..." a user sees, before any socket is opened.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.gateway.tool_parsers import DEFAULT_PARSER, PARSERS


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    router: str  # the router's ZMQ address, e.g. tcp://127.0.0.1:7100
    stream_bind: str = "tcp://127.0.0.1:0"  # where workers push tokens (port 0: any)
    advertise_host: str = "127.0.0.1"  # how workers reach stream_bind
    api_key: str | None = None  # None: no key is asked for
    model: str | None = None  # whose tokenizer and limits to use; None: the default model
    served_model_name: str | None = None  # the name clients send; None: the model's own
    max_model_len: int | None = None  # None: the model's (and the workers') limit
    request_timeout: float = 600.0  # silence from the workers that fails a request
    admission_timeout: float = 120.0  # must exceed the router's queue timeout
    drain_timeout: float = 30.0  # SIGTERM: open requests get this long to finish
    # How long a request waits for a router that is out of reach (a restart) before its
    # 503; once the router has been away this long, new requests are refused at once.
    router_reach_timeout: float = 10.0
    tool_call_parser: str = DEFAULT_PARSER  # reads tool calls out of text (tool_parsers.PARSERS)

    def __post_init__(self) -> None:
        for name in ("router", "stream_bind"):
            value = getattr(self, name)
            _check(isinstance(value, str) and "://" in value, name,
                   f"must be a ZMQ address like tcp://host:port, got {value!r}")
        _check(isinstance(self.advertise_host, str) and bool(self.advertise_host),
               "advertise_host", "must not be empty")
        if self.api_key is not None:
            # It travels in an HTTP header, so a key a client cannot send would lock all out.
            key = self.api_key
            _check(isinstance(key, str) and key != "" and key.isascii() and key.isprintable()
                   and " " not in key, "api_key",
                   "must be printable ASCII without spaces (leave it unset for no key)")
        _check(self.served_model_name != "", "served_model_name", "must not be empty")
        if self.max_model_len is not None:
            _check(not isinstance(self.max_model_len, bool) and isinstance(self.max_model_len, int)
                   and self.max_model_len >= 1, "max_model_len",
                   f"must be a positive integer, got {self.max_model_len!r}")
        _check(isinstance(self.drain_timeout, int | float) and math.isfinite(self.drain_timeout)
               and self.drain_timeout >= 0, "drain_timeout",
               f"must be a number of seconds >= 0, got {self.drain_timeout!r}")
        _check(self.tool_call_parser in PARSERS, "tool_call_parser",
               f"must be one of {', '.join(PARSERS)}, got {self.tool_call_parser!r}")
        for name in ("request_timeout", "admission_timeout", "router_reach_timeout"):
            value = getattr(self, name)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            _check(number and math.isfinite(value) and value > 0, name,
                   f"must be a positive number of seconds, got {value!r}")


def _check(ok: bool, name: str, problem: str) -> None:
    if not ok:
        raise ValueError(f"gateway setting {name} {problem}")
