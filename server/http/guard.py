"""What may reach a route: the Host allow-list, the Origin check, CORS preflights, the API key, the body size.

A server on loopback without ``--api-key`` is reachable by every web page its user opens. Two attacks matter:

- **Cross-origin requests.** A page may send a "simple" POST (``Content-Type: text/plain``, no preflight) to
  ``http://127.0.0.1:8080``; the browser sends it with an ``Origin`` header naming the page. We refuse any request
  whose ``Origin`` is neither the server's own nor listed in ``--allowed-origins``.
- **DNS rebinding.** A hostile name re-resolved to 127.0.0.1 makes the page same-origin with the server, so the
  Origin check passes; but the browser still sends ``Host: evil.example:8080``. We refuse any ``Host`` that is not
  a loopback name, the ``--host`` we bind, or listed in ``--allowed-hosts``. An IP literal cannot be rebound, so
  when the server binds every interface (``0.0.0.0`` / ``::``) any IP literal is accepted too.

Clients that are not browsers (curl, the SDKs) send no ``Origin`` and a loopback ``Host``: nothing changes for them.
State-changing ``/admin/*`` endpoints are stricter: never cross-origin (even from an allowed origin, and whatever
``Sec-Fetch-Site`` says), and never a body of a type a page may send without a preflight.

This module decides only (pure functions over header values); ``server.http.app`` turns a refusal into a 403 in the
error shape of the API the request went to.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from typing import Mapping, Optional
from urllib.parse import urlsplit

import orjson
from fastapi import Request
from fastapi.responses import Response
from starlette.datastructures import MutableHeaders

from server.errors import APIError, AuthenticationError, Forbidden, PayloadTooLarge
from server.http.error_shapes import shaped_error_body

__all__ = ["WebPolicy", "Refusal", "check_request", "preflight_headers", "cors_headers", "SIMPLE_CONTENT_TYPES",
           "RequestGuard", "refusal", "connection_refusal", "error_response"]

# the Content-Types a page may POST cross-origin without a CORS preflight (the Fetch standard's safelist)
SIMPLE_CONTENT_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")
_WILDCARD_BINDS = {"0.0.0.0", "::", ""}
_ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
_EXPOSED_HEADERS = "X-Request-Id, Retry-After"


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: ``code`` is the error body's machine-readable code, ``message`` says what to do."""

    code: str
    message: str


@dataclass(frozen=True)
class WebPolicy:
    """The configured allow-lists (``--host``, ``--allowed-hosts``, ``--allowed-origins``).

    ``allowed_hosts``: host names (no port), lower case; ``".example.com"`` also allows every sub-domain; ``"*"``
    turns the Host check off. ``allowed_origins``: exact origins (``scheme://host[:port]``, no path); ``"*"``
    allows every origin (never the default).
    """

    bind_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()

    @classmethod
    def build(cls, bind_host: str, allowed_hosts=(), allowed_origins=()) -> "WebPolicy":
        hosts = tuple(h.strip().lower() for h in allowed_hosts if h and h.strip())
        origins = tuple(_normal_origin(o) if o.strip() != "*" else "*" for o in allowed_origins if o and o.strip())
        return cls(bind_host=(bind_host or "").strip().lower().strip("[]"), allowed_hosts=hosts,
                   allowed_origins=origins)

    def host_allowed(self, host_header: Optional[str]) -> bool:
        """Is this ``Host`` header one of ours? No header at all (HTTP/1.0 tools) is not a browser: allowed."""
        if host_header is None:
            return True
        name = _host_name(host_header)
        if name is None:
            return False
        if "*" in self.allowed_hosts or name == self.bind_host or _is_loopback_name(name):
            return True
        if self.bind_host in _WILDCARD_BINDS and _is_ip(name):
            return True
        return any(name == h or (h.startswith(".") and (name.endswith(h) or name == h[1:]))
                   for h in self.allowed_hosts)

    def origin_listed(self, origin: str) -> bool:
        """Is ``origin`` opened up explicitly by ``--allowed-origins``?"""
        return "*" in self.allowed_origins or _normal_origin(origin) in self.allowed_origins


def same_origin(origin: str, host_header: Optional[str]) -> bool:
    """Is ``origin`` the server itself as the browser reached it (scheme http or https, same host and port)?"""
    if not host_header:
        return False
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False
    default = 443 if parts.scheme == "https" else 80
    return _authority(parts.netloc, default) == _authority(host_header, default)


def check_request(policy: WebPolicy, method: str, path: str, headers: Mapping[str, str]) -> Optional[Refusal]:
    """None when the request may go on; otherwise why it is refused (the caller answers 403).

    ``headers``: lower-case names (Starlette's ``request.headers`` qualifies).
    """
    host = headers.get("host")
    if not policy.host_allowed(host):
        return Refusal("host_not_allowed",
                       f"Host '{host}' is not allowed: this server answers to loopback names and its --host. If you "
                       "reach it under another name (a proxy, a LAN name), add it with --allowed-hosts.")
    origin = headers.get("origin")
    admin = path.startswith("/admin/")
    if admin:
        return _check_admin(method, headers, origin, host)
    if origin is not None and not same_origin(origin, host) and not policy.origin_listed(origin):
        return Refusal("origin_not_allowed",
                       f"Requests from the web page at Origin '{origin}' are not allowed. To let a browser-based "
                       "client at that origin use this server, start it with --allowed-origins ORIGIN.")
    return None


def _check_admin(method: str, headers: Mapping[str, str], origin: Optional[str], host: Optional[str]) -> Optional[Refusal]:
    site = headers.get("sec-fetch-site")
    if (origin is not None and not same_origin(origin, host)) or site in ("cross-site", "same-site"):
        return Refusal("cross_origin_admin",
                       "The /admin endpoints never accept a request from another web origin (--allowed-origins "
                       "does not open them). Call them from curl or a script on this machine.")
    ctype = headers.get("content-type", "").split(";")[0].strip().lower()
    if method != "GET" and ctype in SIMPLE_CONTENT_TYPES:
        return Refusal("admin_content_type",
                       f"The /admin endpoints take no '{ctype}' body (a web page can send that without asking): "
                       "send no body (curl -X POST URL), or Content-Type: application/json.")
    return None


def preflight_headers(policy: WebPolicy, headers: Mapping[str, str], path: str) -> Optional[dict]:
    """The answer to a CORS preflight (OPTIONS with ``Access-Control-Request-Method``) from an allowed origin,
    or None to refuse it. /admin never gets one."""
    origin = headers.get("origin")
    if origin is None or path.startswith("/admin/") or not policy.origin_listed(origin):
        return None
    asked = headers.get("access-control-request-headers", "")
    return {
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": _ALLOWED_METHODS,
        "Access-Control-Allow-Headers": asked or "Authorization, Content-Type",
        "Access-Control-Max-Age": "600",
        "Vary": "Origin",
    }


def is_preflight(method: str, headers: Mapping[str, str]) -> bool:
    return method == "OPTIONS" and "origin" in headers and "access-control-request-method" in headers


def cors_headers(policy: WebPolicy, headers: Mapping[str, str]) -> dict:
    """Headers letting an allowed cross-origin page read this response ({} for every other request)."""
    origin = headers.get("origin")
    if origin is None or same_origin(origin, headers.get("host")) or not policy.origin_listed(origin):
        return {}
    return {"Access-Control-Allow-Origin": origin, "Access-Control-Expose-Headers": _EXPOSED_HEADERS,
            "Vary": "Origin"}


# -- helpers ------------------------------------------------------------------------------------------------------
def _host_name(host_header: str) -> Optional[str]:
    """The name part of a Host header, lower case, IPv6 brackets removed; None when it is malformed."""
    value = host_header.strip().lower()
    if not value or any(c in value for c in "/@\\ "):
        return None
    if value.startswith("["):
        end = value.find("]")
        return value[1:end] if end > 0 else None
    if value.count(":") > 1:  # a bare IPv6 address
        return value
    return value.rsplit(":", 1)[0] if ":" in value else value


def _authority(netloc: str, default_port: int) -> tuple[Optional[str], int]:
    name = _host_name(netloc)
    value = netloc.strip().lower()
    port = default_port
    tail = value.rsplit("]", 1)[-1] if value.startswith("[") else (value if value.count(":") == 1 else "")
    if ":" in tail:
        try:
            port = int(tail.rsplit(":", 1)[1])
        except ValueError:
            return (None, -1)
    return (name, port)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _is_loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):  # browsers resolve *.localhost to loopback themselves
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _normal_origin(origin: str) -> str:
    parts = urlsplit(origin.strip().lower())
    if not parts.scheme or not parts.netloc:
        return origin.strip().lower().rstrip("/")
    default = {"http": 80, "https": 443}.get(parts.scheme)
    name, port = _authority(parts.netloc, default or 0)
    host = f"[{name}]" if name and ":" in name else name
    return f"{parts.scheme}://{host}" + ("" if port == default else f":{port}")


# -- the guard in front of every route --------------------------------------------------------------------------------
def error_response(request: Request, err: APIError, headers: Optional[dict] = None) -> Response:
    """``err`` in the error shape of the API the request went to (OpenAI's, or Anthropic's)."""
    return Response(orjson.dumps(shaped_error_body(request.url.path, err)), status_code=err.status_code,
                    media_type="application/json", headers={**err.headers(), **(headers or {})})


def refusal(state, request: Request) -> Optional[Response]:
    """The answer for a request that may not reach a route, or None. Browser checks first (a refused Host or Origin
    learns nothing, not even whether a key is needed), then CORS preflights, the API key, the body size."""
    path, headers = request.url.path, request.headers
    refused = check_request(state.web, request.method, path, headers)
    if refused is not None:
        return error_response(request, Forbidden(refused.message, code=refused.code))
    if is_preflight(request.method, headers):
        allow = preflight_headers(state.web, headers, path)
        if allow is not None:
            return Response(status_code=204, headers=allow)
    if state.api_key and not _open_path(state, path):
        if not hmac.compare_digest(_given_key(request).encode(), state.api_key.encode()):
            err = AuthenticationError("Incorrect or missing API key. Send 'Authorization: Bearer <key>' "
                                      "(or 'x-api-key: <key>').")
            return error_response(request, err, {"WWW-Authenticate": "Bearer", **cors_headers(state.web, headers)})
    length = request.headers.get("content-length")
    if length is not None:
        try:
            too_big = int(length) > state.max_body_bytes
        except ValueError:
            too_big = True
        if too_big:
            return error_response(request, PayloadTooLarge(
                f"The request body is larger than {state.max_body_bytes} bytes."))
    return None


def connection_refusal(state, conn) -> Optional[APIError]:
    """Why a WebSocket handshake (``conn``: Starlette's ``WebSocket``) may not be accepted, or None: the Host and
    Origin checks and the API key of ``refusal``. The guard middleware sees HTTP requests only; a browser opens a
    WebSocket to any origin without asking (CORS does not apply to it), so a WebSocket route must call this before it
    accepts."""
    refused = check_request(state.web, "GET", conn.url.path, conn.headers)
    if refused is not None:
        return Forbidden(refused.message, code=refused.code)
    if state.api_key and not hmac.compare_digest(_given_key(conn).encode(), state.api_key.encode()):
        return AuthenticationError("Incorrect or missing API key. Send 'Authorization: Bearer <key>' "
                                   "(or 'x-api-key: <key>').")
    return None


class RequestGuard:
    """Pure ASGI middleware: ``refuse(request)`` sees the headers and may answer instead of the app;
    ``on_response(request, status, headers, refused)`` sees (and may add to) every response's start.

    Not Starlette's ``BaseHTTPMiddleware`` (``@app.middleware("http")``): that one re-streams every response chunk
    through a memory stream and an extra task, a cost paid per token per stream (profiled: the biggest item of the
    event loop's time under 16 concurrent streams)."""

    def __init__(self, app, refuse, on_response):
        self.app = app
        self.refuse = refuse
        self.on_response = on_response

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        refusal = self.refuse(request)

        async def send_seen(message) -> None:
            if message["type"] == "http.response.start":
                self.on_response(request, message["status"], MutableHeaders(scope=message), refusal is not None)
            await send(message)

        if refusal is not None:
            await refusal(scope, receive, send_seen)
        else:
            await self.app(scope, receive, send_seen)


def _open_path(state, path: str) -> bool:
    """Paths that never need the API key: /health, and the dashboard's static page (it holds no data: it asks for
    the key, then reads /stats with it)."""
    if path == "/health":
        return True
    return state.dashboard and (path in ("/", "/dashboard") or path.startswith("/dashboard/assets/"))


def _given_key(request) -> str:
    """The API key a client sent: OpenAI clients send ``Authorization: Bearer KEY``, Anthropic's send
    ``x-api-key: KEY`` (Claude Code sends either, depending on how it was configured)."""
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:]
    return request.headers.get("x-api-key", "")
