"""``kvbudget serve`` end to end: vLLM's own OpenAI app with the budget inside, the real engine.

The server is started ONCE for the module, as a subprocess, exactly as docs/serve.md says
(``kvbudget serve MODEL --dtype float32 --enforce-eager ...``), on a small KV cache (24 blocks
of 32 tokens) so that a flood is easy; the ``openai`` client and httpx talk to it over loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import random
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

import vllm_support
from test_examples import PROXY_VARIABLES, ServerProcess, _free_port, _model_dir

pytestmark = pytest.mark.vllm

KV_BLOCKS = 24  # 23 usable blocks of 32 tokens
MAX_MODEL_LEN = 736
DISCONNECT_ATTEMPTS = 10  # tries at leaving a stream half-way before it ends by itself
START_TIMEOUT_S = 180.0


@contextlib.contextmanager
def running_serve(
    log: pathlib.Path, kv_blocks: int, max_model_len: int, extra: Sequence[str] = ()
) -> Iterator[dict[str, Any]]:
    """``kvbudget serve`` on the tiny model, on loopback with no proxies, until the block ends;
    yields ``{"url", "proc"}``. ``extra``: more command-line arguments."""
    model = _model_dir()
    port = _free_port()
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.lower() in PROXY_VARIABLES}
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    proc = ServerProcess(
        "kvbudget serve",
        ["-m", "kvbudget.cli", "serve", str(model), "--dtype", "float32", "--enforce-eager",
         "--block-size", "32", "--num-gpu-blocks-override", str(kv_blocks),
         "--max-model-len", str(max_model_len), "--max-num-seqs", "64", "--port", str(port),
         "--served-model-name", "tiny", "--gpu-memory-utilization", "0.3",
         "--disable-uvicorn-access-log", *extra],
        log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url, START_TIMEOUT_S)
        yield {"url": url, "proc": proc}
    finally:
        proc.stop()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    log = tmp_path_factory.mktemp("serve-logs") / "kvbudget-serve.log"
    with running_serve(log, KV_BLOCKS, MAX_MODEL_LEN) as srv:
        yield srv


def _client(server: dict[str, Any]) -> Any:
    import httpx
    import openai

    return openai.OpenAI(
        base_url=f"{server['url']}/v1", api_key="x", max_retries=0,
        http_client=httpx.Client(trust_env=False, timeout=60),
    )


def _snapshot(server: dict[str, Any]) -> dict[str, Any]:
    import httpx

    data: dict[str, Any] = httpx.get(
        f"{server['url']}/kvbudget/snapshot", timeout=5, trust_env=False
    ).json()
    return data


def _wait_idle(server: dict[str, Any], timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        snap = _snapshot(server)
        if snap["reserved_blocks"] == 0 and snap["active"] == 0 and snap["queued"] == 0:
            return snap
        if time.monotonic() > deadline:
            return snap
        time.sleep(0.1)


def test_completions_and_chat_stream_and_not(server: dict[str, Any]) -> None:
    client = _client(server)
    done = client.completions.create(model="tiny", prompt="hello there", max_tokens=24,
                                      extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == 24
    chunks = list(client.completions.create(
        model="tiny", prompt="hello there", max_tokens=40, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens == 40 and text
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=16,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].logprobs is not None
    assert len(chat.choices[0].logprobs.content or []) == 16
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=16, stream=True,
        extra_body={"ignore_eos": True},
    )
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts)
    snap = _wait_idle(server)
    assert snap["reserved_blocks"] == 0 and snap["totals"]["completed"] >= 4


def test_parallel_samples_share_the_prompt(server: dict[str, Any]) -> None:
    """``n=3`` through vLLM's own OpenAI layer: three choices, each its tokens; the budget
    charged the prompt once (two samples found its blocks)."""
    client = _client(server)
    before = _snapshot(server)["totals"]
    prompt = " ".join(f"word{i}" for i in range(120))
    done = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, n=3,
                                      temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in done.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in done.choices)
    assert done.usage is not None and done.usage.completion_tokens == 36
    chunks = list(client.completions.create(
        model="tiny", prompt=prompt, max_tokens=10, n=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    reasons = {c.index: c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason}
    assert reasons == {0: "length", 1: "length"}
    after = _wait_idle(server)["totals"]
    assert after["completed"] == before["completed"] + 5
    assert after["prefix_shared_blocks"] >= before["prefix_shared_blocks"] + 3 * 2


def test_tools_and_structured_output(server: dict[str, Any]) -> None:
    """A request with tools is served; one under a grammar (``response_format``: structured
    outputs) is granted its hard max, since a pause would restart the grammar, and is never
    paused."""
    client = _client(server)
    before = _snapshot(server)["totals"]
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    }}
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "weather in Paris?"}],
        tools=[tool], tool_choice="none", max_tokens=16,
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    shaped = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a city, as JSON"}], max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"]}}},
    )
    assert shaped.choices[0].message.content
    after = _wait_idle(server)["totals"]
    assert after["full_grants"] == before["full_grants"] + 1
    assert after["pauses"] == before["pauses"]


def test_what_the_budget_cannot_carry_is_a_clear_400(server: dict[str, Any]) -> None:
    import httpx

    url = f"{server['url']}/v1/completions"
    r = httpx.post(url, json={"model": "tiny", "prompt": "hi", "max_tokens": 4, "n": 17},
                   trust_env=False, timeout=30)
    assert r.status_code == 400 and "parallel samples" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": "tiny", "prompt": "hi", "max_tokens": 4},
                   headers={"X-KVBudget-Class": "nope"}, trust_env=False, timeout=30)
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": "nope", "prompt": "hi", "max_tokens": 4},
                   trust_env=False, timeout=30)
    assert r.status_code == 404  # vLLM's own validation is still there


def test_overload_is_429_with_retry_after_and_never_an_error_after_200(
    server: dict[str, Any],
) -> None:
    import httpx

    before = _wait_idle(server)["rejections_by_reason"]
    rng = random.Random(0)

    async def flood() -> list[tuple[int, str | None, int, int]]:
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            async def one(i: int) -> tuple[int, str | None, int, int]:
                body = {"model": "tiny", "prompt": [rng.randrange(5, 1000) for _ in range(300)],
                        "max_tokens": 300, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                async with client.stream("POST", f"{server['url']}/v1/completions",
                                         json=body) as r:
                    errors = tokens = 0
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            errors += 1
                        elif chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                    return r.status_code, r.headers.get("retry-after"), errors, tokens

            return list(await asyncio.gather(*[one(i) for i in range(24)]))

    results = asyncio.run(flood())
    codes = [code for code, _, _, _ in results]
    assert codes.count(429) >= 1, codes
    assert all(ra is not None and int(ra) >= 1 for code, ra, _, _ in results if code == 429)
    served = [(errors, tokens) for code, _, errors, tokens in results if code == 200]
    assert served and all(errors == 0 and tokens == 300 for errors, tokens in served), served
    snap = _wait_idle(server)
    assert snap["reserved_blocks"] == 0 and snap["engine_preemptions"] == 0
    # every caller the budget turned away got its 429, those turned away after they queued
    # (the response already started: the middleware's held start) as well as at arrival
    turned_away = {
        reason: n - before.get(reason, 0)
        for reason, n in snap["rejections_by_reason"].items()
        if n > before.get(reason, 0)
    }
    assert sum(turned_away.values()) == codes.count(429), (turned_away, codes)


def test_disconnect_mid_stream_returns_the_blocks(server: dict[str, Any]) -> None:
    """A client that leaves at its first chunk: the engine request is aborted (counted as
    cancelled) and every block comes back. On a loaded machine the stream may be over before
    the close reaches the server (the rest sits in socket buffers); such an attempt proves
    nothing and is repeated."""
    import httpx

    tried: list[str] = []
    for _attempt in range(DISCONNECT_ATTEMPTS):
        idle = _wait_idle(server)["totals"]
        body = {"model": "tiny", "prompt": "go", "max_tokens": 700, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=60, trust_env=False) as client, client.stream(
            "POST", f"{server['url']}/v1/completions", json=body
        ) as r:
            assert r.status_code == 200
            first = ""
            for line in r.iter_lines():
                if line.startswith("data: "):
                    first = line
                    break  # leave after the first chunk
        snap = _wait_idle(server)
        delta = {k: snap["totals"][k] - idle[k] for k in ("completed", "cancelled")}
        tried.append(f"{delta} after first chunk {first[:80]!r}")
        if delta["completed"]:
            continue  # it ended before the close reached the server: again
        assert snap["reserved_blocks"] == 0, json.dumps(snap)
        assert delta["cancelled"] == 1, (first[:200], json.dumps(snap["totals"]))
        return
    pytest.fail(f"no stream was left half-way in {DISCONNECT_ATTEMPTS} attempts: {tried}")


def test_engine_profile_endpoint(server: dict[str, Any]) -> None:
    """``GET /kvbudget/engine-profile`` on ``kvbudget serve``: the profile fitted from the steps
    the engine ran (the tests above), loadable by the simulator."""
    import httpx

    from kvbudget.sim.profile import EngineProfile

    _client(server).completions.create(model="tiny", prompt="steps", max_tokens=16,
                                       extra_body={"ignore_eos": True})
    resp = httpx.get(f"{server['url']}/kvbudget/engine-profile", timeout=30, trust_env=False)
    assert resp.status_code == 200, resp.text
    profile = EngineProfile.from_dict(resp.json())
    assert profile.observed_steps >= 16 and profile.capacity_blocks == KV_BLOCKS - 1
    stretch = f"{server['url']}/kvbudget/engine-profile"
    none_ran = httpx.get(stretch, params={"since": 0, "until": 1}, timeout=30, trust_env=False)
    assert none_ran.status_code == 409
    bad = httpx.get(stretch, params={"since": 5, "until": 1}, timeout=30, trust_env=False)
    assert bad.status_code == 400 and "until" in bad.text


def test_metrics_carry_vllms_and_kvbudgets(server: dict[str, Any]) -> None:
    import httpx

    text = httpx.get(f"{server['url']}/metrics", timeout=10, trust_env=False).text
    assert "vllm:num_preemptions_total" in text
    assert "kvbudget_completed_total" in text and "kvbudget_engine_preemptions_total" in text


def test_a_client_stalled_past_five_seconds_reuses_its_pooled_connections(
    server: dict[str, Any],
) -> None:
    """A client that stalls past vLLM's 5 s keep-alive and then sends on its pooled
    connections is served (vLLM's own server resets them: ``ServerDisconnectedError``)."""
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
    statuses = vllm_support.posts_after_a_client_stall(f"{server['url']}/v1/completions", body)
    assert statuses == [200] * 4


def test_kvbudget_serve_takes_the_examples_first_token_pause_option() -> None:
    from kvbudget.policy_options import POLICY_DEFAULT
    from kvbudget.serve import make_parser

    parser = make_parser()
    assert parser.parse_args([]).kvbudget_first_token_pause_share == POLICY_DEFAULT
    args = parser.parse_args(["--kvbudget-first-token-pause-share", "off"])
    assert args.kvbudget_first_token_pause_share is None


def test_kvbudget_serve_takes_an_events_level() -> None:
    """``--kvbudget-events LEVEL``, as the examples' ``--events``; none given: kvbudget's events
    are left to structlog's defaults (info and up, kvbudget.observability.KvbudgetLogger)."""
    from kvbudget.serve import make_parser

    parser = make_parser()
    assert parser.parse_args([]).kvbudget_events is None
    assert parser.parse_args(["--kvbudget-events", "debug"]).kvbudget_events == "debug"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kvbudget-events", "verbose"])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
