"""Bounded names: invented tenants and tasks fold into ``other`` before they reach the core."""

from __future__ import annotations

from contextlib import aclosing

import prometheus_client
import pytest

from _kvb_helpers import quiet_structlog, spec  # noqa: F401 (autouse fixture)
from kvbudget import Budget, Capacity, InvalidInput, SchedulerConfig
from kvbudget.engines.sim import SimEngine
from kvbudget.names import NameFolder, NameLimits
from kvbudget.observability import PrometheusExporter


def test_first_names_are_kept_the_rest_fold_and_are_counted() -> None:
    folder = NameFolder(NameLimits(max_tenants=2, max_tasks=1, known_tenants={"acme"}))
    assert [folder.fold_name("tenant", t) for t in ("acme", "a", "b", "c", "a", "acme")] == [
        "acme", "a", "b", "other", "a", "acme",
    ]
    assert folder.fold_name("tenant", "other") == "other"  # idempotent, not counted
    assert folder.folded["tenant"] == 1
    s = folder.fold(spec(tenant="zzz", task="t1"))
    assert (s.tenant, s.task) == ("other", "t1")
    assert folder.fold(spec(tenant="a", task="t1")) is not None
    assert folder.fold(spec(tenant="a", task="t2")).task == "other"
    assert folder.to_dict()["tenant"] == {
        "kept": 2, "limit": 2, "configured": 1, "folded_requests": 2,
    }


def test_long_names_fold_and_limits_are_checked() -> None:
    folder = NameFolder(NameLimits(max_name_length=8))
    assert folder.fold_name("task", "x" * 9) == "other"
    assert folder.fold_name("task", "x" * 8) == "x" * 8
    with pytest.raises(InvalidInput):
        NameLimits(max_tenants=-1)
    with pytest.raises(InvalidInput):
        NameLimits(other="")
    assert NameLimits(max_tenants=0).with_known(tenants=["k"]).known_tenants == {"k"}


async def _flood(budget: Budget, engine: SimEngine, start: int, n: int) -> None:
    for i in range(start, start + n):
        s = spec(prompt=8, max_tokens=4, tenant=f"t{i}", task=f"task-{i}")
        async with aclosing(budget.generate(engine, s)) as steps:
            async for _ in steps:
                pass


@pytest.mark.anyio
async def test_thousands_of_invented_names_keep_state_and_metrics_bounded() -> None:
    budget = Budget(
        Capacity(64, 16), config=SchedulerConfig(tenant_weights={"vip": 2.0}),
        names=NameLimits(max_tenants=8, max_tasks=4),
    )
    registry = prometheus_client.CollectorRegistry()
    PrometheusExporter(budget, registry=registry)
    engine = SimEngine(capacity=budget.capacity, lengths=lambda rid: 3)
    async with budget:
        await _flood(budget, engine, 0, 500)
        snap = budget.snapshot()
        text = prometheus_client.generate_latest(registry).decode()
        await _flood(budget, engine, 500, 200)  # more invented names: no more series
        again = prometheus_client.generate_latest(registry).decode()
    assert snap.completed >= 499  # the last confirmation may still be on its way
    assert len(snap.by_tenant) <= 9  # 8 kept + other
    assert "other" in snap.by_tenant
    assert len(snap.by_class_tenant) <= 9
    assert budget.names.kept("tenant") == 8 and budget.names.kept("task") == 4
    assert budget.names.folded == {"tenant": 700 - 8, "task": 700 - 4}
    assert "vip" in budget.names.limits.known_tenants  # configured weights are never folded
    under = snap.underestimation
    if under is not None:
        for values in under.dimensions.values():
            assert len(values) <= 10
    assert 'kvbudget_folded_names_total{kind="tenant"} 492.0' in text
    assert again.count("\n") == text.count("\n")
    assert 'kvbudget_folded_names_total{kind="tenant"} 692.0' in again


def test_a_folder_can_be_shared_and_configured_weights_stay_apart() -> None:
    folder = NameFolder(NameLimits(max_tenants=0))
    budget = Budget(Capacity(64, 16), names=folder)
    assert budget.names is folder
    lease = budget.lease(spec(tenant="anyone"))
    assert lease.spec.tenant == "other"
    b2 = Budget(Capacity(64, 16), config=SchedulerConfig(tenant_weights={"gold": 3.0}),
                names=NameLimits(max_tenants=0))
    assert b2.lease(spec(tenant="gold")).spec.tenant == "gold"
