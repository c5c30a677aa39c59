"""Pure-ASGI guards that run before any body is parsed: API key, body size, content type, request
ids.

Each is a small class rather than a Starlette `BaseHTTPMiddleware`, so streaming responses and
client-disconnect messages pass through untouched.
"""
from __future__ import annotations

import hmac
import json
import logging
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specserve.server.errors import error_envelope

logger = logging.getLogger("specserve.server")
REQUEST_ID_KEY = "specserve.request_id"
GUARDED_PREFIXES = ("/v1", "/tokenize", "/detokenize")      # openai-api.md §9 (ours: + tokenize)
UNSUPPORTED_MEDIA = "Unsupported Media Type: Only 'application/json' is allowed"
# curl's `-d` sends this; a JSON body under it is read as JSON so `curl -d '{...}'` works (ours).
LENIENT_MEDIA_TYPES = ("", "application/x-www-form-urlencoded")


async def send_envelope(send: Send, status: int, message: str,
                        headers: dict[str, str] | None = None):
    body = json.dumps(error_envelope(status, message)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` on /v1, /tokenize and /detokenize: the scheme in any case
    (RFC 9110), the key compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and \
                scope["path"].startswith(GUARDED_PREFIXES):
            scheme, _, token = (_header(scope, b"authorization") or "").strip().partition(" ")
            given = token.strip().encode("latin-1", "replace")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given, self.expected):
                await send_envelope(send, 401, "Invalid or missing API key.")
                return
        await self.app(scope, receive, send)


class BodyGuardMiddleware:
    """Refuse bodies over `max_body_bytes` before parsing (413) and non-JSON content types (400).

    The body is read here, bounded, and replayed to the app; after it, `receive` is the client's
    own, so handlers still see `http.disconnect`.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        too_large = f"Request body is larger than the limit of {self.max_body_bytes} bytes."
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await send_envelope(send, 413, too_large)
            return
        media = (_header(scope, b"content-type") or "").split(";", 1)[0].strip().lower()
        if media not in ("application/json", *LENIENT_MEDIA_TYPES):
            await send_envelope(send, 400, UNSUPPORTED_MEDIA)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await send_envelope(send, 413, too_large)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        if media != "application/json":
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
            scope["headers"] = headers + [(b"content-type", b"application/json")]
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class RequestIdMiddleware:
    """Put a request id in the scope (X-Request-Id or a random hex uuid) and echo it on the
    response.

    Handlers may replace `scope[REQUEST_ID_KEY]` (e.g. a body `request_id`) before the response
    starts.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[REQUEST_ID_KEY] = _header(scope, b"x-request-id") or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k,
                           v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id",
                                scope[REQUEST_ID_KEY].encode("latin-1", "replace")))
                message = dict(message, headers=headers)
            await send(message)

        await self.app(scope, receive, send_with_id)


class RequestLogMiddleware:
    """`--enable-log-requests`: one log line per request on the OpenAI routes, written when its
    body has been read: the request id, method, route and the body (its first `max_log_len`
    characters; None: all of it), on one line."""

    def __init__(self, app: ASGIApp, max_log_len: int | None = None):
        self.app = app
        self.max_log_len = max_log_len

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GUARDED_PREFIXES):
            await self.app(scope, receive, send)
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            self._log(scope, b"")
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        logged = False

        async def logging_receive() -> Message:
            nonlocal logged
            message = await receive()
            if message["type"] == "http.request" and not logged:
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    logged = True
                    self._log(scope, b"".join(chunks))
            return message

        await self.app(scope, logging_receive, send)

    def _log(self, scope: Scope, body: bytes) -> None:
        text = body.decode("utf-8", "replace")
        if self.max_log_len is not None and len(text) > self.max_log_len:
            text = text[:self.max_log_len] + f"... ({len(text)} chars)"
        text = text.replace("\r", "\\r").replace("\n", "\\n")      # one line, always
        logger.info("request %s: %s %s %s", scope.get(REQUEST_ID_KEY, "-"), scope["method"],
                    scope["path"], text)
