"""What a server's front end costs per streamed token: vLLM's own OpenAI server beside
``kvbudget serve`` (and the FastAPI example), on the same tiny CPU engine, side by side.

Why. On a machine where the engine and the front end share the cores (this one: 2), every
microsecond the front-end process spends per token is taken from the engine: in serve_bench's
runs the kvbudget servers' engines ran slower in the very turns where they served fewer callers
than vLLM's server, and ``sim_vs_real.py --pace-of vllm`` puts their decisions level with vLLM's
or above once they run on vLLM's engine pace (docs/benchmarks-history.md, forty-first session). This
benchmark isolates that cost: no request waits for KV (a cache far larger than the load needs,
so neither the budget nor vLLM pauses or preempts anything), prompts are sent as token ids (no
tokenization), and every server gets the same streams.

What it does. It starts every server at once on the tiny model (``--servers``; a budgeted server
whose budget pauses or preempts, or turns a caller away, during a round is flagged in that
round; so is a server whose engine preempts), then for ``--rounds``
rounds drives each server in turn (the order rotates every round; the others stopped meanwhile,
SIGSTOP to their process groups; every server at serve_bench's niceness: without it the same
server's figure varied 2x between rounds, the others stopped or not) with
``--requests`` streaming ``/v1/completions`` requests, ``--concurrency`` at a time, each
``--prompt-len`` token ids and ``--output-len`` tokens (``ignore_eos``, ``return_token_ids``).
A round measures the front-end process's CPU time (every thread of it, from the OS; its
engine-core child apart) over the tokens its clients received. One warm-up round, not
counted, comes first. With a smaller ``--kv-blocks`` and more ``--concurrency`` the same is
measured under pressure: pauses, preemptions and callers turned away (429 or 503: counted,
not errors) are then part of what each front end does per token, and each round says how many.

``--against DIR``: one more ``kvbudget serve`` (``kvbudget-serve@base``) run on the kvbudget
under ``DIR/src`` (e.g. a ``git worktree`` of the commit before a change), driven in the same
rounds: two trees compared side by side, on the same machine state.

Output: a line per round and server; then per server the median µs of front-end CPU per token
with its range, and per round the ratio of each server's figure to vLLM's server's (median and
range over the rounds): the machine drifts by 20-30 % between runs, a ratio within a round much
less. The last line is one JSON object with every figure.

Run: ``python benchmarks/frontend_cpu.py [--rounds 5] [--servers vllm,kvbudget-serve,kvbudget]
[--against DIR]`` (about 1 minute to start the servers, then about 10 s per round and server).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench as sb  # (the servers as serve_bench starts them)

#: blocks of 32 tokens: room for every stream of the default load several times over
KV_BLOCKS = 1024
BASE = "kvbudget-serve@base"


@contextlib.contextmanager
def alone(server: sb.ServerProcess, others: Sequence[sb.ServerProcess]) -> Iterator[None]:
    """The other servers' process groups stopped (SIGSTOP) while ``server`` is measured, so
    that nothing of theirs runs beside it (each server's process group is its own: serve_bench
    starts it in a new session)."""
    groups = [o.proc.pid for o in others if o.proc is not None]
    for g in groups:
        os.killpg(g, signal.SIGSTOP)
    try:
        time.sleep(0.5)  # (what was running settles)
        yield
    finally:
        for g in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(g, signal.SIGCONT)


#: what a round counts of the waiting it should not have (:func:`waited`)
WAITS = ("budget_preemptions", "budget_pauses", "engine_preemptions")


def waited(server: sb.ServerProcess) -> dict[str, float | None]:
    """The server's preemptions so far, as serve_bench reads them (``ServerProcess.counters``:
    the engine's, under vLLM's metric or the example's, and the budget's), and its budget's
    pauses (its snapshot; None for vLLM's server)."""
    counters = server.counters()
    totals = (server.snapshot() or {}).get("totals")
    return {
        "budget_preemptions": counters["budget_preemptions"],
        "budget_pauses": None if totals is None else sb._num(totals.get("pauses", 0)),
        "engine_preemptions": counters["engine_preemptions"],
    }


#: answers that turn a caller away (the budget's 429, vLLM's queue caps' 503): counted, not errors
TURNED_AWAY = (429, 503)


async def drive(
    base_url: str, requests: int, concurrency: int, prompt_len: int, output_len: int, round_: int
) -> tuple[int, int]:
    """Send the round's streams: (tokens their clients received, callers turned away). Any other
    answer than 200 or a turn-away raises."""
    import aiohttp  # (vLLM's own dependency)

    received = turned_away = 0
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=600)

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal received, turned_away
        # distinct prompts (no prefix cache hit between them), the same in every server's turn
        prompt = [1 + (round_ * 7919 + i * 104729 + k * 31) % 900 for k in range(prompt_len)]
        body = {
            "model": sb.SERVED_MODEL, "prompt": prompt, "max_tokens": output_len,
            "stream": True, "ignore_eos": True, "return_token_ids": True, "temperature": 1.0,
        }
        async with gate, session.post(f"{base_url}/v1/completions", json=body) as resp:
            if resp.status in TURNED_AWAY:
                turned_away += 1
                return
            if resp.status != 200:
                raise RuntimeError(f"{base_url}: HTTP {resp.status}: {await resp.text()}")
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    received += len(choice.get("token_ids") or ())

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(session, i) for i in range(requests)))
    return received, turned_away


def measure(server: sb.ServerProcess, opts: argparse.Namespace, round_: int) -> dict[str, Any]:
    """One round on one server."""
    counts = waited(server)
    before = server.cpu_seconds()  # (after the scrapes, which cost the front end CPU too)
    t0 = time.monotonic()
    tokens, turned_away = asyncio.run(drive(server.base, opts.requests, opts.concurrency,
                                            opts.prompt_len, opts.output_len, round_))
    wall = time.monotonic() - t0
    after = server.cpu_seconds()
    fe = (after["frontend_cpu_s"] or 0.0) - (before["frontend_cpu_s"] or 0.0)
    engine = (after["engine_cpu_s"] or 0.0) - (before["engine_cpu_s"] or 0.0)
    after_counts = waited(server)
    expected = opts.requests * opts.output_len
    return {
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "frontend_cpu_s": round(fe, 3),
        "engine_cpu_s": round(engine, 3),
        "frontend_us_per_token": round(1e6 * fe / max(1, tokens), 2),
        "tokens_per_s": round(tokens / wall, 1),
        # the round is not the clean per-token measure it is meant to be where something waited
        **{k: int(sb._delta(after_counts[k], counts[k]) or 0) for k in WAITS},
        "turned_away": turned_away,
        "complete": tokens == expected,
    }


def rotated(names: Sequence[str], k: int) -> list[str]:
    k %= len(names)
    return [*names[k:], *names[:k]]


def summary(rounds: list[dict[str, dict[str, Any]]], names: Sequence[str]) -> dict[str, Any]:
    """Per server: the median and range of µs per token; the median and range over the rounds
    of its ratio to vLLM's server's figure in the same round."""
    out: dict[str, Any] = {}
    for name in names:
        per = [r[name]["frontend_us_per_token"] for r in rounds]
        entry: dict[str, Any] = {
            "us_per_token_median": round(statistics.median(per), 2),
            "us_per_token_range": [min(per), max(per)],
        }
        for ref, key in (("vllm", "vllm"), (BASE, "base")):
            if ref in names and name not in (ref, "vllm"):
                ratios = sorted(
                    r[name]["frontend_us_per_token"] / r[ref]["frontend_us_per_token"]
                    for r in rounds
                )
                entry[f"ratio_to_{key}_median"] = round(statistics.median(ratios), 3)
                entry[f"ratio_to_{key}_range"] = [round(ratios[0], 3), round(ratios[-1], 3)]
        out[name] = entry
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default="vllm,kvbudget-serve",
                   help="comma-separated: vllm, kvbudget-serve, kvbudget (the FastAPI example)")
    p.add_argument("--against", type=Path, default=None, metavar="DIR",
                   help=f"one more kvbudget serve ({BASE}) on the kvbudget under DIR/src")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--kv-blocks", type=int, default=KV_BLOCKS)
    p.add_argument("--server-nice", type=int, default=sb.DEFAULT_SERVER_NICE, metavar="N",
                   help="every server's niceness, as serve_bench's (default "
                        f"{sb.DEFAULT_SERVER_NICE}: the client is not starved by them)")
    p.add_argument("--port", type=int, default=8520)
    p.add_argument("--model", type=Path, default=sb.ROOT / ".pytest_cache" / "kvbudget-tiny")
    opts = p.parse_args(argv)
    names = [n.strip() for n in opts.servers.split(",") if n.strip()]
    unknown = sorted(set(names) - {"vllm", "kvbudget-serve", "kvbudget"})
    if unknown or not names:
        p.error(f"--servers: unknown {unknown}" if unknown else "--servers: none given")
    if opts.against is not None and not (opts.against / "src" / "kvbudget").is_dir():
        p.error(f"--against {opts.against}: no src/kvbudget there")
    for flag in ("rounds", "requests", "concurrency", "prompt_len", "output_len", "kv_blocks"):
        if getattr(opts, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    opts.names = names + ([BASE] if opts.against is not None else [])
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    sb.configure_client_env()
    from kvbudget.engines.tiny_model import build_tiny_llama

    model = build_tiny_llama(opts.model)
    need = opts.concurrency * -(-(opts.prompt_len + opts.output_len) // sb.BLOCK_SIZE)
    if need > opts.kv_blocks // 2:
        print(f"! {opts.concurrency} streams take {need} of {opts.kv_blocks} blocks: raise "
              "--kv-blocks, or a budget may wait for room", flush=True)
    with contextlib.ExitStack() as stack:
        servers: dict[str, sb.ServerProcess] = {}
        for k, name in enumerate(opts.names):
            spec = sb.ServerSpec(name, "kvbudget-serve" if name == BASE else name)
            argv_ = spec.argv(model, opts.port + k, "calibrated", kv_blocks=opts.kv_blocks,
                              max_num_seqs=max(sb.MAX_NUM_SEQS, opts.concurrency))
            log = Path(os.environ.get("TMPDIR", "/tmp")) / f"frontend_cpu-{name}.log"
            src = opts.against.resolve() / "src" if name == BASE else None
            servers[name] = stack.enter_context(sb.ServerProcess(
                spec, argv_, opts.port + k, log, nice=opts.server_nice, src=src
            ))
            print(f"# {name} up on port {opts.port + k} (log {log})", flush=True)

        def measured(name: str, round_: int) -> dict[str, Any]:
            with alone(servers[name], [servers[o] for o in opts.names if o != name]):
                return measure(servers[name], opts, round_)

        for name in opts.names:  # warm-up, not counted
            measured(name, -1)
        rounds: list[dict[str, dict[str, Any]]] = []
        for r in range(opts.rounds):
            row: dict[str, dict[str, Any]] = {}
            for name in rotated(opts.names, r):
                row[name] = m = measured(name, r)
                flags = [] if m["complete"] else ["INCOMPLETE"]
                flags += [f"{k}={m[k]}" for k in (*WAITS, "turned_away") if m[k]]
                print(f"round {r} {name:<20} {m['frontend_us_per_token']:7.2f} us/token "
                      f"({m['tokens']} tokens, {m['wall_s']:.2f} s, {m['tokens_per_s']:.0f} "
                      f"tokens/s, engine {m['engine_cpu_s']:.2f} s) {' '.join(flags)}",
                      flush=True)
            rounds.append(row)
    result = summary(rounds, opts.names)
    for name, s in result.items():
        line = (f"{name:<20} median {s['us_per_token_median']:.2f} us/token "
                f"[{s['us_per_token_range'][0]:.2f}-{s['us_per_token_range'][1]:.2f}]")
        if "ratio_to_vllm_median" in s:
            line += (f", / vLLM's server per round {s['ratio_to_vllm_median']:.3f} "
                     f"[{s['ratio_to_vllm_range'][0]:.3f}-{s['ratio_to_vllm_range'][1]:.3f}]")
        if "ratio_to_base_median" in s:
            line += (f", / {BASE} per round {s['ratio_to_base_median']:.3f} "
                     f"[{s['ratio_to_base_range'][0]:.3f}-{s['ratio_to_base_range'][1]:.3f}]")
        print(line)
    print(json.dumps({"summary": result, "rounds": rounds, "settings": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()
    }}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
