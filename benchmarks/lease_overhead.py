"""What the anyio shell costs per lease and per generated token.

Measured, each as the median over ``--runs`` runs (default 15) of a timed loop:

* ``core_charge_ns_median``: one ``Scheduler.charge(request_id, 1, now)`` on the core itself, with
  ``now`` precomputed (the pure core cost; a grant that never reaches its boundary, so the call
  returns ``()``);
* ``charge_step_ns_median``: one ``Lease.charge(1)`` through the shell (clock read, core charge,
  action check) on the same kind of grant;
* ``charge_vs_core_ratio``: the median over runs of (shell ns per charge / core ns per charge),
  each run timing the core and then the shell back to back, so that load on the machine hits
  both alike (target: <= 1.5);
* ``bare_step_ns_median``: one iteration of a bare anyio loop standing in for a decode loop, doing
  the work of a step and nothing else: ``await anyio.lowlevel.checkpoint()``;
* ``shell_step_ns_median``: the same iteration plus ``lease.charge(1)``;
* ``overhead_ratio_vs_bare`` = ``shell_step_ns_median / bare_step_ns_median``: how much slower an
  async decode loop gets when every step is charged through the shell;
* ``lease_enter_exit_us_median``: ``async with budget.lease(spec): pass`` followed by
  ``budget.confirm_release`` (admission at once, finish, release), in microseconds, and
  ``bare_enter_exit_us_median`` for an empty async context manager in the same loop.

Run: ``python benchmarks/lease_overhead.py [--backend asyncio|trio] [--runs N]``. The last line of
output is one JSON object with all the figures above.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.lowlevel
import structlog

from kvbudget import Budget, Capacity, RequestSpec, Scheduler

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

SPEC = RequestSpec(prompt_tokens=16, max_tokens=10_000_000, model_max_len=20_000_000)
CAP = Capacity(blocks=2_000_000, block_size=16)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def core_run(n: int, r: int) -> float:
    sched = Scheduler(CAP, policy="reserve-max")
    rid = f"core{r}"
    sched.arrive(rid, SPEC, 0.0)
    charge = sched.charge
    now = 1.0
    t0 = time.perf_counter_ns()
    for _ in range(n):
        charge(rid, 1, now)
    return (time.perf_counter_ns() - t0) / n


async def shell_run(n: int, r: int) -> float:
    budget = Budget(CAP, policy="reserve-max")
    async with budget.lease(SPEC, f"shell{r}") as lease:
        charge = lease.charge
        t0 = time.perf_counter_ns()
        for _ in range(n):
            charge(1)
        return (time.perf_counter_ns() - t0) / n


async def bench_charge(n: int, runs: int) -> tuple[float, float, float]:
    """Core and shell runs interleaved, so that load on the machine hits both alike; the
    ratio is the median of the per-pair ratios."""
    core, shell, ratios = [], [], []
    for r in range(runs):
        c = core_run(n, r)
        sh = await shell_run(n, r)
        core.append(c)
        shell.append(sh)
        ratios.append(sh / c)
    return median(core), median(shell), median(ratios)


async def bench_steps(n: int, runs: int) -> tuple[float, float]:
    bare, shell = [], []
    checkpoint = anyio.lowlevel.checkpoint
    for r in range(runs):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            await checkpoint()
        bare.append((time.perf_counter_ns() - t0) / n)
        budget = Budget(CAP, policy="reserve-max")
        async with budget.lease(SPEC, f"step{r}") as lease:
            charge = lease.charge
            t0 = time.perf_counter_ns()
            for _ in range(n):
                await checkpoint()
                charge(1)
            shell.append((time.perf_counter_ns() - t0) / n)
    return median(bare), median(shell)


@asynccontextmanager
async def empty() -> AsyncIterator[None]:
    yield


async def bench_enter_exit(n: int, runs: int) -> tuple[float, float]:
    shell, bare = [], []
    for r in range(runs):
        budget = Budget(Capacity(4096, 16))
        spec = RequestSpec(prompt_tokens=16, max_tokens=64, model_max_len=4096)
        ids = [f"l{r}-{i}" for i in range(n)]
        t0 = time.perf_counter_ns()
        for rid in ids:
            async with budget.lease(spec, rid):
                pass
            budget.confirm_release(rid)
        shell.append((time.perf_counter_ns() - t0) / n / 1000)
        t0 = time.perf_counter_ns()
        for _ in range(n):
            async with empty():
                pass
        bare.append((time.perf_counter_ns() - t0) / n / 1000)
    return median(shell), median(bare)


async def main(runs: int, backend: str) -> dict[str, float | str]:
    core, shell, ratio = await bench_charge(100_000, runs)
    bare_step, shell_step = await bench_steps(50_000, runs)
    enter_exit, bare_enter_exit = await bench_enter_exit(2_000, runs)
    return {
        "backend": backend,
        "lease_enter_exit_us_median": round(enter_exit, 2),
        "bare_enter_exit_us_median": round(bare_enter_exit, 2),
        "charge_step_ns_median": round(shell, 1),
        "core_charge_ns_median": round(core, 1),
        "charge_vs_core_ratio": round(ratio, 3),
        "bare_step_ns_median": round(bare_step, 1),
        "shell_step_ns_median": round(shell_step, 1),
        "overhead_ratio_vs_bare": round(shell_step / bare_step, 3),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    args = parser.parse_args()
    result = anyio.run(main, args.runs, args.backend, backend=args.backend)
    for key, value in result.items():
        print(f"{key:>28}: {value}")
    print(json.dumps(result))
