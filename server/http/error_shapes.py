"""Each API's own error body, chosen by the request path at the app boundary.

Errors are raised once, as ``server.errors.APIError`` subclasses; only their shape differs per API:

- OpenAI (chat, completions, responses, everything else): ``{"error": {"message", "type", "param", "code"}}``
- Anthropic (everything under ``/v1/messages``): ``{"type": "error", "error": {"type", "message"}, "request_id"}``,
  the ``error.type`` derived from the HTTP status the way Anthropic maps them (400 invalid_request_error,
  401 authentication_error, 403 permission_error, 404 not_found_error, 429 rate_limit_error, 500 api_error,
  503/529 overloaded_error; 413 invalid_request_error: the type Anthropic's error page names for it,
  request_too_large, is in neither its OpenAPI spec nor its SDKs, so a client generated from the spec could not
  read it; the status still says 413).
"""

from __future__ import annotations

from server.errors import APIError, error_body

__all__ = ["is_anthropic_path", "anthropic_error_body", "shaped_error_body", "shaped_body"]

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",  # Anthropic's error page says request_too_large; its spec and SDKs know no such type
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error body (``request_id`` null: this server has no request ids of its own to give)."""
    kind = _ANTHROPIC_TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}, "request_id": None}


def shaped_error_body(path: str, err: APIError) -> dict:
    """``err`` in the error shape of the API that serves ``path``."""
    if is_anthropic_path(path):
        return anthropic_error_body(err.status_code, err.message)
    return err.body()


def shaped_body(path: str, status: int, message: str, type_: str, param=None, code=None) -> dict:
    """An error that is not an ``APIError`` (framework 404/405, validation) in the shape of ``path``'s API."""
    if is_anthropic_path(path):
        return anthropic_error_body(status, message)
    return error_body(message, type_, param, code)
