"""`kvbudget serve`'s request headers -> budget options (pure: no engine, no vLLM import)."""

from __future__ import annotations

import importlib.util

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
