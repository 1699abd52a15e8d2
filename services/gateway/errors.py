"""Errors a client sees from the gateway, as OpenAI's ``{"error": {...}}`` body.

``APIError`` carries the HTTP status, the message, the request field it is about and,
for 429/503, how long to wait. ``shown`` puts a client's value into a message safely.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from common.errors import InvalidRequestError

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error to send to the client; ``type`` follows from ``status`` unless given."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after  # seconds, sent as Retry-After (429/503)
        self.status = status
        self.message = message
        self.type = type or _ERROR_TYPES.get(status, "server_error")
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    @classmethod
    def invalid(cls, message: str, param: str | None = None, code: str | None = None) -> APIError:
        return cls(400, message, param=param, code=code)

    @classmethod
    def from_invalid_request(cls, e: InvalidRequestError) -> APIError:
        """The engine's and SamplingParams' client errors (e.g. PromptTooLongError)."""
        return cls(400, e.message, param=e.param, code=e.code)

    @classmethod
    def model_not_found(cls, model: str) -> APIError:
        return cls(404, f"The model `{model}` does not exist or you do not have access to it.",
                   param="model", code="model_not_found")

    @classmethod
    def invalid_api_key(cls) -> APIError:
        return cls(401, "Incorrect API key provided.", code="invalid_api_key")

    @classmethod
    def rate_limited(cls, message: str) -> APIError:
        return cls(429, message, code="rate_limit_exceeded")

    @classmethod
    def unavailable(cls, message: str, retry_after: float | None = None) -> APIError:
        return cls(503, message, retry_after=retry_after)

    @classmethod
    def server_error(cls, message: str = "The server had an error while processing your request.") -> APIError:
        return cls(500, message)



def shown(value: Any) -> str:
    """A client value in an error message, cut short: it may be huge."""
    if isinstance(value, list):
        return "an array"
    if isinstance(value, Mapping):
        return "an object"
    if not isinstance(value, str | int | float | bool):
        return type(value).__name__
    # ensure_ascii keeps a lone surrogate printable; a long value is cut.
    text = json.dumps(value[:80] if isinstance(value, str) else value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_text(value: Any) -> bool:
    """A string the tokenizer can take: JSON may carry a lone surrogate ("\\ud800"), on
    which the tokenizer raises."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unicode_text(text: str, where: str) -> str:
    """``text`` as it is, or a 400 on ``where`` for a lone surrogate."""
    if not is_text(text):
        raise APIError.invalid(f"{where} is not valid Unicode text (unpaired surrogate)", where)
    return text
