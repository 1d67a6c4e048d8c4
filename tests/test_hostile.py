"""The example servers under sloppy and hostile clients, on the real engine (issue 15).

Both examples are started ONCE for the module as their docs say: the FastAPI server without an
API-keys file (the tenant header is trusted, names are folded: ``--max-tenants 16 --max-tasks
16``), the gRPC server with one (``--api-keys``). Hypothesis sends bodies and headers of every
type, range and size; no answer may be a 5xx or a plain-text error, the budget is back at idle
afterwards, and ``/metrics`` stops growing however many tenants and tasks are invented.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import _hostile
from test_examples import (  # noqa: F401 (loopback_only is a fixture)
    EXAMPLES,
    ServerProcess,
    _free_port,
    _model_dir,
    _protos,
    loopback_only,
)

pytestmark = pytest.mark.vllm

START_TIMEOUT_S = 150.0
MAX_NAMES = 16
KEYS = {
    "sk-acme": {"tenant": "acme", "weight": 2.0},
    "sk-etl": {"tenant": "etl", "classes": ["batch"]},
}
FUZZ = settings(
    max_examples=150, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, loopback_only: None  # noqa: F811
) -> Iterator[dict[str, Any]]:
    model = _model_dir()
    logs = tmp_path_factory.mktemp("hostile-logs")
    keys = logs / "keys.json"
    keys.write_text(json.dumps(KEYS))
    http_port, grpc_port = _free_port(), _free_port()
    common = ["--model", str(model), "--kv-blocks", "24", "--max-model-len",
              str(_hostile.MAX_MODEL_LEN), "--served-model-name", "tiny"]
    http = ServerProcess(
        "fastapi_server",
        ["examples/fastapi_server.py", *common, "--port", str(http_port),
         "--max-tenants", str(MAX_NAMES), "--max-tasks", str(MAX_NAMES),
         "--max-body-bytes", "200000"],
        logs / "fastapi.log",
    )
    grpc_ = ServerProcess(
        "grpc_server",
        ["examples/grpc_server.py", *common, "--port", str(grpc_port), "--api-keys", str(keys)],
        logs / "grpc.log",
    )
    try:
        yield {"http": http, "http_url": f"http://127.0.0.1:{http_port}", "grpc": grpc_,
               "grpc_target": f"127.0.0.1:{grpc_port}"}
    finally:
        for proc in (http, grpc_):
            proc.terminate()
        http.stop()
        grpc_.stop()


@pytest.fixture(scope="module")
def http_url(servers: dict[str, Any]) -> str:
    proc: ServerProcess = servers["http"]
    return proc.wait_http(servers["http_url"], START_TIMEOUT_S)


@pytest.fixture(scope="module")
def http(http_url: str) -> Iterator[Any]:
    import httpx

    with httpx.Client(base_url=http_url, timeout=120, trust_env=False) as client:
        yield client


def _snapshot(client: Any) -> dict[str, Any]:
    data: dict[str, Any] = client.get("/kvbudget/snapshot").json()
    return data


def _answer(client: Any, path: str, content: bytes, headers: dict[str, Any]) -> None:
    h = {"content-type": "application/json", **headers}
    r = client.post(path, content=content, headers=h)
    _hostile.check_answer(r.status_code, r.headers.get("content-type", ""), r.text)


def test_the_issue_table_and_friends(http: Any) -> None:
    """The requests of the issue (and the rest of the list) answered as vLLM would."""
    base = {"prompt": "hi", "max_tokens": 2}
    cases: list[tuple[Any, int, str | None]] = [
        ({**base, "prompt": [1, 999999]}, 400, "prompt"),
        ({**base, "prompt": [1, -1]}, 400, "prompt"),
        ({**base, "temperature": float("nan")}, 400, "temperature"),
        ({**base, "temperature": -1}, 400, "temperature"),
        ({**base, "top_p": 1.5}, 400, "top_p"),
        ({**base, "max_tokens": -1}, 400, "max_tokens"),
        ({**base, "max_tokens": 10**30}, 400, "max_tokens"),
        ({**base, "max_tokens": "4"}, 400, "max_tokens"),
        ({**base, "model": "nope"}, 404, "model"),
        ({**base, "prompt": 5}, 400, "prompt"),
        ({**base, "prompt": ""}, 400, "prompt"),
        ({**base, "prompt": [7] * 800}, 400, "prompt"),
        ({**base, "prompt": "a\ud800b"}, 400, "prompt"),
        ([1, 2], 400, None),
    ]
    for body, status, param in cases:
        r = http.post("/v1/completions", content=_hostile.encode(body),
                      headers={"content-type": "application/json"})
        assert r.status_code == status, (body if len(str(body)) < 200 else param, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert "does not exist" in http.post("/v1/completions", json={**base, "model": "nope"}
                                         ).json()["error"]["message"]
    for raw in (b"{nope", b"\xff\xfe\x00", b"", b"[" * 100000):
        r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code in (400, 413) and "error" in r.json(), r.text
    r = http.post("/v1/completions", json={**base, "junk": "x" * 300000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = http.post("/v1/completions", json=base, headers={"X-Junk": "y" * 40000})
    assert r.status_code == 413
    r = http.post("/v1/completions", json=base, headers={"X-KVBudget-Deadline": "nan"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-KVBudget-Deadline"
    r = http.post("/v1/completions", json=base, headers={"X-KVBudget-Class": "gold"})
    assert r.status_code == 400
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": 7}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert http.get("/v1/nothing").json()["error"]["code"] == 404
    assert http.post("/v1/completions", json=base).status_code == 200
    assert _hostile.idle(_hostile.wait_idle(lambda: _snapshot(http)))


@FUZZ
@given(chat=st.booleans(), data=st.data())
def test_fuzzed_bodies_and_headers_never_get_a_5xx(http: Any, chat: bool, data: Any) -> None:
    body = data.draw(_hostile.body(chat), label="body")
    headers = data.draw(_hostile.headers(), label="headers")
    _answer(http, "/v1/chat/completions" if chat else "/v1/completions", _hostile.encode(body),
            headers)


def test_fuzzing_left_the_budget_idle_and_invented_names_stay_bounded(http: Any) -> None:
    snap = _hostile.wait_idle(lambda: _snapshot(http))
    assert _hostile.idle(snap), snap
    seen = _hostile.SEEN
    assert seen[200] >= 20 and seen[400] >= 20, seen  # both kinds of request were common
    base = {"prompt": [1, 2, 3], "max_tokens": 1}
    statuses = asyncio.run(_hostile.flood_names(str(http.base_url), "/v1/completions", 600,
                                                base))
    assert set(statuses) <= {200, 429}, set(statuses)
    assert _hostile.idle(_hostile.wait_idle(lambda: _snapshot(http)))  # every stop observed
    first = http.get("/metrics").text
    statuses = asyncio.run(_hostile.flood_names(str(http.base_url), "/v1/completions", 1200,
                                                base))
    assert set(statuses) <= {200, 429}, set(statuses)
    snap = _hostile.wait_idle(lambda: _snapshot(http))
    assert _hostile.idle(snap), snap
    text = http.get("/metrics").text
    new = _hostile.series(text) - _hostile.series(first)
    assert not new, sorted(new)[:40]  # no new series
    assert len(text) < 200_000
    assert len(snap["by_tenant"]) <= MAX_NAMES + 3  # + default, other and "*" (reconciliation)
    names = snap["names"]
    assert names["tenant"]["kept"] == MAX_NAMES and names["task"]["kept"] == MAX_NAMES
    assert names["tenant"]["folded_requests"] >= 1800 - MAX_NAMES - 200
    assert 'kvbudget_folded_names_total{kind="tenant"}' in text


# -- gRPC, with --api-keys -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def grpc_target(servers: dict[str, Any]) -> str:
    proc: ServerProcess = servers["grpc"]
    return proc.wait_grpc(servers["grpc_target"], START_TIMEOUT_S)


GRPC_OK = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED",
           "PERMISSION_DENIED"}


async def _generate(stub: Any, request: Any, metadata: list[tuple[str, str]]) -> str:
    import grpc

    try:
        async for _ in stub.Generate(request, metadata=metadata, timeout=60):
            pass
    except grpc.aio.AioRpcError as exc:
        return str(exc.code().name)
    return "OK"


def test_grpc_keys_and_bad_requests(grpc_target: str) -> None:
    import grpc

    pb, svc = _protos()
    acme = [("authorization", "Bearer sk-acme")]

    async def main() -> None:
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            stub = svc.KvBudgetStub(channel)
            ok = pb.GenerateRequest(prompt="hi", max_tokens=2)
            assert await _generate(stub, ok, []) == "UNAUTHENTICATED"
            assert await _generate(stub, ok, [("authorization", "Bearer nope")]) \
                == "UNAUTHENTICATED"
            assert await _generate(stub, ok, acme) == "OK"
            etl = [("authorization", "Bearer sk-etl")]
            assert await _generate(stub, ok, etl) == "OK"  # its default class: batch
            inter = pb.GenerateRequest(prompt="hi", max_tokens=2, service_class="interactive")
            assert await _generate(stub, inter, etl) == "PERMISSION_DENIED"
            forged = pb.GenerateRequest(prompt="hi", max_tokens=2, tenant="someone-else")
            assert await _generate(stub, forged, acme) == "OK"
            for bad in (pb.GenerateRequest(prompt_token_ids=[1, 999999], max_tokens=2),
                        pb.GenerateRequest(prompt_token_ids=[1, -1], max_tokens=2),
                        pb.GenerateRequest(prompt="hi", temperature=float("nan")),
                        pb.GenerateRequest(prompt="hi", temperature=-1),
                        pb.GenerateRequest(prompt=""),
                        pb.GenerateRequest(prompt_token_ids=[5] * 800),
                        pb.GenerateRequest(prompt="hi", max_tokens=4_000_000_000)):
                assert await _generate(stub, bad, acme) == "INVALID_ARGUMENT", bad
            assert await _generate(stub, pb.GenerateRequest(prompt="hi", model="nope"),
                                   acme) == "NOT_FOUND"
            snap = json.loads((await stub.Snapshot(pb.SnapshotRequest())).json)
            assert set(snap["by_tenant"]) <= {"acme", "etl", "*"}, snap["by_tenant"]  # not forged

    asyncio.run(main())


GRPC_REQUESTS = st.tuples(
    st.fixed_dictionaries({
        "prompt": st.text(max_size=30),
        "prompt_token_ids": st.lists(
            st.integers(-(2**31), 2**31 - 1) | st.integers(0, 1100), max_size=8
        ),
        "max_tokens": st.sampled_from([0, 1, 2, 3, 2**32 - 1]),
        "temperature": st.floats(width=32, allow_nan=True),
        "service_class": st.sampled_from(["", "interactive", "batch", "gold", "ü" * 50]),
        "tenant": st.text(max_size=20),
        "model": st.sampled_from(["", "tiny", "nope"]),
        "allow_continuation": st.booleans(),
    }),
    st.sampled_from([[], [("x-kvbudget-deadline", "nan")], [("x-kvbudget-task", "t" * 300)],
                     [("x-kvbudget-durable", "1")], [("x-kvbudget-class", "batch")]]),
    st.sampled_from(["Bearer sk-acme", "Bearer sk-etl", "Bearer sk-nope", "sk-acme", ""]),
)


@pytest.fixture(scope="module")
def grpc_stub(grpc_target: str) -> Iterator[tuple[Any, Any]]:
    import grpc

    pb, svc = _protos()
    with grpc.insecure_channel(grpc_target) as channel:
        yield pb, svc.KvBudgetStub(channel)


@settings(FUZZ, max_examples=60)
@given(GRPC_REQUESTS)
def test_grpc_fuzzed_requests_get_a_status_never_internal(
    grpc_stub: tuple[Any, Any], case: tuple[dict[str, Any], list[tuple[str, str]], str]
) -> None:
    import grpc

    pb, stub = grpc_stub
    fields, metadata, auth = case
    md = [*metadata, ("authorization", auth)] if auth else metadata
    try:
        for _ in stub.Generate(pb.GenerateRequest(**fields), metadata=md, timeout=60):
            pass
        code = "OK"
    except grpc.RpcError as exc:
        code = exc.code().name
    assert code in GRPC_OK, (code, fields, md)


def test_grpc_idle_after_the_fuzz(grpc_stub: tuple[Any, Any]) -> None:
    pb, stub = grpc_stub
    snap = _hostile.wait_idle(lambda: json.loads(stub.Snapshot(pb.SnapshotRequest()).json))
    assert _hostile.idle(snap), snap
    assert set(snap["by_tenant"]) <= {"acme", "etl", "*"}  # the keys' tenants, never forged


def test_docs_mention_the_options() -> None:
    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "examples.md").read_text()
    for flag in ("--api-keys", "--max-tenants", "--max-body-bytes"):
        assert flag in text
