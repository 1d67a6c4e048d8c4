"""The HTTP servers' front door: size limits and API keys, answered before anything is reserved.

:class:`RequestGuard` is a pure ASGI middleware both HTTP servers the project ships put outside
everything else (``examples/fastapi_server.py`` and ``kvbudget serve``):

* request headers larger than ``max_header_bytes`` in total (names + values), a
  ``Content-Length`` above ``max_body_bytes``, or a body (chunked or not) that grows past it:
  **413** with an OpenAI-style error body (``code: "request_too_large"``); a ``Content-Length``
  that is not a number: 400. The body is read here (up to the limit) and handed on whole;
* with ``api_keys`` (:class:`kvbudget.auth.ApiKeys`), a request to a guarded path (``/v1``,
  ``/v2``, ``/inference``, ``/cohere``: the prefixes vLLM's own ``--api-key`` guards; never
  ``OPTIONS``) without a valid ``Authorization: Bearer KEY``: **401** (``code:
  "invalid_api_key"``, ``WWW-Authenticate: Bearer``). The key found is put in the ASGI scope
  under :data:`API_KEY_SCOPE` for the handler (its tenant, weight and allowed classes).
"""

from __future__ import annotations

import json
from typing import Any, Final

from kvbudget.auth import ApiKey, ApiKeys
from kvbudget.errors import Unauthorized
from kvbudget.validate import check_int

#: the ASGI scope key under which the request's :class:`~kvbudget.auth.ApiKey` is found
API_KEY_SCOPE: Final = "kvbudget.api_key"
#: the path prefixes that need a key (vLLM's ``GUARDED_PREFIX``)
GUARDED_PREFIXES: Final = ("/v1", "/v2", "/inference", "/cohere")
DEFAULT_MAX_BODY_BYTES: Final = 4 * 1024 * 1024
DEFAULT_MAX_HEADER_BYTES: Final = 32 * 1024
#: Seconds an idle keep-alive connection stays open (uvicorn's and vLLM's default is 5). A
#: client pools idle connections longer (aiohttp 15 s, vLLM's benchmark client 60 s, Go 90 s),
#: and one that stalls past the server's timeout sends its next POST on a connection the server
#: closed meanwhile: it fails with "connection reset" / ``ServerDisconnectedError``, every
#: pooled connection at once. Measured: after a 5.5 s client stall, 24 of 24 POSTs failed at
#: 5 s, none at 120 s.
DEFAULT_KEEP_ALIVE_S: Final = 120


def error_body(
    message: str, type_: str = "invalid_request_error", code: str | int | None = None,
    param: str | None = None,
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, as OpenAI and vLLM answer."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


async def send_json(
    send: Any, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> None:
    """Answer an ASGI exchange with a JSON body."""
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode(), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


class RequestGuard:
    """Size limits and API keys in front of an ASGI app (see the module docs)."""

    def __init__(
        self,
        app: Any,
        *,
        api_keys: ApiKeys | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    ) -> None:
        self.app = app
        self.api_keys = api_keys
        self.max_body_bytes = check_int("max_body_bytes", max_body_bytes, minimum=1)
        self.max_header_bytes = check_int("max_header_bytes", max_header_bytes, minimum=1)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers") or ()
        size = sum(len(k) + len(v) for k, v in headers)
        if size > self.max_header_bytes:
            await send_json(send, 413, error_body(
                f"the request headers are {size} bytes; at most {self.max_header_bytes}",
                code="request_too_large",
            ))
            return
        length: int | None = None
        authorization: str | None = None
        for name, value in headers:
            lname = name.lower()
            if lname == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = -1
            elif lname == b"authorization":
                authorization = value.decode("latin-1")
        if length is not None and length < 0:
            await send_json(send, 400, error_body("Content-Length must be a number of bytes"))
            return
        if length is not None and length > self.max_body_bytes:
            await send_json(send, 413, error_body(
                f"the request body is {length} bytes; at most {self.max_body_bytes}",
                code="request_too_large",
            ))
            return
        if self.api_keys is not None and self._guarded(scope):
            try:
                key: ApiKey = self.api_keys.authenticate(authorization)
            except Unauthorized as exc:
                await send_json(
                    send, 401, error_body(str(exc), code="invalid_api_key"),
                    {"WWW-Authenticate": "Bearer"},
                )
                return
            scope = dict(scope)
            scope[API_KEY_SCOPE] = key
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone before its body arrived: nothing to answer
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await send_json(send, 413, error_body(
                    f"the request body is larger than {self.max_body_bytes} bytes",
                    code="request_too_large",
                ))
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # then the disconnect, when it comes

        await self.app(scope, replay, send)

    def _guarded(self, scope: Any) -> bool:
        if scope.get("method") == "OPTIONS":
            return False
        path = str(scope.get("path", "")).removeprefix(str(scope.get("root_path", "")))
        return path.startswith(GUARDED_PREFIXES)


def api_key_of(scope: Any) -> ApiKey | None:
    """The :class:`~kvbudget.auth.ApiKey` :class:`RequestGuard` found for this request."""
    key = scope.get(API_KEY_SCOPE) if isinstance(scope, dict) else None
    return key if isinstance(key, ApiKey) else None


__all__ = [
    "API_KEY_SCOPE",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_HEADER_BYTES",
    "GUARDED_PREFIXES",
    "RequestGuard",
    "api_key_of",
    "error_body",
    "send_json",
]
