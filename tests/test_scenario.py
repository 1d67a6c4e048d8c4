"""Tests of kvbudget.sim.scenario: the overlay that turns a workload into SimRequests."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

import attrs
import pytest

from kvbudget.errors import InvalidInput
from kvbudget.sim.scenario import (
    Scenario,
    SimRequest,
    Wave,
    apply_scenario,
    overlay_summary,
    scenario_from_dict,
    scenario_to_dict,
)
from kvbudget.sim.workload import TraceRequest, Workload, read_azure_csv, synthetic_workload

AZURE_TRACE = (
    Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "azure-llm-2023-conv.csv"
)
needs_trace = pytest.mark.skipif(not AZURE_TRACE.exists(), reason=f"{AZURE_TRACE} is absent")

BIG = synthetic_workload(seed=11, n_requests=20_000)


def trace_only(reqs: tuple[SimRequest, ...]) -> list[SimRequest]:
    return [r for r in reqs if not r.is_wave]


def test_class_and_tenant_mix_within_tolerance() -> None:
    reqs = apply_scenario(BIG, Scenario(seed=1))
    n = len(reqs)
    classes = Counter(r.service_class for r in reqs)
    assert classes["interactive"] / n == pytest.approx(0.7, abs=0.015)
    assert classes["batch"] / n == pytest.approx(0.3, abs=0.015)
    tenants = Counter(r.tenant for r in reqs)
    assert tenants["acme"] / n == pytest.approx(0.6, abs=0.015)
    assert tenants["globex"] / n == pytest.approx(0.3, abs=0.015)
    assert tenants["initech"] / n == pytest.approx(0.1, abs=0.01)
    sampling = Counter(r.spec.sampling for r in reqs)
    assert sampling["greedy"] / n == pytest.approx(0.3, abs=0.015)
    stops = Counter(r.spec.stops for r in reqs)
    assert stops["stop-strings"] / n == pytest.approx(0.2, abs=0.015)

    skewed = apply_scenario(BIG, Scenario(seed=1, interactive_share=0.2, tenants=(("a", 1.0),)))
    share = sum(r.service_class == "interactive" for r in skewed) / len(skewed)
    assert share == pytest.approx(0.2, abs=0.015)
    assert {r.tenant for r in skewed} == {"a"}


def test_specs_carry_the_scenario() -> None:
    sc = Scenario(
        seed=2,
        model="llama",
        task="chat",
        interactive_max_tokens=1000,
        batch_max_tokens=3000,
        model_max_len=16384,
        batch_deadline_s=900.0,
    )
    for r in apply_scenario(BIG, sc)[:2000]:
        spec = r.spec
        assert spec.model == "llama" and spec.task == "chat"
        assert spec.model_max_len == 16384
        assert spec.prompt_tokens == r.prompt_tokens
        if spec.service_class == "interactive":
            assert spec.max_tokens == 1000 and spec.deadline is None and not spec.durable
        else:
            assert spec.max_tokens == 3000 and spec.deadline == 900.0
        assert spec.calibration_key.tenant == spec.tenant


def test_hard_max_respected_and_clamps_counted() -> None:
    # A small context forces both kinds of clamping on the synthetic workload.
    sc = Scenario(seed=3, interactive_max_tokens=100, batch_max_tokens=300, model_max_len=2048)
    reqs = apply_scenario(BIG, sc)
    prompt_clamped = 0
    output_clamped = 0
    for r, tr in zip(reqs, BIG.requests, strict=True):
        assert r.unclamped_prompt_tokens == tr.prompt_tokens
        assert r.unclamped_output_tokens == tr.output_tokens
        assert r.prompt_tokens == min(tr.prompt_tokens, 2047)
        hard_max = min(sc.max_tokens_for(r.service_class), 2048 - r.prompt_tokens)
        assert r.hard_max == hard_max
        assert 1 <= r.true_output_tokens <= hard_max
        assert r.true_output_tokens == min(tr.output_tokens, hard_max)
        prompt_clamped += r.prompt_clamped
        output_clamped += r.output_clamped
    assert prompt_clamped > 100 and output_clamped > 1000
    summary = overlay_summary(reqs)
    assert summary["prompts_clamped"] == prompt_clamped
    assert summary["outputs_clamped"] == output_clamped
    assert summary["total_true_output_tokens"] == sum(r.true_output_tokens for r in reqs)
    json.dumps(summary)


def test_long_prompt_is_clamped_to_leave_one_output_token() -> None:
    w = Workload(
        name="w", requests=(TraceRequest(arrival_s=0.0, prompt_tokens=9000, output_tokens=50),)
    )
    (r,) = apply_scenario(w, Scenario(model_max_len=8192))
    assert r.prompt_tokens == 8191 and r.unclamped_prompt_tokens == 9000
    assert r.hard_max == 1 and r.true_output_tokens == 1 and r.unclamped_output_tokens == 50
    assert r.prompt_clamped and r.output_clamped


def test_wave_requests_present_at_the_right_time() -> None:
    wave = Wave(at_s=100.0, count=40, output_tokens=3000, prompt_tokens=700, spread_s=2.5)
    reqs = apply_scenario(BIG, Scenario(seed=4, wave=wave, interactive_max_tokens=2048))
    waves = [r for r in reqs if r.is_wave]
    assert len(waves) == 40
    assert len(reqs) == len(BIG.requests) + 40
    for r in waves:
        assert 100.0 <= r.arrival_s <= 102.5
        assert r.service_class == "interactive"
        assert r.prompt_tokens == 700
        assert r.unclamped_output_tokens == 3000
        assert r.true_output_tokens == 2048  # cut to the interactive max_tokens
        assert r.request_id.startswith("w")
    assert statistics.pstdev([r.arrival_s for r in waves]) > 0.1  # spread, not one instant
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    assert len({r.request_id for r in reqs}) == len(reqs)
    assert overlay_summary(reqs)["wave"] == 40
    # Adding the wave leaves the trace requests' draws unchanged.
    assert trace_only(reqs) == list(apply_scenario(BIG, Scenario(seed=4)))
    # A zero spread puts the whole wave at one instant.
    point = apply_scenario(BIG, Scenario(seed=4, wave=attrs.evolve(wave, spread_s=0.0)))
    assert {r.arrival_s for r in point if r.is_wave} == {100.0}


def test_abandonment_only_on_interactive() -> None:
    sc = Scenario(seed=5, abandon_share=0.25, abandon_mean_s=8.0, ttft_slo_s=1.5)
    reqs = apply_scenario(BIG, sc)
    interactive = [r for r in reqs if r.service_class == "interactive"]
    batch = [r for r in reqs if r.service_class == "batch"]
    assert all(r.abandon_after_s is None for r in batch)
    leaving = [r for r in interactive if r.abandon_after_s is not None]
    assert len(leaving) / len(interactive) == pytest.approx(0.25, abs=0.015)
    streams = []
    for r in leaving:
        assert r.abandon_after_first_token_s is not None and r.abandon_after_s is not None
        assert r.abandon_after_s == pytest.approx(1.5 + r.abandon_after_first_token_s)
        streams.append(r.abandon_after_first_token_s)
    assert statistics.fmean(streams) == pytest.approx(8.0, rel=0.08)
    assert overlay_summary(reqs)["abandoning"] == len(leaving)
    assert all(r.abandon_after_s is None for r in apply_scenario(BIG, Scenario(abandon_share=0.0)))


def test_durable_only_batch_and_continue_share() -> None:
    reqs = apply_scenario(BIG, Scenario(seed=6, durable_share=0.4, continue_share=0.3))
    batch = [r for r in reqs if r.service_class == "batch"]
    assert not any(r.spec.durable for r in reqs if r.service_class == "interactive")
    assert sum(r.spec.durable for r in batch) / len(batch) == pytest.approx(0.4, abs=0.03)
    cont = sum(r.spec.on_exhausted == "continue" for r in reqs) / len(reqs)
    assert cont == pytest.approx(0.3, abs=0.015)
    assert all(r.spec.on_exhausted == "extend" for r in apply_scenario(BIG, Scenario(seed=6)))


def test_rate_scale_compresses_arrivals() -> None:
    base = apply_scenario(BIG, Scenario(seed=7))
    fast = apply_scenario(BIG, Scenario(seed=7, rate_scale=4.0))
    assert [r.arrival_s for r in fast] == pytest.approx([r.arrival_s / 4.0 for r in base])
    assert overlay_summary(fast)["duration_s"] == pytest.approx(BIG.duration_s / 4.0)
    # Everything but the arrival is unchanged.
    assert [attrs.evolve(r, arrival_s=0.0) for r in fast] == [
        attrs.evolve(r, arrival_s=0.0) for r in base
    ]


def test_deterministic_and_draws_are_laid_out_per_request() -> None:
    a = apply_scenario(BIG, Scenario(seed=8, wave=Wave()))
    assert a == apply_scenario(BIG, Scenario(seed=8, wave=Wave()))
    b = apply_scenario(BIG, Scenario(seed=9, wave=Wave()))
    assert [r.tenant for r in a] != [r.tenant for r in b]
    # Changing the class mix does not reshuffle tenants or sampling of any request.
    c = apply_scenario(BIG, Scenario(seed=8, wave=Wave(), interactive_share=0.3))
    assert [(r.tenant, r.spec.sampling, r.spec.stops) for r in c] == [
        (r.tenant, r.spec.sampling, r.spec.stops) for r in a
    ]
    assert a[0].request_id.startswith("t")


def test_overlay_covers_twenty_thousand_requests() -> None:
    sc = Scenario(wave=Wave(count=100))
    reqs = apply_scenario(BIG, sc)
    assert len(reqs) == 20_100


@needs_trace
def test_overlay_on_the_real_trace() -> None:
    w = read_azure_csv(AZURE_TRACE)
    reqs = apply_scenario(w, Scenario(model_max_len=4096, rate_scale=2.0))
    s = overlay_summary(reqs)
    assert s["count"] == 19_366
    # Prompts of 4,096+ tokens in the trace are exactly the ones clamped.
    assert s["prompts_clamped"] == sum(r.prompt_tokens > 4095 for r in w.requests) > 0
    assert s["duration_s"] == pytest.approx(w.duration_s / 2.0)
    assert all(r.true_output_tokens <= r.hard_max for r in reqs)


# --------------------------------------------------------------------------------------------
# Scenario validation, service classes and the JSON round trip
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"interactive_share": 1.5},
        {"interactive_share": -0.1},
        {"tenants": ()},
        {"tenants": (("a", 0.5), ("a", 0.5))},
        {"tenants": (("", 1.0),)},
        {"tenants": (("a", 0.0),)},
        {"sampling_profiles": (("greedy",),)},
        {"interactive_max_tokens": 0},
        {"model_max_len": 1},
        {"ttft_slo_s": 0.0},
        {"abandon_share": 2.0},
        {"abandon_mean_s": -1.0},
        {"rate_scale": 0.0},
        {"wave": "soon"},
        {"wave": {"at_s": 1.0, "bogus": 2}},
        {"seed": 1.5},
    ],
)
def test_scenario_rejects_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidInput):
        Scenario(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [{"count": 0}, {"at_s": -1.0}, {"output_tokens": 0}, {"prompt_tokens": 0}, {"spread_s": -1}],
)
def test_wave_rejects_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidInput):
        Wave(**kwargs)  # type: ignore[arg-type]


def test_apply_scenario_checks_its_arguments() -> None:
    with pytest.raises(InvalidInput):
        apply_scenario(BIG.requests, Scenario())  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        apply_scenario(BIG, {"seed": 1})  # type: ignore[arg-type]


def test_service_classes_take_the_objectives() -> None:
    interactive, batch = Scenario(
        ttft_slo_s=1.0, itl_floor_s=0.1, batch_deadline_s=300
    ).service_classes()
    assert interactive.name == "interactive" and batch.name == "batch"
    assert interactive.ttft_slo_s == 1.0 and interactive.max_queue_delay_s == 1.0
    assert interactive.latency_floor_s == 0.1 and interactive.protected
    assert batch.default_deadline_s == 300 and batch.preemptible
    with pytest.raises(InvalidInput):
        Scenario().max_tokens_for("gold")


def test_json_round_trip() -> None:
    sc = Scenario(
        seed=42,
        tenants=(("x", 2.0), ("y", 1.0)),
        wave=Wave(at_s=30.0, count=8),
        rate_scale=1.5,
        continue_share=0.1,
    )
    text = json.dumps(scenario_to_dict(sc))
    back = scenario_from_dict(json.loads(text))
    assert back == sc
    assert Scenario.from_dict(sc.to_dict()) == sc
    assert scenario_from_dict({}) == Scenario()
    assert scenario_from_dict(scenario_to_dict(Scenario())).wave is None
    assert Scenario(tenants={"a": 1.0, "b": 3.0}).tenants == (("a", 1.0), ("b", 3.0))
    with pytest.raises(InvalidInput, match="known field"):
        scenario_from_dict({"interactive_shares": 0.5})
    with pytest.raises(InvalidInput):
        scenario_from_dict([("seed", 1)])  # type: ignore[arg-type]
