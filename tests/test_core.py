"""Unit tests of the core: bad input (typed errors naming field and range, nothing leaks) and
focused scheduler behaviour (preemption, resume, continuation, overload, timeouts, the deadlock
breaker, reconciliation, weighted tenant fairness)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbudget.core import events as ev
from kvbudget.core.cost import CostModel, StepTimeModel
from kvbudget.core.ledger import Request, State
from kvbudget.core.lengths import LengthModel
from kvbudget.core.model import Capacity, RequestSpec, ServiceClass
from kvbudget.core.policy import (
    BasePolicy,
    Blocked,
    CalibratedPolicy,
    make_policy,
)
from kvbudget.core.scheduler import Scheduler, SchedulerConfig
from kvbudget.errors import (
    AlreadyReleased,
    DuplicateRequest,
    GrantExceeded,
    HardLimitExceeded,
    InvalidInput,
    InvalidTransition,
    PolicyViolation,
    UnknownClass,
    UnknownPolicy,
    UnknownRequest,
)
from kvbudget.testing import fingerprint

# == helpers =====================================================================================


def of(actions: Iterable[ev.Action], kind: type[Any], rid: str | None = None) -> list[Any]:
    return [a for a in actions if isinstance(a, kind) and (rid is None or a.request_id == rid)]


def to_boundary(s: Scheduler, rid: str, now: float) -> list[ev.Action]:
    """Generate up to the request's current boundary."""
    r = s.requests[rid]
    return list(s.charge(rid, r.boundary - r.generated, now)) if r.generated < r.boundary else []


def push(s: Scheduler, rid: str, now: float) -> list[ev.Action]:
    """Generate to the boundary (following extensions granted on the way), then report it."""
    out: list[ev.Action] = []
    for _ in range(1000):
        r = s.requests[rid]
        if r.state not in (State.ADMITTED, State.RUNNING, State.EXTENDING):
            return out
        if r.generated < r.boundary:
            out += s.charge(rid, r.boundary - r.generated, now)
        else:
            return out + s.boundary_reached(rid, now)
    raise AssertionError("no boundary reached")


def raises_unchanged(s: Scheduler, kind: type[BaseException], fn: Callable[[], object]) -> Any:
    before = fingerprint(s)
    with pytest.raises(kind) as info:
        fn()
    assert fingerprint(s) == before, "the failed call changed the scheduler"
    return info.value


class ReserveMaxFront(BasePolicy):
    """Reserve the hard max behind kvbudget's front (turn-away, timeouts, the latency-floor gate,
    tenant stride): the tests of that front. (``ReserveMaxPolicy`` is TensorRT-LLM's rule and,
    like every baseline, runs without kvbudget's front.)"""

    name = "reserve-max-front"


class Fixed(BasePolicy):
    """A small, predictable policy for behaviour tests."""

    name = "fixed"

    def __init__(
        self,
        allowance: int = 8,
        step: int | None = 8,
        blocked: Blocked = Blocked.WAIT,
        protected: int = 0,
        headroom: int = 0,
    ) -> None:
        self.allowance = allowance
        self.step = step
        self.blocked = blocked
        self._protected = protected
        self._headroom = headroom

    def headroom_target(self) -> int:
        return self._headroom

    def protected_blocks(self) -> int:
        return self._protected

    def initial_allowance(self, req: Request) -> int:
        return min(req.remaining, self.allowance)

    def extension_tokens(self, req: Request) -> int | None:
        room = req.hard_max - req.boundary
        return None if self.step is None or room <= 0 else min(room, self.step)

    def on_blocked(self, req: Request) -> Blocked:
        if self.blocked is Blocked.CONTINUE and req.spec.on_exhausted != "continue":
            return Blocked.WAIT
        return self.blocked


def spec(prompt: int = 4, max_tokens: int = 64, cls: str = "batch", **kw: Any) -> RequestSpec:
    return RequestSpec(prompt, max_tokens, 4096, service_class=cls, **kw)


# == bad input ===================================================================================


@pytest.mark.parametrize("field", ["prompt_tokens", "max_tokens", "model_max_len"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "8", None, math.nan])
def test_request_spec_token_counts(field: str, value: object) -> None:
    kwargs: dict[str, Any] = {"prompt_tokens": 8, "max_tokens": 8, "model_max_len": 64}
    kwargs[field] = value
    with pytest.raises(InvalidInput) as info:
        RequestSpec(**kwargs)
    assert info.value.field == field
    assert "integer" in info.value.expected and ">= 1" in info.value.expected
    assert field in str(info.value)


@pytest.mark.parametrize("prompt,mml", [(64, 64), (100, 64), (1, 1)])
def test_prompt_that_leaves_no_room_is_refused(prompt: int, mml: int) -> None:
    with pytest.raises(InvalidInput) as info:
        RequestSpec(prompt, 16, mml)
    assert info.value.field == "prompt_tokens"
    assert "model_max_len" in info.value.expected


def test_max_tokens_below_one() -> None:
    with pytest.raises(InvalidInput) as info:
        RequestSpec(8, 0, 64)
    assert info.value.field == "max_tokens"


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0.0, -1.0, True])
def test_deadline_must_be_finite_positive(value: float) -> None:
    with pytest.raises(InvalidInput) as info:
        RequestSpec(8, 8, 64, deadline=value)
    assert info.value.field == "deadline"


@pytest.mark.parametrize("field", ["initial_quantile", "extension_quantile"])
@pytest.mark.parametrize("value", [0.0, 1.0, -0.1, 1.5, math.nan, math.inf, True])
def test_quantiles_out_of_range(field: str, value: float) -> None:
    with pytest.raises(InvalidInput) as info:
        ServiceClass("c", **{field: value})
    assert info.value.field == field
    assert "(0.0, 1.0)" in info.value.expected


@pytest.mark.parametrize("field", ["blocks", "block_size"])
@pytest.mark.parametrize("value", [0, -4, 2.0, math.nan, True])
def test_capacity_sizes(field: str, value: object) -> None:
    kwargs: dict[str, Any] = {"blocks": 8, "block_size": 16}
    kwargs[field] = value
    with pytest.raises(InvalidInput) as info:
        Capacity(**kwargs)
    assert info.value.field == field


@pytest.mark.parametrize(
    "field,value",
    [
        ("slack_tokens", -1),
        ("slack_tokens", 1.0),
        ("max_active", 0),
        ("confirm_timeout_s", math.nan),
        ("confirm_timeout_s", 0.0),
        ("release_rate_window_s", math.inf),
        ("arrival_rate_window_s", 0.0),
        ("deadline_service_quantile", 0.0),
        ("deadline_service_quantile", 1.0),
        ("deadline_service_quantile", math.nan),
        ("first_token_quantile", 0.0),
        ("first_token_quantile", 1.0),
        ("first_token_quantile", math.inf),
        ("first_token_quantile", "0.9"),
        ("arrival_rate_window_s", math.nan),
        ("prefill_chunk_tokens", 0),
        ("prefill_chunk_tokens", 2.5),
        ("turn_away_late_first_tokens", 1),
    ],
)
def test_scheduler_config(field: str, value: object) -> None:
    with pytest.raises(InvalidInput) as info:
        SchedulerConfig(**{field: value})
    assert info.value.field == field


def test_unknown_class_and_policy_names() -> None:
    s = Scheduler(Capacity(16, 4))
    e = raises_unchanged(s, UnknownClass, lambda: s.arrive("a", spec(cls="gold"), 0.0))
    assert e.name == "gold" and set(e.known) == {"interactive", "batch"}
    assert isinstance(e, KeyError)
    with pytest.raises(UnknownPolicy) as info:
        make_policy("fifo")
    assert info.value.name == "fifo" and "calibrated" in info.value.known
    with pytest.raises(UnknownPolicy):
        Scheduler(Capacity(16, 4), policy="fifo")


@pytest.mark.parametrize("tokens", [0, -1, True, 1.0, None, "1"])
def test_charge_bad_token_counts(tokens: object) -> None:
    s = Scheduler(Capacity(64, 4), policy=Fixed())
    s.arrive("a", spec(), 0.0)
    e = raises_unchanged(s, InvalidInput, lambda: s.charge("a", tokens, 0.0))  # type: ignore[arg-type]
    assert e.field == "tokens" and e.expected == "an integer >= 1"


def test_charge_past_grant_and_hard_max() -> None:
    s = Scheduler(
        Capacity(64, 4),
        policy=Fixed(allowance=8, step=None),
        config=SchedulerConfig(slack_tokens=2),
    )
    s.arrive("a", spec(max_tokens=40), 0.0)
    b = s.requests["a"].boundary
    assert b == 10  # prompt 4 + 8 + slack 2 = 14 tokens -> 4 blocks = 16 tokens -> 10 output
    s.charge("a", b + 2, 0.0)  # the reserved slack may be used
    e = raises_unchanged(s, GrantExceeded, lambda: s.charge("a", 1, 0.0))
    assert (e.boundary, e.slack, e.attempted) == (10, 2, 13)
    e = raises_unchanged(s, HardLimitExceeded, lambda: s.charge("a", 29, 0.0))
    assert (e.hard_max, e.attempted) == (40, 41)


def test_events_for_unknown_and_released_requests() -> None:
    s = Scheduler(Capacity(64, 4), policy=Fixed())
    calls: dict[str, Callable[[str], object]] = {
        "charge": lambda r: s.charge(r, 1, 0.0),
        "finish": lambda r: s.finish(r, "stop", 0.0),
        "cancel": lambda r: s.cancel(r, 0.0),
        "fail": lambda r: s.fail(r, "x", 0.0),
        "confirm": lambda r: s.confirm_release(r, 0.0),
        "boundary": lambda r: s.boundary_reached(r, 0.0),
    }
    for fn in calls.values():
        e = raises_unchanged(s, UnknownRequest, lambda fn=fn: fn("ghost"))
        assert e.request_id == "ghost"
    s.arrive("a", spec(), 0.0)
    s.charge("a", 3, 0.0)
    s.finish("a", "stop", 0.0)
    released = s.confirm_release("a", 0.0)
    assert of(released, ev.Released, "a")[0].outcome == "completed"
    for name, fn in calls.items():
        if name == "cancel":
            continue
        raises_unchanged(s, AlreadyReleased, lambda fn=fn: fn("a"))
    # a second release
    e = raises_unchanged(s, AlreadyReleased, lambda: s.confirm_release("a", 0.0))
    assert isinstance(e, InvalidTransition)
    raises_unchanged(s, DuplicateRequest, lambda: s.arrive("a", spec(), 0.0))


def test_confirm_of_a_running_request_is_refused() -> None:
    s = Scheduler(Capacity(64, 4), policy=Fixed())
    s.arrive("a", spec(), 0.0)
    e = raises_unchanged(s, InvalidTransition, lambda: s.confirm_release("a", 0.0))
    assert e.state == "admitted" and e.event == "confirm"


@pytest.mark.parametrize("now", [math.nan, math.inf, -math.inf])
def test_non_finite_time(now: float) -> None:
    s = Scheduler(Capacity(64, 4), policy=Fixed())
    e = raises_unchanged(s, InvalidInput, lambda: s.tick(now))
    assert e.field == "now"
    e = raises_unchanged(s, InvalidInput, lambda: s.arrive("a", spec(), now))
    assert e.field == "now"


@pytest.mark.parametrize(
    "call,field",
    [
        (lambda s: s.observe_step(-1, 0, 0.01, 0.0), "batch_size"),
        (lambda s: s.observe_step(1, 0, math.nan, 0.0), "seconds"),
        (lambda s: s.observe_step(1, 1.5, 0.01, 0.0), "context_tokens"),
        (lambda s: s.reconcile(-1, 0.0), "engine_used_blocks"),
        (lambda s: s.finish("a", "eos", 0.0), "reason"),
        (lambda s: s.finish("a", "length", 0.0), "reason"),
    ],
)
def test_bad_event_fields(call: Callable[[Scheduler], object], field: str) -> None:
    s = Scheduler(Capacity(64, 4), policy=Fixed())
    s.arrive("a", spec(), 0.0)
    e = raises_unchanged(s, InvalidInput, lambda: call(s))
    assert e.field == field and e.expected


class BadAllowance(Fixed):
    name = "bad-allowance"

    def initial_allowance(self, req: Request) -> int:
        return req.remaining + 1


def test_policy_violation_mid_arrival_leaks_nothing() -> None:
    s = Scheduler(Capacity(64, 4), policy=BadAllowance())
    e = raises_unchanged(s, PolicyViolation, lambda: s.arrive("a", spec(), 0.0))
    assert "initial allowance" in e.detail
    assert s.snapshot().totals.arrived == 0 and "a" not in s.requests


class ChoosesVictims(Fixed):
    """Fixed, preempting others at the boundary: the victims are ``pick(scheduler)``."""

    name = "chooses-victims"

    def __init__(self, pick: Callable[[Scheduler], list[Request]]) -> None:
        super().__init__(allowance=4, blocked=Blocked.PREEMPT_OTHERS)
        self.pick = pick

    def choose_victims(
        self, req: Request, need_blocks: int, candidates: Sequence[Request]
    ) -> list[Request]:
        return self.pick(self.scheduler)  # type: ignore[arg-type]


def _full_cache(policy: BasePolicy) -> Scheduler:
    """'a' and 'b' hold the whole cache, 'a' at its boundary; 'q' queued."""
    s = Scheduler(Capacity(4, 4), policy=policy, config=SchedulerConfig(slack_tokens=0))
    for rid in ("a", "b", "q"):
        s.arrive(rid, spec(prompt=4, max_tokens=64), 0.0)
    s.charge("a", 4, 0.1)
    s.charge("b", 1, 0.1)
    return s


def test_a_token_that_lands_after_its_preemption_is_the_callers_own_first_token() -> None:
    """Preempted before its first token, a request gets one token from the engine before the
    stop lands. The checkpoint keeps it and the caller receives it, so it is the caller's first
    token, counted once, and no token is wasted. (It was counted as wasted and the caller's
    first token never was: a random policy on the real engine saw 9 first tokens for 10
    callers, and a checkpoint cancelled later would have counted it wasted twice.)"""
    cls = ServiceClass("batch", ttft_slo_s=0.2)
    victim_b = ChoosesVictims(lambda s: [s.requests["b"]])
    s = Scheduler(Capacity(4, 4), classes=(cls,), policy=victim_b,
                  config=SchedulerConfig(slack_tokens=0))
    for rid in ("a", "b"):
        s.arrive(rid, spec(prompt=4, max_tokens=8), 0.0)
    s.charge("a", 4, 0.1)
    assert of(s.boundary_reached("a", 0.2), ev.Preempt, "b")
    b = s.requests["b"]
    assert b.state is State.PREEMPTING and b.generated == 0
    s.charge("b", 1, 0.25)  # (before the stop lands: late for its 0.2 s objective)
    s.confirm_release("b", 0.3)
    assert b.resume is not None and b.resume.generated_tokens == 1

    def to_hard_max(rid: str, now: float) -> None:
        r = s.requests[rid]
        while r.generated < r.hard_max:
            if r.generated < r.boundary:
                s.charge(rid, r.boundary - r.generated, now)
            else:
                s.boundary_reached(rid, now)
        s.finish(rid, "length", now)

    to_hard_max("a", 0.4)  # (b's blocks grow a's grant)
    assert of(s.confirm_release("a", 0.6), ev.Admit, "b")
    to_hard_max("b", 0.8)
    s.confirm_release("b", 0.9)
    totals = s.snapshot().totals
    assert totals.completed == 2
    assert (totals.first_tokens, totals.first_tokens_late) == (2, 1)
    assert totals.wasted_tokens == 0 and totals.tokens == 16


@pytest.mark.parametrize(
    "pick, detail",
    [
        (lambda s: [s.requests["b"], s.requests["b"]], "victim 'b' chosen twice"),
        (lambda s: [s.requests["b"], s.requests["q"]], "victim 'q' is not one of the candidates"),
        (lambda s: None, "victims must be a list of requests, got None"),
        (lambda s: ["b"], "victim 'b' is not one of the candidates offered (requests)"),
    ],
    ids=["twice", "queued", "none", "bare-id"],
)
def test_a_bad_victim_list_is_refused_before_anyone_is_stopped(
    pick: Callable[[Scheduler], list[Request]], detail: str
) -> None:
    """The list is checked whole before the first victim is stopped: before, 'b' chosen twice
    was stopped once and then refused, and held its blocks with no Preempt ever sent for it."""
    s = _full_cache(ChoosesVictims(pick))
    with pytest.raises(PolicyViolation) as info:
        s.boundary_reached("a", 0.2)
    assert detail in info.value.detail
    assert s.requests["b"].state is State.RUNNING and s.preempting == 0
    assert s.ledger.reserved == 4
    # a valid list then preempts as usual
    s.policy.pick = lambda s: [s.requests["b"]]  # type: ignore[attr-defined]
    assert of(s.boundary_reached("a", 0.3), ev.Preempt, "b")


class OddAnswers(Fixed):
    name = "odd-answers"

    def __init__(self, headroom: object = 0, lookahead: object = 0) -> None:
        super().__init__()
        self._odd_headroom, self.lookahead = headroom, lookahead

    def headroom_target(self) -> int:
        return self._odd_headroom  # type: ignore[return-value]

    def lookahead_tokens(self, req: Request) -> int:
        return self.lookahead  # type: ignore[return-value]


@pytest.mark.parametrize(
    "odd, detail",
    [({"headroom": v}, "headroom target") for v in (math.nan, 2.5, -1, "4", None)]
    + [({"lookahead": v}, "lookahead") for v in (-1, math.nan, 1.5, None)],
)
def test_an_odd_headroom_or_lookahead_is_refused_and_the_caller_still_waits(
    odd: dict[str, object], detail: str
) -> None:
    """A NaN compares false with every bound: as a headroom target it used to pass. Both are
    refused before anything is granted, and the caller stays queued (not popped and lost):
    with the policy mended, the next pass admits it."""
    if "headroom" in odd:  # (a headroom is asked for when the scheduler is made)
        with pytest.raises(PolicyViolation):
            Scheduler(Capacity(64, 4), policy=OddAnswers(**odd))
    policy = OddAnswers()
    s = Scheduler(Capacity(64, 4), policy=policy)
    policy._odd_headroom, policy.lookahead = odd.get("headroom", 0), odd.get("lookahead", 0)
    with pytest.raises(PolicyViolation) as info:
        s.arrive("a", spec(), 0.0)
    assert detail in info.value.detail
    assert s.requests["a"].state is State.QUEUED and s.ledger.reserved == 0
    policy._odd_headroom, policy.lookahead = 0, 0
    assert of(s.tick(0.1), ev.Admit, "a")


def test_a_headroom_past_the_cache_or_a_protected_part_past_the_target_is_capped() -> None:
    """The documented cap (docs/harness.md): the target at the cache, the protected part at the
    target; both are still whole blocks."""
    s = Scheduler(Capacity(8, 4), policy=Fixed(headroom=10**6, protected=10**6))
    s.arrive("a", spec(cls="interactive"), 0.0)  # (a protected class is live: its part counts)
    assert (s.ledger.headroom_target, s.ledger.protected_blocks) == (8, 8)
    s = Scheduler(Capacity(8, 4), policy=Fixed(headroom=2, protected=5))
    s.arrive("a", spec(cls="interactive"), 0.0)
    assert (s.ledger.headroom_target, s.ledger.protected_blocks) == (2, 2)


def test_whole_numbers_of_other_types_are_answers_too() -> None:
    """One rule for every count a policy answers (kvbudget.validate.whole): any integer type,
    not a bool, not a float."""
    np = pytest.importorskip("numpy")
    policy = OddAnswers(headroom=np.int64(3), lookahead=np.int32(2))
    policy.allowance, policy.step = np.int64(8), np.int16(8)  # type: ignore[assignment]
    s = Scheduler(Capacity(64, 4), policy=policy)
    assert of(s.arrive("a", spec(), 0.0), ev.Admit, "a")
    assert type(s.requests["a"].boundary) is int and s.requests["a"].boundary == 8
    grown = to_boundary(s, "a", 0.1)  # (asked 2 tokens ahead: the lookahead)
    assert of(grown, ev.Extend, "a") and s.requests["a"].boundary == 16
    for bad in (True, 2.0):
        odd = Scheduler(Capacity(64, 4), policy=Fixed(allowance=bad))  # type: ignore[arg-type]
        with pytest.raises(PolicyViolation, match="initial allowance"):
            odd.arrive("a", spec(), 0.0)
    assert type(s.ledger.headroom_target) is int and s.ledger.headroom_target == 3
    assert s.requests["a"].ask_at == s.requests["a"].boundary - 2


class SecondAnswerOdd(Fixed):
    """Answers a's extension as asked twice, then 2.5 tokens (the scheduler asks a third time
    when it sizes the room a blocked stream preempts others for); others get none and wait."""

    name = "second-answer-odd"

    def __init__(self) -> None:
        super().__init__(blocked=Blocked.PREEMPT_OTHERS)
        self.asked: dict[str, int] = {}

    def extension_tokens(self, req: Request) -> int | None:
        if req.request_id != "a":
            return None
        n = self.asked[req.request_id] = self.asked.get(req.request_id, 0) + 1
        # (asked ahead of the boundary, at it, then to size the preemption)
        return 8 if n <= 2 else 2.5  # type: ignore[return-value]

    def on_blocked(self, req: Request) -> Blocked:
        return Blocked.PREEMPT_OTHERS if req.request_id == "a" else Blocked.WAIT


def test_an_odd_extension_answer_is_refused_where_it_sizes_a_preemption_too() -> None:
    """Every extension answer goes through one check, also the second one the scheduler asks for
    a stream blocked at its boundary (which sizes the room it preempts others for): before, a
    fractional answer there stopped a victim for a boundary of 14.5 tokens."""
    s = Scheduler(Capacity(6, 4), policy=SecondAnswerOdd())
    assert of(s.arrive("a", spec(), 0.0), ev.Admit, "a")
    assert of(s.arrive("b", spec(), 0.0), ev.Admit, "b")
    to_boundary(s, "b", 0.1)
    with pytest.raises(PolicyViolation, match="extension must be"):
        push(s, "a", 0.2)  # (the cache is full: its extension cannot be granted)
    assert s.requests["b"].state is State.RUNNING and s.preempting == 0


class FaultyHooks(Fixed):
    """A policy whose notifications raise (``fail``: the hook names), and whose admission gate
    raises while ``boom`` is set."""

    name = "faulty-hooks"

    def __init__(self, fail: tuple[str, ...] = (), **kw: Any) -> None:
        super().__init__(**kw)
        self.fail, self.boom = fail, False

    def _hook(self, name: str) -> None:
        if name in self.fail:
            raise RuntimeError(f"{name} bug")

    def on_granted(self, req: Request) -> None:
        self._hook("on_granted")

    def on_leave(self, req: Request) -> None:
        self._hook("on_leave")

    def on_finished(self, req: Request, length: int) -> None:
        self._hook("on_finished")

    def on_step(self) -> None:
        self._hook("on_step")

    def admit(self, req: Request, blocks: int) -> bool:
        if self.boom:
            raise RuntimeError("admit bug")
        return True


def test_a_notification_that_raises_is_counted_not_let_out_half_way() -> None:
    """Notifications decide nothing: one that raises used to leave the change it reported half
    made (on_granted raised after the grant and before its Admit: blocks reserved for a caller
    never told). Now the change completes, the fault is counted and kept."""
    hooks = ("on_granted", "on_leave", "on_finished", "on_step")
    s = Scheduler(Capacity(16, 4), policy=FaultyHooks(fail=hooks))
    assert of(s.arrive("a", spec(), 0.0), ev.Admit, "a")
    s.charge("a", 2, 0.1)
    assert s.observe_step(1, 6, 0.01, 0.1) == []
    s.finish("a", "stop", 0.2)
    assert of(s.confirm_release("a", 0.3), ev.Released, "a")
    assert s.policy_faults == 4 and s.snapshot().policy_faults == 4
    details = [f.detail for f in s.policy_fault_log]
    assert details[0] == "on_granted for 'a' raised RuntimeError('on_granted bug')"
    assert {d.split(" ")[0] for d in details} == set(hooks)
    assert s.ledger.reserved == 0 and s.active == 0 and not s.live


def test_the_pass_after_a_release_keeps_a_fault_and_returns_what_it_decided() -> None:
    """An engine's confirmation is not the policy's business: the pass after the release grew
    a grant and then met a policy that raised for the next caller. The release and the growth
    stand and are returned; the fault is kept (before, the exception left with both)."""
    policy = FaultyHooks(allowance=3, step=4)
    s = Scheduler(Capacity(4, 4), policy=policy, config=SchedulerConfig(slack_tokens=0))
    s.arrive("a", spec(prompt=4), 0.0)
    s.arrive("b", spec(prompt=4), 0.0)
    s.arrive("q", spec(prompt=1), 0.0)  # (1 block with its allowance; the cache is full)
    assert s.requests["q"].state is State.QUEUED
    assert of(to_boundary(s, "a", 0.1), ev.Deny, "a")
    s.charge("b", 3, 0.1)
    s.finish("b", "stop", 0.2)
    policy.boom = True
    out = s.confirm_release("b", 0.3)
    assert of(out, ev.Released, "b") and of(out, ev.Extend, "a")
    assert s.requests["a"].boundary == 8  # (its blocks filled)
    assert s.policy_faults == 1 and "admit bug" in s.policy_fault_log[0].detail
    policy.boom = False
    assert of(s.tick(0.4), ev.Admit, "q")


class GateFor(Fixed):
    """Its admission gate says no to the ids in ``closed`` and raises for those in ``broken``."""

    name = "gate-for"

    def __init__(self) -> None:
        super().__init__(allowance=3)
        self.closed: set[str] = set()
        self.broken: set[str] = set()

    def admit(self, req: Request, blocks: int) -> bool:
        if req.request_id in self.broken:
            raise RuntimeError(f"admit bug for {req.request_id}")
        return req.request_id not in self.closed


def test_a_pass_cut_short_for_its_caller_strands_nothing() -> None:
    """A caller's own pass (here its arrival) admitted a caller queued before it and then
    raised on its own admission: the caller gets the error, and the first admission, made in
    the ledger, comes out of the next pass instead of being lost with the exception."""
    policy = GateFor()
    s = Scheduler(Capacity(16, 4), policy=policy)
    s.arrive("a", spec(prompt=1), 0.0)  # (live: the gate counts; an idle engine admits anyway)
    policy.closed.add("q")
    s.arrive("q", spec(prompt=1), 0.0)
    assert s.requests["q"].state is State.QUEUED
    policy.closed.clear()
    policy.broken.add("z")
    with pytest.raises(PolicyViolation, match="admit raised RuntimeError") as err:
        s.arrive("z", spec(prompt=1), 0.1)
    assert isinstance(err.value.__cause__, RuntimeError)
    assert s.requests["q"].state is State.ADMITTED  # (in the ledger, its Admit not yet out)
    policy.broken.clear()
    out = s.tick(0.2)
    assert of(out, ev.Admit, "q") and of(out, ev.Admit, "z")
    assert not of(s.tick(0.3), ev.Admit)


class RaisesIn(Fixed):
    """Raises (a plain bug, not a kvbudget error) from the decision hook named ``hook``."""

    name = "raises-in"

    def __init__(self, hook: str) -> None:
        super().__init__(allowance=3, step=4)
        self.hook = hook

    def _maybe(self, hook: str) -> None:
        if hook == self.hook:
            raise ZeroDivisionError(f"{hook} bug")

    def headroom_target(self) -> int:
        self._maybe("headroom_target")
        return super().headroom_target()

    def initial_allowance(self, req: Request) -> int:
        self._maybe("initial_allowance")
        return super().initial_allowance(req)

    def admit(self, req: Request, blocks: int) -> bool:
        self._maybe("admit")
        return True

    def lookahead_tokens(self, req: Request) -> int:
        self._maybe("lookahead_tokens")
        return 0

    def extension_tokens(self, req: Request) -> int | None:
        self._maybe("extension_tokens")
        return super().extension_tokens(req)

    def on_blocked(self, req: Request) -> Blocked:
        self._maybe("on_blocked")
        return super().on_blocked(req)


@pytest.mark.parametrize(
    "hook",
    [
        "headroom_target",
        "initial_allowance",
        "admit",
        "lookahead_tokens",
        "extension_tokens",
        "on_blocked",
    ],
)
def test_a_decision_hook_that_raises_reaches_its_caller_as_a_policy_violation(hook: str) -> None:
    """A decision hook that raises in a caller's own pass (an arrival, a boundary) used to reach
    that caller as whatever it raised (here a ZeroDivisionError): now a PolicyViolation naming
    the hook, the bug as its cause, and the ledger as it was."""
    at_boundary = hook in ("extension_tokens", "on_blocked")
    policy = RaisesIn(hook="-")
    # (at a boundary: a full cache, so that "a" cannot grow; at an arrival: room for "b")
    s = Scheduler(Capacity(2 if at_boundary else 4, 4), policy=policy)
    s.arrive("a", spec(prompt=4), 0.0)  # (1 block of prompt, 1 for its 3-token allowance)
    s.charge("a", 1, 0.05)
    if at_boundary:
        assert of(to_boundary(s, "a", 0.1), ev.Deny, "a")
    policy.hook = hook
    with pytest.raises(PolicyViolation) as err:
        if at_boundary:
            s.boundary_reached("a", 0.2)
        else:
            s.arrive("b", spec(prompt=4), 0.2)
    assert err.value.policy == "raises-in"
    assert err.value.detail == f"{hook} raised ZeroDivisionError('{hook} bug')"
    assert isinstance(err.value.__cause__, ZeroDivisionError)
    assert s.policy_faults == 0  # (the caller was told: nothing kept)
    s.check_invariants()
    assert s.ledger.reserved == 2 and s.requests["a"].blocks == 2


# == behaviour ===================================================================================


class _Asked(Fixed):
    """A policy whose allowance is a new answer each time it is asked (8, 9, 10, ...)."""

    name = "asked"

    def __init__(self) -> None:
        super().__init__(allowance=8)
        self.asked: list[str] = []

    def initial_allowance(self, req: Request) -> int:
        self.asked.append(req.request_id)
        return min(req.remaining, 7 + len(self.asked))


def test_an_arrival_admitted_at_once_is_granted_the_allowance_it_was_asked() -> None:
    """Nothing queued, no extension waiting: the pass that admits an arrival grants the very
    allowance the arrival asked (and counted as its queue demand), asking the policy once.
    Behind a queue the pass asks again: grants were made in between."""
    s = Scheduler(Capacity(64, 4), policy=_Asked(), config=SchedulerConfig(slack_tokens=0))
    policy = s.policy
    assert isinstance(policy, _Asked)
    assert of(s.arrive("a", spec(prompt=4, max_tokens=64), 0.0), ev.Admit, "a")
    assert policy.asked == ["a"]
    a = s.requests["a"]
    assert a.allowance == 8 and a.boundary == 8  # the first answer: 4 + 8 tokens, 3 blocks
    # a caller that waits is asked again when the pass that admits it comes
    s2 = Scheduler(Capacity(8, 4), policy=_Asked(), config=SchedulerConfig(slack_tokens=0))
    p2 = s2.policy
    assert isinstance(p2, _Asked)
    s2.arrive("big", spec(prompt=20, max_tokens=8), 0.0)  # 20 + 8 tokens: 7 of 8 blocks
    assert not of(s2.arrive("w", spec(prompt=4, max_tokens=64), 0.0), ev.Admit, "w")
    asked_before = len(p2.asked)
    s2.finish("big", "stop", 1.0)
    actions = s2.confirm_release("big", 1.0)
    assert of(actions, ev.Admit, "w")
    assert len(p2.asked) > asked_before  # asked again, and granted the newest answer
    assert s2.requests["w"].allowance == 7 + len(p2.asked)


def _calibrated(blocks: int = 16, **kw: Any) -> Scheduler:
    return Scheduler(
        Capacity(blocks, 4),
        policy=CalibratedPolicy(headroom_min=0.0625, protected_fraction=0.0625, **kw),
        lengths=LengthModel(prior_tokens=8),  # p50 = 6, p90 = 19 tokens
        config=SchedulerConfig(slack_tokens=0),
    )


def test_calibrated_grants_grow_in_bounded_steps() -> None:
    """``grant_step_tokens`` bounds how far a grant reaches past the context (the initial one:
    the prompt's last block filled, then one step) and each extension; the quantiles still
    decide when a request stops growing, and the headroom forecast still counts what a stepped
    grant expects to grow to."""
    lengths = LengthModel(prior_tokens=8)
    for _ in range(200):
        lengths.observe(spec().calibration_key, 400)  # every answer is 400 tokens long

    def sched(step: int | None) -> Scheduler:
        return Scheduler(
            Capacity(256, 16), policy=CalibratedPolicy(grant_step_tokens=step), lengths=lengths,
            config=SchedulerConfig(slack_tokens=0),
        )

    stepped, whole = sched(40), sched(None)
    for s in (stepped, whole):
        s.arrive("a", spec(prompt=20, max_tokens=1000), 0.0)
    a = stepped.requests["a"]
    # 20 prompt tokens: 12 fill the second block, then one step (in whole blocks: 72 -> 80)
    assert a.blocks == 5 and a.boundary == 5 * 16 - 20
    assert whole.requests["a"].boundary > 350  # the calibrated quantile (~400), at once
    assert stepped.policy.headroom_target() > whole.policy.headroom_target()
    while a.boundary <= 350:  # a step of 40 tokens is at most 3 new blocks
        before = a.blocks
        assert of(to_boundary(stepped, "a", 1.0), ev.Extend, "a")
        assert 0 < a.blocks - before <= 3
    # a protected stream keeps its whole quantile grant (a wait at its boundary is a stall)
    stepped.arrive("i", spec(prompt=20, max_tokens=1000, cls="interactive"), 2.0)
    assert stepped.requests["i"].boundary > 350
    with pytest.raises(InvalidInput):
        CalibratedPolicy(grant_step_tokens=0)


def test_headroom_forecast_judges_a_long_protected_stream_by_what_it_outlived() -> None:
    """Past everything the length model has seen, a protected stream is expected to go on
    (its next extension counts in full); batch work there counts as unlikely to extend."""
    lengths = LengthModel(prior_tokens=8)
    for _ in range(200):
        lengths.observe(spec().calibration_key, 100)
        lengths.observe(spec(cls="interactive").calibration_key, 100)
    s = Scheduler(Capacity(512, 16), policy=CalibratedPolicy(), lengths=lengths,
                  config=SchedulerConfig(slack_tokens=0))
    policy = s.policy
    assert isinstance(policy, CalibratedPolicy)
    for rid, cls in (("i", "interactive"), ("b", "batch")):
        s.arrive(rid, spec(prompt=16, max_tokens=2000, cls=cls), 0.0)
        for _ in range(100):  # to three times any length seen, extended one block ahead
            if s.requests[rid].generated >= 300:
                break
            to_boundary(s, rid, 0.0)
        assert 300 <= s.requests[rid].generated < s.requests[rid].boundary
    demand = policy._demand_of
    assert demand["i"] >= 1.0  # P(extend) = 1 x at least one block
    assert demand["b"] < 0.05


def _borrowing_setup(long_stream: bool) -> Scheduler:
    """Every answer seen is 100 tokens long; one release has been seen (so a queued head could
    expect the next); with ``long_stream``, a protected stream extended past 100 tokens runs;
    then batch work fills the admission budget, and nothing waits to extend."""
    lengths = LengthModel(prior_tokens=8)
    for _ in range(200):
        lengths.observe(spec().calibration_key, 100)
        lengths.observe(spec(cls="interactive").calibration_key, 100)
    s = Scheduler(Capacity(64, 16), lengths=lengths, config=SchedulerConfig(slack_tokens=0),
                  policy=CalibratedPolicy(headroom_min=0.25, protected_fraction=0.0625))
    assert of(s.arrive("b0", spec(prompt=16, max_tokens=400), 0.0), ev.Admit)
    s.charge("b0", 50, 0.0)
    s.finish("b0", "stop", 0.0)
    s.confirm_release("b0", 0.0)
    if long_stream:
        s.arrive("long", spec(prompt=16, max_tokens=400, cls="interactive"), 0.0)
        while s.requests["long"].boundary <= 100:
            assert of(to_boundary(s, "long", 0.0), ev.Extend, "long")
    for i in range(1, 10):
        s.arrive(f"b{i}", spec(prompt=16, max_tokens=400), 0.01)
    assert s.requests["b9"].state is State.QUEUED and not s._waiting_ext
    return s


def test_protected_head_takes_unprotected_headroom_while_the_forecast_holds() -> None:
    """A protected head that does not fit the admission budget takes the headroom beyond its
    protected part at once, when no extension waits for it (the head's wait is certain, the
    pool's demand a forecast); not once a protected stream's grant has outrun everything the
    length model has seen, as a wave of long answers does: then the headroom is kept for it."""
    for long_stream in (False, True):
        s = _borrowing_setup(long_stream)
        policy = s.policy
        assert isinstance(policy, CalibratedPolicy)
        assert policy._outrun == ({"long"} if long_stream else set())
        head = spec(prompt=16, max_tokens=400, cls="interactive")
        blocks = 8  # 16 prompt tokens + the 100-token median
        assert not s.ledger.fits_admission(blocks)
        assert s.ledger.free - blocks >= s.ledger.protected_blocks
        out = s.arrive("i", head, 0.02)
        assert not of(out, ev.Preempt)
        if long_stream:
            assert not of(out, ev.Admit) and s.requests["i"].state is State.QUEUED
        else:
            assert of(out, ev.Admit, "i") and s.requests["i"].blocks == blocks
            assert s.ledger.free < s.ledger.headroom_target  # it took headroom


@pytest.mark.parametrize(
    ("prompt", "chunk", "admitted"),
    [(400, 2048, True), (1000, 2048, False), (1000, 400, True), (1000, None, False)],
)
def test_latency_floor_counts_the_prefill_an_admission_brings(
    prompt: int, chunk: int | None, admitted: bool
) -> None:
    """The steps that prefill a newcomer's prompt carry up to ``prefill_chunk_tokens`` of it
    beside every active stream's decode: an admission whose prefill would push that step past
    an active stream's latency floor waits (decode 50 ms + 0.1 ms per prompt token, floor 0.1 s).
    """
    from kvbudget.core.cost import CostModel, StepTimeModel

    cls = ServiceClass("interactive", priority=0, protected=True, preemptible=False,
                       latency_floor_s=0.1)
    cost = CostModel(StepTimeModel(fixed_s=0.05, per_seq_s=0.0, per_context_token_s=0.0,
                                   prefill_per_token_s=1e-4))
    s = Scheduler(Capacity(1000, 16), classes=(cls,), policy=ReserveMaxFront(), cost=cost,
                  config=SchedulerConfig(prefill_chunk_tokens=chunk))
    assert of(s.arrive("a", spec(prompt=16, max_tokens=100, cls="interactive"), 0.0), ev.Admit)
    out = s.arrive("b", spec(prompt=prompt, max_tokens=100, cls="interactive"), 0.0)
    assert bool(of(out, ev.Admit, "b")) is admitted
    if not admitted:  # it waits, and comes in once the stream it would have slowed is gone
        assert s.requests["b"].state is State.QUEUED
        assert s.requests["b"].held_by == "latency-floor"
        s.charge("a", 100, 0.1)
        out = s.finish("a", "length", 0.1) + s.confirm_release("a", 0.1)
        assert of(out, ev.Admit, "b")


def test_past_future_draws_once_per_instant_for_a_refused_head() -> None:
    """LightLLM's past-future test runs once per scheduling step: a head it refused is not
    drawn for again at the same instant with the same requests running, but is at the next."""
    from kvbudget.core.policy import PastFuturePolicy

    policy = PastFuturePolicy(window=4)
    s = Scheduler(Capacity(8, 16), policy=policy, config=SchedulerConfig(slack_tokens=0))
    for i in range(4):  # a window of finished lengths: 100 tokens each
        s.arrive(f"w{i}", spec(prompt=16, max_tokens=100), 0.0)
        for _ in range(100):
            if s.requests[f"w{i}"].generated == 100:
                break
            to_boundary(s, f"w{i}", 0.0)
        s.finish(f"w{i}", "length", 0.0)
        s.confirm_release(f"w{i}", 0.0)
    s.arrive("a", spec(prompt=16, max_tokens=100), 0.0)  # its future fills the cache
    s.arrive("b", spec(prompt=16, max_tokens=100), 0.0)
    head = s.requests["b"]
    assert head.state is State.QUEUED  # refused at its arrival
    state = policy._rng.getstate()
    assert not policy.admit(head, 1)
    assert policy._rng.getstate() == state  # the same instant: no new draw
    s.tick(1.0)
    assert policy._rng.getstate() != state  # the clock moved: drawn again
    assert head.state is State.QUEUED


def test_interactive_extension_preempts_cheapest_batch_victim() -> None:
    s = _calibrated(blocks=16)
    assert of(s.arrive("i", spec(prompt=4, max_tokens=400, cls="interactive"), 0.0), ev.Admit)
    for rid, prompt in (("b-big", 12), ("b-small", 4), ("b-mid", 8)):
        s.arrive(rid, spec(prompt=prompt, max_tokens=400, deadline=100.0), 0.0)
    # the batch work runs to its boundaries and takes what headroom it may
    for _ in range(10):
        for rid in ("b-big", "b-small"):
            r = s.requests[rid]
            if r.state in (State.ADMITTED, State.RUNNING):
                push(s, rid, 0.0)
    assert s.requests["b-big"].state is State.EXTENDING
    assert s.requests["b-small"].state is State.EXTENDING
    # the interactive stream grows until nothing is free: then it preempts batch work
    pre: list[ev.Preempt] = []
    for _ in range(50):
        pre = of(push(s, "i", 0.0), ev.Preempt)
        if pre:
            break
    assert pre, "the interactive extension never preempted"
    victim = pre[0]
    v = s.requests["b-small"]
    assert victim.request_id == "b-small"  # lowest recompute cost: 4 + 8 < 12 + 12
    assert victim.checkpoint.generated_tokens == v.generated > 0
    assert victim.recompute_tokens == 4 + v.generated
    assert victim.deadline == pytest.approx(100.0)
    assert victim.reason == "for:i"
    assert v.blocks > 0 and v.state is State.PREEMPTING  # held until confirmed
    out = s.confirm_release("b-small", 0.1)
    rel = of(out, ev.Released, "b-small")[0]
    assert rel.outcome == "preempted" and rel.resumable
    assert of(out, ev.Extend, "i"), "the freed blocks go to the interactive extension"
    # the preempted request resumes from its checkpoint once room comes back ...
    resumed: list[ev.Admit] = []
    for rid in ("i", "b-big", "b-mid"):  # everyone else leaves
        if rid in s.requests:
            resumed += of(s.cancel(rid, 0.2), ev.Admit, "b-small")
        if rid in s.requests:
            resumed += of(s.confirm_release(rid, 0.2), ev.Admit, "b-small")
    assert len(resumed) == 1 and resumed[0].resume == victim.checkpoint
    # ... and completes at its full length
    full = 48  # prompt 4 + 48 = 52 tokens: 13 of the 16 blocks
    for _ in range(200):
        r = s.requests["b-small"]
        if r.generated == full:
            break
        if r.generated >= r.boundary:
            s.boundary_reached("b-small", 1.0)
        else:
            s.charge("b-small", min(full, r.boundary) - r.generated, 1.0)
    assert s.requests["b-small"].generated == full
    s.finish("b-small", "stop", 1.0)
    out = s.confirm_release("b-small", 1.0)
    assert of(out, ev.Released, "b-small")[0].outcome == "completed"
    assert s.ledger.reserved == sum(r.blocks for r in s.requests.values())


def test_continuation_only_when_allowed() -> None:
    s = Scheduler(Capacity(4, 4), policy=Fixed(allowance=4, step=4, blocked=Blocked.CONTINUE))
    s.arrive("c", spec(prompt=2, max_tokens=64, on_exhausted="continue"), 0.0)
    s.arrive("e", spec(prompt=2, max_tokens=64), 0.0)
    for rid in ("c", "e"):
        to_boundary(s, rid, 0.0)
    # both are at their boundary with nothing free
    out = s.boundary_reached("e", 0.0)
    assert not of(out, ev.Continue)
    out = s.boundary_reached("c", 0.0)
    cont = of(out, ev.Continue, "c")
    g = s.requests["c"].generated
    assert cont and cont[0].continuation.generated_tokens == g
    assert cont[0].continuation.remaining_tokens == 64 - g
    assert cont[0].continuation.continuation_id == "c~1"
    assert not of(out, ev.Continue, "e")
    assert s.requests["e"].state is State.EXTENDING


def test_base_policy_never_continues_an_extend_request() -> None:
    class Bad(Fixed):
        name = "bad-continue"

        def on_blocked(self, req: Request) -> Blocked:
            return Blocked.CONTINUE

    s = Scheduler(Capacity(2, 4), policy=Bad(allowance=4, step=4))
    s.arrive("a", spec(prompt=2, max_tokens=64), 0.0)
    s.arrive("b", spec(prompt=2, max_tokens=64), 0.0)
    to_boundary(s, "a", 0.0)
    with pytest.raises(PolicyViolation, match="silent truncation"):
        s.boundary_reached("a", 0.0)


def test_overload_rejects_with_retry_after_when_the_wait_exceeds_the_deadline() -> None:
    s = Scheduler(Capacity(8, 4), policy=ReserveMaxFront())
    # a release rate: one request of 2 blocks per second
    for k in range(3):
        s.arrive(f"w{k}", spec(prompt=4, max_tokens=4), float(k))
        s.charge(f"w{k}", 4, float(k))
        s.finish(f"w{k}", "stop", float(k))
        s.confirm_release(f"w{k}", float(k) + 0.5)
    # a slow engine: the running streams take seconds to drain, too
    for _ in range(50):
        s.observe_step(4, 32, 0.5, 2.9)
    # the cache is full and the queue ahead is long
    for k in range(4):
        s.arrive(f"h{k}", spec(prompt=4, max_tokens=4), 3.0)
    for k in range(6):
        s.arrive(f"q{k}", spec(prompt=4, max_tokens=4), 3.0)
    out = s.arrive("late", spec(prompt=4, max_tokens=4, deadline=0.5), 3.0)
    rej = of(out, ev.Reject, "late")
    assert rej and rej[0].reason == "deadline"
    assert rej[0].retry_after > 0.5 and math.isfinite(rej[0].retry_after)
    assert "late" not in s.requests
    # a caller with a generous deadline queues instead
    assert not of(s.arrive("patient", spec(prompt=4, max_tokens=4, deadline=500.0), 3.0), ev.Reject)


def _pessimistic_waits(
    s: Scheduler, rounds: int, spacing: float | None = None, bound_share: float | None = None
) -> float:
    """``rounds`` callers each queued behind a full cache with a forecast wait, then admitted at
    once by a release that comes long before the forecast said; returns the last forecast.
    ``spacing``: seconds from one round to the next (None: each round right after the last).
    ``bound_share``: each caller might wait that share of its forecast (None: no bound)."""
    t = 10.0
    forecast = 0.0
    for k in range(rounds):
        s.arrive(f"hold{k}", spec(prompt=4, max_tokens=28), t)  # the whole cache (8 blocks)
        s.arrive(f"next{k}", spec(prompt=4, max_tokens=28), t)
        req = s.requests[f"next{k}"]
        forecast = req.wait_forecast
        assert forecast > 0.0
        if bound_share is not None:
            # (its queue bound, as a class's max_queue_delay_s or a deadline sets it)
            req.wait_bound = bound_share * forecast
            req.expiry = t + req.wait_bound
            s.queues.note_expiry(req)
        s.charge(f"hold{k}", 28, t)
        s.finish(f"hold{k}", "stop", t)
        admitted = of(s.confirm_release(f"hold{k}", t + 0.1 * forecast), ev.Admit, f"next{k}")
        assert admitted
        s.charge(f"next{k}", 28, t + 0.1 * forecast)
        s.finish(f"next{k}", "stop", t + 0.1 * forecast)
        s.confirm_release(f"next{k}", t + 0.1 * forecast)
        t += 0.1 * forecast + 0.01 if spacing is None else spacing
    return forecast


def test_the_release_rates_warm_up_runs_from_when_the_engine_first_held_blocks() -> None:
    """A first release 0.26 s after the engine took its first blocks reads as that many blocks
    over 0.26 s, not over the moment since the release itself (over the real engine a fresh
    server's first preemptions read as 2,500 blocks a second, and the second judgement of the
    callers queued on a placeholder forecast turned none of them away)."""
    from kvbudget.core.forecast import DecayingRate

    rate = DecayingRate(10.0, warm_up=True)
    rate.begin(0.0)
    rate.add(65.0, 0.26)
    assert rate.rate(0.26) == pytest.approx(65.0 / 0.26)
    rate.begin(0.25)  # (once begun, it stays)
    assert rate.rate(0.26) == pytest.approx(65.0 / 0.26)
    s = Scheduler(Capacity(32, 4), policy=ReserveMaxFront())
    s.arrive("a", spec(prompt=4, max_tokens=28), 1.0)  # the engine takes its first blocks
    s.arrive("b", spec(prompt=4, max_tokens=28), 1.0)
    s.charge("a", 28, 1.2)
    s.finish("a", "stop", 1.2)
    s.confirm_release("a", 1.26)
    assert s.forecast.release_rate(1.26) == pytest.approx(8 / 0.26, rel=0.01)


def _release_rate(s: Scheduler) -> None:
    for k in range(3):  # one request of 8 blocks per second
        s.arrive(f"w{k}", spec(prompt=4, max_tokens=28), float(k))
        s.charge(f"w{k}", 28, float(k))
        s.finish(f"w{k}", "stop", float(k))
        s.confirm_release(f"w{k}", float(k) + 0.5)


@pytest.mark.parametrize("quantile", [0.2, None])
def test_turn_away_at_arrival_learns_that_callers_past_their_bound_were_served(
    quantile: float | None,
) -> None:
    """Callers forecast to wait 1.5x what they might were each admitted at a tenth of the
    forecast, in time: the turn-away at arrival reads that they were (at
    ``turn_away_wait_quantile``) and queues the next caller forecast past its bound; with the
    quantile off, the raw forecast turns it away."""
    from kvbudget.core.forecast import MIN_WAIT_OUTCOMES

    config = SchedulerConfig(turn_away_wait_quantile=quantile)
    s = Scheduler(Capacity(9, 4), policy=ReserveMaxFront(), config=config)
    # a stream of one block live throughout: the engine is never idle, so the release rate
    # counts the seconds between the rounds (an idle engine's do not count)
    s.arrive("background", spec(prompt=1, max_tokens=3), 0.0)
    _release_rate(s)
    assert s.snapshot().wait_in_time_share == 1.0  # nothing seen yet
    assert s.snapshot().wait_forecast_samples == 0
    _pessimistic_waits(s, MIN_WAIT_OUTCOMES + 8, spacing=1.0, bound_share=1 / 1.5)
    t = s.now + 0.01
    s.arrive("hog", spec(prompt=4, max_tokens=28), t)
    s.arrive("ahead", spec(prompt=4, max_tokens=28), t)
    wait = s.requests["ahead"].wait_forecast
    # behind "ahead", its forecast is twice that: 1.33x its bound
    out = s.arrive("edge", spec(prompt=4, max_tokens=28, deadline=wait * 1.5), t)
    snap = s.snapshot()
    if quantile is None:
        assert of(out, ev.Reject, "edge")[0].reason == "deadline"
    else:
        assert snap.wait_forecast_samples >= MIN_WAIT_OUTCOMES
        assert snap.wait_in_time_share == 1.0
        assert not of(out, ev.Reject) and s.requests["edge"].state is State.QUEUED
        # a forecast far past the bound, beyond anything seen served, is still told at once
        far = s.arrive("far", spec(prompt=4, max_tokens=28, deadline=wait * 0.05), t)
        assert of(far, ev.Reject, "far")[0].reason == "deadline"


def test_turn_away_at_arrival_reads_outcomes_at_the_callers_pressure() -> None:
    """Whether a caller is unlikely to be admitted in time is read from the outcomes of recent
    queued callers forecast at about its pressure (forecast / the wait it may have): served in
    time far past the bound, a caller forecast there queues; timed out inside it, a caller
    forecast there is turned away though the forecast alone would queue it. Cold, a forecast
    past the bound is turned away (UNCALIBRATED_WAIT_RATIO: taken as it is), one the pauses for
    first tokens may serve only past four times it (UNCALIBRATED_WAIT_RATIO_PAUSES)."""
    from kvbudget.core.forecast import MIN_WAIT_OUTCOMES, wait_pressure_band
    from kvbudget.observability import snapshot_to_dict

    s = Scheduler(Capacity(8, 4), policy=ReserveMaxFront())
    f = s.forecast
    assert not f.unlikely_in_time(1.0, 1.0) and f.unlikely_in_time(1.2, 1.0)  # cold: the bound
    # where pauses for its first token may make room later, cold, a quarter of the forecast
    assert not f.unlikely_in_time(3.0, 1.0, pauses=True)
    assert f.unlikely_in_time(5.0, 1.0, pauses=True)
    assert f.unlikely_in_time(0.1, 0.0)  # nothing to wait: any wait is too long
    for _ in range(MIN_WAIT_OUTCOMES):
        f.note_waited(5.0, 1.0, True, s.now)  # forecast at 5x its bound, served in time
        f.note_waited(0.8, 1.0, False, s.now)  # inside its bound, timed out
    assert not f.unlikely_in_time(5.0, 1.0)
    assert f.in_time_share(5.0) == 1.0
    assert f.unlikely_in_time(0.8, 1.0)
    snap = s.snapshot()  # the snapshot shows the outcomes read for the forecast judged last
    assert snap.wait_in_time_share == 0.0 and snap.wait_forecast_samples == MIN_WAIT_OUTCOMES
    # and every band's outcomes, as the turn-away reads them
    bands = snap.wait_outcomes_by_band
    assert bands[wait_pressure_band(5.0)] == (MIN_WAIT_OUTCOMES, MIN_WAIT_OUTCOMES)
    assert bands[wait_pressure_band(0.8)] == (MIN_WAIT_OUTCOMES, 0)
    assert sum(seen for seen, _ in bands) == 2 * MIN_WAIT_OUTCOMES
    # each row names its band's lowest pressure: a forecast there is in that band, one just
    # below it in the band before
    from kvbudget.core.forecast import WAIT_PRESSURE_BANDS, wait_pressure_band_from

    for band in range(1, WAIT_PRESSURE_BANDS):
        edge = wait_pressure_band_from(band)
        assert wait_pressure_band(edge) == band and wait_pressure_band(0.999 * edge) == band - 1
    rows = snapshot_to_dict(snap)["wait_outcomes_by_band"]
    assert [r["pressure_from"] for r in rows[:4]] == [0.0, 0.5, 0.707, 1.0]
    assert rows[wait_pressure_band(0.8)] == {
        "pressure_from": 0.707, "seen": MIN_WAIT_OUTCOMES, "in_time": 0,
    }
    # an empty band reads the ones beside it, then the next one down: served at 5x, a caller
    # at up to twice that pressure queues; far past that the forecast alone decides again
    assert wait_pressure_band(7.5) == wait_pressure_band(5.0) + 1
    assert not f.unlikely_in_time(7.5, 1.0) and not f.unlikely_in_time(10.0, 1.0)
    assert f.unlikely_in_time(40.0, 1.0) and s.snapshot().wait_forecast_samples == 0
    # a quarter served in time is not unlikely enough at the default quantile (0.2)
    g = Scheduler(Capacity(8, 4), policy=ReserveMaxFront()).forecast
    for k in range(MIN_WAIT_OUTCOMES):
        g.note_waited(2.0, 1.0, k % 4 == 0, 0.0)
    assert g.in_time_share(2.0) == 0.25 and not g.unlikely_in_time(2.0, 1.0)
    g.note_waited(2.0, 1.0, False, 0.0)
    g.note_waited(2.0, 1.0, False, 0.0)
    g.note_waited(2.0, 1.0, False, 0.0)
    g.note_waited(2.0, 1.0, False, 0.0)
    assert g.in_time_share(2.0) == 0.2 and not g.unlikely_in_time(2.0, 1.0)
    g.note_waited(2.0, 1.0, False, 0.0)
    assert g.unlikely_in_time(2.0, 1.0)
    # a caller forecast inside its bound, where callers timed out: turned away, unless the
    # drain of what the engine holds admits it in time (nothing is held here: none to drain)
    assert f.turns_away(_queued_probe(s), 0.8, 1.0) is True
    assert f.turns_away(_queued_probe(s), 5.0, 1.0) is False


def test_outcomes_are_forgotten_after_a_minute() -> None:
    """A pressure that callers timed out at is judged afresh once its outcomes are a minute
    old (the regime may have changed): by the forecast alone, which queues a caller forecast
    inside its bound."""
    from kvbudget.core.forecast import MIN_WAIT_OUTCOMES, WAIT_OUTCOME_HORIZON_S

    s = Scheduler(Capacity(8, 4), policy=ReserveMaxFront())
    f = s.forecast
    for _ in range(MIN_WAIT_OUTCOMES):
        f.note_waited(0.8, 1.0, False, 0.0)
    assert f.unlikely_in_time(0.8, 1.0)
    s.tick(WAIT_OUTCOME_HORIZON_S - 1.0)
    assert f.unlikely_in_time(0.8, 1.0)
    s.tick(WAIT_OUTCOME_HORIZON_S + 1.0)
    assert not f.unlikely_in_time(0.8, 1.0)
    assert s.snapshot().wait_forecast_samples == 0


def _queued_probe(s: Scheduler) -> Any:
    """A request object as the forecast judges one at arrival (not queued, nothing held)."""
    from kvbudget.core.lifecycle import Request

    cls = s.classes["interactive"]
    return Request("probe", spec(prompt=4, max_tokens=4, cls="interactive"), cls, s.now, None)


def test_a_cold_forecast_turns_away_at_once_callers_forecast_past_their_bound() -> None:
    """With no evidence yet of how the wait forecast errs, a newcomer is turned away at arrival
    if it is forecast to wait past its bound (and the drain of what the engine holds would not
    admit it in time either); one forecast inside its bound queues (its queue bound still
    times it out)."""

    def cold() -> Scheduler:  # a full cache, one caller queued, one release rate seen
        s = Scheduler(Capacity(8, 4), policy=ReserveMaxFront())
        _release_rate(s)
        s.arrive("hog", spec(prompt=4, max_tokens=28), 3.0)
        s.arrive("ahead", spec(prompt=4, max_tokens=28), 3.0)
        return s

    probe = cold()
    probe.arrive("next", spec(prompt=4, max_tokens=28, deadline=1e6), 3.0)
    wait = probe.requests["next"].wait_forecast  # what the next caller is forecast to wait
    assert wait > 0.0 and probe.snapshot().wait_forecast_samples == 0
    # a deadline bounds the wait to it less the predicted service (deadline_service_quantile)
    service = probe.forecast.predicted_service(probe.requests["next"], 0.5)
    s = cold()
    inside = s.arrive("next", spec(prompt=4, max_tokens=28, deadline=wait * 1.2 + service), 3.0)
    assert not of(inside, ev.Reject) and s.requests["next"].state is State.QUEUED
    s = cold()
    past = s.arrive("next", spec(prompt=4, max_tokens=28, deadline=wait / 2 + service), 3.0)
    assert of(past, ev.Reject, "next")[0].reason == "deadline"


def approx(value: float) -> Any:
    """A time the drain forecast gives, to the cost model's fit (within 1 %)."""
    return pytest.approx(value, rel=0.01)


def _steady_steps(s: Scheduler, seconds: float, now: float) -> None:
    """Teach the cost model an engine whose every decode step takes ``seconds``."""
    for k in range(200):
        s.observe_step(1 + k % 8, 32 * (k % 5), seconds, now)
    assert s.step_seconds() == pytest.approx(seconds, rel=0.05)


def test_drain_wait_hand_worked() -> None:
    """The drain of what the engine holds: a stopped request's blocks within a step, each live
    stream's at its expected length at the current pace, then the same releases again every
    turnover. Here steps take 10 ms; a stopped request holds 2 blocks, ``near`` (2 tokens left)
    and ``far`` (4 tokens left) hold 2 each."""
    s = Scheduler(Capacity(8, 4), policy=ReserveMaxFront())
    _steady_steps(s, 0.01, 0.0)
    for rid in ("done", "near", "far"):
        assert of(s.arrive(rid, spec(prompt=4, max_tokens=4), 0.0), ev.Admit)
    s.charge("done", 4, 0.0)
    s.finish("done", "stop", 0.0)
    s.charge("near", 2, 0.0)
    drain = s.forecast.drain_wait
    assert drain(1, 0.5) == approx(0.01)  # the stopped request's blocks
    assert drain(3, 0.5) == approx(0.02)  # ... and near's, 2 tokens later
    assert drain(5, 0.5) == approx(0.04)  # ... and far's, 4 tokens later
    assert drain(6, 0.5) == approx(0.04)  # everything held
    # past it, the callers admitted into those blocks hold them a turnover: the releases repeat
    assert drain(7, 0.5) == approx(0.5 + 0.01)
    assert drain(13, 0.5) == approx(2 * 0.5 + 0.01)
    # several deficits at once (a round of due callers, each with those ahead of it)
    assert s.forecast.drain_waits([1, 3, 5, 7, 13], 0.5) == approx(
        [0.01, 0.02, 0.04, 0.51, 1.01]
    )
    s.confirm_release("done", 0.1)
    assert drain(4, 0.5) == approx(0.04)


def test_drain_wait_counts_the_blocks_streams_grow_by_before_they_end() -> None:
    """A stream granted less than it is expected to generate takes more blocks from what is free
    before it returns them all: those come first out of what the queue could have had."""
    lengths = LengthModel()
    for _ in range(64):
        lengths.observe(spec().calibration_key, 20)  # every answer is 20 tokens long
    s = Scheduler(Capacity(16, 4), policy=Fixed(allowance=4, step=4), lengths=lengths)
    _steady_steps(s, 0.01, 0.0)
    assert of(s.arrive("a", spec(prompt=4, max_tokens=64), 0.0), ev.Admit)
    assert s.requests["a"].blocks == 2  # prompt 4 + 4 tokens
    assert s.expected_length(s.requests["a"]) == 20
    # it grows to 6 blocks (prompt 4 + 20) by its end, 20 steps away: of the 6 it returns
    # then, 4 were taken from what is free now, so a queue short of 2 blocks is served at its
    # end and one short of 3 only a turnover later (ignoring its growth: 0.20 for up to 6)
    assert s.forecast.drain_wait(2, 1.0) == approx(0.20)
    assert s.forecast.drain_wait(3, 1.0) == approx(1.0 + 0.20)


def test_a_burst_after_a_quiet_spell_queues_where_the_running_streams_drain_in_time() -> None:
    """After a quiet spell the recent release rate is the spell's low demand, not what the engine
    turns over: a burst behind a full cache is forecast by it to wait seconds. The running
    streams end within tens of milliseconds, though, and the callers queued ahead are served as
    fast: the drain of what the engine holds admits the newcomer within its bound, so it queues
    (and is admitted in time) rather than being turned away; an engine that steps slowly still
    turns it away."""

    def burst(step_s: float) -> tuple[Scheduler, list[ev.Action]]:
        s = Scheduler(Capacity(8, 4), policy=ReserveMaxFront())
        _steady_steps(s, step_s, 0.0)
        for k in range(3):  # the quiet spell: 2 blocks a second
            s.arrive(f"w{k}", spec(prompt=4, max_tokens=4), float(k))
            s.charge(f"w{k}", 4, float(k))
            s.finish(f"w{k}", "stop", float(k))
            s.confirm_release(f"w{k}", float(k) + 0.5)
        for k in range(4):  # the burst fills the cache
            s.arrive(f"h{k}", spec(prompt=4, max_tokens=4), 3.0)
        for k in range(6):  # and queues
            s.arrive(f"q{k}", spec(prompt=4, max_tokens=4, deadline=10.0), 3.0)
        return s, s.arrive("new", spec(prompt=4, max_tokens=4, deadline=1.0), 3.0)

    s, out = burst(0.001)
    assert 14 / s.forecast.release_rate(3.0) > 2.0  # the rate alone: 14 blocks take > 2 s
    assert not of(out, ev.Reject) and s.requests["new"].state is State.QUEUED
    now = 3.0
    admitted_at = None
    while admitted_at is None and now < 4.0:  # the engine runs: 4 steps per request
        now += 0.001
        for rid, r in list(s.requests.items()):
            if r.state in (State.ADMITTED, State.RUNNING):
                s.charge(rid, 1, now)
                if r.generated >= r.hard_max:
                    s.finish(rid, "length", now)
            elif r.state is State.RELEASING:
                s.confirm_release(rid, now)
        if s.requests["new"].state is not State.QUEUED:
            admitted_at = now
    assert admitted_at is not None and admitted_at - 3.0 < 1.0
    _, slow = burst(0.5)  # 4 steps of half a second per request: far past its bound
    assert of(slow, ev.Reject, "new")[0].reason == "deadline"


def test_an_idle_spell_does_not_slow_the_release_rate() -> None:
    """Blocks come back only while the engine holds some: seconds in which it holds none do not
    dilute the release rate, so the first caller of a surge after a quiet minute is forecast the
    wait it would have had right before it, and a caller that would wait just as long is not
    turned away (a server whose second benchmark run turned most callers away)."""

    def after(idle_s: float) -> tuple[Scheduler, float]:
        s = Scheduler(Capacity(8, 4), policy=ReserveMaxFront())
        _release_rate(s)  # 8 blocks a second while busy; idle from 2.5 s
        t = 2.5 + idle_s
        s.arrive("hold", spec(prompt=4, max_tokens=28), t)
        s.arrive("next", spec(prompt=4, max_tokens=28), t)
        return s, s.requests["next"].wait_forecast

    busy, right_after = after(0.0)
    quiet, after_a_minute = after(60.0)
    assert right_after > 0.0
    assert after_a_minute == pytest.approx(right_after)
    assert quiet.forecast.release_rate(quiet.now) == pytest.approx(
        busy.forecast.release_rate(busy.now)
    )
    # while it holds blocks and releases none, the rate does fall
    assert quiet.forecast.release_rate(quiet.now + 10.0) < 0.5 * quiet.forecast.release_rate(
        quiet.now
    )


def test_the_snapshot_shows_the_release_rate_the_forecasts_read() -> None:
    """``Snapshot.release_rate_blocks_per_s`` is the rate the wait forecasts divide by: none
    before a release, the busy spell's after it, and after an idle spell still the rate the
    last busy spell ended at (the clock stops while the engine holds no blocks)."""
    s = Scheduler(Capacity(8, 4), policy=ReserveMaxFront())
    assert s.snapshot().release_rate_blocks_per_s == 0.0
    _release_rate(s)  # 8 blocks a second while busy; idle from 2.5 s
    busy = s.snapshot().release_rate_blocks_per_s
    assert busy == pytest.approx(s.forecast.release_rate(s.now)) and busy > 0.0
    s.tick(62.5)  # a quiet minute
    assert s.snapshot().release_rate_blocks_per_s == pytest.approx(busy)
    assert s.forecast.release_rate(s.now) == pytest.approx(busy)


def test_callers_timed_out_in_the_queue_turn_the_next_away_at_arrival() -> None:
    """Queued callers forecast to wait 0.4 of their bound, each turned away at its bound: the
    turn-away at arrival learns that callers at that pressure are not served in time, and reads
    it for the next one (cold, it would queue: its forecast is inside its bound)."""
    from kvbudget.core.forecast import MIN_WAIT_OUTCOMES

    s = Scheduler(Capacity(9, 4), policy=ReserveMaxFront())
    s.arrive("background", spec(prompt=1, max_tokens=3), 0.0)  # (never idle, as above)
    for k in range(20):  # 80 blocks a second: forecasts well inside the outcomes' minute
        s.arrive(f"w{k}", spec(prompt=4, max_tokens=28), 0.1 * k)
        s.charge(f"w{k}", 28, 0.1 * k)
        s.finish(f"w{k}", "stop", 0.1 * k)
        s.confirm_release(f"w{k}", 0.1 * k + 0.05)
    t = 2.0
    assert not s.forecast.unlikely_in_time(1.0, 2.5)
    for k in range(MIN_WAIT_OUTCOMES):
        s.arrive(f"hold{k}", spec(prompt=4, max_tokens=28), t)
        out = s.arrive(f"late{k}", spec(prompt=4, max_tokens=28, deadline=100.0), t)
        assert not of(out, ev.Reject)
        req = s.requests[f"late{k}"]
        bound = 2.5 * req.wait_forecast
        req.wait_bound = bound
        req.expiry = t + bound  # (its queue bound, as a class's max_queue_delay_s sets it)
        s.queues.note_expiry(req)
        assert of(s.tick(t + bound + 0.01), ev.Reject, f"late{k}")[0].reason == "queue-timeout"
        s.charge(f"hold{k}", 28, t + bound)
        s.finish(f"hold{k}", "stop", t + bound)
        s.confirm_release(f"hold{k}", t + bound)
        t += bound + 0.02
    assert s.forecast.unlikely_in_time(1.0, 2.5)
    snap = s.snapshot()
    assert snap.wait_in_time_share == 0.0 and snap.wait_forecast_samples >= MIN_WAIT_OUTCOMES


def test_a_wait_told_before_any_release_is_not_learned_from() -> None:
    """Before any block came back there is no release rate: the wait a queued caller is told is
    a placeholder, and its real wait says nothing about the forecast's error."""
    s = Scheduler(Capacity(8, 4), policy=ReserveMaxFront())
    s.arrive("hold", spec(prompt=4, max_tokens=28), 0.0)  # the whole cache, never released
    for k in range(20):
        t = 3.0 * k
        out = s.arrive(f"cold{k}", spec(prompt=4, max_tokens=28, cls="interactive"), t)
        assert not of(out, ev.Reject)
        assert of(s.tick(t + 0.9), ev.Reject, f"cold{k}") == []
        assert of(s.tick(t + 2.5), ev.Reject, f"cold{k}")  # its 2 s queue bound
    assert s.snapshot().wait_forecast_samples == 0


def test_queue_timeout_rejects_via_tick() -> None:
    s = Scheduler(Capacity(4, 4), policy=ReserveMaxFront())
    s.arrive("hog", spec(prompt=4, max_tokens=12, cls="interactive"), 0.0)
    assert not of(s.arrive("w", spec(prompt=4, max_tokens=12, cls="interactive"), 0.0), ev.Admit)
    assert s.requests["w"].state is State.QUEUED
    assert not of(s.tick(1.9), ev.Reject)
    out = s.tick(2.5)  # interactive max_queue_delay_s = 2.0
    rej = of(out, ev.Reject, "w")
    assert rej and rej[0].reason == "queue-timeout" and rej[0].retry_after > 0
    assert "w" not in s.requests and s.requests["hog"].blocks == 4


def test_a_callers_queue_bound_and_deadline_run_from_when_the_server_received_it() -> None:
    """``arrive(received_at=)``: a server that parsed and tokenized a request for 0.8 s before
    it reached the budget; its 2 s queue bound (and its deadline) run from the receipt, as its
    caller's clock does: turned away at 1.3 s after its arrival, not 2.0 s. A caller without
    it keeps the bound from its arrival."""
    s = Scheduler(Capacity(4, 4), policy=ReserveMaxFront())
    s.arrive("hog", spec(prompt=4, max_tokens=12, cls="interactive"), 0.0)
    late = spec(prompt=4, max_tokens=12, cls="interactive", deadline=5.0)
    assert not of(s.arrive("w", late, 1.0, received_at=0.2), ev.Admit)
    assert not of(s.arrive("v", late, 1.0), ev.Admit)
    w, v = s.requests["w"], s.requests["v"]
    assert (w.arrival, w.deadline_at) == (0.2, 5.2)
    assert (v.arrival, v.deadline_at) == (1.0, 6.0)
    assert not of(s.tick(2.1), ev.Reject)
    out = s.tick(2.3)
    assert [r.request_id for r in of(out, ev.Reject)] == ["w"]
    assert of(out, ev.Reject)[0].reason == "queue-timeout"
    assert of(s.tick(3.1), ev.Reject, "v")


@pytest.mark.parametrize("received_at", [math.nan, math.inf, -math.inf, True, "0.5", 1.5])
def test_a_receipt_that_is_not_a_time_before_the_arrival_is_refused(received_at: Any) -> None:
    s = Scheduler(Capacity(64, 4), policy=Fixed())
    s.tick(1.0)
    e = raises_unchanged(
        s, InvalidInput, lambda: s.arrive("a", spec(), 1.0, received_at=received_at)
    )
    assert e.field == "received_at"
    assert of(s.arrive("a", spec(), 1.0, received_at=1.0), ev.Admit)


def test_callers_turned_away_after_queueing_are_counted_by_what_held_them() -> None:
    """``Snapshot.turned_away_held_by``: the head held for room counts as "no-room", a caller
    never judged as head (behind it) by what held that head, and ``turned_away_behind`` counts
    it; one the batch cap held as "batch-cap"; a caller of a class after the held head's waits
    behind it too; a caller refused at arrival is not counted there, and the JSON snapshot
    carries both."""
    import attrs

    from kvbudget.core.model import BATCH, INTERACTIVE
    from kvbudget.core.stats import HELD_BY
    from kvbudget.observability import snapshot_to_dict

    s = Scheduler(Capacity(4, 4), policy=ReserveMaxFront())
    s.arrive("hog", spec(prompt=4, max_tokens=12, cls="interactive"), 0.0)
    s.arrive("head", spec(prompt=4, max_tokens=12, cls="interactive"), 0.0)
    s.arrive("next", spec(prompt=4, max_tokens=12, cls="interactive"), 0.1)
    assert s.requests["head"].held_by == "no-room" and s.requests["next"].held_by is None
    assert len(of(s.tick(2.5), ev.Reject)) == 2  # both at their 2 s queue bound
    snap = s.snapshot()
    assert snap.turned_away_held_by == {"no-room": 2}
    assert snap.turned_away_behind == 1
    assert snap.rejections_by_reason == {"queue-timeout": 2}
    as_dict = snapshot_to_dict(snap)
    assert as_dict["turned_away_held_by"] == {"no-room": 2}
    assert as_dict["turned_away_behind"] == 1
    assert set(snap.turned_away_held_by) <= set(HELD_BY)
    # too large for the engine: refused at arrival, never queued, not counted here
    assert of(s.arrive("huge", spec(prompt=40, max_tokens=12, cls="interactive"), 3.0),
              ev.Reject)
    assert s.snapshot().turned_away_held_by == {"no-room": 2}
    assert s.snapshot().turned_away_behind == 1

    capped = Scheduler(Capacity(64, 4), policy=ReserveMaxFront(),
                       config=SchedulerConfig(max_active=1))
    for rid in ("one", "two", "three"):
        capped.arrive(rid, spec(prompt=4, max_tokens=12, cls="interactive"), 0.0)
    assert capped.requests["two"].held_by == "batch-cap"
    assert capped.requests["three"].held_by is None
    assert len(of(capped.tick(2.5), ev.Reject)) == 2
    assert capped.snapshot().turned_away_held_by == {"batch-cap": 2}
    assert capped.snapshot().turned_away_behind == 1

    # strict class priority: a batch caller behind an interactive head held for room
    classes = (INTERACTIVE, attrs.evolve(BATCH, max_queue_delay_s=1.0))
    mixed = Scheduler(Capacity(4, 4), classes=classes, policy=ReserveMaxFront())
    mixed.arrive("hog", spec(prompt=4, max_tokens=12, cls="interactive"), 0.0)
    mixed.arrive("head", spec(prompt=4, max_tokens=12, cls="interactive"), 0.0)
    mixed.arrive("bulk", spec(prompt=4, max_tokens=4, cls="batch"), 0.0)
    assert mixed.requests["bulk"].held_by is None
    assert of(mixed.tick(1.5), ev.Reject, "bulk")
    assert mixed.snapshot().turned_away_held_by == {"no-room": 1}
    assert mixed.snapshot().turned_away_behind == 1


def test_a_head_is_held_by_the_policy_only_where_its_gate_kept_room_the_head_could_take() -> None:
    """The cause a refused head records: a protected head whose grant fits neither the
    admission budget nor the unprotected headroom is held by room ("no-room") even where the
    policy's gate refuses it too; one that would fit that headroom is held by the gate
    ("policy")."""

    class KeepsHeadroom(BasePolicy):
        name = "keeps-headroom"
        preempt_for_admission = True

        def headroom_target(self) -> int:
            return 4

        def admit(self, req: Request, blocks: int) -> bool:
            return self._s.ledger.fits_admission(blocks)

    s = Scheduler(Capacity(12, 4), policy=KeepsHeadroom())
    assert of(s.arrive("hog", spec(prompt=4, max_tokens=24, cls="interactive"), 0.0), ev.Admit)
    s.charge("hog", 1, 0.0)  # 7 blocks held, 5 free: 1 for admissions past the 4 of headroom
    s.arrive("big", spec(prompt=4, max_tokens=24, cls="interactive"), 0.0)  # 7 > 5 free
    assert s.requests["big"].held_by == "no-room"
    s.tick(2.5)  # turned away at its queue bound
    s.arrive("small", spec(prompt=4, max_tokens=8, cls="interactive"), 3.0)  # 3: the headroom
    assert s.requests["small"].held_by == "policy"


def test_queued_caller_turned_away_once_a_first_token_in_time_is_impossible() -> None:
    """Under a first-token objective, a queued caller is turned away at the objective less its
    predicted prefill (admitted later, it would miss anyway), not at its longer queue bound; a
    newcomer whose estimated wait already passes that point is told at once."""
    from kvbudget.core.cost import CostModel, StepTimeModel

    cls = ServiceClass("interactive", priority=0, protected=True, preemptible=False,
                       ttft_slo_s=2.0, max_queue_delay_s=10.0)
    cost = CostModel(StepTimeModel(fixed_s=0.01, per_seq_s=0.0, per_context_token_s=0.0,
                                   prefill_per_token_s=1e-3))  # 1,500 prompt tokens: 1.5 s
    s = Scheduler(Capacity(200, 16), classes=(cls,), policy=ReserveMaxFront(), cost=cost)
    s.arrive("hog", spec(prompt=1600, max_tokens=100, cls="interactive"), 0.0)  # 107 blocks
    s.charge("hog", 1, 0.0)  # its prefill is done: nothing queued ahead of the next caller
    s.arrive("w", spec(prompt=1500, max_tokens=100, cls="interactive"), 0.0)  # 100 > 93 free
    assert s.requests["w"].state is State.QUEUED
    assert not of(s.tick(0.45), ev.Reject)
    rej = of(s.tick(0.55), ev.Reject, "w")  # 2.0 s objective - 1.5 s prefill, not 10 s
    assert rej and rej[0].reason == "queue-timeout"
    assert "w" not in s.requests
    # a prefill longer than the objective: a caller who must wait at all is told at once
    out = s.arrive("late", spec(prompt=2100, max_tokens=100, cls="interactive"), 1.0)
    late = of(out, ev.Reject, "late")
    assert late and late[0].reason == "deadline" and "late" not in s.requests
    # ... while one the cache can take now is admitted (its first token is as early as can be)
    s.charge("hog", 99, 1.0)
    s.finish("hog", "length", 1.0)
    s.confirm_release("hog", 1.0)
    out = s.arrive("now", spec(prompt=2100, max_tokens=100, cls="interactive"), 1.0)
    assert of(out, ev.Admit, "now")


def test_queued_caller_is_turned_away_by_the_tail_of_first_token_times_not_their_mean() -> None:
    """``first_token_quantile``: a queued caller under a first-token objective is turned away
    at the objective less the time to a first token at that quantile: the learned line (a
    mean) plus how late recent first tokens came after it. At the mean, a caller admitted at
    its last moment gets a late first token every other time."""
    from kvbudget.core.cost import CostModel, StepTimeModel

    cls = ServiceClass("interactive", priority=0, protected=True, preemptible=False,
                       ttft_slo_s=2.0, max_queue_delay_s=10.0)

    def expiry(q: float | None) -> float:
        cost = CostModel(StepTimeModel(fixed_s=0.01, per_seq_s=0.0, per_context_token_s=0.0,
                                       prefill_per_token_s=1e-4))
        for i in range(40):  # 100 ms or 300 ms after admission, whatever the prompt
            cost.observe_first_token(100 * (1 + i % 5), 0.1 if i % 2 else 0.3)
        assert cost.predict_first_token(100) == pytest.approx(0.2, abs=0.02)
        assert cost.first_token_margin(0.9) == pytest.approx(0.1, abs=0.02)
        s = Scheduler(Capacity(64, 16), classes=(cls,), policy=ReserveMaxFront(), cost=cost,
                      config=SchedulerConfig(first_token_quantile=q))
        s.arrive("hog", spec(prompt=100, max_tokens=900, cls="interactive"), 0.0)
        s.charge("hog", 1, 0.0)
        s.arrive("w", spec(prompt=100, max_tokens=100, cls="interactive"), 0.0)
        at = s.requests["w"].expiry
        assert not of(s.tick(at - 0.01), ev.Reject)
        rej = of(s.tick(at + 0.01), ev.Reject, "w")
        assert rej and rej[0].reason == "queue-timeout"
        return at

    assert expiry(0.9) == pytest.approx(2.0 - 0.2 - 0.1, abs=0.03)
    assert expiry(None) == pytest.approx(2.0 - 0.2, abs=0.02)


def test_queued_request_turned_away_once_it_could_no_longer_finish_by_its_deadline() -> None:
    """``deadline_service_quantile``: a queued request with a deadline is turned away at the
    deadline less its predicted service (prefill, then its median length of steps), not at the
    deadline itself: admitted later it would finish late, and its KV and engine time would be
    lost to others; a newcomer that could not be admitted by then is told at once."""
    from kvbudget.core.cost import CostModel, StepTimeModel

    def scheduler(q: float | None) -> Scheduler:
        cost = CostModel(StepTimeModel(fixed_s=0.01, per_seq_s=0.0, per_context_token_s=0.0,
                                       prefill_per_token_s=1e-3))
        s = Scheduler(Capacity(64, 16), policy=ReserveMaxFront(), cost=cost,
                      config=SchedulerConfig(deadline_service_quantile=q))
        s.arrive("hog", spec(prompt=100, max_tokens=900), 0.0)  # 63 of 64 blocks
        s.charge("hog", 1, 0.0)
        s.arrive("w", spec(prompt=100, max_tokens=500, deadline=20.0), 0.0)
        assert s.requests["w"].state is State.QUEUED
        return s

    s = scheduler(0.5)
    w = s.requests["w"]
    tokens = min(500, s.lengths.quantile(w.key, 0.5))
    service = 0.1 + tokens * 0.01  # its prefill, then one 10 ms step per token
    assert w.expiry == pytest.approx(20.0 - service)
    assert 0.0 < w.expiry < 20.0
    assert not of(s.tick(w.expiry - 0.01), ev.Reject)
    rej = of(s.tick(w.expiry + 0.01), ev.Reject, "w")
    assert rej and rej[0].reason == "queue-timeout" and "w" not in s.requests
    # a newcomer whose deadline is shorter than its own service: told at once
    out = s.arrive("short", spec(prompt=100, max_tokens=500, deadline=service / 2), 1.0)
    late = of(out, ev.Reject, "short")
    assert late and late[0].reason == "deadline" and "short" not in s.requests
    # off: turned away at the deadline itself, and the newcomer waits
    s = scheduler(None)
    assert s.requests["w"].expiry == 20.0
    assert not of(s.tick(19.9), ev.Reject)
    assert of(s.tick(20.1), ev.Reject, "w")
    assert not of(s.arrive("short", spec(prompt=100, max_tokens=500, deadline=service / 2),
                           20.1), ev.Reject)


def test_caller_turned_away_when_its_first_token_would_come_late_behind_queued_prefill() -> None:
    """With ``turn_away_late_first_tokens``: the prefill already queued in the engine delays a
    newcomer's first token: a head that would miss its objective behind it is turned away at
    admission ("overloaded" now, and its prefill is not taken from callers who can still be
    served); the backlog is returned as
    first tokens come and as requests leave, and each first token refits the forecast."""
    from kvbudget.core.cost import CostModel, StepTimeModel

    cls = ServiceClass("interactive", priority=0, protected=True, preemptible=False,
                       ttft_slo_s=2.0, max_queue_delay_s=10.0)
    cost = CostModel(StepTimeModel(fixed_s=0.01, per_seq_s=0.0, per_context_token_s=0.0,
                                   prefill_per_token_s=1e-3))  # 1,000 prompt tokens: 1 s
    config = SchedulerConfig(turn_away_late_first_tokens=True)
    s = Scheduler(Capacity(10_000, 16), classes=(cls,), policy=ReserveMaxFront(), cost=cost,
                  config=config)
    assert of(s.arrive("a", spec(prompt=1000, max_tokens=10, cls="interactive"), 0.0), ev.Admit)
    assert s.prefill_backlog == 1000
    out = s.arrive("b", spec(prompt=1000, max_tokens=10, cls="interactive"), 0.0)  # 2.01 s
    rej = of(out, ev.Reject, "b")
    assert rej and rej[0].reason == "first-token-late" and "b" not in s.requests
    assert s.snapshot().turned_away_held_by == {"prefill-queue": 1}
    assert of(s.arrive("c", spec(prompt=500, max_tokens=10, cls="interactive"), 0.0), ev.Admit)
    assert s.prefill_backlog == 1500
    s.charge("a", 1, 1.0)
    assert s.prefill_backlog == 500 and cost.first_token_observations == 1
    s.cancel("c", 1.1)
    assert s.prefill_backlog == 0
    # with nothing queued ahead, the same prompt is admitted
    assert of(s.arrive("d", spec(prompt=1000, max_tokens=10, cls="interactive"), 1.2), ev.Admit)
    assert s.snapshot().totals.rejected == 1
    # off, the caller is admitted behind the backlog; the backlog is still kept
    s = Scheduler(Capacity(10_000, 16), classes=(cls,), policy=ReserveMaxFront(), cost=cost,
                  config=SchedulerConfig(turn_away_late_first_tokens=False))
    for rid in ("a", "b"):
        assert of(s.arrive(rid, spec(prompt=1000, max_tokens=10, cls="interactive"), 0.0),
                  ev.Admit)
    assert s.prefill_backlog == 2000


def test_a_prefill_nearly_done_no_longer_counts_in_full_ahead_of_a_newcomer() -> None:
    """The backlog leaves only as first tokens come, but the engine works through it all the
    while: a caller who arrives as a long prefill is nearly done is admitted behind what is
    left of it (its first token comes in time), not turned away as if the whole prompt were
    still ahead; the same caller at once behind it is turned away. (Over Mooncake's synthetic
    trace at 5 % of its load, 26 short interactive callers were turned away behind a
    35,000-token prefill nearly done, which every baseline served in 0.1-1.5 s.)"""
    from kvbudget.core.cost import CostModel, StepTimeModel

    cls = ServiceClass("interactive", priority=0, protected=True, preemptible=False,
                       ttft_slo_s=2.0, max_queue_delay_s=10.0)
    batch = ServiceClass("batch", priority=1, protected=False, preemptible=True)

    def scheduler() -> Scheduler:
        cost = CostModel(StepTimeModel(fixed_s=0.01, per_seq_s=0.0, per_context_token_s=0.0,
                                       prefill_per_token_s=1e-3))  # 1,000 tokens: 1 s
        s = Scheduler(Capacity(10_000, 16), classes=(cls, batch), policy=ReserveMaxFront(),
                      cost=cost, config=SchedulerConfig(turn_away_late_first_tokens=True))
        # two long prompts admitted at 0 and 0.5: both prefilled by about 3.01 s
        assert of(s.arrive("long1", spec(prompt=1500, max_tokens=10, cls="batch"), 0.0),
                  ev.Admit)
        assert of(s.arrive("long2", spec(prompt=1500, max_tokens=10, cls="batch"), 0.5),
                  ev.Admit)
        assert s.prefill_backlog == 3000
        return s

    s = scheduler()
    # at 0.6 nearly all of it is ahead: 2.4 s or more to a first token
    rej = of(s.arrive("early", spec(prompt=10, max_tokens=10, cls="interactive"), 0.6),
             ev.Reject, "early")
    assert rej and rej[0].reason == "first-token-late"
    # at 2.9 little of it is left, though no first token has come: admitted
    s = scheduler()
    assert of(s.arrive("late", spec(prompt=10, max_tokens=10, cls="interactive"), 2.9),
              ev.Admit, "late")
    assert s.prefill_backlog == 3010
    late = s.requests["late"]
    assert late.prefill_ahead < 1000  # what is left of the backlog, and its own
    assert s.first_token_delay(late) < 2.0
    # the forecast counts no more than the backlog, whatever the clock says
    s.charge("long1", 1, 3.0)
    s.charge("long2", 1, 3.0)
    assert s.forecast.queued_prefill() <= s.prefill_backlog == 10


def test_late_first_tokens_are_turned_away_by_default_only_once_they_are_common() -> None:
    """The default (None) engages the turn-away while more than 5 % of the recent first tokens
    missed their objective: a trace whose first tokens come in time keeps admitting behind a
    backlog; once late first tokens pile up (the engine's prefill queue is the bottleneck), the
    same caller is turned away; and as first tokens come in time again, it lets go."""
    from kvbudget.core.cost import CostModel, StepTimeModel

    cls = ServiceClass("interactive", priority=0, protected=True, preemptible=False,
                       ttft_slo_s=2.0, max_queue_delay_s=10.0)
    cost = CostModel(StepTimeModel(fixed_s=0.01, per_seq_s=0.0, per_context_token_s=0.0,
                                   prefill_per_token_s=1e-3))
    s = Scheduler(Capacity(100_000, 16), classes=(cls,), policy=ReserveMaxFront(), cost=cost)
    assert s.config.turn_away_late_first_tokens is None

    def first_tokens(n: int, late: bool, t: float) -> None:
        for i in range(n):
            rid, at = f"{'late' if late else 'ok'}{t}-{i}", t + 4.0 * i
            prompt = 3000 if late else 10  # late behind a long prefill: the fit learns its slope
            s.arrive(rid, spec(prompt=prompt, max_tokens=10, cls="interactive"), at)
            s.charge(rid, 1, at + (3.0 if late else 0.1))
            s.finish(rid, "stop", at + 3.0)
            s.confirm_release(rid, at + 3.0)

    def burst_admits(t: float) -> bool:  # the second of two 1,000-token prompts: 2.01 s
        out = s.arrive(f"x{t}", spec(prompt=1000, max_tokens=10, cls="interactive"), t)
        out += s.arrive(f"y{t}", spec(prompt=1000, max_tokens=10, cls="interactive"), t)
        admitted = bool(of(out, ev.Admit, f"y{t}"))
        for rid in (f"x{t}", f"y{t}"):
            if rid in s.requests:
                s.cancel(rid, t)
                s.confirm_release(rid, t)
        return admitted

    first_tokens(20, late=False, t=0.0)
    assert s.late_first_token_share == 0.0 and burst_admits(100.0)
    first_tokens(6, late=True, t=200.0)  # 1 - 0.99**6 = 5.9 % of recent first tokens late
    assert s.late_first_token_share > 0.05 and not burst_admits(300.0)
    first_tokens(30, late=False, t=400.0)
    assert s.late_first_token_share < 0.05 and burst_admits(600.0)


def test_batch_waits_while_the_prefill_queue_would_crowd_interactive_first_tokens() -> None:
    """Calibrated's ``batch_prefill_share``: the engine prefills first come first served, so a
    batch head waits in kvbudget's queue (which serves interactive callers first) while the
    prefill queued in the engine, its own and what interactive callers are expected to bring
    within their 2 s objective would take more than half of it; it is admitted as the queue
    drains, and at once when nothing is queued for prefill. Off (None), it is admitted at once."""
    from kvbudget.core.cost import CostModel, StepTimeModel

    def scheduler(**kw: Any) -> Scheduler:
        cost = CostModel(StepTimeModel(fixed_s=0.01, per_seq_s=0.0, per_context_token_s=0.0,
                                       prefill_per_token_s=1e-3))  # 1,000 tokens: 1 s
        return Scheduler(Capacity(10_000, 16), policy=CalibratedPolicy(**kw), cost=cost)

    s = scheduler()
    assert s.first_token_prefill_rate() == 0.0
    assert of(s.arrive("i0", spec(prompt=850, max_tokens=10, cls="interactive"), 0.0), ev.Admit)
    assert s.first_token_prefill_rate() == pytest.approx(85.0)  # 850 tokens over a 10 s window
    # 850 queued + its own 150 + 85 tok/s x 2 s coming = 1,170 tokens: 1.18 s > 1 s
    assert not of(s.arrive("b", spec(prompt=150, max_tokens=10, cls="batch"), 0.0), ev.Admit)
    b = s.requests["b"]
    assert b.state is State.QUEUED
    # held with room in the cache: its deadline still counts its predicted service
    assert b.deadline_at is not None and b.expiry < b.deadline_at
    assert s.first_token_prefill_rate() == pytest.approx(85.0)  # batch prompts do not count
    # an interactive caller is still served first
    assert of(s.arrive("i1", spec(prompt=50, max_tokens=10, cls="interactive"), 0.0), ev.Admit)
    assert not of(s.tick(0.1), ev.Admit)  # (at 0.1 the engine has prefilled ~100 of it)
    s.charge("i0", 1, 0.6)  # its prefill left the queue: 50 + 150 + ~170 coming: 0.38 s
    assert of(s.tick(0.6), ev.Admit, "b")
    # nothing queued for prefill: a batch head is admitted whatever the interactive rate
    s.charge("i1", 1, 0.7)
    s.charge("b", 1, 0.7)
    for k in range(20):
        s.arrive(f"r{k}", spec(prompt=1000, max_tokens=10, cls="interactive"), 0.8)
        s.cancel(f"r{k}", 0.8)
    assert s.prefill_backlog == 0 and s.first_token_prefill_rate() > 1000.0
    assert of(s.arrive("b2", spec(prompt=150, max_tokens=10, cls="batch"), 0.8), ev.Admit)
    # off: the batch head is admitted behind the queued prefill
    s = scheduler(batch_prefill_share=None)
    s.arrive("i0", spec(prompt=850, max_tokens=10, cls="interactive"), 0.0)
    assert of(s.arrive("b", spec(prompt=150, max_tokens=10, cls="batch"), 0.0), ev.Admit)
    # a larger share lets it join the same queue
    s = scheduler(batch_prefill_share=0.6)
    s.arrive("i0", spec(prompt=850, max_tokens=10, cls="interactive"), 0.0)
    assert of(s.arrive("b", spec(prompt=150, max_tokens=10, cls="batch"), 0.0), ev.Admit)
    for bad in (0.0, -0.5, math.nan, math.inf, "half"):
        with pytest.raises(InvalidInput) as info:
            CalibratedPolicy(batch_prefill_share=bad)  # type: ignore[arg-type]
        assert info.value.field == "batch_prefill_share"


def test_first_token_prefill_rate_decays_over_its_window() -> None:
    s = Scheduler(Capacity(10_000, 16), config=SchedulerConfig(arrival_rate_window_s=5.0))
    s.arrive("a", spec(prompt=500, max_tokens=10, cls="interactive"), 0.0)
    s.arrive("b", spec(prompt=500, max_tokens=10, cls="interactive"), 0.0)
    assert s.first_token_prefill_rate() == pytest.approx(200.0)
    s.tick(5.0)
    assert s.first_token_prefill_rate() == pytest.approx(200.0 * math.exp(-1.0))
    s.arrive("c", spec(prompt=100, max_tokens=10, cls="interactive"), 5.0)
    assert s.first_token_prefill_rate() == pytest.approx(200.0 * math.exp(-1.0) + 20.0)


def test_deadlock_breaker_checkpoints_one_of_the_stuck() -> None:
    s = Scheduler(Capacity(4, 4), policy=Fixed(allowance=4, step=4))
    s.arrive("a", spec(prompt=4, max_tokens=64), 0.0)
    s.arrive("b", spec(prompt=4, max_tokens=64), 0.0)
    to_boundary(s, "a", 0.0)
    to_boundary(s, "b", 0.0)
    assert not of(s.boundary_reached("a", 0.0), ev.Preempt)  # b still runs
    out = s.boundary_reached("b", 0.0)  # now everyone waits and nothing will free blocks
    pre = of(out, ev.Preempt)
    assert [p.request_id for p in pre] == ["b"]  # the most recently admitted gives way
    assert pre[0].reason == "progress"
    out = s.confirm_release("b", 0.1)
    assert of(out, ev.Extend, "a")


def test_a_checkpointed_stream_frozen_past_its_floor_counts_a_stall_when_it_resumes() -> None:
    """The caller of a stream that gave way saw no token from its last before the checkpoint
    to its first after the resume: that gap is an inter-token stall like any other (the wait
    for the very first token is not)."""
    classes = (ServiceClass("batch", latency_floor_s=0.1),)
    s = Scheduler(Capacity(4, 4), classes=classes, policy=Fixed(allowance=4, step=4))
    s.arrive("a", spec(prompt=4, max_tokens=8), 0.0)
    s.arrive("b", spec(prompt=4, max_tokens=64), 0.0)
    to_boundary(s, "a", 0.0)
    to_boundary(s, "b", 0.0)
    s.boundary_reached("a", 0.0)
    pre = of(s.boundary_reached("b", 0.0), ev.Preempt)
    assert [p.request_id for p in pre] == ["b"]
    assert of(s.confirm_release("b", 0.05), ev.Extend, "a")
    s.charge("a", 4, 0.06)  # (a gap of 60 ms: within the floor)
    s.finish("a", "length", 0.06)
    assert of(s.confirm_release("a", 1.0), ev.Admit, "b")
    assert s.snapshot().stalls == 0
    s.charge("b", 1, 2.0)  # the first token after the resume, 2 s after the one before
    assert s.snapshot().stalls == 1
    s.charge("b", 1, 2.05)
    assert s.snapshot().stalls == 1


def test_first_tokens_under_an_objective_are_counted_and_the_late_ones_apart() -> None:
    """``first_tokens`` counts each caller's own first token under a first-token objective,
    ``first_tokens_late`` those later than it from the caller's receipt (``received_at``, not
    the arrival at the budget); a class without an objective counts neither, and the first
    token after a checkpoint's resume is not the caller's first token."""
    classes = (
        ServiceClass("chat", ttft_slo_s=1.0, latency_floor_s=None),
        ServiceClass("batch", latency_floor_s=None),
    )
    s = Scheduler(Capacity(16, 4), classes=classes, policy=Fixed(allowance=4, step=4))
    s.arrive("on-time", spec(prompt=4, max_tokens=8, cls="chat"), 0.0)
    s.arrive("late", spec(prompt=4, max_tokens=8, cls="chat"), 0.5, received_at=0.0)
    s.arrive("no-objective", spec(prompt=4, max_tokens=8, cls="batch"), 0.0)
    s.charge("on-time", 1, 1.0)  # (exactly at the objective: in time)
    s.charge("late", 1, 1.2)  # 0.7 s after it reached the budget, 1.2 s after its receipt
    s.charge("no-objective", 1, 5.0)
    s.charge("on-time", 1, 1.3)  # (its second token: not a first token)
    snap = s.snapshot()
    assert snap.by_class["chat"].first_tokens == 2
    assert snap.by_class["chat"].first_tokens_late == 1
    assert snap.by_class["batch"].first_tokens == snap.by_class["batch"].first_tokens_late == 0
    assert (snap.totals.first_tokens, snap.totals.first_tokens_late) == (2, 1)


def test_the_first_token_after_a_resume_is_not_counted_as_a_first_token() -> None:
    """A stream checkpointed after its first token and resumed seconds later: its next token
    is not a first token, late as it is against the objective from the caller's receipt."""
    classes = (ServiceClass("chat", ttft_slo_s=1.0, latency_floor_s=None),)
    s = Scheduler(Capacity(4, 4), classes=classes, policy=Fixed(allowance=4, step=4))
    s.arrive("a", spec(prompt=4, max_tokens=8, cls="chat"), 0.0)
    s.arrive("b", spec(prompt=4, max_tokens=64, cls="chat"), 0.0)
    to_boundary(s, "a", 0.0)
    to_boundary(s, "b", 0.0)
    s.boundary_reached("a", 0.0)
    assert [p.request_id for p in of(s.boundary_reached("b", 0.0), ev.Preempt)] == ["b"]
    assert of(s.confirm_release("b", 0.05), ev.Extend, "a")
    s.charge("a", 4, 0.06)
    s.finish("a", "length", 0.06)
    assert of(s.confirm_release("a", 3.0), ev.Admit, "b")
    s.charge("b", 1, 4.0)  # b's first token after its resume, 4 s after its receipt
    totals = s.snapshot().totals
    assert (totals.first_tokens, totals.first_tokens_late) == (2, 0)


def test_a_lone_batch_request_grows_into_the_protected_part_rather_than_fail() -> None:
    """Batch work that fits the cache only with the headroom kept for interactive extensions:
    alone, it takes that part (an interactive extension could preempt it) and completes; it is
    not ended as capacity-exhausted. (The simulator found this on a code trace at 0.6x load:
    two 7,500-token prompts failed on a cache that held them.)"""
    s = Scheduler(Capacity(8, 4), policy=Fixed(allowance=4, step=4, protected=2, headroom=2))
    assert of(s.arrive("a", spec(prompt=4, max_tokens=28), 0.0), ev.Admit, "a")
    out: list[ev.Action] = []
    for _ in range(20):
        a = s.requests["a"]
        if a.generated >= 28 or a.state not in (State.ADMITTED, State.RUNNING, State.EXTENDING):
            break
        if a.generated < a.boundary:
            out += s.charge("a", a.boundary - a.generated, 0.0)
        else:
            out += s.boundary_reached("a", 0.0)
    assert not of(out, ev.Abort), out
    assert s.requests["a"].generated == 28 and s.requests["a"].blocks == 8
    assert of(s.finish("a", "length", 0.1) + s.confirm_release("a", 0.2), ev.Released, "a")[
        0
    ].outcome == "completed"


def test_a_request_that_needs_the_headroom_is_admitted_into_an_idle_cache_only() -> None:
    """The headroom is kept for the extensions of grants in flight: with none, a prompt that
    needs nearly the whole cache takes it (the simulator found half a long-context trace's
    prompts queued to their deadlines behind a headroom nobody could use); with a request in
    flight, it waits for the cache to empty."""
    s = Scheduler(Capacity(8, 4), policy=Fixed(allowance=4, step=4, headroom=3))
    assert of(s.arrive("a", spec(prompt=4, max_tokens=4), 0.0), ev.Admit, "a")
    assert not of(s.arrive("big", spec(prompt=24, max_tokens=4), 0.0), ev.Admit)
    to_boundary(s, "a", 0.1)
    out = s.finish("a", "length", 0.2)
    assert not of(out, ev.Admit, "big")  # a's blocks are not confirmed free yet
    assert of(s.confirm_release("a", 0.3), ev.Admit, "big")
    assert s.ledger.free == 1


def test_deadlock_breaker_fails_a_lone_request_that_cannot_fit() -> None:
    s = Scheduler(Capacity(3, 4), policy=Fixed(allowance=4, step=4))
    s.arrive("a", spec(prompt=4, max_tokens=64), 0.0)
    out = push(s, "a", 0.0)  # grows to all 3 blocks on the way, then is stuck alone
    abort = of(out, ev.Abort, "a")
    assert abort and abort[0].reason == "capacity-exhausted"
    assert of(s.confirm_release("a", 0.0), ev.Released, "a")[0].outcome == "failed"


def test_reconcile_releases_only_stops_the_engine_no_longer_holds() -> None:
    s = Scheduler(
        Capacity(64, 4), policy=Fixed(allowance=40), config=SchedulerConfig(confirm_timeout_s=1.0)
    )
    s.arrive("small", spec(prompt=4, max_tokens=64), 0.0)  # uses 2 blocks when stopped
    s.arrive("large", spec(prompt=16, max_tokens=64), 0.0)  # uses 5 blocks when stopped
    s.arrive("run", spec(prompt=4, max_tokens=64), 0.0)
    s.charge("small", 4, 0.0)
    s.charge("large", 4, 0.0)
    s.charge("run", 8, 0.0)
    s.cancel("small", 0.0)
    s.cancel("large", 0.0)
    running_used = s.requests["run"].used_blocks
    # before the timeout nothing is reconciled, whatever the engine says
    assert not s.reconcile(running_used, 0.5)
    s.tick(2.0)
    assert s.snapshot().unconfirmed_releasing == 2
    # the engine still holds 5 blocks of stopped work: either could be it; release nothing
    before = fingerprint(s)
    assert not of(s.reconcile(running_used + 5, 2.0), ev.Released)
    assert fingerprint(s)[:8] == before[:8]
    # 2 blocks held: "large" (5 used blocks) cannot be among them
    out = s.reconcile(running_used + 2, 2.0)
    assert [a.request_id for a in of(out, ev.Released)] == ["large"]
    assert s.requests["small"].state is State.RELEASING
    # the engine now holds nothing stopped
    out = s.reconcile(running_used, 2.0)
    assert [a.request_id for a in of(out, ev.Released)] == ["small"]
    assert s.ledger.reserved == s.requests["run"].blocks


def test_unconfirmed_flag_belongs_to_one_stop() -> None:
    s = Scheduler(
        Capacity(8, 4),
        policy=Fixed(allowance=4, step=4, blocked=Blocked.PREEMPT_SELF),
        config=SchedulerConfig(confirm_timeout_s=1.0),
    )
    s.arrive("a", spec(prompt=4, max_tokens=64), 0.0)
    s.arrive("b", spec(prompt=4, max_tokens=64), 0.0)
    s.arrive("c", spec(prompt=4, max_tokens=64), 0.0)
    s.charge("a", 4, 0.0)
    s.charge("b", 4, 0.0)
    s.charge("c", 4, 0.0)
    s.boundary_reached("c", 0.0)  # c extends... or a/b: fill the cache
    for rid in ("a", "b", "c"):
        if (
            s.requests[rid].state is State.RUNNING
            and s.requests[rid].generated >= s.requests[rid].boundary
        ):
            s.boundary_reached(rid, 0.0)
    pre = [r for r in s.requests.values() if r.state is State.PREEMPTING]
    assert pre, "one request checkpointed itself"
    r = pre[0]
    s.tick(5.0)
    assert r.unconfirmed  # late confirmation: counted
    s.confirm_release(r.request_id, 5.0)
    # whatever happens next, a new stop of the same request starts unflagged
    if r.state in (State.ADMITTED, State.RUNNING):
        s.cancel(r.request_id, 5.0)
        assert not r.unconfirmed and r.release_started_at == 5.0


def test_preempted_then_cancelled_keeps_its_first_confirmation_clock() -> None:
    s = Scheduler(
        Capacity(2, 4),
        policy=Fixed(allowance=4, step=4, blocked=Blocked.PREEMPT_SELF),
        config=SchedulerConfig(confirm_timeout_s=1.0),
    )
    s.arrive("a", spec(prompt=2, max_tokens=64), 0.0)
    s.arrive("b", spec(prompt=2, max_tokens=64), 0.0)
    to_boundary(s, "a", 0.0)
    assert of(s.boundary_reached("a", 0.0), ev.Preempt, "a")
    s.cancel("a", 0.9)  # the caller leaves while the preemption is in flight
    assert s.requests["a"].state is State.RELEASING
    s.tick(1.5)  # 1.5 s after the engine was told to stop
    assert s.requests["a"].unconfirmed


@pytest.mark.parametrize("cls", ["batch", "interactive"])
def test_weighted_tenant_fairness_under_saturation(cls: str) -> None:
    # (interactive: the backfilling of the stride lets an older caller go first only from a
    # tenant at most one admission ahead, so the weights still hold)
    s = Scheduler(
        Capacity(4, 4),
        policy=ReserveMaxFront(),
        config=SchedulerConfig(tenant_weights={"a": 10.0, "b": 1.0}),
    )
    n = 2000
    admitted: list[str] = []

    def record(actions: Sequence[ev.Action]) -> None:
        admitted.extend(a.request_id for a in of(actions, ev.Admit))

    for k in range(n):
        record(s.arrive(f"a{k}", spec(prompt=2, max_tokens=2, cls=cls, tenant="a"), 0.0))
        record(s.arrive(f"b{k}", spec(prompt=2, max_tokens=2, cls=cls, tenant="b"), 0.0))
    t = 0.0
    served = 0
    while served < 1100:
        rid = next(r.request_id for r in s.requests.values() if r.state is State.ADMITTED)
        s.charge(rid, 1, t)
        record(s.finish(rid, "stop", t))
        record(s.confirm_release(rid, t))
        served += 1
    window = admitted[:1100]
    share_a = sum(1 for r in window if r.startswith("a")) / len(window)
    assert share_a == pytest.approx(10 / 11, rel=0.10)
    share_b = 1 - share_a
    assert share_b == pytest.approx(1 / 11, rel=0.10)


def ends_or_continues(make: Callable[[], Scheduler], remaining: int) -> None:
    """``make()`` leaves r1 with no room to grow and told nothing final. Either the engine
    says it ended (then it completed) or that it stopped and wants more (then a continuation of
    its ``remaining`` tokens)."""
    s = make()
    s.finish("r1", "stop", 0.1)  # it was its last token
    assert s.requests["r1"].state is State.RELEASING
    out = make().boundary_reached("r1", 0.1)  # it stopped and wants more: no room
    assert of(out, ev.Continue, "r1")[0].continuation.remaining_tokens == remaining


def test_an_overshoot_into_the_slack_waits_for_the_engine_before_a_continuation() -> None:
    """An engine that overshoots its boundary into the reserved slack has not stopped: the token
    past the boundary may be its last one. With no room to extend, the request is told nothing
    final until the engine says it stopped (then a continuation) or ended (then it completed;
    found by the property harness: a Continue for a request whose overshooting token was its
    natural end)."""
    from kvbudget.core.policy import NewTokenRatioPolicy

    def overshot() -> Scheduler:
        s = Scheduler(
            Capacity(5, 4), policy=NewTokenRatioPolicy(), config=SchedulerConfig(slack_tokens=2)
        )
        spec_ = RequestSpec(17, 3, 20, service_class="interactive", on_exhausted="continue")
        assert of(s.arrive("r1", spec_, 0.0), ev.Admit, "r1")[0].boundary == 1
        out = s.charge("r1", 2, 0.0)  # one token past the boundary, into the slack
        assert not of(out, ev.Continue) and not of(out, ev.Preempt)
        return s

    ends_or_continues(overshot, remaining=1)


def test_a_policy_acting_ahead_waits_for_the_engine_at_the_boundary_itself() -> None:
    """A policy that decides ahead of the boundary (``acts_ahead``) decides while the request
    is short of it. The token that reaches the boundary may be the request's last one, so a
    refused extension there waits for the engine's word, as past it (found by the property
    harness with a policy answering at random: a Continue for a request whose token at its
    boundary was its natural end)."""

    class Ahead(Fixed):
        name = "ahead"

        def acts_ahead(self, req: Request) -> bool:
            return True

    def at_boundary() -> Scheduler:
        s = Scheduler(Capacity(2, 4), policy=Ahead(allowance=4, step=4, blocked=Blocked.CONTINUE))
        spec_ = spec(prompt=4, max_tokens=16, on_exhausted="continue")
        assert of(s.arrive("r1", spec_, 0.0), ev.Admit, "r1")[0].boundary == 4
        out = s.charge("r1", 4, 0.0)  # exactly to the boundary; the cache is full
        assert not of(out, ev.Continue) and not of(out, ev.Preempt), out
        return s

    ends_or_continues(at_boundary, remaining=12)


def test_a_continuation_asked_ahead_of_the_boundary_waits_for_it() -> None:
    """A policy acting ahead that answers ``CONTINUE`` while the request is short of its
    boundary does not end it there: its grant covers the tokens to the boundary, and the token
    just charged may be its last one (found by the property harness with a policy answering at
    random: a Continue at the first token of a one-token answer)."""

    class AheadContinues(Fixed):
        name = "ahead-continues"

        def acts_ahead(self, req: Request) -> bool:
            return True

        def lookahead_tokens(self, req: Request) -> int:
            return 100

    def first_token() -> Scheduler:
        s = Scheduler(
            Capacity(2, 4), policy=AheadContinues(allowance=4, step=4, blocked=Blocked.CONTINUE)
        )
        spec_ = spec(prompt=4, max_tokens=16, on_exhausted="continue")
        assert of(s.arrive("r1", spec_, 0.0), ev.Admit, "r1")[0].boundary == 4
        out = s.charge("r1", 1, 0.0)  # asked ahead at once; the cache is full
        assert not of(out, ev.Continue), out
        assert s.requests["r1"].state is State.RUNNING
        return s

    s = first_token()
    s.finish("r1", "stop", 0.1)  # it was its last token, short of the boundary
    assert s.requests["r1"].state is State.RELEASING

    def at_boundary() -> Scheduler:
        s = first_token()
        assert not of(s.charge("r1", 3, 0.1), ev.Continue)  # to the boundary: the engine decides
        return s

    ends_or_continues(at_boundary, remaining=12)


#: pressures in a few bands side by side and far apart (so that outcomes crowd a band)
_PRESSURES = st.sampled_from([0.3, 0.8, 1.0, 1.2, 1.6, 2.5, 3.0, 6.0, 40.0])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.tuples(
                st.just("outcome"),
                _PRESSURES,
                st.sampled_from([0.0, 0.5, 2.0]),
                st.booleans(),
            ),
            st.tuples(st.just("time"), st.floats(0.0, 40.0), st.just(0.0), st.just(False)),
            st.tuples(st.just("read"), _PRESSURES, st.sampled_from([0.5, 2.0]), st.just(False)),
        ),
        max_size=120,
    ),
    st.integers(1, 20),
)
def test_the_in_time_share_is_always_what_the_outcomes_kept_say(
    steps: list[tuple[str, float, float, bool]], window: int
) -> None:
    """Whatever the sequence of outcomes, reads and passing time, the share and count the
    turn-away reads for a pressure (cached between reads) are those of the outcomes kept: the
    last ``wait_outcome_window`` of each band, none older than ``WAIT_OUTCOME_HORIZON_S``, its
    band, then the bands beside it and the next one down until ``MIN_WAIT_OUTCOMES``."""
    from kvbudget.core.forecast import (
        MIN_WAIT_OUTCOMES,
        WAIT_OUTCOME_HORIZON_S,
        WAIT_PRESSURE_BANDS,
        wait_pressure_band,
    )

    s = Scheduler(Capacity(8, 4), policy=ReserveMaxFront(),
                  config=SchedulerConfig(wait_outcome_window=window))
    f = s.forecast
    kept: list[list[tuple[float, bool]]] = [[] for _ in range(WAIT_PRESSURE_BANDS)]
    now = 0.0
    for kind, a, b, flag in steps:
        if kind == "time":
            now += a
            s.tick(now)
        elif kind == "outcome":  # (a: the pressure, b: the bound)
            f.note_waited(a * b if b > 0.0 else a, b, flag, now)
            band = wait_pressure_band(a if b > 0.0 else math.inf)
            kept[band] = (kept[band] + [(now, flag)])[-window:]
        else:
            fresh = [[o for o in k if o[0] >= now - WAIT_OUTCOME_HORIZON_S] for k in kept]
            band = wait_pressure_band(a)
            seen = list(fresh[band])
            for near in (band + 1, band - 1, band - 2):
                if len(seen) >= MIN_WAIT_OUTCOMES:
                    break
                if 0 <= near < WAIT_PRESSURE_BANDS:
                    seen += fresh[near]
            share = f.in_time_share(a)
            assert f.unlikely_in_time(a * b, b) is (
                share < 0.2 if len(seen) >= MIN_WAIT_OUTCOMES else a > 1.0
            )
            assert f.wait_outcome_samples == len(seen)
            expected = sum(ok for _, ok in seen) / len(seen) if seen else 1.0
            assert share == pytest.approx(expected)
            assert 0.0 <= share <= 1.0
            snap = s.snapshot()
            assert snap.wait_forecast_samples == len(seen)
            assert snap.wait_in_time_share == pytest.approx(expected)


def test_a_forecast_taken_over_by_another_scheduler_answers_as_it_would_have() -> None:
    """``Forecast.memory`` / ``recall``: a scheduler that goes on where another stopped (the
    simulator's next workload of one server) reads the same release rate and the same
    calibration of its wait forecasts, its times moved to its own clock (the time between
    counts as none); a fresh one has no release rate and no outcomes."""
    from kvbudget.core.forecast import MIN_WAIT_OUTCOMES

    s = Scheduler(Capacity(9, 4), policy=ReserveMaxFront())
    s.arrive("background", spec(prompt=1, max_tokens=3), 0.0)
    _release_rate(s)
    f = s.forecast
    for _ in range(MIN_WAIT_OUTCOMES):
        f.note_waited(5.0, 1.0, True, s.now)
    rate, share, late = f.release_rate(s.now), f.in_time_share(5.0), f.late_first_token_share
    assert rate > 0.0 and share == 1.0
    memory = f.memory()
    assert memory.at == s.now
    # the memory reads as the forecast that takes it over will (what sim_vs_real shows)
    window = s.config.release_rate_window_s
    assert memory.release_rate(window) == pytest.approx(rate)
    t = Scheduler(Capacity(9, 4), policy=ReserveMaxFront())
    assert t.forecast.release_rate(100.0) == 0.0 and not t.forecast.unlikely_in_time(0.5, 1.0)
    t.forecast.recall(memory, 100.0)
    g = t.forecast
    assert g.release_rate(100.0) == pytest.approx(rate)
    t.tick(100.0)
    assert g.memory().release_rate(window) == pytest.approx(rate)
    assert g.in_time_share(5.0) == share and g.late_first_token_share == late
    assert g.memory().outcomes == tuple(
        tuple((when + 100.0 - memory.at, ok) for when, ok in band) for band in memory.outcomes
    )
    assert t.snapshot().wait_forecast_samples >= MIN_WAIT_OUTCOMES
    # outcomes are forgotten a minute after they came: on the new clock, too
    from kvbudget.core.forecast import WAIT_OUTCOME_HORIZON_S

    t.arrive("later", spec(prompt=1, max_tokens=3), 100.0 + WAIT_OUTCOME_HORIZON_S + 1.0)
    g.in_time_share(5.0)
    assert t.snapshot().wait_forecast_samples == 0


def test_a_caller_the_batch_cap_holds_back_is_told_at_arrival() -> None:
    """Room for every block, a batch cap of 2 sequences (``max_active``, vLLM's
    ``max_num_seqs``), 2,000-token answers ending one a second: with two streams live and more
    callers queued behind the cap, a newcomer would wait for a sequence slot per caller ahead of
    it, at a slot a second, beyond its 2 s bound, and the live streams are not expected to end
    before it: it is turned away at arrival ("deadline"), not queued to time out at its bound.
    Before the slots were in the forecast, its wait was one block at the block release rate
    (2 ms) and it was queued. A caller with a slot ahead of it within its bound is queued; the
    slots' drain is the live streams' expected ends, then cycles of the turnover."""
    s = Scheduler(Capacity(10_000, 4), policy=ReserveMaxFront(),
                  config=SchedulerConfig(max_active=2))
    for k in range(20):  # one stream of 2,000 tokens ending every second
        s.arrive(f"w{k}", spec(prompt=4, max_tokens=2000, cls="interactive"), float(k))
        s.charge(f"w{k}", 2000, float(k) + 0.9)
        s.finish(f"w{k}", "stop", float(k) + 0.9)
        s.confirm_release(f"w{k}", float(k) + 0.95)
    t = 20.0
    for rid in ("a", "b"):
        assert of(s.arrive(rid, spec(prompt=4, max_tokens=2000, cls="interactive"), t), ev.Admit)
    assert s.active == 2
    out = s.arrive("q0", spec(prompt=4, max_tokens=2000, cls="interactive"), t)
    assert not of(out, ev.Reject) and s.requests["q0"].state is State.QUEUED
    wait, measured = s.forecast.wait_estimate(s.requests["q0"])
    assert measured and 1.5 <= wait <= 3.0, wait  # two slots (its own counted again) at ~1/s
    turned = []
    for k in range(1, 6):
        out = s.arrive(f"q{k}", spec(prompt=4, max_tokens=2000, cls="interactive"), t)
        turned += [r.reason for r in of(out, ev.Reject)]
    assert turned and set(turned) == {"deadline"}, turned
    assert s.queues.count_ahead(s.classes["interactive"]) <= 2  # q0 and at most one more
    step = s.step_seconds()
    e1, e2 = sorted((s.expected_length(r) - r.generated) * step for r in s.live.values())
    drain = s.forecast.slot_drain_wait
    assert drain(1, 0.0) == e1 and drain(2, 0.0) == e2
    assert drain(3, 100.0) == 100.0 + e1 and drain(4, 0.0) == 2 * e2  # a cycle, then again


def test_below_the_batch_cap_a_queue_waiting_for_blocks_is_not_counted_in_slots() -> None:
    """A batch cap of 4, one stream holding every block and five callers queued for blocks:
    more callers than free slots, but the cap holds no one back (the stream whose end returns
    the blocks frees its slot too), so no slot is counted; at the cap the queue is (an earlier
    version counted the queue against the free slots here, and over the real engine with twice
    the cache turned away callers the blocks served in time)."""
    s = Scheduler(Capacity(16, 4), policy=ReserveMaxFront(), config=SchedulerConfig(max_active=4))
    assert of(s.arrive("hog", spec(prompt=4, max_tokens=60, cls="interactive"), 0.0), ev.Admit)
    for k in range(5):
        s.arrive(f"q{k}", spec(prompt=4, max_tokens=60, cls="interactive"), 0.0)
    assert s.active == 1 and s.queues.count_ahead(s.classes["interactive"]) == 5
    assert s.forecast.slot_deficit(s.requests["q4"]) == 0
    s2 = Scheduler(Capacity(1000, 4), policy=ReserveMaxFront(),
                   config=SchedulerConfig(max_active=2))
    for rid in ("a", "b", "q0", "q1"):
        s2.arrive(rid, spec(prompt=4, max_tokens=60, cls="interactive"), 0.0)
    assert s2.active == 2
    assert s2.forecast.slot_deficit(s2.requests["q1"]) == 3  # q0, q1 (counted again), + 1


# == backfilling the tenant stride ===============================================================


def backfill_case(
    cls: str, step: StepTimeModel, release_at: float = 0.3
) -> tuple[Scheduler, list[ev.Action]]:
    """Tenant b's ``big`` (4 blocks) and tenant a's ``a1`` (3) hold 7 of 8 blocks; then a's
    ``a2`` (3 blocks) and, later, b's ``b2`` (4 blocks) queue. Both
    tenants have had one admission and b was seen first, so the stride's head is b2. ``big``
    ends at ``release_at``: 5 blocks free, room for either queued caller, not both. Returns
    the scheduler and the actions of that release."""
    s = Scheduler(Capacity(8, 4), policy=ReserveMaxFront(), cost=CostModel(step))
    assert of(s.arrive("big", spec(4, 12, cls, tenant="b"), 0.0), ev.Admit)
    assert of(s.arrive("a1", spec(4, 8, cls, tenant="a"), 0.0), ev.Admit)
    s.charge("big", 1, 0.05)
    s.charge("a1", 1, 0.05)
    assert not s.arrive("a2", spec(4, 8, cls, tenant="a"), 0.1)
    assert not s.arrive("b2", spec(4, 12, cls, tenant="b"), 0.2)
    assert s.queues.by_class[cls].head() is s.requests["b2"]
    s.finish("big", "stop", release_at)
    return s, list(s.confirm_release("big", release_at))


FAST_STEPS = StepTimeModel(fixed_s=0.01, per_seq_s=0.0, per_context_token_s=0.0,
                           prefill_per_token_s=1e-4)


def test_an_older_caller_is_backfilled_before_the_stride_head_whose_slack_absorbs_it() -> None:
    # a2 (3 blocks, at most 8 tokens: 0.08 s at 10 ms a step) fits, b2 may still wait 1.9 s:
    # a2 goes first, and b2 waits for a2's blocks well within its bound
    s, out = backfill_case("interactive", FAST_STEPS)
    a2, b2 = s.requests["a2"], s.requests["b2"]
    assert s.forecast.predicted_service(a2, 0.9) <= 0.5 * s.queue_slack(b2)
    assert [a.request_id for a in of(out, ev.Admit)] == ["a2"]
    assert b2.state is State.QUEUED
    # a's pass paid for it: b2 is still the stride's head, and goes when a1 ends
    assert s.queues.by_class["interactive"].head() is b2
    s.finish("a1", "stop", 0.35)
    assert [a.request_id for a in of(s.confirm_release("a1", 0.35), ev.Admit)] == ["b2"]


def test_the_stride_head_goes_first_where_the_older_callers_service_would_eat_its_slack() -> None:
    # the same queue with 0.12 s steps: a2's 8 tokens take about 1 s, more than half of the
    # 1.3 s b2 may still wait at 0.9 s: the stride's order stands
    slow = StepTimeModel(fixed_s=0.12, per_seq_s=0.0, per_context_token_s=0.0,
                         prefill_per_token_s=1e-4)
    s, out = backfill_case("interactive", slow, release_at=0.9)
    a2, b2 = s.requests["a2"], s.requests["b2"]
    assert s.forecast.predicted_service(a2, 0.9) > 0.5 * s.queue_slack(b2)
    assert [a.request_id for a in of(out, ev.Admit)] == ["b2"]
    assert a2.state is State.QUEUED


def test_backfilling_leaves_classes_without_a_first_token_objective_in_stride_order() -> None:
    s, out = backfill_case("batch", FAST_STEPS)
    assert [a.request_id for a in of(out, ev.Admit)] == ["b2"]
    assert s.requests["a2"].state is State.QUEUED


def test_no_backfill_where_both_callers_fit() -> None:
    # b2 with a 2-block grant (8 tokens in all): both fit the 5 free blocks, in stride order
    s2 = Scheduler(Capacity(8, 4), policy=ReserveMaxFront(), cost=CostModel(FAST_STEPS))
    assert of(s2.arrive("big", spec(4, 12, "interactive", tenant="b"), 0.0), ev.Admit)
    assert of(s2.arrive("a1", spec(4, 8, "interactive", tenant="a"), 0.0), ev.Admit)
    assert not s2.arrive("a2", spec(4, 8, "interactive", tenant="a"), 0.1)
    assert not s2.arrive("b2", spec(4, 4, "interactive", tenant="b"), 0.2)
    s2.finish("big", "stop", 0.3)
    assert [a.request_id for a in of(s2.confirm_release("big", 0.3), ev.Admit)] == ["b2", "a2"]


def easy_case(step: StepTimeModel) -> Scheduler:
    """``x`` (4 blocks) runs; ``y`` (3) has ended, so releases are measured; ``h`` wants 6 blocks
    of the 4 free and heads the queue; ``s`` behind it wants 2 (8 tokens in all)."""
    s = Scheduler(Capacity(8, 4), policy=ReserveMaxFront(), cost=CostModel(step))
    assert of(s.arrive("x", spec(4, 12, "interactive"), 0.0), ev.Admit)
    assert of(s.arrive("y", spec(4, 8, "interactive"), 0.0), ev.Admit)
    s.charge("x", 1, 0.05)
    s.charge("y", 1, 0.05)
    s.finish("y", "stop", 0.1)
    s.confirm_release("y", 0.1)
    assert s.forecast.release_rate(0.1) > 0
    assert not s.arrive("h", spec(4, 20, "interactive"), 0.15)
    return s


def test_a_caller_that_ends_before_the_heads_reservation_is_backfilled_behind_it() -> None:
    s = easy_case(FAST_STEPS)
    h = s.requests["h"]
    assert h.reserved_until is not None and h.reserved_until > 0.15  # when its blocks are due
    out = s.arrive("s", spec(4, 4, "interactive"), 0.16)
    left = h.reserved_until - 0.16
    assert s.forecast.predicted_service(s.requests["s"], 0.9) <= left
    assert [a.request_id for a in of(out, ev.Admit)] == ["s"]
    assert h.state is State.QUEUED and s.queues.by_class["interactive"].head() is h


def test_a_caller_that_would_outlast_the_heads_reservation_waits_behind_it() -> None:
    slow = StepTimeModel(fixed_s=0.12, per_seq_s=0.0, per_context_token_s=0.0,
                         prefill_per_token_s=1e-4)
    s = easy_case(slow)
    h = s.requests["h"]
    out = s.arrive("s", spec(4, 4, "interactive"), 0.16)
    assert h.reserved_until is not None
    assert s.forecast.predicted_service(s.requests["s"], 0.9) > h.reserved_until - 0.16
    assert not of(out, ev.Admit)
    assert s.requests["s"].state is State.QUEUED
