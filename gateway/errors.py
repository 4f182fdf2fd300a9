"""Errors the gateway turns into OpenAI-style responses.

    GatewayError                   every error carries an HTTP status hint and an OpenAI `type`
    ├── BadRequestError (400)      malformed JSON, wrong field types, missing messages
    │   ├── JsonTooDeepError (400) a JSON body nested past limits.max_json_depth (logged, rate-limited)
    │   └── PayloadTooLargeError (413)  body over the configured limit
    ├── UnauthorizedError (401)    admin API without the right bearer token
    ├── NotFoundError (404)        unknown admin object
    ├── ConflictError (409)        an admin registration the pool has no room for
    ├── TooManyRequestsError (429) shed by admission control; carries the Retry-After seconds
    ├── NoWorkerError (503)        no live worker of a needed role; the message names the role
    ├── PrefillFailedError (503)   every P attempt failed and policy.prefill_failure = "error"
    └── UpstreamError              a worker failed
        ├── UpstreamStatusError    the worker answered an error status (4xx passed on, 5xx -> 502)
        ├── UpstreamUnreachableError (502)  connection refused/reset before any byte of the answer
        ├── UpstreamTimeoutError (504)      no answer within the configured timeout
        └── UpstreamBrokenError    a stream broke after it started (reset, idle timeout); the
                                   forwarder turns it into an SSE error event, never a status

Rule: core modules raise these, and `upstream.py` translates every transport error into them (no
other module sees an aiohttp exception); only the HTTP layer (`app.py`) renders them, once, with
`to_openai_error`. Errors after a streaming response has started never become an HTTP status; the
forwarder turns them into an SSE error event instead.
"""

from __future__ import annotations

from typing import Any

from ppd.records import worker_status_error

__all__ = [
    "BadRequestError",
    "ConflictError",
    "GatewayError",
    "JsonTooDeepError",
    "NoWorkerError",
    "NotFoundError",
    "PayloadTooLargeError",
    "PrefillFailedError",
    "TooManyRequestsError",
    "UnauthorizedError",
    "UpstreamBrokenError",
    "UpstreamError",
    "UpstreamStatusError",
    "UpstreamTimeoutError",
    "UpstreamUnreachableError",
    "error_body",
]


class GatewayError(Exception):
    status: int = 500
    error_type: str = "InternalServerError"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_openai_error(self) -> tuple[int, dict[str, Any]]:
        return self.status, error_body(self.message, self.error_type, self.status, self.param)

    def response_headers(self) -> dict[str, str]:
        """Headers each edge sends with the error (both front doors)."""
        return {}


class BadRequestError(GatewayError):
    status = 400
    error_type = "BadRequestError"


class PayloadTooLargeError(BadRequestError):
    status = 413


class JsonTooDeepError(BadRequestError):
    """A JSON body nested past `limits.max_json_depth` (limits.py rule 4)."""

    def __init__(self, max_depth: int) -> None:
        super().__init__(
            f"request body is JSON nested deeper than {max_depth} levels (limits.max_json_depth)"
        )
        self.max_depth = max_depth


class UnauthorizedError(GatewayError):
    status = 401
    error_type = "AuthenticationError"


class NotFoundError(GatewayError):
    status = 404
    error_type = "NotFoundError"


class ConflictError(GatewayError):
    status = 409
    error_type = "ConflictError"


class TooManyRequestsError(GatewayError):
    """Shed by admission control (gateway/admission_gate.py): the client should retry after
    `retry_after_s` seconds (the Retry-After header)."""

    status = 429
    error_type = "RateLimitError"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def response_headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class NoWorkerError(GatewayError):
    status = 503
    error_type = "ServiceUnavailableError"

    def __init__(self, role: str, *, scope: str = "") -> None:
        super().__init__(f"no live {role} worker in {scope or 'the pool'}")
        self.role = role


class PrefillFailedError(GatewayError):
    status = 503
    error_type = "ServiceUnavailableError"


class UpstreamError(GatewayError):
    status = 502
    error_type = "BadGatewayError"

    def __init__(self, message: str, *, worker: str) -> None:
        super().__init__(message)
        self.worker = worker


class UpstreamStatusError(UpstreamError):
    """The worker answered with an error status. Client errors (4xx) keep their status and the
    worker's own error body; server errors become 502 with ours."""

    def __init__(self, status: int, body: bytes, *, worker: str) -> None:
        super().__init__(worker_status_error(worker, status), worker=worker)
        self.upstream_status = status
        self.body = body
        if 400 <= status < 500:
            self.status = status
            self.error_type = "BadRequestError"

    def to_openai_error(self) -> tuple[int, dict[str, Any]]:
        if 400 <= self.upstream_status < 500:
            passed = _openai_error_or_none(self.body)
            if passed is not None:
                return self.upstream_status, passed
        return super().to_openai_error()


class UpstreamUnreachableError(UpstreamError):
    pass


class UpstreamTimeoutError(UpstreamError):
    status = 504
    error_type = "GatewayTimeoutError"


class UpstreamBrokenError(UpstreamError):
    """A stream from a worker broke after its headers arrived; `cause` names the transport error
    (e.g. `ClientPayloadError`, `TimeoutError`)."""

    def __init__(self, cause: str, *, worker: str) -> None:
        super().__init__(f"worker {worker} failed mid-stream: {cause}", worker=worker)
        self.cause = cause


def error_body(message: str, error_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's ErrorResponse shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _openai_error_or_none(body: bytes) -> dict[str, Any] | None:
    import json

    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return parsed
    return None
