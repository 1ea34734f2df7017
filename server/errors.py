"""Errors of the HTTP layer, shaped like OpenAI's.

Hierarchy (every one maps to ``{"error": {"message", "type", "param", "code"}}``)::

    APIError                      500 internal_error / server_error
    ├── InvalidRequest            400 invalid_request_error   (bad JSON, wrong types, bad values)
    │   └── ContextLengthExceeded 400 code=context_length_exceeded
    ├── AuthenticationError       401 invalid_api_key
    ├── Forbidden                 403 (a code naming why: host_not_allowed, origin_not_allowed, ...)
    ├── NotFound                  404 not_found (or a code naming what, e.g. previous_response_not_found)
    │   └── ModelNotFound         404 model_not_found
    ├── Conflict                  409 (a code naming the state that refuses it, e.g. ssd_cache_disabled)
    ├── PayloadTooLarge           413
    └── QueueFull                 429 (with Retry-After)
        └── ShuttingDown          503 (with Retry-After): draining for a shutdown

Low-level failures are mapped to these at the boundary (``raise ... from exc``); the
body never carries a stack trace or a file path.
"""

from __future__ import annotations

__all__ = [
    "APIError",
    "InvalidRequest",
    "ContextLengthExceeded",
    "AuthenticationError",
    "Forbidden",
    "NotFound",
    "ModelNotFound",
    "Conflict",
    "PayloadTooLarge",
    "QueueFull",
    "ClientClosed",
    "ShuttingDown",
    "DeviceLost",
    "PermissionDenied",
    "error_body",
]


class APIError(Exception):
    status_code = 500
    type = "server_error"
    code: str | None = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        return {}


class InvalidRequest(APIError):
    status_code = 400
    type = "invalid_request_error"
    code = None


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class AuthenticationError(APIError):
    status_code = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class Forbidden(APIError):
    """403: a request a browser may have been tricked into sending (server/http/guard.py decides, with its own
    codes), or an action this server's configuration does not allow (PermissionDenied)."""

    status_code = 403
    type = "invalid_request_error"
    code = "forbidden"


class PermissionDenied(Forbidden):
    code = "permission_denied"


class NotFound(APIError):
    status_code = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class Conflict(APIError):
    status_code = 409
    type = "invalid_request_error"
    code = "conflict"


class PayloadTooLarge(APIError):
    status_code = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class ClientClosed(APIError):
    """499 (nginx's "client closed request"): the client left before its answer was complete, so the lane cancelled
    the job. Nobody reads it; it exists so /stats and the dashboard count a client that gave up (a timeout, Ctrl-C)
    as that, not as a 500, which says the server failed."""

    status_code = 499
    type = "invalid_request_error"
    code = "client_closed_request"


class QueueFull(APIError):
    status_code = 429
    type = "rate_limit_error"
    code = "queue_full"

    def __init__(self, message: str, *, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class ShuttingDown(QueueFull):
    """503 (with Retry-After): the server is draining for a shutdown (a new request), or its --shutdown-timeout
    ended this one."""

    status_code = 503
    type = "server_error"
    code = "server_shutting_down"


class DeviceLost(APIError):
    """503: the GPU reported an error that leaves it unusable for this process (server.lane.device_loss); no retry
    helps until the server restarts, so no Retry-After."""

    status_code = 503
    type = "server_error"
    code = "device_lost"

    def __init__(self, message: str, *, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
