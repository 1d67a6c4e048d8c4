"""Tests of the discrete-event driver (kvbudget.sim.driver) and the engine model."""

from __future__ import annotations

import math

import attrs
import pytest

from kvbudget.core.lengths import LengthModel
from kvbudget.core.lifecycle import Request
from kvbudget.core.model import Capacity
from kvbudget.core.policy import POLICY_NAMES, CalibratedPolicy
from kvbudget.errors import InvalidInput, SimulationError
from kvbudget.sim.driver import run_policies, simulate
from kvbudget.sim.engine import DEFAULT_CAPACITY_BLOCKS, EngineModel
from kvbudget.sim.report import JSON_POLICY_KEYS, PolicyResult
from kvbudget.sim.scenario import Scenario, SimRequest, Wave, apply_scenario
from kvbudget.sim.workload import TraceRequest, Workload, synthetic_workload

SMALL_ENGINE = EngineModel(capacity=Capacity(600, 16))


def _requests(
    n: int = 150, rate: float = 4.0, seed: int = 0, **scenario: object
) -> tuple[tuple[SimRequest, ...], Scenario]:
    sc = Scenario(seed=seed, **scenario)  # type: ignore[arg-type]
    wl = synthetic_workload(seed=seed, n_requests=n, rate_rps=rate)
    return apply_scenario(wl, sc), sc


def _figures(r: PolicyResult) -> dict[str, object]:
    d = r.to_dict()
    d.pop("wall_s")
    d["itl_cdf"] = r.itl_cdf
    d["kv_series"] = r.kv_series
    return d


def _ends(r: PolicyResult) -> int:
    return r.completed + r.rejected + r.abandoned + r.continued + r.failed


def test_engine_defaults_follow_the_cited_setting() -> None:
    e = EngineModel()
    assert e.capacity.blocks == DEFAULT_CAPACITY_BLOCKS == 7152
    assert e.capacity.block_size == 16
    # decode of 10 sequences holding 10k tokens plus 100 prefill tokens
    expected = 9.57e-3 + 10 * 15e-6 + 10_000 * 0.306e-6 + 100 * 61e-6
    assert e.step_time(10, 10_000, 100) == pytest.approx(expected)
    assert e.step_time(0, 0, 0) == 0.0
    with pytest.raises(InvalidInput):
        EngineModel(abort_latency_s=-1.0)
    with pytest.raises(InvalidInput):
        EngineModel(max_batch=0)


class _FinishFaults(CalibratedPolicy):
    """Raises when told a request finished: a notification the core goes on after."""

    name = "finish-faults"

    def on_finished(self, req: Request, length: int) -> None:
        raise ValueError("on_finished bug")


def test_a_run_whose_policy_faulted_is_an_error_not_a_result() -> None:
    """The core goes on after a policy's notification raises (a server must); a comparison
    of policies must not report figures from such a run."""
    reqs, sc = _requests(n=30)
    with pytest.raises(SimulationError, match="on_finished bug"):
        simulate(reqs, sc, SMALL_ENGINE, _FinishFaults())


def test_deterministic_per_seed() -> None:
    reqs, sc = _requests(seed=3, wave=Wave(at_s=10.0, count=8, output_tokens=600))
    for policy in ("calibrated", "past-future"):
        a = simulate(reqs, sc, SMALL_ENGINE, policy, seed=3)
        b = simulate(reqs, sc, SMALL_ENGINE, policy, seed=3)
        assert _figures(a) == _figures(b)


def test_every_request_accounted_once_and_no_violations_for_every_policy() -> None:
    reqs, sc = _requests(
        n=160,
        rate=5.0,
        abandon_share=0.3,
        abandon_mean_s=2.0,
        continue_share=0.2,
        wave=Wave(at_s=8.0, count=10, output_tokens=900, prompt_tokens=256),
    )
    results = run_policies(reqs, sc, SMALL_ENGINE, POLICY_NAMES)
    assert set(results) == set(POLICY_NAMES)
    for name, r in results.items():
        assert r.requests == len(reqs) == _ends(r), name
        assert r.hard_max_violations == 0, name
        assert r.silent_truncations == 0, name
        assert r.good == r.good_interactive + r.good_batch <= r.completed, name
        assert r.abandoned > 0, name  # the scenario abandons, and the driver saw it
        assert 0.0 <= r.kv_used_mean <= r.kv_reserved_mean <= 100.0, name
        assert set(JSON_POLICY_KEYS) <= set(r.to_dict()), name
    assert results["oracle"].goodput_vs_oracle == pytest.approx(1.0)


def test_checked_invariants_hold_during_a_run() -> None:
    reqs, sc = _requests(n=80, rate=5.0, abandon_share=0.3, abandon_mean_s=2.0)
    for policy in ("calibrated", "reserve-current", "segmented"):
        r = simulate(reqs, sc, SMALL_ENGINE, policy, check_invariants=True)
        assert _ends(r) == len(reqs)


def test_oracle_beats_reserve_max_when_overloaded() -> None:
    reqs, sc = _requests(n=200, rate=8.0)
    results = run_policies(reqs, sc, SMALL_ENGINE, ("reserve-max", "oracle"))
    # it is overloaded, and like TensorRT-LLM it turns nobody away: its callers wait in its queue
    # until they give up
    assert results["reserve-max"].rejected == 0
    assert results["reserve-max"].good < len(reqs)
    assert results["oracle"].goodput_rps >= results["reserve-max"].goodput_rps
    assert results["reserve-max"].kv_used_mean < results["oracle"].kv_used_mean


def test_preemptions_under_a_wave() -> None:
    # a quiet trace, then a synchronized wave of long interactive outputs
    trace = Workload(
        name="quiet",
        requests=[TraceRequest(arrival_s=i * 0.5, prompt_tokens=200, output_tokens=150)
                  for i in range(40)],
    )
    sc = Scenario(
        interactive_share=0.5,
        abandon_share=0.0,
        wave=Wave(at_s=5.0, count=24, output_tokens=1500, prompt_tokens=300, spread_s=0.5),
    )
    reqs = apply_scenario(trace, sc)
    results = run_policies(reqs, sc, SMALL_ENGINE, ("reserve-current", "reserve-max"))
    assert results["reserve-current"].preemptions > 0
    assert results["reserve-current"].recompute_tokens > 0
    assert results["reserve-max"].preemptions == 0
    assert results["reserve-max"].recompute_tokens == 0
    for r in results.values():
        assert r.hard_max_violations == 0 and r.silent_truncations == 0


def test_abandoned_request_keeps_decoding_until_the_engine_confirms_its_abort() -> None:
    """A busy engine takes an abort in before its next step and the adapter confirms it with the
    second step record after it: the stream decodes the step in flight and the next one, however
    long the idle engine's round trip (``abort_latency_s``) would take."""
    trace = Workload(name="one", requests=[TraceRequest(arrival_s=0.0, prompt_tokens=64,
                                                        output_tokens=2000)])
    base = Scenario(interactive_share=1.0, abandon_share=1.0, abandon_mean_s=1.0)
    (req,) = apply_scenario(trace, base)
    assert req.abandon_after_s is not None
    slow = attrs.evolve(SMALL_ENGINE, abort_latency_s=2.0)
    fast = attrs.evolve(SMALL_ENGINE, abort_latency_s=0.0)
    r_slow = simulate([req], base, slow, "reserve-max", keep_requests=True)
    r_fast = simulate([req], base, fast, "reserve-max", keep_requests=True)
    assert r_slow.abandoned == r_fast.abandoned == 1
    assert r_slow.wasted_decoded_tokens == r_fast.wasted_decoded_tokens
    (rec,) = r_slow.request_records
    step = SMALL_ENGINE.step.decode_time(1, 64 + rec.output_tokens)
    left = req.arrival_s + req.abandon_after_s
    # tokens after the client left: the rest of the step in flight and one more step
    assert rec.last_token_s is not None
    assert left < rec.last_token_s <= left + 2.5 * step


def test_single_request_timing_matches_the_step_model() -> None:
    trace = Workload(name="one", requests=[TraceRequest(arrival_s=0.0, prompt_tokens=100,
                                                        output_tokens=10)])
    sc = Scenario(interactive_share=1.0, abandon_share=0.0)
    (req,) = apply_scenario(trace, sc)
    r = simulate([req], sc, SMALL_ENGINE, "reserve-max")
    step = SMALL_ENGINE.step
    assert r.completed == 1 and r.good == 1
    # first token after the prefill step: fixed + 100 x prefill
    assert r.ttft_p50_s == pytest.approx(step.fixed_s + 100 * step.prefill_per_token_s)
    assert r.decoded_tokens == 10


def test_request_records_time_every_token_as_the_step_model_says() -> None:
    trace = Workload(name="two", requests=[
        TraceRequest(arrival_s=0.0, prompt_tokens=100, output_tokens=10),
        TraceRequest(arrival_s=50.0, prompt_tokens=100, output_tokens=1),
    ])
    sc = Scenario(interactive_share=1.0, abandon_share=0.0)
    reqs = apply_scenario(trace, sc)
    assert simulate(reqs, sc, SMALL_ENGINE, "reserve-max").request_records == ()
    r = simulate(reqs, sc, SMALL_ENGINE, "reserve-max", keep_requests=True)
    first, second = r.request_records
    step = SMALL_ENGINE.step
    assert (first.request_id, first.end, first.output_tokens, first.expected_tokens) == (
        reqs[0].request_id, "completed", 10, 10
    )
    assert first.ttft_s == pytest.approx(step.fixed_s + 100 * step.prefill_per_token_s)
    # nine decode steps of one sequence (context 101..109) after the first token: TPOT is
    # their mean
    mean = sum(step.decode_time(1, 100 + k) for k in range(1, 10)) / 9
    assert first.tpot_s == pytest.approx(mean)
    assert first.finished_s == first.last_token_s
    assert second.arrival_s == 50.0 and second.tpot_s == 0.0  # a single token


def test_a_client_leaves_after_its_planned_tokens() -> None:
    trace = Workload(name="two", requests=[
        TraceRequest(arrival_s=0.0, prompt_tokens=64, output_tokens=300),
        TraceRequest(arrival_s=0.0, prompt_tokens=64, output_tokens=300),
    ])
    sc = Scenario(interactive_share=1.0, abandon_share=0.0)
    stays, leaves = apply_scenario(trace, sc)
    leaves = attrs.evolve(leaves, abandon_after_tokens=40)
    r = simulate([stays, leaves], sc, SMALL_ENGINE, "reserve-current", keep_requests=True)
    kept, gone = r.request_records
    assert (kept.end, kept.output_tokens) == ("completed", 300)
    assert gone.end == "abandoned"
    # it leaves at its 40th token; the abort lands abort_latency_s later (a few more tokens)
    steps = SMALL_ENGINE.abort_latency_s / SMALL_ENGINE.step.decode_time(2, 700)
    assert 40 <= gone.output_tokens <= 40 + math.ceil(steps) + 1
    assert r.abandoned == 1 and r.completed == 1
    # a client that would leave after the last token never leaves
    late = attrs.evolve(stays, abandon_after_tokens=300)
    assert simulate([late], sc, SMALL_ENGINE, "reserve-current").completed == 1


def test_the_length_model_can_be_carried_from_one_run_to_the_next() -> None:
    reqs, sc = _requests(n=60, rate=4.0)
    lengths = LengthModel()
    first = simulate(reqs, sc, SMALL_ENGINE, "calibrated", lengths=lengths)
    learned = lengths.underestimation()
    assert learned is not None and learned.overall.count > 0
    again = simulate(reqs, sc, SMALL_ENGINE, "calibrated", lengths=lengths)
    fresh = simulate(reqs, sc, SMALL_ENGINE, "calibrated")
    assert _figures(fresh) == _figures(first)  # a fresh model by default
    assert again.under_p90 != first.under_p90 or again.coverage != first.coverage


def test_the_cost_model_learns_the_engines_prefill_as_over_vllm() -> None:
    """As the vLLM adapter feeds the engine's step details, the simulated engine feeds its
    prefills to the budget's cost model: the prefill cost per token is learned (and with it
    calibrated's cheap-to-pause rule can engage, as it does over the real engine)."""
    from kvbudget.core.cost import CostModel

    reqs, sc = _requests(n=30, rate=4.0)
    cost = CostModel()
    simulate(reqs, sc, SMALL_ENGINE, "calibrated", cost=cost)
    assert cost.prefill_observations >= 30
    assert cost.current().prefill_per_token_s == pytest.approx(
        SMALL_ENGINE.step.prefill_per_token_s, rel=0.02
    )


def _one_prefill_of_100(output_tokens: int) -> tuple[SimRequest, Scenario, float]:
    """One interactive request of 100 prompt tokens at 0, its scenario, and the seconds of its
    prefill step on ``SMALL_ENGINE`` (fixed + 100 prompt tokens)."""
    trace = Workload(name="one", requests=[TraceRequest(arrival_s=0.0, prompt_tokens=100,
                                                        output_tokens=output_tokens)])
    sc = Scenario(interactive_share=1.0, abandon_share=0.0)
    (req,) = apply_scenario(trace, sc)
    step = SMALL_ENGINE.step
    return req, sc, step.fixed_s + 100 * step.prefill_per_token_s


@pytest.mark.parametrize("speed", [0.0, 0.3, 1.0])
def test_a_machine_stall_slows_the_steps_it_meets(speed: float) -> None:
    """A span in which the machine ran at ``speed`` of its own: the prefill step that meets it
    takes what the span withheld longer (all of it at 0); steps before and after are the step
    model's. Here the first token's prefill step (fixed + 100 prompt tokens) starts at 0 and a
    stall spans [half of it, half of it + 1 s)."""
    req, sc, prefill = _one_prefill_of_100(output_tokens=10)
    r = simulate([req], sc, SMALL_ENGINE, "reserve-max", keep_requests=True,
                 stalls=[(prefill / 2, 1.0)], stall_speed=speed)
    (rec,) = r.request_records
    if speed >= 1.0:
        want = prefill
    elif speed > 0.0 and prefill / 2 <= speed * 1.0:  # done inside the stall, at its speed
        want = prefill / 2 + (prefill / 2) / speed
    else:  # the rest after the stall
        want = 1.0 + prefill - speed * 1.0
    assert rec.ttft_s == pytest.approx(want)
    unstalled = simulate([req], sc, SMALL_ENGINE, "reserve-max", keep_requests=True)
    decode = [
        b - a for a, b in ((unstalled.request_records[0].first_token_s,
                            unstalled.request_records[0].last_token_s),
                           (rec.first_token_s, rec.last_token_s))
    ]
    if speed in (0.0, 1.0):
        assert decode[1] == pytest.approx(decode[0])  # after the stall (or none): untouched
    else:  # all of it inside the stall, at its speed
        assert rec.last_token_s is not None and rec.last_token_s < prefill / 2 + 1.0
        assert decode[1] == pytest.approx(decode[0] / speed)
    with pytest.raises(InvalidInput):
        simulate([req], sc, SMALL_ENGINE, "reserve-max", stalls=[(0.0, 1.0)], stall_speed=1.5)


def test_a_record_keeps_its_longest_gap_between_tokens() -> None:
    """``longest_gap_s``: an interactive stream's longest gap between two tokens as the engine
    made them. Unstalled, every gap of the lone stream is one decode step; a stall of the whole
    machine for 1 s just after its first token makes one gap a step and that second."""
    req, sc, prefill = _one_prefill_of_100(output_tokens=10)
    plain = simulate([req], sc, SMALL_ENGINE, "reserve-max", keep_requests=True)
    (rec,) = plain.request_records
    assert rec.first_token_s is not None and rec.last_token_s is not None
    step = rec.longest_gap_s
    span = rec.last_token_s - rec.first_token_s
    assert step is not None and span / 9 - 1e-9 <= step <= span  # at least the mean of 9 gaps
    stalled = simulate([req], sc, SMALL_ENGINE, "reserve-max", keep_requests=True,
                       stalls=[(prefill + 1e-6, 1.0)], stall_speed=0.0)
    # (the stalled gap is the first decode step, a few microseconds shorter than the longest)
    assert stalled.request_records[0].longest_gap_s == pytest.approx(step + 1.0, abs=1e-4)


def test_spans_of_their_own_speed_slow_the_steps_each_at_its_own() -> None:
    """Spans ``(begin, seconds, speed)``: a step runs at each span's speed while in it. Here
    the prefill step (fixed + 100 prompt tokens) meets a span at half speed for its first
    quarter and then one at a quarter speed (back to back): hand-worked, the first quarter of
    its work takes half of it, and the rest runs at 0.25 until done. A pair keeps
    ``stall_speed``; overlapping spans, a speed above 1 and a malformed span are typed
    errors."""
    req, sc, prefill = _one_prefill_of_100(output_tokens=2)
    first = prefill / 2  # half speed: a quarter of the work done in it
    spans = [(0.0, first, 0.5), (first, 100.0, 0.25)]
    r = simulate([req], sc, SMALL_ENGINE, "reserve-max", keep_requests=True, stalls=spans)
    (rec,) = r.request_records
    assert rec.ttft_s == pytest.approx(first + (prefill * 0.75) / 0.25)
    # the same span as a pair at stall_speed 0.25 and as a triple agree
    pair = simulate([req], sc, SMALL_ENGINE, "reserve-max", keep_requests=True,
                    stalls=[(0.0, 100.0)], stall_speed=0.25).request_records[0]
    triple = simulate([req], sc, SMALL_ENGINE, "reserve-max", keep_requests=True,
                      stalls=[(0.0, 100.0, 0.25)]).request_records[0]
    assert pair.ttft_s == pytest.approx(triple.ttft_s) == pytest.approx(prefill / 0.25)
    for bad in ([(0.0, 2.0, 0.5), (1.0, 2.0, 0.5)], [(0.0, 1.0, 1.5)], [(0.0,)],
                [(0.0, float("nan"), 0.5)]):
        with pytest.raises(InvalidInput):
            simulate([req], sc, SMALL_ENGINE, "reserve-max", stalls=bad)  # type: ignore[arg-type]


def test_the_front_end_delays_what_clients_get_as_a_one_thread_queue() -> None:
    """Hand-worked: one request alone. The front end takes it in (per_request) before the
    scheduler sees it, so its prefill starts then; every token reaches the client per_output
    after its step ends (the front end is idle between steps here: 1 output per step, each
    shorter than a step). The engine's own steps are untouched."""
    from kvbudget.sim.engine_model import FrontEndModel

    trace = Workload(name="one", requests=[TraceRequest(arrival_s=0.0, prompt_tokens=100,
                                                        output_tokens=10)])
    sc = Scenario(interactive_share=1.0, abandon_share=0.0)
    (req,) = apply_scenario(trace, sc)
    step = SMALL_ENGINE.step
    fe = FrontEndModel(per_request_s=0.002, per_output_s=0.0001)
    assert fe.per_output_s < step.decode_time(1, 100)
    plain = simulate([req], sc, SMALL_ENGINE, "reserve-max", keep_requests=True)
    fronted = simulate([req], sc, attrs.evolve(SMALL_ENGINE, front_end=fe), "reserve-max",
                       keep_requests=True)
    (a,), (b,) = plain.request_records, fronted.request_records
    assert a.ttft_s is not None and a.tpot_s is not None
    assert b.ttft_s == pytest.approx(a.ttft_s + fe.per_request_s + fe.per_output_s)
    assert b.tpot_s == pytest.approx(a.tpot_s)
    assert b.output_tokens == a.output_tokens == 10
    # a front end that costs nothing changes nothing
    free = simulate([req], sc, attrs.evolve(SMALL_ENGINE, front_end=FrontEndModel()),
                    "reserve-max", keep_requests=True)
    assert free.request_records == plain.request_records


def test_a_burst_of_arrivals_delays_the_next_step_by_its_intake() -> None:
    """Hand-worked: five requests arrive together at an idle engine whose steps cost a fixed
    1 ms and nothing else; the first step prefills all five and pays their intake, 5 x 10 ms,
    so every first token comes at 51 ms (1 ms without the intake). A sixth arriving alone at
    t = 1 s, the engine idle again, pays only its own: 11 ms. Tokens after the first keep the
    engine's pace (no arrival in between), and an intake of 0 changes nothing."""
    from kvbudget.core.cost import StepTimeModel

    trace = Workload(name="burst", requests=[
        *(TraceRequest(arrival_s=0.0, prompt_tokens=64, output_tokens=4) for _ in range(5)),
        TraceRequest(arrival_s=1.0, prompt_tokens=64, output_tokens=4),
    ])
    sc = Scenario(interactive_share=1.0, abandon_share=0.0)
    reqs = apply_scenario(trace, sc)
    flat = EngineModel(
        capacity=Capacity(6000, 16),  # room for all five at once, even at reserve-max
        step=StepTimeModel(fixed_s=0.001, per_seq_s=0.0, per_context_token_s=0.0,
                           prefill_per_token_s=0.0),
    )
    plain = simulate(reqs, sc, flat, "reserve-max", keep_requests=True)
    taxed = simulate(reqs, sc, attrs.evolve(flat, intake_s=0.010), "reserve-max",
                     keep_requests=True)
    by_arrival = sorted(taxed.request_records, key=lambda r: (r.arrival_s, r.request_id))
    assert [r.ttft_s for r in by_arrival] == pytest.approx([0.051] * 5 + [0.011])
    assert [r.ttft_s for r in plain.request_records] == pytest.approx([0.001] * 6)
    for rec in by_arrival:
        assert rec.tpot_s == pytest.approx(0.001) and rec.output_tokens == 4
    zero = simulate(reqs, sc, attrs.evolve(flat, intake_s=0.0), "reserve-max",
                    keep_requests=True)
    assert zero.request_records == plain.request_records
    for bad in (-0.001, math.nan, math.inf):
        with pytest.raises(InvalidInput):
            attrs.evolve(flat, intake_s=bad)


def test_a_front_end_that_cannot_keep_up_makes_first_tokens_late() -> None:
    """Many streams, each step's outputs taking the front end longer than the step: its backlog
    grows with every step, so clients get tokens ever later than the engine made them, and a
    request that arrives then waits behind it to be taken in; TTFT and goodput suffer, tokens
    and preemptions (the engine's business) do not."""
    from kvbudget.sim.engine_model import FrontEndModel

    reqs, sc = _requests(n=80, rate=40.0, interactive_share=1.0, abandon_share=0.0)
    engine = EngineModel(capacity=Capacity(4000, 16))
    base = simulate(reqs, sc, engine, "reserve-current", keep_requests=True)
    slow = FrontEndModel(per_request_s=0.001, per_output_s=engine.step.decode_time(1, 0))
    late = simulate(reqs, sc, attrs.evolve(engine, front_end=slow), "reserve-current",
                    keep_requests=True)
    assert late.decoded_tokens == base.decoded_tokens and late.completed == base.completed
    assert late.ttft_p50_s > 2 * base.ttft_p50_s
    assert late.goodput_rps < base.goodput_rps
    ttft = {r.request_id: r.ttft_s for r in base.request_records}
    for rec in late.request_records:
        got, was = rec.ttft_s, ttft[rec.request_id]
        if got is not None and was is not None:
            assert got >= was + slow.per_request_s - 1e-9
