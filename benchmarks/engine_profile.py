"""Fit the simulator's engine profile from the real engine: the tiny CPU model under vLLM.

    PYTHONPATH=src:tests .venv/bin/python benchmarks/engine_profile.py \
        [--out src/kvbudget/sim/profiles/vllm-cpu-tiny.json] [--requests 300]

Starts ``BudgetedEngine.from_engine_args`` on the tiny random Llama the tests build (257 blocks of
32 tokens, ``max_model_len`` 2048, ``max_num_seqs`` 64: the engine of
``benchmarks/serve_bench.py`` and of the issue's runs), sends ``--requests`` requests in Poisson
bursts with random sampling, prompts of 16-1,500 tokens (log-uniform) and outputs of 16-400
(``ignore_eos``), so that the engine's steps cover batch sizes and contexts from 1 to its limits,
and fits the step time from the steps timed whole (from one step's stats to the next as the
frontend receives them; ``BudgetedEngine.engine_profile``) with
:func:`kvbudget.sim.profile.fit_step_time`. Prints the fit, the fit's error on the steps it saw
(median and p90 of |predicted - measured| / measured) and writes the profile. The last line
printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

BLOCKS = 257
BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 64


async def _run(n_requests: int, rate: float, seed: int) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    import vllm_support
    from kvbudget.core.model import ServiceClass
    from kvbudget.engines.vllm.adapter import vllm_version
    from kvbudget.vllm import BudgetedEngine

    model = vllm_support.tiny_model_dir()
    args = vllm_support.make_engine_args(
        model, num_blocks=BLOCKS, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
    )
    # no turn-away: every request runs, so the steps cover the whole range of batch sizes
    classes = [ServiceClass("batch", priority=0)]
    rng = random.Random(seed)
    async with BudgetedEngine.from_engine_args(args, classes=classes) as eng:

        async def one(i: int) -> int:
            n_prompt = int(math.exp(rng.uniform(math.log(16), math.log(1500))))
            prompt = [rng.randrange(100, 1000) for _ in range(n_prompt)]
            sp = SamplingParams(
                max_tokens=rng.randint(16, 400), ignore_eos=True, temperature=rng.random(),
                top_p=rng.uniform(0.5, 1.0), output_kind=RequestOutputKind.DELTA,
            )
            n = 0
            async for out in eng.generate(
                {"prompt_token_ids": prompt}, sp, f"p{i}", service_class="batch"
            ):
                n += len(out.outputs[0].token_ids)
            return n

        tasks = []
        for i in range(n_requests):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(rng.expovariate(rate))
        tokens = sum(await asyncio.gather(*tasks))
        whole = list(eng.steps.wall)
        source = (
            f"vllm-cpu {vllm_version()} on {platform.machine()} ({_cpu()}), the tiny random "
            f"Llama of kvbudget's tests (kvbudget.engines.tiny_model), {BLOCKS} blocks x "
            f"{BLOCK_SIZE} tokens, max_num_seqs {MAX_NUM_SEQS}; fitted by "
            f"benchmarks/engine_profile.py from {len(whole)} steps timed whole (from one "
            f"step's stats to the next, as the frontend receives them) of {n_requests} "
            f"requests ({tokens} output tokens)"
        )
        profile = eng.engine_profile("vllm-cpu-tiny", source)
        return profile, whole


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> None:
    from kvbudget.sim.profile import EngineProfile

    # engine time per arriving request on this machine (the server's parsing and tokenizing on
    # the cores the engine shares), measured from bursts of arrivals, not from steps: kept in
    # one place, the shipped profile (docs/benchmarks-history.md, twenty-third session)
    intake_ms = EngineProfile.load("vllm-cpu-tiny").intake_s * 1e3
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = ROOT / "src/kvbudget/sim/profiles/vllm-cpu-tiny.json"
    p.add_argument("--out", type=Path, default=default_out)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--rate", type=float, default=6.0, help="mean arrivals per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--intake-ms", type=float, default=intake_ms,
                   help="engine time per arriving request, set on the profile as measured "
                        f"elsewhere: the steps do not tell it apart (default {intake_ms:g}, the "
                        "shipped profile's, from bursts of arrivals: docs/benchmarks-history.md)")
    a = p.parse_args(argv)
    if not 0.0 <= a.intake_ms < math.inf:
        p.error("--intake-ms must be a finite number >= 0")
    profile, steps = asyncio.run(_run(a.requests, a.rate, a.seed))
    if a.intake_ms:
        profile = attrs.evolve(
            profile, intake_s=a.intake_ms / 1e3,
            source=f"{profile.source}; intake {a.intake_ms:g} ms per arriving request, "
            "measured from the first tokens of bursts of arrivals against the simulated ones "
            "(docs/benchmarks-history.md, twenty-third session)",
        )
    step = profile.step
    errors = []
    for batch, context, prefill, seconds in steps:
        if seconds <= 0.0:
            continue
        predicted = (
            step.decode_time(batch, context) if batch else step.fixed_s
        ) + step.prefill_time(prefill)
        errors.append(abs(predicted - seconds) / seconds)
    errors.sort()
    figures = {
        "steps": len(steps),
        "fixed_ms": step.fixed_s * 1e3,
        "per_seq_us": step.per_seq_s * 1e6,
        "per_context_token_ns": step.per_context_token_s * 1e9,
        "prefill_per_token_us": step.prefill_per_token_s * 1e6,
        "abort_latency_ms": profile.abort_latency_s * 1e3,
        "relative_error_p50": errors[len(errors) // 2] if errors else None,
        "relative_error_p90": errors[int(len(errors) * 0.9)] if errors else None,
        "decode_steps": sum(1 for s in steps if s[2] == 0),
        "batch_p50": statistics.median(s[0] for s in steps),
        "batch_max": max(s[0] for s in steps),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(a.out)
    print(f"wrote {a.out}")
    for k, v in figures.items():
        print(f"{k:>24}: {v:.4g}" if isinstance(v, float) else f"{k:>24}: {v}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
