"""`kvbudget serve`'s request headers -> budget options (pure: no engine, no vLLM import)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from kvbudget.errors import InvalidInput

if importlib.util.find_spec("fastapi") is None:  # pragma: no cover
    pytest.skip("fastapi is not installed", allow_module_level=True)

from kvbudget.guard import DEFAULT_KEEP_ALIVE_S
from kvbudget.serve import (
    RequestOptions,
    keep_alive_seconds,
    options_from_headers,
    retry_after_header,
)


def _h(**kv: str) -> list[tuple[bytes, bytes]]:
    return [(k.replace("_", "-").encode(), v.encode()) for k, v in kv.items()]


def test_defaults_without_headers() -> None:
    assert options_from_headers([]) == RequestOptions()


def test_kvbudget_headers() -> None:
    opts = options_from_headers(_h(
        X_KVBudget_Class="batch", X_KVBudget_Tenant="acme", X_KVBudget_Task="summ",
        X_KVBudget_Durable="yes", X_KVBudget_Deadline="30", X_KVBudget_On_Exhausted="continue",
    ))
    assert opts == RequestOptions("batch", "acme", "summ", True, 30.0, "continue")


def test_llm_d_headers_and_which_wins() -> None:
    opts = options_from_headers(_h(
        x_llm_d_inference_objective="batch", x_llm_d_inference_fairness_id="team-a"
    ))
    assert (opts.service_class, opts.tenant) == ("batch", "team-a")
    both = [(b"x-llm-d-inference-fairness-id", b"team-a"), (b"X-KVBudget-Tenant", b"acme")]
    assert options_from_headers(both).tenant == "acme"
    assert options_from_headers(list(reversed(both))).tenant == "acme"


@pytest.mark.parametrize(
    "headers",
    [_h(X_KVBudget_Deadline="soon"), _h(X_KVBudget_Deadline="-1"),
     _h(X_KVBudget_Deadline="nan"), _h(X_KVBudget_On_Exhausted="truncate")],
)
def test_bad_values_are_invalid_input(headers: list[tuple[bytes, bytes]]) -> None:
    with pytest.raises(InvalidInput):
        options_from_headers(headers)


def test_retry_after_is_whole_seconds_rounded_up() -> None:
    assert retry_after_header(0.2) == {"Retry-After": "1", "retry-after-ms": "200"}
    assert retry_after_header(2.01)["Retry-After"] == "3"


def test_keep_alive_option_then_vllms_variable_then_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse

    monkeypatch.delenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", raising=False)
    args = argparse.Namespace(kvbudget_timeout_keep_alive=None)
    assert keep_alive_seconds(args) == DEFAULT_KEEP_ALIVE_S == 120
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "30")
    assert keep_alive_seconds(args) == 30
    assert keep_alive_seconds(argparse.Namespace(kvbudget_timeout_keep_alive=7)) == 7
    with pytest.raises(InvalidInput):
        keep_alive_seconds(argparse.Namespace(kvbudget_timeout_keep_alive=0))
    for bad in ("soon", "0", "-5"):
        monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", bad)
        with pytest.raises(InvalidInput, match="VLLM_HTTP_TIMEOUT_KEEP_ALIVE"):
            keep_alive_seconds(args)


def test_the_middleware_stamps_each_requests_receipt_on_the_budgets_clock() -> None:
    """What ``BudgetedClient.generate`` passes on as ``received_at``: the middleware's clock
    read when the request reached it, before vLLM's handler parsed and tokenized it."""
    import asyncio

    from kvbudget.serve import _EXCHANGE, BudgetOptionsMiddleware

    ticks = iter([41.5, 99.0])
    seen: list[tuple[float | None, str]] = []

    async def app(scope: object, receive: object, send: object) -> None:
        exchange = _EXCHANGE.get()
        assert exchange is not None
        seen.append((exchange.received_at, exchange.options.service_class))

    middleware = BudgetOptionsMiddleware(app, clock=lambda: next(ticks))
    scope = {"type": "http", "headers": [(b"x-kvbudget-class", b"batch")]}

    async def nothing() -> dict[str, object]:
        return {}

    async def discard(message: dict[str, object]) -> None:
        pass

    asyncio.run(middleware(scope, nothing, discard))
    assert seen == [(41.5, "batch")]
    assert _EXCHANGE.get() is None


@pytest.mark.parametrize("turned_away", [True, False])
def test_a_stream_turned_away_before_its_first_output_is_answered_429(turned_away: bool) -> None:
    """vLLM's handler starts an event stream, then the stream ends with Overloaded before its
    first output (reported through ``BudgetedEngine.generate``'s ``on_turned_away``, which
    ``BudgetedClient`` points at the exchange): the caller gets a 429 with Retry-After and
    nothing of the started stream. A stream that was not turned away goes out untouched."""
    import asyncio
    import json

    from kvbudget.errors import Overloaded
    from kvbudget.serve import _EXCHANGE, BudgetOptionsMiddleware

    start = {"type": "http.response.start", "status": 200,
             "headers": [(b"content-type", b"text/event-stream")]}
    chunks = [{"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True},
              {"type": "http.response.body", "body": b"", "more_body": False}]

    async def app(scope: object, receive: object, send: Any) -> None:
        await send(start)
        exchange = _EXCHANGE.get()
        assert exchange is not None
        if turned_away:
            exchange.turned_away(Overloaded(2.2, "queue-timeout", "r0"))
        for chunk in chunks:
            await send(chunk)

    sent: list[dict[str, Any]] = []

    async def record(message: dict[str, Any]) -> None:
        sent.append(message)

    async def nothing() -> dict[str, object]:
        return {}

    middleware = BudgetOptionsMiddleware(app)
    asyncio.run(middleware({"type": "http", "headers": []}, nothing, record))
    if not turned_away:
        assert sent == [start, *chunks]
        return
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 429
    headers = dict(sent[0]["headers"])
    assert headers[b"retry-after"] == b"3" and headers[b"retry-after-ms"] == b"2200"
    body = json.loads(sent[1]["body"])
    assert "queue-timeout" in body["error"]["message"]


def test_the_client_passes_the_receipt_and_the_options_to_the_budget() -> None:
    from kvbudget.serve import _EXCHANGE, BudgetedClient, _Exchange

    class Recorder:  # (the glue under test hands everything to BudgetedEngine.generate)
        engine = None

        def __init__(self) -> None:
            self.calls: list[dict[str, object]] = []

        def generate(self, *args: object, **kwargs: object) -> object:
            self.calls.append(kwargs)
            return iter(())

    rec = Recorder()
    client = BudgetedClient(rec)  # type: ignore[arg-type]
    client.generate("p", None, "r0")
    exchange = _Exchange(RequestOptions(tenant="acme"), 12.25)
    token = _EXCHANGE.set(exchange)
    try:
        client.generate("p", None, "r1")
    finally:
        _EXCHANGE.reset(token)
    assert rec.calls[0]["received_at"] is None and rec.calls[0]["on_turned_away"] is None
    assert rec.calls[1]["received_at"] == 12.25 and rec.calls[1]["tenant"] == "acme"
    assert rec.calls[1]["on_turned_away"] == exchange.turned_away
    assert all(call["arrive_now"] is True for call in rec.calls)


def test_vllms_stream_loggers_drop_a_turned_away_callers_traceback_and_keep_the_rest() -> None:
    import logging

    from kvbudget.errors import Overloaded
    from kvbudget.serve import VLLM_STREAM_LOGGERS, QuietOverloaded, quiet_vllm_overloaded

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    quiet_vllm_overloaded()
    quiet_vllm_overloaded()  # once is enough: no second filter
    for name in VLLM_STREAM_LOGGERS:
        logger = logging.getLogger(name)
        assert sum(isinstance(f, QuietOverloaded) for f in logger.filters) == 1
        records.clear()
        handler = Keep()
        logger.addHandler(handler)
        try:
            for exc in (Overloaded(1.5, "queue-timeout", "r"), ValueError("a real bug")):
                try:
                    raise exc
                except Exception:
                    logger.exception("Error in completion stream generator.")
        finally:
            logger.removeHandler(handler)
        assert [type(r.exc_info[1]) for r in records if r.exc_info] == [ValueError]
