"""The shell's bookkeeping under every order of caller, engine and clock events (hypothesis
stateful): a lease is tracked exactly while its core request is not over, every core request
has its lease, and once every caller has ended and the engine has confirmed every stop, nothing
is left tracked, held or queued.

The machine drives :class:`kvbudget.Budget` itself, with a manual clock and no task group:
its synchronous calls directly, and each awaitable one (entering a lease, waiting for a grant,
waiting to resume) in its own short event loop that gives it up at once if it would wait, as
a caller's timeout would. The core's stateful machine (:mod:`kvbudget.testing`) checks the
ledger's invariants; this one checks what the shell adds on top: the leases."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from _kvb_helpers import quiet_structlog, spec  # noqa: F401 (autouse fixture)
from kvbudget import Budget, Capacity, Lease
from kvbudget.core.lengths import LengthModel
from kvbudget.core.lifecycle import TERMINAL_STATES
from kvbudget.errors import KvBudgetError, PolicyViolation


def _briefly(call: Callable[[], Awaitable[Any]]) -> None:
    """Run one awaitable call of the shell's; if it would wait, the caller gives up at once."""

    async def attempt() -> None:
        with anyio.move_on_after(0):
            await call()

    try:
        anyio.run(attempt)
    except PolicyViolation:
        raise
    except KvBudgetError:
        pass  # a typed outcome for this caller (Preempted, Overloaded, ...): it is noted


def _typed(call: Callable[[], object]) -> None:
    try:
        call()
    except PolicyViolation:
        raise
    except KvBudgetError:
        pass


class LeaseMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        # small, so that grants end, admissions wait and interactive arrivals preempt batch
        self.budget = Budget(
            Capacity(24, 16), lengths=LengthModel(prior_tokens=16), clock=lambda: self.now
        )
        self.leases: list[Lease] = []

    # -- callers -----------------------------------------------------------------------------

    @rule(
        interactive=st.booleans(),
        prompt=st.integers(1, 300),
        max_tokens=st.integers(1, 400),
        continue_when_exhausted=st.booleans(),
        received_ago=st.sampled_from([None, 0.0, 1.0, 3.0, -1.0]),
    )
    def arrive(
        self,
        interactive: bool,
        prompt: int,
        max_tokens: int,
        continue_when_exhausted: bool,
        received_ago: float | None,
    ) -> None:
        # received by the server before it arrives (its bounds run from then), or, -1.0, a
        # receipt after the arrival: InvalidInput, and the lease must hold nothing
        lease = self.budget.lease(
            spec(
                prompt=prompt,
                max_tokens=max_tokens,
                cls="interactive" if interactive else "batch",
                on_exhausted="continue" if continue_when_exhausted else "extend",
            ),
            f"r{len(self.leases)}",
            received_at=None if received_ago is None else self.now - received_ago,
        )
        self.leases.append(lease)
        _typed(lease.arrive)

    def _pick(self, data: st.DataObject) -> Lease:
        return data.draw(st.sampled_from(self.leases))

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def enter(self, data: st.DataObject) -> None:
        lease = self._pick(data)
        if lease._arrived and not lease._ended and lease._handed < 0:
            _briefly(lease.__aenter__)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def wait_resumed(self, data: st.DataObject) -> None:
        lease = self._pick(data)
        if lease.checkpoint is not None and not lease._ended:
            _briefly(lease.wait_resumed)

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), tokens=st.integers(1, 24))
    def generate(self, data: st.DataObject, tokens: int) -> None:
        lease = self._pick(data)
        if lease._handed >= 0 and not lease._ended:
            _typed(lambda: lease.charge(max(1, min(tokens, lease.remaining_in_grant))))

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def wait_for_grant(self, data: st.DataObject) -> None:
        lease = self._pick(data)
        if lease._handed >= 0 and not lease._ended:
            _briefly(lease.wait_for_grant)

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), how=st.sampled_from(["finish", "cancel", "fail", "exit-with-error"]))
    def end(self, data: st.DataObject, how: str) -> None:
        lease = self._pick(data)
        if not lease._arrived:
            return
        if how == "finish":
            if lease._handed >= 0 and not lease._ended:
                _typed(lease.finish)
        elif how == "cancel":
            _typed(lease.cancel)
        elif how == "fail":
            _typed(lambda: lease.fail("the engine failed it"))
        else:
            _briefly(lambda: lease.__aexit__(RuntimeError, RuntimeError("caller failed"), None))

    # -- the engine and the clock --------------------------------------------------------------

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), attempt=st.sampled_from(["current", "earlier", "unsaid"]))
    def confirm(self, data: st.DataObject, attempt: str) -> None:
        lease = self._pick(data)
        said = {"current": lease.attempt, "earlier": lease.attempt - 1, "unsaid": None}[attempt]
        self.budget.confirm_release(lease.request_id, attempt=said)

    @rule(seconds=st.floats(0.001, 3.0))
    def tick(self, seconds: float) -> None:
        self.now += seconds
        self.budget._apply(self.budget.scheduler.tick(self.now))

    # -- what must hold ------------------------------------------------------------------------

    @invariant()
    def a_lease_is_tracked_exactly_while_its_request_is_not_over(self) -> None:
        tracked = set(self.budget._leases)
        live = {
            lease.request_id
            for lease in self.leases
            if lease._req is not None and lease._req.state not in TERMINAL_STATES
        }
        assert tracked == live
        assert set(self.budget.scheduler.requests) <= tracked

    def teardown(self) -> None:
        budget = self.budget
        for lease in self.leases:
            if lease._arrived:
                _typed(lease.cancel)
        for lease in self.leases:
            budget.confirm_release(lease.request_id)
        self.now += 1.0
        budget._apply(budget.scheduler.tick(self.now))
        snap = budget.snapshot()
        assert budget.pending_leases == 0
        assert snap.reserved_blocks == 0 and snap.queued == 0 and snap.active == 0
        assert snap.policy_faults == 0, budget.scheduler.policy_fault_log
        t = snap.totals
        assert t.completed + t.cancelled + t.rejected + t.failed + t.continued == t.arrived


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
