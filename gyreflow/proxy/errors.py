"""Errors in the OpenAI schema: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations


class ApiError(Exception):
    """A refused request; the server answers it with ``status`` and :meth:`body`.

    Parameters
    ----------
    status
        HTTP status (4xx for the caller's mistakes).
    message
        What is wrong, naming the field where there is one.
    type
        OpenAI error type, e.g. ``invalid_request_error``, ``authentication_error``.
    param
        The offending request field, if any.
    code
        A machine-readable code, e.g. ``model_not_found``, ``budget_exhausted``.
    retry
        Whether a client should retry (sent as ``x-should-retry``, which the official SDK honours).
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry: bool | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry = retry

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)
