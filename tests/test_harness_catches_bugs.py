"""The property harness must be able to fail: plant bugs and check that it catches each one.

Every test here runs :class:`kvbudget.testing.BudgetStateMachine` against a deliberately broken
policy or a monkeypatched core and asserts that the run fails with the expected error: the core's
own refusal (:class:`PolicyViolation`) where the core guards the invariant, the harness's shadow
check (:class:`AssertionError`) where the bug slips past the core.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvbudget.core import events as ev
from kvbudget.core.ledger import Ledger, Request, State
from kvbudget.core.model import Capacity
from kvbudget.core.policy import Blocked, CalibratedPolicy, ReserveCurrentPolicy
from kvbudget.core.scheduler import Scheduler
from kvbudget.errors import PolicyViolation
from kvbudget.testing import BudgetStateMachine

FAST = settings(
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    database=None,
    derandomize=True,
    phases=[Phase.generate],  # no shrinking: we only need to know that it fails
    suppress_health_check=list(HealthCheck),
)


def _flatten(e: BaseException) -> list[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        return [x for sub in e.exceptions for x in _flatten(sub)]
    return [e]


def assert_caught(
    machine: type[BudgetStateMachine],
    kinds: tuple[type[BaseException], ...],
    match: Callable[[BaseException], bool] = lambda e: True,
) -> BaseException:
    """Run ``machine`` and return the planted bug's failure (the test fails if none comes)."""
    try:
        run_state_machine_as_test(machine, settings=FAST)
    except BaseException as e:
        found = [x for x in _flatten(e) if isinstance(x, kinds) and match(x)]
        assert found, f"the harness failed, but not with {kinds}: {e!r}"
        return found[0]
    raise AssertionError("the harness did not catch the planted bug")


# -- (a) past the hard max ------------------------------------------------------------------------


class ExtendsPastHardMax(ReserveCurrentPolicy):
    """Extensions of one block more than the room left under the hard max."""

    name = "bug-extends-past-hard-max"

    def extension_tokens(self, req: Request) -> int | None:
        room = req.hard_max - req.boundary
        return room + self.block_size if room > 0 else None


class AllowancePastHardMax(CalibratedPolicy):
    name = "bug-allowance-past-hard-max"

    def initial_allowance(self, req: Request) -> int:
        return req.remaining + 1


def test_catches_extension_past_hard_max() -> None:
    m = BudgetStateMachine.for_policy(lambda _truth: ExtendsPastHardMax())
    e = assert_caught(m, (PolicyViolation,))
    assert "hard max" in str(e)


def test_catches_allowance_past_hard_max() -> None:
    m = BudgetStateMachine.for_policy(lambda _truth: AllowancePastHardMax())
    assert_caught(m, (PolicyViolation,))


def test_catches_ledger_granting_one_block_too_many(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ledger's own math is wrong: only the harness's independent shadow notices."""
    original = Ledger.grant_blocks

    def grant_blocks(self: Ledger, req: Request, boundary: int) -> int:
        return original(self, req, boundary) + 1

    monkeypatch.setattr(Ledger, "grant_blocks", grant_blocks)
    m = BudgetStateMachine.for_policy("reserve-max")
    assert_caught(m, (AssertionError,))


# -- (b) blocks back without confirmation ---------------------------------------------------------


def test_catches_release_at_finish_without_confirmation(monkeypatch: pytest.MonkeyPatch) -> None:
    original = Scheduler.finish

    def finish(self: Scheduler, request_id: str, reason: str, now: float) -> list[ev.Action]:
        actions = original(self, request_id, reason, now)
        req = self.requests.get(request_id)
        if req is not None and req.state is State.RELEASING:
            actions = actions + self._release(req, now, [])  # the bug: no confirmation
        return actions

    monkeypatch.setattr(Scheduler, "finish", finish)
    m = BudgetStateMachine.for_policy("calibrated")
    e = assert_caught(m, (AssertionError,))
    assert "inv. 4" in str(e)


# -- (c) protected headroom to batch --------------------------------------------------------------


class PromotesBatch(CalibratedPolicy):
    """Quietly treats batch requests as protected, so their extensions draw protected headroom."""

    name = "bug-promotes-batch"

    def __init__(self) -> None:
        super().__init__(headroom_min=0.1, protected_fraction=0.1)

    def extension_tokens(self, req: Request) -> int | None:
        if not req.cls.protected:
            req.cls = attrs.evolve(req.cls, protected=True)
        return super().extension_tokens(req)


def test_catches_protected_headroom_given_to_batch() -> None:
    m = BudgetStateMachine.for_policy(lambda _truth: PromotesBatch())
    e = assert_caught(m, (AssertionError,), lambda e: "inv. 5" in str(e))
    assert "protected" in str(e)


def test_catches_extension_rule_ignoring_protected_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        Ledger, "fits_extension", lambda self, blocks, protected: self.free - blocks >= 0
    )
    # (the protected part is kept only while an interactive stream is live: small grant steps on
    # a larger cache make batch extensions meet it while one is, in every run; with 20 blocks
    # and whole-quantile steps only about half the random seeds met it)
    m = BudgetStateMachine.for_policy(
        lambda _truth: CalibratedPolicy(
            headroom_min=0.25, protected_fraction=0.25, grant_step_tokens=4
        ),
        capacity=Capacity(32, 4),
    )
    assert_caught(m, (AssertionError,), lambda e: "inv. 5" in str(e))


# -- (d) a continuation the request did not allow -------------------------------------------------


class AlwaysContinues(ReserveCurrentPolicy):
    name = "bug-always-continues"

    def on_blocked(self, req: Request) -> Blocked:
        return Blocked.CONTINUE


class ForgesConsent(AlwaysContinues):
    """Rewrites the request's spec so that the core's own check passes: only the harness,
    which remembers what the client sent, can tell."""

    name = "bug-forges-consent"

    def on_blocked(self, req: Request) -> Blocked:
        req.spec = attrs.evolve(req.spec, on_exhausted="continue")
        return Blocked.CONTINUE


def test_catches_continuation_not_allowed_core_refuses() -> None:
    m = BudgetStateMachine.for_policy(lambda _truth: AlwaysContinues())
    e = assert_caught(m, (PolicyViolation,))
    assert "silent truncation" in str(e)


def test_catches_continuation_not_allowed_harness_check() -> None:
    m = BudgetStateMachine.for_policy(lambda _truth: ForgesConsent())
    e = assert_caught(m, (AssertionError,), lambda e: "did not allow a continuation" in str(e))
    assert "inv. 6" in str(e)


class LeaveRaises(CalibratedPolicy):
    """A notification that raises: the core goes on without it, the harness must still fail."""

    name = "bug-leave-raises"

    def on_leave(self, req: Request) -> None:
        raise ZeroDivisionError("on_leave bug")


def test_catches_a_notification_that_raises() -> None:
    m = BudgetStateMachine.for_policy(lambda _truth: LeaveRaises())
    e = assert_caught(m, (PolicyViolation,), lambda e: "on_leave" in str(e))
    assert "raised ZeroDivisionError('on_leave bug')" in str(e)


# -- the harness itself: its checks are not vacuous ----------------------------------------------


def _machine() -> BudgetStateMachine:
    m = BudgetStateMachine.for_policy("reserve-max", capacity=Capacity(16, 4), slack_tokens=0)()
    m.setup(Capacity(16, 4), 0, 32, 2, None)
    return m


def test_shadow_detects_a_leaked_block() -> None:
    m = _machine()
    m.verify()
    m.sched.ledger.reserved += 1  # a block the harness never saw granted
    with pytest.raises(AssertionError, match=r"inv\. 1"):
        m.verify()


def test_shadow_detects_a_silently_released_stop() -> None:
    from kvbudget.core.model import RequestSpec

    m = _machine()
    rid = m._arrive(RequestSpec(4, 8, 64, service_class="interactive"), 8)
    sh = m.shadows[rid]
    assert sh.phase == "running"
    m._call(f"charge:{rid}", lambda: list(m.sched.charge(rid, 8, m.now)))
    m._received(sh, 8)
    m._call(f"finish:{rid}", lambda: m.sched.finish(rid, "stop", m.now))
    m._stop(sh, "finish")
    m._end(sh, "completed")
    m.verify()
    req = m.sched.requests[rid]
    m.sched.ledger.release(req)  # blocks back behind the harness's back
    with pytest.raises(AssertionError):
        m.verify()


def test_teardown_drains_to_zero() -> None:
    from kvbudget.core.model import RequestSpec

    m = _machine()
    for n in (3, 8, 20):
        m._arrive(RequestSpec(4, 20, 64, service_class="batch"), n)
    m.drain()
    assert m.sched.ledger.reserved == 0
    assert all(sh.phase in ("ended", "rejected") for sh in m.shadows.values())


# -- (h) shared prompt blocks (invariant 8) -------------------------------------------------------


def _release_shared_with_first_holder(self: Ledger, req: Request) -> int:
    """Planted: the first holder's release returns every prompt block it names, although a
    twin still holds them (a shared block's charge ends while a holder lives)."""
    from kvbudget.core.lifecycle import Trigger, transition

    transition(req, Trigger.CONFIRM)
    freed = req.blocks - len(req.prefix)
    for h in req.prefix:
        if h in self.shared:
            del self.shared[h]
            freed += 1
    self.reserved -= freed
    self.used = max(0, self.used - req.used_blocks)
    req.blocks = 0
    req.used_blocks = 0
    req.shared_at_grant = 0
    return freed


def test_catches_shared_block_released_while_a_holder_lives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(Ledger, "release", _release_shared_with_first_holder)
    e = assert_caught(BudgetStateMachine, (AssertionError,))
    assert "inv." in str(e), e


def test_catches_shared_block_charged_per_holder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: a newcomer's admission is charged its whole prompt, as if nothing were shared;
    the ledger's own books then disagree with the harness's count of what it charges."""
    monkeypatch.setattr(Ledger, "reusable", lambda self, req: 0)
    e = assert_caught(BudgetStateMachine, (AssertionError,))
    assert "inv." in str(e) or "blocks" in str(e), e


def test_shared_prompt_blocks_in_the_harness() -> None:
    """The harness really draws twins: two requests of one chain share their leading blocks,
    the ledger charges them once, and the charge stays until the last holder is released."""
    from kvbudget.core.model import RequestSpec
    from kvbudget.testing.strategies import prefix_chain

    m = _machine()  # 16 blocks of 4 tokens
    a = m._arrive(RequestSpec(12, 4, 64, prefix_blocks=prefix_chain(1, 3)), 4)
    b = m._arrive(RequestSpec(12, 4, 64, prefix_blocks=prefix_chain(1, 3)), 4)
    m.verify()
    led = m.sched.ledger
    assert m.shadows[a].phase == m.shadows[b].phase == "running"
    assert led.shared == {h: 2 for h in prefix_chain(1, 3)}
    own = sum(m.shadows[r].blocks - 3 for r in (a, b))
    assert led.reserved == own + 3
    sh = m.shadows[a]
    m._call(f"charge:{a}", lambda: list(m.sched.charge(a, 4, m.now)))
    m._received(sh, 4)
    m._call(f"finish:{a}", lambda: m.sched.finish(a, "stop", m.now))
    m._stop(sh, "finish")
    m._end(sh, "completed")
    m.engine_frees(0, "confirm")
    m.verify()
    assert led.shared == {h: 1 for h in prefix_chain(1, 3)}  # b still holds them
