"""Each baseline as its engine runs it (issue 13, part 1): one hand-worked case per baseline's
rule, that no baseline runs behind kvbudget's front (no overload rejection, one first-come-first-
served queue across classes and tenants), vLLM's queue caps, and the simulator's in-engine
preemptions.

Every case runs the real scheduler through its public API, on a cache small enough to count its
blocks by hand (16-token blocks, no slack).
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace
from typing import Any, cast

import pytest

import _kvb_helpers
from kvbudget.core import events as ev
from kvbudget.core.lifecycle import Request, State
from kvbudget.core.model import Capacity, RequestSpec
from kvbudget.core.policy import (
    POLICY_NAMES,
    BasePolicy,
    CalibratedPolicy,
    NewTokenRatioPolicy,
    PastFuturePolicy,
    Policy,
    ReserveCurrentPolicy,
    ReserveMaxPolicy,
    SegmentedPolicy,
    make_policy,
)
from kvbudget.core.scheduler import Scheduler, SchedulerConfig

BASELINES = tuple(n for n in POLICY_NAMES if n != "calibrated")
NO_SLACK = SchedulerConfig(slack_tokens=0)


def spec(
    prompt: int = 16, max_tokens: int = 64, cls: str = "interactive", **kw: Any
) -> RequestSpec:
    return _kvb_helpers.spec(prompt, max_tokens, cls, **kw)


def of(actions: list[ev.Action], kind: type[Any], rid: str | None = None) -> list[Any]:
    return [a for a in actions if isinstance(a, kind) and (rid is None or a.request_id == rid)]


def sched(blocks: int, policy: Policy | str, **config: Any) -> Scheduler:
    return Scheduler(
        Capacity(blocks, 16), policy=policy, config=SchedulerConfig(slack_tokens=0, **config)
    )


def grow(s: Scheduler, rid: str, tokens: int, now: float = 0.0) -> list[ev.Action]:
    """Generate ``tokens`` one at a time, reporting each boundary the engine stops at."""
    out: list[ev.Action] = []
    for _ in range(tokens):
        r = s.requests[rid]
        if r.generated >= r.boundary:
            out += s.boundary_reached(rid, now)
            if s.requests[rid].generated >= s.requests[rid].boundary:
                return out  # still stopped: it waits (or was preempted)
        out += s.charge(rid, 1, now)
    return out


def run_out(s: Scheduler, rid: str, now: float = 0.0) -> list[ev.Action]:
    """Run ``rid`` to its hard max and let the engine confirm it."""
    out = grow(s, rid, s.requests[rid].remaining, now)
    return out + s.finish(rid, "length", now) + s.confirm_release(rid, now)


def queue_order(s: Scheduler, cls: str = "interactive") -> list[str]:
    return [r.request_id for r in s.queues.by_class[cls]]


# == no kvbudget front ===========================================================================


@pytest.mark.parametrize("name", BASELINES)
def test_baselines_declare_no_front_and_calibrated_does(name: str) -> None:
    assert make_policy(name).front is False  # type: ignore[attr-defined]
    assert CalibratedPolicy.front is True
    assert BasePolicy.front is True


@pytest.mark.parametrize("name", BASELINES)
def test_baselines_never_reject_for_overload(name: str) -> None:
    """Far more callers than the cache, a queue cap of 2 and queue bounds that kvbudget's front
    would enforce (interactive: 2 s): a baseline turns nobody away, however long they wait."""
    s = sched(8, name, max_queued=2)
    out: list[ev.Action] = []
    for i in range(20):
        cls = "interactive" if i % 2 else "batch"
        out += s.arrive(f"r{i}", spec(prompt=100, max_tokens=10, cls=cls, deadline=1.0), 0.0)
    out += s.tick(3600.0)
    assert not of(out, ev.Reject)
    assert s.rejections_by_reason == {}
    assert s.queued() == 19 and s.active == 1


def test_the_front_rejects_what_a_baseline_keeps() -> None:
    """The same load behind kvbudget's front (BasePolicy: the hard max, with the front): a full
    queue and callers past their bound are turned away."""
    s = sched(8, BasePolicy(), max_queued=2)
    out: list[ev.Action] = []
    for i in range(20):
        out += s.arrive(f"r{i}", spec(prompt=100, max_tokens=10, deadline=1.0), 0.0)
    out += s.tick(3600.0)
    assert of(out, ev.Reject)
    assert s.queued() == 0


@pytest.mark.parametrize("name", BASELINES)
def test_baselines_serve_first_come_first_served_across_classes_and_tenants(name: str) -> None:
    """One request fits at a time (prompt 100 + 10 = 7 of 8 blocks). Behind kvbudget's front the
    interactive callers would go first and tenants would take turns; a baseline admits in
    arrival order."""
    s = sched(8, name)
    s.arrive("x", spec(prompt=100, max_tokens=10, cls="batch", tenant="t0"), 0.0)
    arrivals = [
        ("q1", "batch", "t1"),
        ("q2", "interactive", "t2"),
        ("q3", "batch", "t1"),
        ("q4", "interactive", "t1"),
        ("q5", "interactive", "t1"),
    ]
    for rid, cls, tenant in arrivals:
        s.arrive(rid, spec(prompt=100, max_tokens=10, cls=cls, tenant=tenant), 0.0)
    admitted: list[str] = []
    current = "x"
    for _ in arrivals:
        out = run_out(s, current)
        (admit,) = of(out, ev.Admit)
        admitted.append(admit.request_id)
        current = admit.request_id
    assert admitted == ["q1", "q2", "q3", "q4", "q5"]


def test_kvbudget_front_orders_by_class_then_tenant() -> None:
    """The same arrivals behind the front: interactive first, tenants in stride order."""
    s = sched(8, BasePolicy())
    s.arrive("x", spec(prompt=100, max_tokens=10, cls="batch", tenant="t0"), 0.0)
    for rid, cls, tenant in [
        ("q1", "batch", "t1"),
        ("q2", "interactive", "t2"),
        ("q3", "batch", "t1"),
        ("q4", "interactive", "t1"),
        ("q5", "interactive", "t1"),
    ]:
        s.arrive(rid, spec(prompt=100, max_tokens=10, cls=cls, tenant=tenant), 0.0)
    admitted: list[str] = []
    current = "x"
    for _ in range(5):
        (admit,) = of(run_out(s, current), ev.Admit)
        admitted.append(admit.request_id)
        current = admit.request_id
    assert admitted[:3] == ["q2", "q4", "q5"] or admitted[:3] == ["q4", "q2", "q5"]
    assert admitted[3:] == ["q1", "q3"]


def test_too_large_is_still_refused() -> None:
    """A request that can never fit is a correctness refusal, not overload: every policy says so."""
    for name in BASELINES:
        s = sched(4, name)
        (reject,) = of(s.arrive("big", spec(prompt=100, max_tokens=10), 0.0), ev.Reject)
        assert reject.reason == "too-large"


# == vLLM (reserve-current) ======================================================================


def test_vllm_victim_is_the_newest_admitted_and_resumes_at_the_head() -> None:
    """vLLM's Scheduler.schedule: a running request that cannot allocate preempts
    ``self.running.pop()`` (the newest) and _preempt_request puts it at the head of the waiting
    queue. Three requests of 2 blocks (prompt 16, grants to 16 tokens) fill 6 blocks; a at its
    boundary needs a third."""
    s = sched(6, ReserveCurrentPolicy())
    for rid in ("a", "b", "c"):
        assert of(s.arrive(rid, spec(prompt=16, max_tokens=64), 0.0), ev.Admit, rid)
    s.arrive("d", spec(prompt=16, max_tokens=64), 0.0)  # waits: the cache is full
    s.charge("a", 16, 0.0)  # its boundary (32 tokens, 2 blocks): the next token needs a block
    out = s.boundary_reached("a", 0.0)
    (pre,) = of(out, ev.Preempt)
    assert pre.request_id == "c"
    out = s.confirm_release("c", 0.0)
    assert of(out, ev.Extend, "a")
    assert queue_order(s) == ["c", "d"]  # at the head, ahead of the caller that came first


def test_vllm_priority_victim_is_the_least_important_latest_arrival() -> None:
    """Under ``--scheduling-policy priority`` the victim is max(running, key=(priority,
    arrival_time)): the batch request, though the interactive one came later."""
    s = sched(6, ReserveCurrentPolicy(priority=True))
    s.arrive("a", spec(cls="interactive"), 0.0)
    s.arrive("b", spec(cls="batch"), 0.1)
    s.arrive("c", spec(cls="interactive"), 0.2)
    s.charge("a", 16, 0.3)
    (pre,) = of(s.boundary_reached("a", 0.3), ev.Preempt)
    assert pre.request_id == "b"


def test_vllm_priority_queue_is_by_class_then_arrival() -> None:
    s = sched(7, ReserveCurrentPolicy(priority=True))
    s.arrive("x", spec(prompt=100, max_tokens=10, cls="batch"), 0.0)
    s.arrive("b1", spec(prompt=100, max_tokens=10, cls="batch", tenant="t1"), 0.1)
    s.arrive("i1", spec(prompt=100, max_tokens=10, cls="interactive", tenant="t2"), 0.2)
    s.arrive("i2", spec(prompt=100, max_tokens=10, cls="interactive", tenant="t2"), 0.3)
    (admit,) = of(run_out(s, "x", 0.4), ev.Admit)
    assert admit.request_id == "i1"
    assert queue_order(s, "interactive") == ["i2"] and queue_order(s, "batch") == ["b1"]


def test_vllm_max_num_queued_reqs_rejects_a_newcomer_when_full() -> None:
    """AsyncLLM.check_admission: refused when waiting + running + 1 would exceed the cap."""
    s = sched(8, ReserveCurrentPolicy(max_num_queued_reqs=2))
    assert of(s.arrive("a", spec(prompt=100, max_tokens=10), 0.0), ev.Admit)
    assert not s.arrive("b", spec(prompt=100, max_tokens=10), 0.0)  # queued
    (reject,) = of(s.arrive("c", spec(prompt=100, max_tokens=10), 0.0), ev.Reject)
    assert reject.reason == "queue-full"
    assert s.rejections_by_reason == {"queue-full": 1}
    run_out(s, "a")  # a is gone, b runs: one unfinished
    assert of(s.arrive("d", spec(prompt=100, max_tokens=10), 0.0), ev.Admit) == []
    assert "d" in s.requests


def test_vllm_max_num_queued_tokens_counts_prompts_still_in_prefill() -> None:
    """Refused when the prompts of requests without a first token already reach the cap (the
    newcomer's own prompt not counted)."""
    s = sched(100, ReserveCurrentPolicy(max_num_queued_tokens=150))
    assert of(s.arrive("a", spec(prompt=100), 0.0), ev.Admit)  # 0 in prefill before it
    assert of(s.arrive("b", spec(prompt=100), 0.0), ev.Admit)  # 100 < 150
    (reject,) = of(s.arrive("c", spec(prompt=100), 0.0), ev.Reject)  # 200 >= 150
    assert reject.reason == "queue-full"
    s.charge("a", 1, 0.0)  # a's first token: only b's 100 still in prefill
    assert of(s.arrive("d", spec(prompt=100), 0.0), ev.Admit)


def test_vllm_uncapped_by_default() -> None:
    policy = ReserveCurrentPolicy()
    assert policy.max_num_queued_reqs is None and policy.max_num_queued_tokens is None


# == SGLang (new-token-ratio) ====================================================================


def _sglang_case(
    steps: int, min_ratio: float = 0.1
) -> tuple[Scheduler, NewTokenRatioPolicy, list[ev.Action]]:
    """10 blocks. a (prompt 16, max 64) at 32 tokens holds 4 blocks (granted to 48), b (prompt
    32, max 64) at 16 tokens holds 4 (granted to 32), c (prompt 16, max 48) at 16 tokens holds 2:
    the cache is full and c, at its boundary, cannot allocate. (The ratio starts at 0.1 and each
    comes in its own round, so that all three are admitted.)"""
    policy = NewTokenRatioPolicy(
        init_ratio=0.1, min_ratio=min_ratio, decay_steps=600, retract_decode_steps=steps
    )
    s = sched(10, policy)
    assert of(s.arrive("a", spec(prompt=16, max_tokens=64), 0.0), ev.Admit)
    assert of(s.arrive("b", spec(prompt=32, max_tokens=64), 0.1), ev.Admit)
    assert of(s.arrive("c", spec(prompt=16, max_tokens=48), 0.2), ev.Admit)
    grow(s, "a", 32)
    grow(s, "b", 16)
    s.charge("c", 16, 0.0)
    assert [s.requests[r].blocks for r in "abc"] == [4, 4, 2] and s.ledger.free == 0
    s.arrive("d", spec(prompt=16, max_tokens=16), 0.0)  # waits
    return s, policy, s.boundary_reached("c", 0.0)


def test_sglang_retracts_fewest_output_longest_prompt_until_room_for_the_steps() -> None:
    """retract_decode: pop order (fewest output tokens, then longest prompt): b, c, a. After b
    (4 blocks = 64 free tokens) there is room for 8 steps of the 2 left (16): stop. The ratio
    becomes (decoded 32 + 16 + 8 x 2) / max_new (64 + 48) = 64 / 112; b joins the back of the
    queue."""
    s, policy, out = _sglang_case(steps=8)
    assert [p.request_id for p in of(out, ev.Preempt)] == ["b"]
    assert policy.ratio == pytest.approx(64 / 112)
    s.confirm_release("b", 0.0)
    assert queue_order(s) == ["d", "b"]


def test_sglang_retracts_more_while_the_steps_do_not_fit_but_never_the_last() -> None:
    """With 40 steps: after b, 64 < 40 x 2, so c goes too (96 free tokens); a alone is never
    retracted. The ratio: min(1, (32 + 40 x 1) / 64) = 1. With 30 steps b is enough (64 >=
    60): (32 + 16 + 30 x 2) / 112."""
    _s, policy, out = _sglang_case(steps=40)
    assert [p.request_id for p in of(out, ev.Preempt)] == ["b", "c"]
    assert policy.ratio == 1.0
    _s, policy, out = _sglang_case(steps=30)
    assert [p.request_id for p in of(out, ev.Preempt)] == ["b"]
    assert policy.ratio == pytest.approx(108 / 112)


def test_sglang_ratio_decays_per_step_except_when_it_retracts() -> None:
    """Scheduler.update_running_batch: 0.7 falls by (0.7 - 0.098) / 600 a step to 0.098; a step
    that retracted sets the ratio instead."""
    s, policy, _out = _sglang_case(steps=8, min_ratio=0.04)  # decay (0.1 - 0.04) / 600
    after_retract = policy.ratio
    s.observe_step(2, 100, 0.01, 0.0)  # the step of the retraction: no decay
    assert policy.ratio == after_retract
    s.observe_step(2, 100, 0.01, 0.0)
    assert policy.ratio == pytest.approx(after_retract - 0.06 / 600)
    fresh = NewTokenRatioPolicy()
    s2 = sched(10, fresh)
    for _ in range(10):
        s2.observe_step(0, 0, 0.01, 0.0)
    assert fresh.ratio == pytest.approx(0.7 - 10 * (0.7 - 0.098) / 600)
    for _ in range(700):
        s2.observe_step(0, 0, 0.01, 0.0)
    assert fresh.ratio == pytest.approx(0.098)


def test_sglang_admission_charges_a_newcomer_whole_in_its_round() -> None:
    """PrefillAdder: free tokens must cover running remaining x ratio + the newcomer's prompt +
    min(max_new, 4096); a request admitted in the same round counts whole. 10 blocks, ratio 0.1:
    a (prompt 16, max 64) leaves 128 free tokens; b (prompt 32, max 64) in the same round needs
    6.4 + 57.6 (a's whole 64, beyond its 6.4) + 96 > 128; in the next round 6.4 + 96 <= 128."""
    s = sched(10, NewTokenRatioPolicy(init_ratio=0.1, min_ratio=0.1))
    assert of(s.arrive("a", spec(prompt=16, max_tokens=64), 0.0), ev.Admit)
    assert not of(s.arrive("b", spec(prompt=32, max_tokens=64), 0.0), ev.Admit)
    assert of(s.tick(0.1), ev.Admit, "b")


def test_sglang_defaults_are_sglangs_constants() -> None:
    p = NewTokenRatioPolicy()
    assert (p.init_ratio, p.min_ratio, p.retract_decode_steps) == (0.7, pytest.approx(0.098), 20)
    assert p.decay == pytest.approx((0.7 - 0.098) / 600)
    assert p.requeue_front is False


# == LightLLM (past-future) ======================================================================


class _FixedRandom:
    """Stands in for the policy's ``random.Random``: random() returns the values given."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)

    def choice(self, seq: Any) -> Any:
        return seq[int(self.random() * len(seq))]


def _req(prompt: int, generated: int, hard_max: int) -> Request:
    return cast(Request, SimpleNamespace(prompt=prompt, generated=generated, hard_max=hard_max))


def test_past_future_window_is_seeded_with_copies_of_the_router_max() -> None:
    """PastFutureQueue.__init__: deque([router_max_new_token_len] * (WINDOW_SIZE // 2),
    maxlen=WINDOW_SIZE)."""
    p = PastFuturePolicy()
    assert list(p.window) == [1024] * 100 and p.window.maxlen == 200
    for _ in range(150):
        p.on_finished(cast(Request, None), 10)
    assert sorted(p.window) == [10] * 150 + [1024] * 50


def test_past_future_interpolates_over_current_history_above_and_max() -> None:
    """_sample_cache_list: the points [150] + [200, 300] + [1000] (100 is below the current
    length); a uniform point x over 3 segments, linear between its two neighbours."""
    p = PastFuturePolicy()
    p.window = deque([300, 100, 200], maxlen=200)
    p._dirty = True
    r = _req(prompt=16, generated=150, hard_max=1000)
    p._rng = _FixedRandom(0.5, 0.9, 0.0, 0.999999)  # type: ignore[assignment]
    assert p._sample_running(r) == (166, 250 - 150)  # x = 1.5: halfway 200..300
    assert p._sample_running(r) == (166, 790 - 150)  # x = 2.7: 300 + 0.7 x 700
    assert p._sample_running(r) == (166, 0)  # x = 0: its current length
    assert p._sample_running(r) == (166, 1000 - 150)  # the far end: its max_new
    # nothing in the window above it: between its length and its max
    short = _req(prompt=16, generated=400, hard_max=500)
    p._rng = _FixedRandom(0.5)  # type: ignore[assignment]
    assert p._sample_running(short) == (416, 450 - 400)


def test_past_future_newcomer_draws_uniformly_from_the_window_clipped_to_its_max() -> None:
    """_update_cache_len_list: random.choice(history_output_len), within max_new."""
    p = PastFuturePolicy()
    p.window = deque([40, 80, 120, 160], maxlen=200)
    p._rng = _FixedRandom(0.3, 0.9)  # type: ignore[assignment]
    new = _req(prompt=10, generated=0, hard_max=100)
    assert p._sample_new(new) == (10, 80)
    assert p._sample_new(new) == (10, 100)  # 160, clipped to max_new


def test_past_future_peak_is_over_the_finish_points() -> None:
    """_calc_max_token_num_needed: (100 context, 10 to come) and (50, 30): when the first ends
    both hold 110 + 60 = 170; when the second ends it alone holds 80."""
    assert PastFuturePolicy._peak([(100, 10), (50, 30)]) == 170
    assert PastFuturePolicy._peak([(100, 0)]) == 100


def test_past_future_draws_k_lists_per_round() -> None:
    """_init_cache_list: K = min(MAXIMUM_LISTS 5, MINIMUM_SAMPLES 200 // n + 1) for n running."""
    for n, k in ((1, 5), (50, 5), (67, 3), (100, 3), (250, 1)):
        p = PastFuturePolicy()
        live = {str(i): _req(16, 0, 64) for i in range(n)}
        p.bind(cast(Any, SimpleNamespace(live=live, capacity=Capacity(64, 16))))
        p._start_round()
        assert len(p._lists) == k and all(len(lst) == n for lst in p._lists)
    p = PastFuturePolicy()
    p.bind(cast(Any, SimpleNamespace(live={}, capacity=Capacity(64, 16))))
    p._start_round()
    assert p._lists == [[]]


def test_past_future_admits_under_95_percent_and_stops_the_round_at_a_refusal() -> None:
    """10 blocks = 160 tokens, limit 152. With the seeded window every draw is 1024, clipped to
    max_new 100: the first newcomer needs 16 + 100 = 116 (admitted); a second would peak at
    2 x 100 + 32 = 232 (refused), and is not drawn for again in the same round."""
    p = PastFuturePolicy()
    s = sched(10, p)
    assert of(s.arrive("a", spec(prompt=16, max_tokens=100), 0.0), ev.Admit)
    p._rng = _FixedRandom(*([0.99] * 100))  # type: ignore[assignment]
    assert not of(s.arrive("b", spec(prompt=16, max_tokens=100), 0.0), ev.Admit)
    assert s.requests["b"].state is State.QUEUED
    left = len(p._rng.values)  # type: ignore[attr-defined]
    assert not p.admit(s.requests["b"], 1)
    assert len(p._rng.values) == left  # type: ignore[attr-defined]  # (no new draw)


# == TensorRT-LLM / TGI v3 (reserve-max), segmented ==============================================


def test_reserve_max_reserves_everything_and_blocks_the_line() -> None:
    """GuaranteedNoEvictScheduler::impl / TGI's next_batch: a reserves prompt + max (116 tokens,
    8 of 10 blocks) at once; c (8 blocks) waits for room and d (2 blocks), behind it, does not
    jump it though 2 blocks are free: the first that does not fit stops the line."""
    s = sched(10, ReserveMaxPolicy())
    (admit,) = of(s.arrive("a", spec(prompt=16, max_tokens=100), 0.0), ev.Admit)
    assert (admit.boundary, admit.blocks) == (100, 8)
    assert not of(s.arrive("c", spec(prompt=16, max_tokens=100), 0.0), ev.Admit)
    assert not of(s.arrive("d", spec(prompt=16, max_tokens=16), 0.0), ev.Admit)
    assert s.ledger.free == 2 and queue_order(s) == ["c", "d"]
    out = run_out(s, "a")
    assert [a.request_id for a in of(out, ev.Admit)] == ["c", "d"]  # in order, once room came
    assert not of(out, ev.Preempt)


def test_segmented_grants_segments_and_requeues_at_the_back() -> None:
    """Segments of 64: a (prompt 16, max 200) gets 80 tokens (5 of 9 blocks); b waits. At its
    boundary a checkpoints itself and goes to the back of the line, behind b."""
    s = sched(9, SegmentedPolicy(segment=64))
    (admit,) = of(s.arrive("a", spec(prompt=16, max_tokens=200), 0.0), ev.Admit)
    assert (admit.boundary, admit.blocks) == (64, 5)
    s.arrive("b", spec(prompt=16, max_tokens=200), 0.0)
    s.charge("a", 64, 0.0)
    (pre,) = of(s.boundary_reached("a", 0.0), ev.Preempt)
    assert pre.request_id == "a"
    out = s.confirm_release("a", 0.0)
    assert [x.request_id for x in of(out, ev.Admit)] == ["b"]
    assert queue_order(s) == ["a"]


# == the simulator: preemptions inside the engine ================================================


@pytest.mark.parametrize(
    ("name", "in_engine"),
    [
        ("reserve-current", True),
        ("new-token-ratio", True),
        ("past-future", True),
        ("segmented", True),
        ("reserve-max", False),
        ("oracle", False),
        ("calibrated", False),
    ],
)
def test_preemption_latency_is_the_policys(name: str, in_engine: bool) -> None:
    """vLLM, SGLang and LightLLM free a victim inside their own step: the simulator returns its
    blocks at once. kvbudget's policies abort through the engine's API and wait for its
    confirmation (even where the engine's idle round trip, ``abort_latency_s``, is 0)."""
    from kvbudget.sim.driver import _Sim
    from kvbudget.sim.engine import EngineModel
    from kvbudget.sim.scenario import Scenario

    engine = EngineModel(abort_latency_s=0.0)
    sim = _Sim([], Scenario(), engine, name, 0, None, False)
    assert sim.preempts_in_engine is in_engine
    assert cast(BasePolicy, sim.sched.policy).preempts_in_engine is in_engine


def test_vllm_victim_blocks_serve_the_rest_of_the_step() -> None:
    """Hand-worked: 4 requests of 64-token prompts on 21 blocks of 16 tokens, each granted its
    prompt and one token (5 blocks), 1 block free. All four reach their 16th token in the same
    step and need a sixth block: vLLM's schedule loop gives the free one to the first, preempts
    the newest (``self.running.pop()``) for the second, freeing its 5 blocks at once, and the
    third takes one of them: 1 preemption. Freed only once the step is over, the third would
    find no block and preempt itself as well (2, the simulator's count before)."""
    import attrs

    from kvbudget.sim.driver import simulate
    from kvbudget.sim.engine import EngineModel
    from kvbudget.sim.scenario import Scenario, apply_scenario
    from kvbudget.sim.workload import TraceRequest, Workload

    trace = Workload(
        name="four", requests=[TraceRequest(0.0, 64, 40) for _ in range(4)]
    )
    sc = Scenario(interactive_share=1.0, abandon_share=0.0)
    reqs = [attrs.evolve(r, spec=attrs.evolve(r.spec, max_tokens=40))
            for r in apply_scenario(trace, sc)]
    engine = EngineModel(capacity=Capacity(21, 16), abort_latency_s=0.05)
    r = simulate(reqs, sc, engine, "reserve-current", keep_requests=True)
    assert r.completed == 4
    assert r.preemptions == 1
    assert sorted(rec.output_tokens for rec in r.request_records) == [40] * 4
