"""Twins over the real engine: requests sharing a long prompt prefix, bare vLLM against kvbudget.

    PYTHONPATH=src:tests .venv/bin/python benchmarks/prefix_twins.py [--repeat 3] \
        [--requests 48] [--prefix 640] [--own 5] [--out 40] [--blocks 129] [--settle 0.3]

Issue 12's case: ``--requests`` requests submitted at once, each a shared ``--prefix``-token prefix
(fresh random tokens per run, so no run finds another's blocks cached) plus ``--own`` tokens of its
own, ``--out`` greedy output tokens with ``ignore_eos``, on the tiny CPU model (``--blocks`` KV
blocks of 32 tokens, 128 usable). One engine; each repeat runs bare ``AsyncLLM.generate`` and the
same engine behind :class:`kvbudget.vllm.BudgetedEngine`, side by side, the one or the other first
in turn; a fresh ``BudgetedEngine`` per run (it probes the engine's prefill with 8 requests when
entered), or with ``--shared-budget`` one for every run, entered once before the first, as a server
keeps one. Prints per run the wall time, TTFT p50, the front-end process's CPU time, vLLM's own
preemptions, the peak of requests running at once and the peak KV usage; then the ratios of
kvbudget's wall time and front-end CPU to bare vLLM's (median and spread over the repeats). Last
line: one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]


class _Peak:
    """Peaks of running requests and KV usage, from vLLM's per-step scheduler stats."""

    def __init__(self, stats: Any) -> None:
        self.stats = stats
        self.running = 0
        self.kv = 0.0
        self.preempted = 0
        self._prev = stats.record

        def record(scheduler_stats: Any, iteration_stats: Any, *a: Any, **k: Any) -> None:
            self._prev(scheduler_stats, iteration_stats, *a, **k)
            if scheduler_stats is not None:
                self.running = max(self.running, scheduler_stats.num_running_reqs)
                self.kv = max(self.kv, scheduler_stats.kv_cache_usage)
            if iteration_stats is not None:
                self.preempted += iteration_stats.num_preempted_reqs

        stats.record = record

    def restore(self) -> None:
        self.stats.record = self._prev


async def _wave(gen: Any, prompts: list[list[int]], sp: Any, tag: str) -> dict[str, Any]:
    ttfts: list[float] = []
    tokens = 0
    start = time.monotonic()

    async def one(i: int) -> None:
        nonlocal tokens
        first = None
        async for out in gen({"prompt_token_ids": prompts[i]}, sp, f"{tag}-{i}"):
            n = len(out.outputs[0].token_ids)
            if n and first is None:
                first = time.monotonic() - start
            tokens += n
        ttfts.append(first if first is not None else float("nan"))

    cpu0 = time.process_time()
    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return {
        "wall_s": time.monotonic() - start,
        # the front-end process's CPU (every thread of it: the event loop, vLLM's input
        # processing and output threads), steadier than the wall time on a noisy machine
        "frontend_cpu_s": time.process_time() - cpu0,
        "ttft_p50_s": statistics.median(ttfts),
        "tokens": tokens,
    }


async def _main(ns: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    import vllm_support
    from kvbudget.core.model import ServiceClass
    from kvbudget.vllm import BudgetedEngine, EngineStats

    model = vllm_support.tiny_model_dir()
    args = vllm_support.make_engine_args(
        model, num_blocks=ns.blocks, block_size=32, max_num_seqs=64, max_model_len=2048
    )
    stats = EngineStats()
    engine = AsyncLLM.from_engine_args(args, stat_loggers=[stats.factory])
    sp = SamplingParams(
        max_tokens=ns.out, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA
    )
    rng = random.Random(ns.seed)
    # queue without a bound: this measures how many run at once, not who is turned away
    classes = [ServiceClass("interactive", priority=0, protected=True, preemptible=False)]
    runs: list[dict[str, Any]] = []
    shared: Any = None
    try:
        if ns.shared_budget:
            budget = BudgetedEngine(engine, stats=stats, classes=classes)
            await budget.__aenter__()
            shared = budget  # (entered: the finally below closes it)
        # warm-up (first steps of a fresh engine are slow)
        await _wave(engine.generate, [[rng.randrange(100, 1000) for _ in range(64)]], sp, "w")
        for rep in range(ns.repeat):
            row: dict[str, Any] = {}
            # the two alternate which goes first: the machine drifts within a repeat as well
            order = ("vllm", "kvbudget") if rep % 2 == 0 else ("kvbudget", "vllm")
            for server in order:
                prefix = [rng.randrange(100, 1000) for _ in range(ns.prefix)]
                prompts = [
                    prefix + [rng.randrange(100, 1000) for _ in range(ns.own)]
                    for _ in range(ns.requests)
                ]
                peak = _Peak(stats)
                try:
                    if server == "vllm":
                        # (bare vLLM's steps do not feed a budget, shared or not)
                        hook, stats.on_step = stats.on_step, None
                        try:
                            fig = await _wave(engine.generate, prompts, sp, f"v{rep}")
                        finally:
                            stats.on_step = hook
                    else:
                        be = shared or BudgetedEngine(engine, stats=stats, classes=classes)
                        async with contextlib.AsyncExitStack() as stack:
                            if shared is None:
                                await stack.enter_async_context(be)
                            fig = await _wave(be.generate, prompts, sp, f"k{rep}")
                            snap = be.snapshot()
                            fig["prefix_shared_blocks"] = snap.totals.prefix_shared_blocks
                            fig["prefix_mismatches"] = be.prefix_mismatches
                            fig["prefix_cached_tokens"] = be.prefix_cached_tokens
                            fig["pauses"] = be.pauses
                            fig["resubmissions"] = be.resubmits
                            fig["kv_preemptions"] = snap.totals.preemptions
                            fig["extensions"] = snap.totals.extensions
                finally:
                    peak.restore()
                fig.update(
                    engine_preemptions=peak.preempted, peak_running=peak.running, peak_kv=peak.kv
                )
                row[server] = fig
                # each wave starts from an idle engine: the last one's aborts, confirmations
                # and stats records are not billed to the next
                await asyncio.sleep(ns.settle)
                print(
                    f"run {rep + 1} {server:9s} wall {fig['wall_s']:.3f} s  TTFT p50 "
                    f"{fig['ttft_p50_s']:.3f} s  front-end CPU {fig['frontend_cpu_s']:.3f} s  "
                    f"preemptions {fig['engine_preemptions']}  "
                    f"peak running {fig['peak_running']}  peak KV {fig['peak_kv']:.0%}",
                    flush=True,
                )
            row["ratio"] = row["kvbudget"]["wall_s"] / row["vllm"]["wall_s"]
            row["cpu_ratio"] = row["kvbudget"]["frontend_cpu_s"] / row["vllm"]["frontend_cpu_s"]
            runs.append(row)
    finally:
        if shared is not None:
            await shared.__aexit__(None, None, None)
        engine.shutdown()
    ratios = [r["ratio"] for r in runs]
    cpu = [r["cpu_ratio"] for r in runs]
    print(
        f"kvbudget / vllm wall time: median {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {len(ratios)} runs)"
    )
    print(
        f"kvbudget / vllm front-end CPU: median {statistics.median(cpu):.3f} "
        f"(min {min(cpu):.3f}, max {max(cpu):.3f})"
    )
    return {
        "runs": runs,
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
        "cpu_ratio_median": statistics.median(cpu),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prefix", type=int, default=640)
    p.add_argument("--own", type=int, default=5)
    p.add_argument("--out", type=int, default=40)
    p.add_argument("--blocks", type=int, default=129)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settle", type=float, default=0.3,
                   help="seconds of idle engine between waves (default 0.3)")
    p.add_argument("--shared-budget", action="store_true",
                   help="one BudgetedEngine for every run (as a server keeps one), not one per run")
    ns = p.parse_args()
    out = asyncio.run(_main(ns))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
