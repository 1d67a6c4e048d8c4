"""serve_bench's workloads straight into the engine, no server, against the simulator's vLLM.

    PYTHONPATH=src:tests .venv/bin/python benchmarks/sim_vs_engine.py [--workload NAME ...] \
        [--engine-profile vllm-cpu-tiny|FILE|run] [--seed 0]

This module owns the engine half of issue 13's fidelity check. ``benchmarks/sim_vs_real.py``
compares the simulator with whole servers: vLLM's OpenAI server around the engine, with its HTTP,
tokenization, detokenization and streaming on the same two cores. This script sends the same
planned requests (:func:`sim_vs_real.plan_workload`: the same arrivals, lengths and shared
prefixes, imported, not copied) to a bare ``AsyncLLM`` with the engine settings serve_bench gives
its servers (257 blocks of 32 tokens, ``max_num_seqs`` 64, ``max_model_len`` 2048, prefix caching
on), token ids in, each at its planned time, and simulates the same plan with the
``reserve-current`` baseline (vLLM v1) on the engine profile (``run``: fitted from this run's own
engine steps, timed whole, with no front end but the replay's around them). Where the two agree
and the server does not, the difference is the server around the engine, which no engine profile
holds.

Per workload: good / late (serve_bench's rule: every token, TTFT <= 2 s, mean TPOT <= 100 ms),
TTFT p50 and p99 and vLLM's preemptions, engine and simulator side by side. Prompts are random
token ids (one random prefix per shared system prompt); outputs are sampled at temperature 1
with ``ignore_eos``. The abandonment workload is not replayed (its clients leave mid-stream).
Last line: one JSON object ``{"workloads": {NAME: {"engine": {...}, "sim": {...}}}, "meta":
{...}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import serve_bench as sb  # noqa: E402
import sim_vs_real as svr  # noqa: E402

#: serve_bench's workloads that a bare engine can replay (abandon's clients leave mid-stream)
WORKLOADS = tuple(w for w in sb.WORKLOADS if w != "abandon")


def prompt_ids(plan: Sequence[svr.Planned], seed: int, vocab: int = 1000) -> list[list[int]]:
    """Random token ids for every planned request, of its exact prompt length: the requests of
    one shared system prompt start with the same ``shared_prefix_tokens`` ids (drawn once per
    system prompt), the rest of each prompt is its own. Ids are drawn from ``[100, vocab)``,
    clear of the tiny model's special tokens."""
    rng = random.Random(seed)
    prefixes: dict[int, list[int]] = {}
    out = []
    for p in plan:
        head: list[int] = []
        if p.system_prompt is not None and p.shared_prefix_tokens:
            head = prefixes.setdefault(
                p.system_prompt,
                [rng.randrange(100, vocab) for _ in range(p.shared_prefix_tokens)],
            )
        own = max(0, p.prompt_tokens - len(head))
        out.append(head + [rng.randrange(100, vocab) for _ in range(own)])
    return out


def summarize(
    timings: Sequence[tuple[float | None, float | None, int, int]], preemptions: int
) -> dict[str, Any]:
    """good / late / failed and TTFT figures of ``(ttft, tpot, tokens, expected)`` per request,
    by serve_bench's rule."""
    good = late = failed = 0
    ttfts = []
    for ttft, tpot, tokens, expected in timings:
        if ttft is None or tpot is None or tokens != expected:
            failed += 1
            continue
        ttfts.append(ttft)
        if sb.in_time(ttft, tpot):
            good += 1
        else:
            late += 1
    ttfts.sort()
    return {
        "sent": len(timings),
        "good": good,
        "late": late,
        "failed": failed,
        "ttft_p50_s": sb._pct(ttfts, 50),
        "ttft_p99_s": sb._pct(ttfts, 99),
        "engine_preemptions": preemptions,
    }


async def replay(
    engine: Any, tag: str, plan: Sequence[svr.Planned], prompts: Sequence[list[int]]
) -> list[tuple[float | None, float | None, int, int]]:
    """Send every planned request to ``engine`` at its planned time; ``(ttft, tpot, tokens,
    expected)`` of each."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    start = time.monotonic()
    timings: list[tuple[float | None, float | None, int, int]] = []

    async def one(p: svr.Planned, ids: list[int]) -> None:
        await asyncio.sleep(max(0.0, p.arrival_s - (time.monotonic() - start)))
        sent = time.monotonic()
        sp = SamplingParams(
            max_tokens=p.output_tokens, ignore_eos=True, temperature=1.0,
            output_kind=RequestOutputKind.DELTA,
        )
        first = last = None
        tokens = 0
        async for o in engine.generate({"prompt_token_ids": ids}, sp, f"{tag}-{p.index}"):
            k = len(o.outputs[0].token_ids)
            if k:
                last = time.monotonic()
                first = first if first is not None else last
                tokens += k
        ttft = None if first is None else first - sent
        tpot = None
        if first is not None and last is not None:
            tpot = 0.0 if tokens < 2 else (last - first) / (tokens - 1)
        timings.append((ttft, tpot, tokens, p.output_tokens))

    await asyncio.gather(*(one(p, ids) for p, ids in zip(plan, prompts, strict=True)))
    return timings


async def run_engine(
    names: Sequence[str], seed: int, recorder: Any = None
) -> dict[str, dict[str, Any]]:
    """Every workload of ``names`` through one bare AsyncLLM, one after the other; with a
    ``recorder`` (:class:`kvbudget.sim.profile.StepRecorder`) every busy engine step is kept,
    timed whole (from one step's stats to the next), with its batch and prefilled tokens (its
    context is not known without a budget: 0)."""
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    import vllm_support
    from kvbudget.vllm import EngineStats

    args = vllm_support.make_engine_args(
        vllm_support.tiny_model_dir(), num_blocks=sb.KV_BLOCKS, block_size=32,
        max_num_seqs=sb.MAX_NUM_SEQS, max_model_len=sb.MAX_MODEL_LEN,
    )
    args.enable_logging_iteration_details = True  # every step reports its batch and prefill
    stats = EngineStats()
    if recorder is not None:

        def on_step(batch: int, seconds: float, prefill: int | None, wall: float | None) -> None:
            if prefill is not None:
                recorder.record(batch, 0, prefill, seconds)
                if wall is not None:
                    recorder.record_wall(batch, 0, prefill, wall)

        stats.on_step = on_step
    engine = AsyncLLM.from_engine_args(args, stat_loggers=[stats.factory])
    out: dict[str, dict[str, Any]] = {}
    try:
        warm = SamplingParams(max_tokens=4)
        async for _ in engine.generate({"prompt_token_ids": [5] * 64}, warm, "warm-up"):
            pass
        for name in names:
            plan = svr.plan_workload(name, seed, svr.TINY_TOKENIZER)
            before = stats.preemptions
            start = time.monotonic()
            timings = await replay(engine, name, plan, prompt_ids(plan, seed))
            out[name] = summarize(timings, stats.preemptions - before)
            out[name]["duration_s"] = round(time.monotonic() - start, 2)
    finally:
        engine.shutdown()
    return out


def run_sim(names: Sequence[str], seed: int, profile: Any) -> dict[str, dict[str, Any]]:
    """The same plans through the simulator's vLLM (``reserve-current``) on ``profile``."""
    from kvbudget.sim.driver import simulate

    out = {}
    for name in names:
        plan = svr.plan_workload(name, seed, svr.TINY_TOKENIZER)
        scenario, reqs = svr.sim_requests(plan)
        result = simulate(
            reqs, scenario, profile.engine_model(), svr.VLLM_POLICY, seed=seed,
            keep_requests=True,
        )
        s = svr.summarize_sim(result.request_records)
        out[name] = {
            "sent": s["sent"], "good": s["good"], "late": s["late"], "failed": s["failed"],
            "ttft_p50_s": s["ttft_p50_s"], "ttft_p99_s": s["ttft_p99_s"],
            "engine_preemptions": result.preemptions, "duration_s": s["duration_s"],
        }
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", action="append", choices=list(WORKLOADS), default=None)
    p.add_argument("--engine-profile", default="vllm-cpu-tiny",
                   help="the simulated engine: a profile file or a shipped name, or 'run': "
                        "fitted from this run's own engine steps, timed whole")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)
    from kvbudget.sim.profile import EngineProfile, StepRecorder, fit_profile

    names = [w for w in WORKLOADS if ns.workload is None or w in ns.workload]
    recorder = StepRecorder() if ns.engine_profile == "run" else None
    real = asyncio.run(run_engine(names, ns.seed, recorder))
    if recorder is not None:
        profile = fit_profile(
            recorder.wall, name="bare-engine-run",
            source=f"this run's {len(recorder.wall)} bare-engine steps, timed whole",
            capacity_blocks=sb.KV_BLOCKS - 1, block_size=32, max_batch=sb.MAX_NUM_SEQS,
            prefill_chunk_tokens=EngineProfile.load("vllm-cpu-tiny").prefill_chunk_tokens,
        )
        print(f"# fitted: {json.dumps(profile.to_dict()['step'])}")
    else:
        profile = EngineProfile.load(ns.engine_profile)
    sim = run_sim(names, ns.seed, profile)
    print("workload      good e/s   late e/s   TTFT p50 e/s    TTFT p99 e/s    preempt e/s")
    for name in names:
        e, s = real[name], sim[name]
        print(
            f"{name:13s} {e['good']:>4}/{s['good']:<4} {e['late']:>4}/{s['late']:<4} "
            f"{e['ttft_p50_s']:>6.2f}/{s['ttft_p50_s']:<6.2f}  {e['ttft_p99_s']:>6.2f}/"
            f"{s['ttft_p99_s']:<6.2f}  {e['engine_preemptions']:>4}/{s['engine_preemptions']}"
        )
    print(json.dumps({
        "workloads": {n: {"engine": real[n], "sim": sim[n]} for n in names},
        "meta": {"engine_profile": profile.name, "seed": ns.seed,
                 "median_ttft_ratio": statistics.median(
                     real[n]["ttft_p50_s"] / sim[n]["ttft_p50_s"] for n in names
                     if sim[n]["ttft_p50_s"])},
    }))


if __name__ == "__main__":
    main()
