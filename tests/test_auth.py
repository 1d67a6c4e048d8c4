"""API keys (kvbudget.auth) and the HTTP front door (kvbudget.guard), without an engine."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import httpx
import pytest

from kvbudget import InvalidInput
from kvbudget.auth import ApiKey, bearer_token, load_api_keys, parse_api_keys
from kvbudget.errors import Forbidden, Unauthorized
from kvbudget.guard import API_KEY_SCOPE, RequestGuard

KEYS = {
    "sk-acme": {"tenant": "acme", "weight": 2.0, "classes": ["interactive", "batch"]},
    "sk-acme-2": {"tenant": "acme", "weight": 2},
    "sk-etl": {"tenant": "etl", "classes": ["batch"]},
    "sk-guest": {"tenant": "guest"},
}


def test_load_authenticate_and_classes(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    keys = load_api_keys(path)
    assert len(keys) == 4 and keys.tenants == {"acme", "etl", "guest"}
    assert keys.tenant_weights() == {"acme": 2.0, "etl": 1.0, "guest": 1.0}
    assert keys.authenticate("Bearer sk-acme").tenant == "acme"
    assert keys.authenticate("bearer   sk-etl ").tenant == "etl"
    for bad in (None, "", "sk-acme", "Basic sk-acme", "Bearer ", "Bearer sk-nope", "Bearer ü"):
        with pytest.raises(Unauthorized):
            keys.authenticate(bad)
    etl = keys.authenticate("Bearer sk-etl")
    assert etl.service_class(None) == "batch"  # its only class is its default
    with pytest.raises(Forbidden):
        etl.service_class("interactive")
    assert ApiKey("g").service_class(None) == "interactive"
    assert ApiKey("g").service_class("batch") == "batch"
    keys.check_classes(["interactive", "batch"])
    with pytest.raises(InvalidInput):
        keys.check_classes(["interactive"])
    assert bearer_token("Bearer abc") == "abc" and bearer_token("Token abc") is None


@pytest.mark.parametrize(
    "data",
    [
        [], {}, {"k": "acme"}, {"k": {}}, {"k": {"tenant": ""}},
        {"k": {"tenant": "a", "weight": 0}}, {"k": {"tenant": "a", "weight": True}},
        {"k": {"tenant": "a", "weight": float("nan")}}, {"k": {"tenant": "a", "classes": []}},
        {"k": {"tenant": "a", "classes": "batch"}}, {"k": {"tenant": "a", "extra": 1}},
        {" k": {"tenant": "a"}}, {"k": {"tenant": "a", "weight": 1}, "j": {"tenant": "a",
                                                                          "weight": 2}},
    ],
)
def test_bad_key_files_say_what_is_wrong(data: Any) -> None:
    with pytest.raises(InvalidInput) as info:
        parse_api_keys(data)
    assert info.value.field == "--api-keys"


def test_unreadable_key_file(tmp_path: pathlib.Path) -> None:
    with pytest.raises(InvalidInput):
        load_api_keys(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InvalidInput):
        load_api_keys(tmp_path / "bad.json")


async def _echo(scope: Any, receive: Any, send: Any) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    key = scope.get(API_KEY_SCOPE)
    data = json.dumps({"len": len(body), "tenant": key.tenant if key else None}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": data})


def _client(**kw: Any) -> httpx.AsyncClient:
    app = RequestGuard(_echo, max_body_bytes=1000, max_header_bytes=2000, **kw)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def _is_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.anyio
async def test_guard_limits_and_keys() -> None:
    async with _client() as c:
        assert (await c.post("/v1/completions", content=b"x" * 1000)).json()["len"] == 1000
        err = _is_error(await c.post("/v1/completions", content=b"x" * 1001), 413)
        assert err["code"] == "request_too_large"

        async def chunks() -> Any:
            for _ in range(20):
                yield b"y" * 100

        _is_error(await c.post("/v1/completions", content=chunks()), 413)  # chunked, no length
        _is_error(await c.get("/v1/models", headers={"X-Big": "z" * 2100}), 413)
        assert (await c.get("/v1/models")).json()["tenant"] is None  # no keys: no check
    keys = parse_api_keys(KEYS)
    async with _client(api_keys=keys) as c:
        err = _is_error(await c.post("/v1/completions", content=b"{}"), 401)
        assert err["code"] == "invalid_api_key"
        r = await c.post("/v1/completions", content=b"{}", headers={"Authorization": "Bearer x"})
        _is_error(r, 401)
        assert r.headers["www-authenticate"] == "Bearer"
        r = await c.post("/v1/completions", headers={"Authorization": "Bearer sk-etl"})
        assert r.json()["tenant"] == "etl"
        assert (await c.get("/health")).status_code == 200  # not a guarded path
        assert (await c.options("/v1/models")).status_code == 200
