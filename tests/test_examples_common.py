"""The request checks the example servers share (examples/_common.py), without an engine."""

from __future__ import annotations

import math
import pathlib
import sys
from typing import Any

import pytest

from kvbudget.auth import ApiKey
from kvbudget.errors import Forbidden

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import _common

sys.path.pop(0)


def test_token_ids_against_the_vocabulary() -> None:
    assert _common.check_token_ids([0, 5, 1023], 1024) == [0, 5, 1023]
    for bad in ([], [1, 1024], [-1], [1, True], [1.0], "12", None):
        with pytest.raises(_common.BadRequest) as info:
            _common.check_token_ids(bad, 1024)
        assert info.value.param == "prompt"


@pytest.mark.parametrize(
    ("values", "param"),
    [
        ({"temperature": math.nan}, "temperature"), ({"temperature": -1}, "temperature"),
        ({"temperature": 2.5}, "temperature"), ({"temperature": "1"}, "temperature"),
        ({"top_p": 0}, "top_p"), ({"top_p": 1.01}, "top_p"), ({"top_k": 1.5}, "top_k"),
        ({"seed": 2**70}, "seed"), ({"min_p": math.inf}, "min_p"),
        ({"presence_penalty": True}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_sampling_values_out_of_range(values: dict[str, Any], param: str) -> None:
    with pytest.raises(_common.BadRequest) as info:
        _common.sampling_values(values)
    assert info.value.param == param


def test_sampling_values_and_model() -> None:
    assert _common.sampling_values({"temperature": 0, "top_p": 1, "seed": 3, "x": 1}) == {
        "temperature": 0.0, "top_p": 1.0, "seed": 3,
    }
    _common.check_model(None, "tiny")
    _common.check_model("tiny", "tiny")
    with pytest.raises(_common.ModelNotFound, match=r"The model `nope` does not exist\."):
        _common.check_model("nope", "tiny")
    with pytest.raises(_common.BadRequest):
        _common.check_model(5, "tiny")


def test_an_api_key_decides_the_tenant_and_the_class() -> None:
    opts = _common.options_from_headers({"X-KVBudget-Tenant": "forged", "X-KVBudget-Task": "t"})
    assert _common.apply_api_key(opts, None, None) is opts  # no keys file: the header is trusted
    key = ApiKey("acme", 2.0, ("batch",))
    got = _common.apply_api_key(opts, key, None)
    assert (got.tenant, got.service_class, got.task) == ("acme", "batch", "t")
    with pytest.raises(Forbidden):
        _common.apply_api_key(opts, key, "interactive")


def test_the_fastapi_app_checks_keys_and_sizes_before_the_engine(tmp_path: pathlib.Path) -> None:
    """The wiring of --api-keys / --max-body-bytes in the FastAPI example, without an engine
    (no lifespan: a request that passes the guard gets 503 "the engine is not running")."""
    import json

    import anyio
    import httpx

    pytest.importorskip("fastapi")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
    try:
        import fastapi_server
    finally:
        sys.path.pop(0)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-a": {"tenant": "a"}}))
    args = _common.make_parser("t", 8000).parse_args(
        ["--model", str(tmp_path), "--api-keys", str(keys), "--max-body-bytes", "100"]
    )
    app = fastapi_server.create_app(args)

    async def main() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            key = {"Authorization": "Bearer sk-a"}
            return [
                (await c.post("/v1/completions", json={"prompt": "hi"})).status_code,
                (await c.post("/v1/completions", json={"prompt": "hi"},
                              headers={"Authorization": "Bearer sk-b"})).status_code,
                (await c.post("/v1/completions", json={"prompt": "x" * 200},
                              headers=key)).status_code,
                (await c.post("/v1/completions", json={"prompt": "hi"}, headers=key)).status_code,
                (await c.get("/v1/nothing", headers=key)).status_code,
            ]

    assert anyio.run(main) == [401, 401, 413, 503, 404]


def test_the_first_token_pause_share_option_reaches_the_calibrated_policy() -> None:
    from kvbudget.core.policy.calibrated import CalibratedPolicy
    from kvbudget.errors import InvalidInput
    from kvbudget.policy_options import POLICY_DEFAULT, server_policy

    parser = _common.make_parser("test", 8000)
    base = ["--model", "/m"]
    args = parser.parse_args(base)
    assert args.first_token_pause_share == POLICY_DEFAULT
    assert server_policy(args.policy, args.first_token_pause_share) == "calibrated"
    off = server_policy("calibrated", parser.parse_args([*base, "--first-token-pause-share", "off"])
                        .first_token_pause_share)
    assert isinstance(off, CalibratedPolicy) and off.first_token_pause_share is None
    quarter = server_policy(
        "calibrated", parser.parse_args([*base, "--first-token-pause-share", "0.25"])
        .first_token_pause_share,
    )
    assert isinstance(quarter, CalibratedPolicy) and quarter.first_token_pause_share == 0.25
    for bad in ("0", "1.5", "nan", "-0.1", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args([*base, "--first-token-pause-share", bad])
    with pytest.raises(InvalidInput, match="calibrated policy only"):
        server_policy("reserve-max", None)
    assert server_policy("reserve-max", POLICY_DEFAULT) == "reserve-max"

