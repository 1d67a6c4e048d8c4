"""The pure parts of ``benchmarks/frontend_cpu.py`` (its servers are serve_bench's, whose real
runs tests/test_serve_bench.py and the benchmark itself cover)."""

from __future__ import annotations

import json
import pathlib
import socket
import sys
from typing import Any

import pytest

from _bench_loader import load_benchmark

fc = load_benchmark("frontend_cpu")


def _round(**us: float) -> dict[str, dict[str, Any]]:
    return {name: {"frontend_us_per_token": v} for name, v in us.items()}


def test_ratios_are_taken_within_each_round_against_vllms_server_and_the_base() -> None:
    """A machine twice as slow in one round moves every server alike: the per-round ratios
    stay, the medians of the figures do not."""
    rounds = [
        _round(vllm=50.0, **{"kvbudget-serve": 60.0, fc.BASE: 66.0}),
        _round(vllm=100.0, **{"kvbudget-serve": 110.0, fc.BASE: 132.0}),
        _round(vllm=52.0, **{"kvbudget-serve": 65.0, fc.BASE: 65.0}),
    ]
    s = fc.summary(rounds, ["vllm", "kvbudget-serve", fc.BASE])
    assert s["vllm"] == {"us_per_token_median": 52.0, "us_per_token_range": [50.0, 100.0]}
    serve = s["kvbudget-serve"]
    assert serve["ratio_to_vllm_median"] == 1.2
    assert serve["ratio_to_vllm_range"] == [1.1, 1.25]
    assert serve["ratio_to_base_median"] == pytest.approx(0.909, abs=1e-3)
    assert serve["ratio_to_base_range"] == [pytest.approx(0.833, abs=1e-3), 1.0]
    assert "ratio_to_base_median" not in s[fc.BASE]  # (not against itself)
    assert "ratio_to_vllm_median" in s[fc.BASE]


def test_the_order_rotates_each_round() -> None:
    names = ["vllm", "kvbudget-serve", "kvbudget"]
    assert [fc.rotated(names, k)[0] for k in range(4)] == ["vllm", "kvbudget-serve",
                                                           "kvbudget", "vllm"]


def test_options_are_checked(tmp_path: pathlib.Path) -> None:
    assert fc.parse_args([]).names == ["vllm", "kvbudget-serve"]
    for bad in (["--servers", "vllm,tgi"], ["--servers", ""], ["--rounds", "0"],
                ["--against", str(tmp_path)]):
        with pytest.raises(SystemExit):
            fc.parse_args(bad)
    (tmp_path / "src" / "kvbudget").mkdir(parents=True)
    opts = fc.parse_args(["--against", str(tmp_path), "--servers", "vllm"])
    assert opts.names == ["vllm", fc.BASE]


def test_the_base_server_imports_kvbudget_from_its_own_tree(tmp_path: pathlib.Path) -> None:
    """A server started with ``src`` (``--against DIR``: ``DIR/src``) imports kvbudget from
    there, not from this repository: the started process itself is asked (it records what it
    imported and exits; serve_bench then reports it exited while starting)."""
    sb = fc.sb
    fake = tmp_path / "base" / "src" / "kvbudget"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    seen = tmp_path / "imported"
    probe = f"import kvbudget, pathlib; pathlib.Path({str(seen)!r}).write_text(kvbudget.__file__)"
    for src, expected in ((fake.parent, fake / "__init__.py"),
                          (None, sb.ROOT / "src" / "kvbudget" / "__init__.py")):
        spec = sb.ServerSpec("kvbudget-serve", "kvbudget-serve")
        with socket.socket() as sock:  # (a free port: the process exits before it listens)
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server = sb.ServerProcess(spec, [sys.executable, "-c", probe], port, tmp_path / "log",
                                  src=src)
        with pytest.raises(sb.ServerError, match="exited"):
            server.start()
        assert pathlib.Path(seen.read_text()).resolve() == expected.resolve()
    assert sb.server_env(fake.parent)["PYTHONPATH"] == str(fake.parent)


def test_the_client_counts_tokens_and_turned_away_callers_over_a_real_socket() -> None:
    """``drive`` against a small SSE server on loopback: every streamed token id is counted,
    a 429 or 503 is a caller turned away (counted, the round goes on), and any other answer
    ends the round with an error that names it."""
    import asyncio

    from aiohttp import web

    answers: list[int] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] and body["ignore_eos"] and body["return_token_ids"]
        assert len(body["prompt"]) == 16
        status = answers.pop(0) if answers else 200
        if status != 200:
            return web.json_response({"error": "no"}, status=status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [k + 1]}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def scenario() -> list[Any]:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        base = f"http://127.0.0.1:{port}"
        try:
            answers.extend([429, 503])
            got = [await fc.drive(base, 6, 3, 16, 5, 0)]
            answers.append(500)
            try:
                await fc.drive(base, 2, 1, 16, 5, 0)
            except RuntimeError as exc:
                got.append(str(exc))
            return got
        finally:
            await runner.cleanup()

    counted, error = asyncio.run(scenario())
    assert counted == (4 * 5, 2)  # four streams of 5 tokens; two callers turned away
    assert "HTTP 500" in error
