"""A policy whose every answer is drawn at random, within the contract of the Policy hooks:
whatever such a policy decides, the core keeps every invariant of DESIGN §4 (the harness
fails on any broken invariant and on any refused answer). A policy the core has never seen
is what a user plugs in; this one found two faults the shipped policies never reached (a
continuation decided ahead of a boundary for an answer that ended there, and the harness's
check of the protected part across a call's several passes)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import attrs
from hypothesis import settings

from kvbudget.core.lifecycle import Request
from kvbudget.core.model import BATCH, INTERACTIVE, Capacity
from kvbudget.core.policy import BasePolicy
from kvbudget.core.policy.base import Blocked
from kvbudget.testing import BudgetStateMachine, TrueLength


class ChaosPolicy(BasePolicy):
    """Legal answers, drawn from ``rng``: sizes anywhere in their range (the headroom past the
    cache, which the core caps), every blocked decision the request allows, any subset of the
    victims offered, and the optional hooks (acting ahead, pauses for first tokens, a refusal
    at arrival) at random too."""

    name = "chaos"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.requeue_front = rng.random() < 0.5
        self.preempt_for_admission = rng.random() < 0.5

    def headroom_target(self) -> int:
        return self.rng.randint(0, self._s.capacity.blocks + 3)

    def protected_blocks(self) -> int:
        return self.rng.randint(0, self._s.capacity.blocks + 3)

    def initial_allowance(self, req: Request) -> int:
        return self.rng.randint(1, max(1, req.remaining))

    def lookahead_tokens(self, req: Request) -> int:
        return self.rng.choice((0, 0, 1, 3, 17, 200))

    def extension_tokens(self, req: Request) -> int | None:
        room = req.hard_max - req.boundary
        if room < 1 or self.rng.random() < 0.2:
            return None
        return self.rng.randint(1, room)

    def admit(self, req: Request, blocks: int) -> bool:
        return self.rng.random() < 0.7

    def on_blocked(self, req: Request) -> Blocked:
        choices = [Blocked.WAIT, Blocked.PREEMPT_OTHERS, Blocked.PREEMPT_SELF]
        if req.spec.on_exhausted == "continue":
            choices.append(Blocked.CONTINUE)
        return self.rng.choice(choices)

    def choose_victims(
        self, req: Request, need_blocks: int, candidates: Sequence[Request]
    ) -> list[Request]:
        pool = list(candidates)
        self.rng.shuffle(pool)
        return pool[: self.rng.randint(0, len(pool))]

    def acts_ahead(self, req: Request) -> bool:
        return self.rng.random() < 0.3

    def first_token_pause_at(self, req: Request) -> float | None:
        return None if self.rng.random() < 0.5 else self.rng.uniform(0.0, 3.0)

    def gives_way(self, victim: Request, head: Request) -> bool:
        return self.rng.random() < 0.5

    def arrival_refusal(self, req: Request) -> str | None:
        return "chaos" if self.rng.random() < 0.05 else None


def _seeded(seed: int) -> type[BudgetStateMachine]:
    # one fixed seed per machine: the same rules replay the same answers (hypothesis shrinks
    # and replays a failure only when a run is a function of the rules it drew)
    def make(true_length: TrueLength) -> ChaosPolicy:
        return ChaosPolicy(random.Random(seed))

    return BudgetStateMachine.for_policy(make, name=f"chaos-{seed}")


_SETTINGS = settings(max_examples=200, stateful_step_count=60, deadline=None)

TestChaos0 = _seeded(0).TestCase
TestChaos0.settings = _SETTINGS
TestChaos1 = _seeded(1).TestCase
TestChaos1.settings = _SETTINGS
TestChaosTiny = BudgetStateMachine.for_policy(
    lambda true_length: ChaosPolicy(random.Random(2)),
    capacity=Capacity(12, 4),
    slack_tokens=2,
    name="chaos-tiny",
).TestCase
TestChaosTiny.settings = _SETTINGS

# every class preemptible and under a first-token objective: the machine's exact count of the
# callers' own first tokens, through preemptions, resumes and tokens after a stop, for both
# classes (a preemption before the first token is rare here: test_core pins that case by hand)
TestChaosObjectives = BudgetStateMachine.for_policy(
    lambda true_length: ChaosPolicy(random.Random(3)),
    capacity=Capacity(12, 4),
    slack_tokens=2,
    classes=(
        attrs.evolve(INTERACTIVE, preemptible=True),
        attrs.evolve(BATCH, ttft_slo_s=1.0),
    ),
    name="chaos-objectives",
).TestCase
TestChaosObjectives.settings = _SETTINGS
