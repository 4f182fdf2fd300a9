"""vLLM's OpenAI-style error: one exception type for the wire layer, rendered as vLLM renders it.

ApiError (Exception)            -> HTTP `status`, body {"error": {message, type, param, code}}
  raised by simulator.core.protocol  (validation: 400, unknown model: 404, huge body: 413)
  raised by simulator.server    (injected faults: 500/503, expired KV lease: 500)
"""

from __future__ import annotations

from typing import Any

__all__ = ["ApiError"]

_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestEntityTooLarge",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """An error answered with vLLM's `ErrorResponse` body and the matching HTTP status."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, error_type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self._error_type = error_type

    @property
    def error_type(self) -> str:
        """vLLM's exception name for the status; request-validation errors say "Bad Request"."""
        if self._error_type is not None:
            return self._error_type
        return _TYPES.get(self.status, "BadRequestError" if self.status < 500 else "InternalServerError")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            }
        }
