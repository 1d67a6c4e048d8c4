"""Bare vLLM vs kvbudget over vLLM on the tiny CPU model: the preemption wave and throughput.

    PYTHONPATH=src:tests .venv/bin/python benchmarks/vllm_wave.py [--rounds 3]

1. *Wave*: a KV cache of 64 blocks x 32 tokens (63 usable); 32 concurrent requests of 7 prompt +
   200 output tokens (``ignore_eos``). First through the bare ``AsyncLLM``, then through
   :class:`kvbudget.vllm.BudgetedEngine` around the same engine. vLLM's own preemptions are
   counted by the stat logger (Σ ``iteration_stats.num_preempted_reqs``).
2. *Throughput*: a second engine with an unconstrained cache (4096 blocks); 32 streams of 7 + 256
   tokens, bare and kvbudget back to back ``--rounds`` times (alternating which goes first);
   the median of the paired tokens/s ratios (robust to a machine whose load drifts), and the
   frontend process's CPU time per token (the adapter's overhead, independent of load).

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]


def _prompt(i: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": [0] + [100 + i] * 6}


def _sp(n: int) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=n, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA
    )


async def _stream(gen: Any) -> int:
    n = 0
    async for out in gen:
        n += len(out.outputs[0].token_ids)
    return n


def _classes() -> Any:
    from kvbudget.core.model import ServiceClass

    # interactive without a queue-delay bound: the wave queues rather than being turned away
    return [ServiceClass("interactive", protected=True, preemptible=False, latency_floor_s=None)]


async def _wave(engine: Any, stats: Any, n: int, out_len: int, tag: str) -> tuple[int, int, float]:
    from kvbudget.vllm import BudgetedEngine

    before = stats.preemptions
    t0 = time.monotonic()
    if tag == "bare":
        lens = await asyncio.gather(
            *[_stream(engine.generate(_prompt(i), _sp(out_len), f"{tag}-{i}")) for i in range(n)]
        )
    else:
        async with BudgetedEngine(engine, stats=stats, classes=_classes()) as be:
            lens = await asyncio.gather(
                *[_stream(be.generate(_prompt(i), _sp(out_len), f"{tag}-{i}")) for i in range(n)]
            )
    wall = time.monotonic() - t0
    full = sum(1 for x in lens if x == out_len)
    return stats.preemptions - before, full, wall


async def _throughput(
    engine: Any, stats: Any, n: int, out_len: int, rounds: int
) -> tuple[float, float, float]:
    """Median over rounds of (kvbudget tok/s) / (bare tok/s), each pair run back to back (the
    order alternates), plus the frontend process's CPU time per token for each."""
    from kvbudget.vllm import BudgetedEngine

    cpu = {"bare": 0.0, "kvb": 0.0}
    toks = {"bare": 0, "kvb": 0}

    async def bare(r: int) -> float:
        c0, t0 = time.process_time(), time.monotonic()
        lens = await asyncio.gather(
            *[_stream(engine.generate(_prompt(i), _sp(out_len), f"tb-{r}-{i}")) for i in range(n)]
        )
        wall = time.monotonic() - t0
        cpu["bare"] += time.process_time() - c0
        toks["bare"] += sum(lens)
        return sum(lens) / wall

    async def kvb(r: int) -> float:
        async with BudgetedEngine(engine, stats=stats, classes=_classes()) as be:
            c0, t0 = time.process_time(), time.monotonic()
            lens = await asyncio.gather(
                *[_stream(be.generate(_prompt(i), _sp(out_len), f"tk-{r}-{i}"))
                  for i in range(n)]
            )
            wall = time.monotonic() - t0
            cpu["kvb"] += time.process_time() - c0
            toks["kvb"] += sum(lens)
            return sum(lens) / wall

    await bare(-1)  # warm-up
    cpu["bare"], toks["bare"] = 0.0, 0
    b: list[float] = []
    k: list[float] = []
    for r in range(rounds):
        if r % 2:
            k.append(await kvb(r))
            b.append(await bare(r))
        else:
            b.append(await bare(r))
            k.append(await kvb(r))
    ratios = [x / y for x, y in zip(k, b, strict=True)]
    print(f"throughput tok/s bare={[round(x) for x in b]} kvbudget={[round(x) for x in k]} "
          f"paired ratios={[round(x, 2) for x in ratios]}")
    us_bare = 1e6 * cpu["bare"] / max(1, toks["bare"])
    us_kvb = 1e6 * cpu["kvb"] / max(1, toks["kvb"])
    print(f"frontend CPU per token: bare {us_bare:.1f} us, kvbudget {us_kvb:.1f} us")
    return statistics.median(ratios), us_bare, us_kvb


def _start(model_dir: Path, num_blocks: int, stats: Any) -> Any:
    from vllm.v1.engine.async_llm import AsyncLLM

    import vllm_support

    args = vllm_support.make_engine_args(
        model_dir, num_blocks=num_blocks, max_num_seqs=64, max_model_len=1024
    )
    return AsyncLLM.from_engine_args(args, stat_loggers=[stats.factory])


async def main(rounds: int) -> dict[str, Any]:
    import vllm_support
    from kvbudget.vllm import EngineStats

    model_dir = vllm_support.tiny_model_dir()
    n, out_len = 32, 200

    stats = EngineStats()
    engine = _start(model_dir, 64, stats)
    try:
        bare_pre, bare_full, bare_wall = await _wave(engine, stats, n, out_len, "bare")
        kvb_pre, kvb_full, kvb_wall = await _wave(engine, stats, n, out_len, "kvb")
    finally:
        engine.shutdown()
    print(f"wave bare: {bare_pre} preemptions, {bare_full}/{n} full, {bare_wall:.2f}s; "
          f"kvbudget: {kvb_pre} preemptions, {kvb_full}/{n} full, {kvb_wall:.2f}s")

    stats2 = EngineStats()
    engine2 = _start(model_dir, 4096, stats2)
    try:
        ratio, us_bare, us_kvb = await _throughput(engine2, stats2, 32, 256, rounds)
    finally:
        engine2.shutdown()
    return {
        "bare_preemptions": bare_pre,
        "kvbudget_preemptions": kvb_pre,
        "bare_completed_full_length": bare_full,
        "kvbudget_completed_full_length": kvb_full,
        "wave_time_ratio": round(kvb_wall / bare_wall, 3),
        "throughput_ratio_unconstrained": round(ratio, 3),
        "frontend_cpu_us_per_token_bare": round(us_bare, 1),
        "frontend_cpu_us_per_token_kvbudget": round(us_kvb, 1),
    }


if __name__ == "__main__":
    import vllm_support

    vllm_support.configure_vllm_env()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    ns = parser.parse_args()
    result = asyncio.run(main(ns.rounds))
    print(json.dumps(result))
