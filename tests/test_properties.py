"""Property tests: the state-machine harness on every shipped policy, plus plain properties.

Profiles (``HYPOTHESIS_PROFILE`` env var): ``ci`` (default: 120 runs of 80 steps per policy,
about a minute on 2 cores) and ``thorough`` (400 runs of 120 steps, for a change to the core or
a policy).
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbudget.core.ledger import TRANSITIONS, Ledger, Request, State, Trigger
from kvbudget.core.model import BATCH, Capacity, RequestSpec, blocks_for
from kvbudget.core.policy import POLICY_NAMES, CalibratedPolicy
from kvbudget.core.policy.baselines import NewTokenRatioPolicy, SegmentedPolicy
from kvbudget.core.queue import ClassQueue as _ClassQueue
from kvbudget.core.stats import Counters
from kvbudget.errors import AlreadyReleased, InvalidInput, InvalidTransition
from kvbudget.testing import BudgetStateMachine, capacities, request_specs, workloads

settings.register_profile(
    "ci",
    max_examples=120,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.register_profile(
    "thorough",
    max_examples=400,
    stateful_step_count=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
PROFILE = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# -- the state machine on every shipped policy ---------------------------------------------------

for _name in POLICY_NAMES:
    _case = BudgetStateMachine.for_policy(_name).TestCase
    _case.settings = PROFILE
    globals()[f"TestPolicy_{_name.replace('-', '_')}"] = _case
del _name, _case


class _PausesEngaged(CalibratedPolicy):
    """Calibrated with every resumable request cheap to pause: its pauses for first tokens and
    at boundaries engage from the first step (with the default cost model the harness rarely
    reaches them), so every invariant is checked through rounds of pauses, and so is the rule
    that a caller streams were paused for waits to be served (``Scheduler.paused_for``)."""

    def cheap_to_pause(self, req: Request) -> bool:
        return req.spec.resumable


TestVariant_calibrated_pauses_engaged = BudgetStateMachine.for_policy(
    lambda _truth: _PausesEngaged(), name="calibrated-pauses-engaged"
).TestCase
TestVariant_calibrated_pauses_engaged.settings = PROFILE

#: the same with tight grants wherever a stream has a latency floor (one step in it is enough):
#: every invariant is checked through grants that end at the block of the next token, grow one
#: block at a time and are asked a pause's confirmation ahead (CalibratedPolicy._tight)
TestVariant_calibrated_tight_grants = BudgetStateMachine.for_policy(
    lambda _truth: _PausesEngaged(tight_floor_steps=1), name="calibrated-tight-grants"
).TestCase
TestVariant_calibrated_tight_grants.settings = PROFILE


#: SGLang's rule with its ratio at its floor from the start (what 600 decode steps decay it to)
#: and every request running to its hard max: it admits against a tenth of the running
#: requests' futures, so their growth runs out of blocks and it retracts (fewest output tokens
#: first, then sets the ratio from what is left), which the default draw almost never reaches
NTR_RETRACTING = BudgetStateMachine.for_policy(
    lambda _truth: NewTokenRatioPolicy(init_ratio=0.098),
    name="new-token-ratio-retracting",
    long_outputs=True,
)
TestVariant_new_token_ratio_retracting = NTR_RETRACTING.TestCase
TestVariant_new_token_ratio_retracting.settings = PROFILE

#: segmented reservation with 16-token segments: every request longer than that is re-queued
#: with its output at each segment's end (the default 1,024 is longer than any drawn request)
SEGMENTED_SHORT = BudgetStateMachine.for_policy(
    lambda _truth: SegmentedPolicy(segment=16), name="segmented-short-segments"
)
TestVariant_segmented_short_segments = SEGMENTED_SHORT.TestCase
TestVariant_segmented_short_segments.settings = PROFILE


def test_every_shipped_policy_has_a_state_machine_test() -> None:
    names = {k for k in globals() if k.startswith("TestPolicy_")}
    assert names == {f"TestPolicy_{n.replace('-', '_')}" for n in POLICY_NAMES}


# -- plain properties -----------------------------------------------------------------------------


@given(
    prompt=st.integers(1, 10_000),
    max_tokens=st.integers(1, 10_000),
    room=st.integers(-50, 10_000),
)
def test_hard_max_formula(prompt: int, max_tokens: int, room: int) -> None:
    mml = prompt + room
    if room <= 0:
        # no room for a single output token: refused at construction, naming the field
        with pytest.raises(InvalidInput) as info:
            RequestSpec(prompt, max_tokens, max(mml, 1))
        assert info.value.field == "prompt_tokens"
        return
    spec = RequestSpec(prompt, max_tokens, mml)
    assert spec.hard_max == min(max_tokens, mml - prompt)
    assert 1 <= spec.hard_max <= max_tokens
    assert spec.prompt_tokens + spec.hard_max <= mml


@given(tokens=st.integers(0, 1 << 20), block_size=st.integers(1, 256))
def test_whole_block_rounding(tokens: int, block_size: int) -> None:
    b = blocks_for(tokens, block_size)
    assert b * block_size >= tokens  # covers the tokens
    assert b == 0 or (b - 1) * block_size < tokens  # and not one block more


@given(spec=request_specs(), cap=capacities(), slack=st.integers(0, 8), data=st.data())
def test_grant_blocks_and_covered_boundary(
    spec: RequestSpec, cap: Capacity, slack: int, data: st.DataObject
) -> None:
    led = Ledger(cap, slack_tokens=slack)
    req = Request("r", spec, BATCH, 0.0, Counters())
    boundary = data.draw(st.integers(1, spec.hard_max))
    blocks = led.grant_blocks(req, boundary)
    assert blocks == blocks_for(spec.prompt_tokens + boundary + slack, cap.block_size)
    covered = led.covered_boundary(req, blocks)
    # whole blocks cover at least what was asked, never more than the hard max
    assert boundary <= covered <= spec.hard_max
    assert led.grant_blocks(req, covered) == blocks


_ABSENT = [(s, t) for s in State for t in Trigger if (s, t) not in TRANSITIONS]
_PRESENT = sorted(TRANSITIONS.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value))


@given(pair=st.sampled_from(_ABSENT))
def test_transitions_absent_from_the_table_raise_and_change_nothing(
    pair: tuple[State, Trigger],
) -> None:
    state, trigger = pair
    led = Ledger(Capacity(8, 4))
    req = Request("r", RequestSpec(4, 8, 64), BATCH, 0.0, Counters())
    req.state = state
    with pytest.raises(InvalidTransition) as info:
        led.transition(req, trigger)
    assert req.state is state
    if state in (State.RELEASED, State.REJECTED):
        assert isinstance(info.value, AlreadyReleased)
    with pytest.raises(InvalidTransition):
        led.check_transition(req, trigger)
    assert req.state is state and led.reserved == 0


def test_transition_table_is_the_only_source_of_moves() -> None:
    assert _ABSENT, "some pairs must be invalid"
    led = Ledger(Capacity(8, 4))
    for (state, trigger), nxt in _PRESENT:
        req = Request("r", RequestSpec(4, 8, 64), BATCH, 0.0, Counters())
        req.state = state
        assert led.transition(req, trigger) is nxt
        assert req.state is nxt
    # terminal states accept nothing
    for terminal in (State.RELEASED, State.REJECTED):
        assert not any(s is terminal for s, _ in TRANSITIONS)


def _queued(tenant: str, i: int) -> Request:
    spec = RequestSpec(4, 8, 64, service_class="batch", tenant=tenant)
    return Request(f"{tenant}-{i}", spec, BATCH, 0.0, Counters())


@given(
    weights=st.dictionaries(
        st.sampled_from(["a", "b", "c", "d"]), st.integers(1, 10), min_size=1, max_size=4
    ),
    pops=st.integers(1, 200),
)
def test_stride_queue_is_weighted_fair(weights: dict[str, int], pops: int) -> None:
    q = _ClassQueue()
    for tenant, w in weights.items():
        for i in range(pops):
            q.push(_queued(tenant, i), float(w))
    served = dict.fromkeys(weights, 0)
    for _ in range(pops):
        head = q.head()
        assert head is not None
        q.pop(head)
        served[head.spec.tenant] += 1
        # stride scheduling: normalised service never differs by more than one stride
        for t, wt in weights.items():
            for u, wu in weights.items():
                assert served[t] / wt - served[u] / wu <= max(1 / wt, 1 / wu) + 1e-9
    assert sum(served.values()) == pops


@given(
    first=st.integers(1, 30),
    late=st.integers(1, 30),
)
def test_idle_tenant_banks_no_credit(first: int, late: int) -> None:
    """A tenant that arrives late is served fairly from then on, not for all it missed."""
    q = _ClassQueue()
    for i in range(first + late):
        q.push(_queued("a", i), 1.0)
    for _ in range(first):
        head = q.head()
        assert head is not None
        q.pop(head)
    for i in range(late):
        q.push(_queued("b", i), 1.0)
    served = {"a": 0, "b": 0}
    for _ in range(2 * min(late, 10)):
        head = q.head()
        assert head is not None
        q.pop(head)
        served[head.spec.tenant] += 1
    assert abs(served["a"] - served["b"]) <= 1


@settings(max_examples=30, deadline=None)
@given(items=workloads(max_requests=15))
def test_workload_strategy_is_valid(items: list[object]) -> None:
    from kvbudget.testing import WorkloadItem

    ids = set()
    for it in items:
        assert isinstance(it, WorkloadItem)
        assert 1 <= it.true_length <= it.spec.hard_max
        assert it.spec.prompt_tokens < it.spec.model_max_len
        ids.add(it.request_id)
    assert len(ids) == len(items)


@given(
    weights=st.dictionaries(
        st.sampled_from(["a", "b", "c", "d"]), st.integers(1, 10), min_size=2, max_size=4
    ),
    pops=st.integers(1, 150),
    order=st.randoms(use_true_random=False),
    backfill=st.lists(st.booleans(), min_size=150, max_size=150),
)
def test_backfilling_keeps_the_stride_within_two_strides(
    weights: dict[str, int], pops: int, order: random.Random, backfill: list[bool]
) -> None:
    """Admitting the stride's backfill candidate instead of its head (whenever the scheduler
    would) keeps every backlogged tenant's normalised service within two strides of another's:
    the candidate's tenant is at most one admission ahead, and pays for the admission."""
    q = _ClassQueue()
    arrivals = [(t, i) for t in weights for i in range(pops)]
    order.shuffle(arrivals)
    for k, (tenant, i) in enumerate(arrivals):
        spec = RequestSpec(4, 8, 64, service_class="batch", tenant=tenant)
        q.push(Request(f"{tenant}-{i}", spec, BATCH, float(k), Counters()), float(weights[tenant]))
    served = dict.fromkeys(weights, 0)
    for step in range(pops):
        head = q.head()
        assert head is not None
        pick = q.backfill_candidate(head) if backfill[step] else head
        q.pop(pick, admitted=True)
        served[pick.spec.tenant] += 1
        for t, wt in weights.items():
            for u, wu in weights.items():
                assert served[t] / wt - served[u] / wu <= 2 * max(1 / wt, 1 / wu) + 1e-9


def _preemptions_reached(machine: type[BudgetStateMachine], examples: int) -> tuple[int, int]:
    """(preemptions, preemptions before the request's first token) over ``examples``
    derandomized runs of ``machine``."""
    from hypothesis.stateful import run_state_machine_as_test

    from kvbudget.core import events as ev

    seen = [0, 0]

    class Counting(machine):  # type: ignore[valid-type, misc]
        def _apply(self, actions: Sequence[ev.Action], cause: str, free_before: int) -> None:
            for action in actions:
                if isinstance(action, ev.Preempt):
                    seen[0] += 1
                    seen[1] += action.checkpoint.generated_tokens == 0
            super()._apply(actions, cause, free_before)

    run_state_machine_as_test(
        Counting,
        settings=settings(
            max_examples=examples, stateful_step_count=80, derandomize=True, database=None,
            deadline=None, suppress_health_check=list(HealthCheck),
        ),
    )
    return seen[0], seen[1]


@pytest.mark.parametrize(
    ("policy", "before_first"),
    [("new-token-ratio-retracting", False), ("segmented-short-segments", False),
     ("calibrated", True)],
)
def test_the_stateful_runs_reach_the_preemptions_they_are_there_for(
    policy: str, before_first: bool
) -> None:
    """The variants above exist to exercise a rule (new-token-ratio's retraction, segmented's
    re-queue, calibrated's preemption of a request that has no token yet): a change to the
    harness or the policy that no longer reaches it must fail here, not pass unnoticed."""
    machine = {
        "new-token-ratio-retracting": NTR_RETRACTING,
        "segmented-short-segments": SEGMENTED_SHORT,
    }.get(policy) or BudgetStateMachine.for_policy(policy)
    preempted, early = _preemptions_reached(machine, 60)
    assert preempted > 0
    if before_first:
        assert early > 0
