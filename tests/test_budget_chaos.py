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
    Budget,
    Capacity,
    ContinuationRequired,
    EngineError,
    GenerationResult,
    KvBudgetError,
    Overloaded,
    Preempted,
    SchedulerConfig,
)
from kvbudget.core.lengths import LengthModel
from kvbudget.engines.base import split_engine_request_id
from kvbudget.engines.sim import Faults, SimEngine
from test_budget_load import SIM_COST, Watcher, check_accounting, settle
from test_chaos_policy import ChaosPolicy

pytestmark = pytest.mark.anyio


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
async def test_a_policy_answering_at_random_loses_nothing_under_faults(seed: int) -> None:
    n = 300
    faults = Faults(release_delay_p=0.3, release_delay_s=0.03, lost_confirm_p=0.1,
                    duplicate_confirm_p=0.3, duplicate_delay_s=0.01, error_p=0.002)
    budget_ref: list[Budget] = []

    def push_confirm(engine_id: str) -> None:
        rid, attempt = split_engine_request_id(engine_id)
        budget_ref[0].confirm_release(rid, attempt=attempt)

    engine = SimEngine(capacity=Capacity(40, 16), median_length=40, seed=seed, faults=faults,
                       on_released=push_confirm)
    budget = Budget(engine.capacity, config=SchedulerConfig(confirm_timeout_s=0.1),
                    policy=ChaosPolicy(random.Random(seed)), engine=engine, confirm_timeout=0.1,
                    stall_timeout=0.5, tick_interval=0.01, lengths=LengthModel(prior_tokens=24),
                    cost=SIM_COST)
    budget_ref.append(budget)
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
                try:
                    async for _ in budget.generate(engine, s, request_id=f"c{i}",
                                                   sink=results.append):
                        pass
                except (EngineError, Overloaded, Preempted, ContinuationRequired) as exc:
                    errors[type(exc).__name__] += 1
                    assert isinstance(exc, KvBudgetError)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watcher.run)
            async with anyio.create_task_group() as inner:
                for i in range(n):
                    inner.start_soon(one, i)
            await settle(budget, timeout=10)
            tg.cancel_scope.cancel()
    watcher.check()
    assert watcher.violations == [], watcher.violations[:5]
    snap = budget.snapshot()
    assert snap.reserved_blocks == 0 and snap.active == 0 and snap.queued == 0
    assert engine.kv_used_blocks() == 0 and engine.overflows == 0
    assert snap.policy_faults == 0, budget.scheduler.policy_fault_log
    assert task_count() == before
    assert budget.pending_leases == 0
    check_accounting(budget, results, n)
    assert snap.totals.completed > 0
