"""Errors a client can cause, shared by the engine, the CLI and the gateway.

Each carries the request field it is about (``param``) so the gateway can build an
OpenAI error body and the CLI a one-line reason; none of them is a server fault.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request cannot be served as sent (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class PromptTooLongError(InvalidRequestError):
    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")
