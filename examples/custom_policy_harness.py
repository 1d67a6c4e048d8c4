"""Run kvbudget's property harness on a custom policy.

    pytest examples/custom_policy_harness.py        # as a test module
    python examples/custom_policy_harness.py        # or directly

``GenerousBatchPolicy`` is a CalibratedPolicy that grants batch work a larger initial allowance
and bigger extensions. The harness plays engine and clients against a Scheduler running it and
checks every invariant of DESIGN §4 after each step.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvbudget.core.ledger import Request
from kvbudget.core.model import Capacity
from kvbudget.core.policy import CalibratedPolicy
from kvbudget.testing import BudgetStateMachine, TrueLength


class GenerousBatchPolicy(CalibratedPolicy):
    """Calibrated, but batch requests start at twice the calibrated allowance."""

    name = "generous-batch"

    def initial_allowance(self, req: Request) -> int:
        base = super().initial_allowance(req)
        if req.cls.protected:
            return base
        return max(1, min(req.remaining, 2 * base))  # never past the hard max

    def extension_tokens(self, req: Request) -> int | None:
        tokens = super().extension_tokens(req)
        if tokens is None or req.cls.protected:
            return tokens
        return min(req.hard_max - req.boundary, 2 * tokens)


def make_policy(true_length: TrueLength) -> GenerousBatchPolicy:
    # the harness passes the true lengths it drew (only an oracle-style policy needs them)
    return GenerousBatchPolicy(headroom_min=0.05, protected_fraction=0.02)


# pytest collects this unittest.TestCase
TestGenerousBatch = BudgetStateMachine.for_policy(make_policy).TestCase
TestGenerousBatch.settings = settings(max_examples=40, stateful_step_count=50, deadline=None)

# the same policy on one fixed, tiny cache with a reserved slack of 2 tokens per grant
TestGenerousBatchTiny = BudgetStateMachine.for_policy(
    make_policy, capacity=Capacity(12, 4), slack_tokens=2, name="generous-tiny"
).TestCase
TestGenerousBatchTiny.settings = settings(max_examples=40, stateful_step_count=50, deadline=None)


if __name__ == "__main__":
    machine = BudgetStateMachine.for_policy(make_policy)
    run_state_machine_as_test(
        machine, settings=settings(max_examples=40, stateful_step_count=50, deadline=None)
    )
    print("generous-batch: every invariant held")
