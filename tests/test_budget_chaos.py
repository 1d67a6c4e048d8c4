"""The shell under a policy that answers at random within the contract
(:class:`test_chaos_policy.ChaosPolicy`), on SimEngine with confirmation and engine faults,
under asyncio and trio: every request ends exactly once with a typed outcome, the budget never
holds fewer blocks than the engine for a request, and nothing is left held, queued or waiting
(the core's checks of every answer are what stand between such a policy and the engine)."""

from __future__ import annotations

import random
from collections import Counter

import anyio
import pytest

from _kvb_helpers import quiet_structlog, spec, task_count  # noqa: F401 (autouse fixture)
from kvbudget import (
    Capacity,
    GenerationResult,
)
from kvbudget.engines.sim import Faults
from test_budget_load import Watcher, check_accounting, faulty_budget, generate_noting_errors
from test_chaos_policy import ChaosPolicy

pytestmark = pytest.mark.anyio


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
async def test_a_policy_answering_at_random_loses_nothing_under_faults(seed: int) -> None:
    n = 300
    faults = Faults(release_delay_p=0.3, release_delay_s=0.03, lost_confirm_p=0.1,
                    duplicate_confirm_p=0.3, duplicate_delay_s=0.01, error_p=0.002)
    engine, budget = faulty_budget(Capacity(40, 16), seed, faults, stall_timeout=0.5,
                                   policy=ChaosPolicy(random.Random(seed)))
    watcher = Watcher(budget, engine)
    results: list[GenerationResult] = []
    errors: Counter[str] = Counter()
    rng = random.Random(seed)
    before = task_count()
    async with budget:

        async def one(i: int) -> None:
            s = spec(prompt=rng.randint(8, 200), max_tokens=rng.choice((8, 64, 200)),
                     cls="batch" if i % 2 else "interactive",
                     on_exhausted="continue" if i % 3 == 0 else "extend")
            await anyio.sleep(rng.uniform(0.0, 0.5))
            with anyio.move_on_after(rng.uniform(0.01, 0.4) if i % 5 == 0 else 60):
                await generate_noting_errors(budget, engine, s, f"c{i}", results, errors)

        await watcher.watch(n, one)
    snap = budget.snapshot()
    assert snap.reserved_blocks == 0 and snap.active == 0 and snap.queued == 0
    assert engine.kv_used_blocks() == 0 and engine.overflows == 0
    assert snap.policy_faults == 0, budget.scheduler.policy_fault_log
    assert task_count() == before
    assert budget.pending_leases == 0
    check_accounting(budget, results, n)
    assert snap.totals.completed > 0
