"""Calibrated's tight grants (``CalibratedPolicy.tight_floor_steps``): a grant made the vLLM way
(a pause is cheap) reaches the end of the block its next token goes in, grows one block at a
time and asks a pause's confirmation ahead, where the engine's steps are short against the
stream's latency floor; elsewhere it holds a block ahead and grows two at a time. Hand-worked
cases on a 32-token block."""

from __future__ import annotations

import pytest

from kvbudget.core import events as ev
from kvbudget.core.config import SchedulerConfig
from kvbudget.core.cost import CostModel, StepTimeModel
from kvbudget.core.lifecycle import Request
from kvbudget.core.model import Capacity, RequestSpec
from kvbudget.core.policy import CalibratedPolicy
from kvbudget.core.scheduler import Scheduler
from kvbudget.errors import InvalidInput

BLOCK = 32


def engine(step_s: float, *, slack: int = 0, policy: CalibratedPolicy | None = None) -> Scheduler:
    """A scheduler over an engine whose decode step takes ``step_s`` and whose prefills the
    cost model has measured (a pause is cheap), as ``BudgetedEngine``'s start-up probes leave
    it; ``slack``: the tokens the ledger charges past every boundary (the vLLM adapter's 4)."""
    policy = policy if policy is not None else CalibratedPolicy()
    step = StepTimeModel(
        fixed_s=step_s, per_seq_s=0.0, per_context_token_s=0.0, prefill_per_token_s=1e-5
    )
    s = Scheduler(
        Capacity(256, BLOCK), policy=policy, cost=CostModel(step),
        config=SchedulerConfig(slack_tokens=slack),
    )
    for _ in range(policy.min_prefill_observations):
        s.cost.observe_prefill(512, 0.005)
    return s


def spec(prompt: int = 500, service_class: str = "interactive") -> RequestSpec:
    return RequestSpec(
        prompt_tokens=prompt, max_tokens=1000, model_max_len=4096, service_class=service_class
    )


def admitted(s: Scheduler, req_spec: RequestSpec) -> tuple[CalibratedPolicy, Request]:
    """The policy of ``s`` and request "a", admitted at once."""
    assert any(isinstance(x, ev.Admit) for x in s.arrive("a", req_spec, 0.0))
    assert isinstance(s.policy, CalibratedPolicy)
    return s.policy, s.requests["a"]


def test_short_steps_grant_to_the_end_of_the_next_tokens_block() -> None:
    # 4 ms steps under the interactive 200 ms floor: 50 steps, at least the 20 asked for.
    # A 500-token prompt: its next token (the 501st) goes in block 16 (tokens 481-512), so the
    # grant covers 12 tokens, where a grant a block ahead covers 12 + 32 = 44
    s = engine(0.004)
    policy, a = admitted(s, spec())
    assert policy.cheap_to_pause(a) and policy._tight(a)
    assert a.boundary == 12 and a.blocks == 16
    # before a confirmation was measured it asks a block ahead: at once
    assert a.ask_at == 1
    out = s.charge("a", 1, 0.01)
    assert any(isinstance(x, ev.Extend) for x in out)
    assert a.boundary == 12 + BLOCK  # one block at a time
    # with the slack the adapter charges past every boundary, the same block ends 4 tokens
    # earlier for the grant
    _, a4 = admitted(engine(0.004, slack=4), spec())
    assert a4.boundary == 8 and a4.blocks == 16


def test_the_tight_lookahead_is_a_pauses_confirmation_and_two_steps() -> None:
    s = engine(0.004)
    policy, a = admitted(s, spec())
    assert policy.lookahead_tokens(a) == BLOCK  # nothing confirmed yet
    s.confirm_seconds = 0.01
    # 10 ms of confirmation at 4 ms a step: 3 tokens, and 2 more for the reader
    assert s.step_seconds() == pytest.approx(0.004)
    assert policy.lookahead_tokens(a) == 5
    s.confirm_seconds = 10.0  # a slow engine: never more than a block
    assert policy.lookahead_tokens(a) == BLOCK


@pytest.mark.parametrize(
    ("step_s", "service_class", "floor_steps"),
    [
        (0.02, "interactive", 20),  # 10 steps of 20 ms under the 200 ms floor: too few
        (0.004, "batch", 20),  # no latency floor
        (0.004, "interactive", None),  # turned off
    ],
)
def test_elsewhere_a_grant_holds_the_next_block_as_well(
    step_s: float, service_class: str, floor_steps: int | None
) -> None:
    s = engine(step_s, policy=CalibratedPolicy(tight_floor_steps=floor_steps))
    policy, a = admitted(s, spec(service_class=service_class))
    assert policy.cheap_to_pause(a) and not policy._tight(a)
    assert a.boundary == 12 + BLOCK
    assert policy.lookahead_tokens(a) == BLOCK
    assert a.ask_at == a.boundary - BLOCK
    assert policy.extension_tokens(a) == 2 * BLOCK


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_tight_floor_steps_is_checked(bad: object) -> None:
    with pytest.raises(InvalidInput):
        CalibratedPolicy(tight_floor_steps=bad)  # type: ignore[arg-type]
