"""The anyio shell: leases, waking, cancellation, confirmation, the driver, shutdown."""

from __future__ import annotations

import logging
from contextlib import aclosing

import anyio
import attrs
import pytest
import structlog

from _kvb_helpers import quiet_structlog, spec, task_count  # noqa: F401 (autouse fixture)
from kvbudget import (
    BATCH,
    INTERACTIVE,
    AlreadyReleased,
    Budget,
    BudgetClosed,
    Capacity,
    ContinuationRequired,
    EngineDead,
    EngineError,
    EngineStalled,
    GenerationResult,
    HardLimitExceeded,
    InvalidInput,
    InvalidTransition,
    Lease,
    Overloaded,
    PolicyViolation,
    Preempted,
    SchedulerConfig,
    ServiceClass,
)
from kvbudget.core.lengths import LengthModel
from kvbudget.core.lifecycle import Request
from kvbudget.core.policy import BasePolicy
from kvbudget.engines.sim import Faults, SimEngine

pytestmark = pytest.mark.anyio


def short_lengths() -> LengthModel:
    """A length prior with mean 16 tokens: small grants, so boundaries are reached quickly."""
    return LengthModel(prior_tokens=16)


# -- leases -------------------------------------------------------------------------------------


async def test_lease_lifecycle_blocks_return_only_on_confirmation() -> None:
    budget = Budget(Capacity(100, 16))
    async with budget.lease(spec(), request_id="a") as lease:
        assert isinstance(lease, Lease)
        assert lease.request_id == "a" and lease.hard_max == 256
        assert lease.boundary > 0 and lease.remaining_in_grant == lease.boundary
        held = budget.snapshot().reserved_blocks
        assert held == lease.blocks > 0
        for _ in range(5):
            lease.charge()
        lease.charge(3)
        assert lease.generated == 8 and lease.remaining_in_grant == lease.boundary - 8
    snap = budget.snapshot()
    assert snap.reserved_blocks == held and snap.releasing == 1 and snap.active == 0
    assert budget.confirm_release("a") is True
    snap = budget.snapshot()
    assert snap.reserved_blocks == 0 and snap.totals.completed == 1
    assert budget.pending_leases == 0


class _OddFor(BasePolicy):
    """Grants the hard max, but answers a negative lookahead for request 'bad' (asked once it
    is queued, in the admission pass) and raises from ``on_granted`` for request 'loud'."""

    name = "odd-for"

    def lookahead_tokens(self, req: Request) -> int:
        return -1 if req.request_id == "bad" else 0

    def on_granted(self, req: Request) -> None:
        if req.request_id == "loud":
            raise RuntimeError("on_granted bug")


async def test_a_refused_policy_answer_at_arrival_leaves_no_request_behind() -> None:
    """The caller gets the PolicyViolation, and the request the core had queued for it is
    given up: before, it stayed queued with no lease, to be admitted (blocks reserved) for
    nobody once the policy answered again."""
    budget = Budget(Capacity(100, 16), policy=_OddFor())
    with pytest.raises(PolicyViolation, match="lookahead"):
        async with budget.lease(spec(), "bad"):
            pass
    assert "bad" not in budget.scheduler.requests and budget.pending_leases == 0
    assert budget.snapshot().queued == 0 and budget.snapshot().reserved_blocks == 0
    async with budget.lease(spec(), "good") as lease:  # (the next caller is served)
        lease.charge(2)
    assert budget.confirm_release("good") and budget.snapshot().reserved_blocks == 0


class _AdmitBug(BasePolicy):
    name = "admit-bug"

    def admit(self, req: Request, blocks: int) -> bool:
        if req.request_id == "bug":
            raise LookupError("admit bug")
        return True


async def test_a_decision_hook_that_raises_reaches_the_caller_typed_and_leaves_nothing() -> None:
    """Before, the LookupError itself reached ``lease``'s caller, which an application
    catching kvbudget's errors did not expect."""
    budget = Budget(Capacity(100, 16), policy=_AdmitBug())
    async with budget.lease(spec(), "first") as lease:  # (live: the gate is asked for "bug")
        with pytest.raises(PolicyViolation, match="admit raised LookupError") as err:
            async with budget.lease(spec(), "bug"):
                pass
        assert isinstance(err.value.__cause__, LookupError)
        lease.charge(2)
    assert "bug" not in budget.scheduler.requests
    assert budget.confirm_release("first") and budget.snapshot().reserved_blocks == 0
    assert budget.pending_leases == 0 and budget.snapshot().queued == 0


async def test_a_notification_that_raises_is_logged_and_the_lease_goes_on() -> None:
    budget = Budget(Capacity(100, 16), policy=_OddFor())
    with structlog.testing.capture_logs() as logs:
        async with budget.lease(spec(), "loud") as lease:
            lease.charge(2)
    faults = [e for e in logs if e["event"] == "policy_fault"]
    assert len(faults) == 1 and faults[0]["log_level"] == "error"
    assert faults[0]["detail"] == "on_granted for 'loud' raised RuntimeError('on_granted bug')"
    assert budget.snapshot().policy_faults == 1
    assert budget.confirm_release("loud") and budget.snapshot().reserved_blocks == 0


class _Flaky(BasePolicy):
    """Grants the hard max; its headroom answer (asked at the start of every pass) raises
    while ``boom`` is set."""

    name = "flaky"
    boom = False

    def headroom_target(self) -> int:
        if self.boom:
            raise RuntimeError("headroom bug")
        return 0


async def test_a_policy_faulting_in_every_tick_does_not_stop_the_budget() -> None:
    """The ticker used to let a refused (or raising) policy answer out of its pass, and the task
    group then took the budget (and the server around it) down. Now the core keeps the fault and
    goes on; the budget logs ``policy_fault`` at most once a second."""
    policy = _Flaky()
    budget = Budget(Capacity(8, 16), policy=policy, tick_interval=0.01)
    got: list[str] = []

    async def second() -> None:
        async with budget.lease(spec(prompt=16, max_tokens=100), "b") as lease:
            got.append(lease.request_id)
            lease.charge(1)

    with structlog.testing.capture_logs() as logs:
        async with budget, anyio.create_task_group() as tg:
            async with budget.lease(spec(prompt=16, max_tokens=100), "a") as a:
                tg.start_soon(second)
                await anyio.sleep(0.02)
                assert budget.snapshot().queued == 1  # (a holds the whole cache)
                policy.boom = True
                await anyio.sleep(0.1)
                assert budget.snapshot().policy_faults >= 3
                policy.boom = False
                a.charge(1)
            assert budget.confirm_release("a")
            with anyio.fail_after(2):
                while not got:
                    await anyio.sleep(0.01)
            with anyio.fail_after(2):
                while not budget.confirm_release("b"):
                    await anyio.sleep(0.01)
    faults = [e for e in logs if e["event"] == "policy_fault"]
    assert len(faults) == 1
    assert faults[0]["detail"] == "headroom_target raised RuntimeError('headroom bug')"
    # (the first tick's two passes both faulted before it was logged)
    assert faults[0]["new"] == faults[0]["faults"] >= 1 and budget.tick_failures == 0
    assert got == ["b"] and budget.snapshot().reserved_blocks == 0


async def test_a_confirmation_whose_pass_faults_still_returns_the_blocks() -> None:
    """The engine's confirmation is not the policy's business: the blocks come back, the
    confirmation says so (True), and the fault of the pass after it is kept, not raised into
    the adapter's task (which would take the budget's task group down)."""
    policy = _Flaky()
    budget = Budget(Capacity(8, 16), policy=policy)
    async with budget.lease(spec(prompt=16, max_tokens=100), "a") as lease:
        lease.charge(1)
    policy.boom = True
    assert budget.confirm_release("a") is True
    snap = budget.snapshot()
    assert snap.reserved_blocks == 0 and snap.policy_faults == 1


async def test_explicit_finish_and_exception_exit_cancels() -> None:
    budget = Budget(Capacity(100, 16))
    async with budget.lease(spec(), "a") as lease:
        lease.charge(2)
        lease.finish("stop")
        with pytest.raises(InvalidTransition):
            lease.finish("stop")
    with pytest.raises(RuntimeError):
        async with budget.lease(spec(), "b") as lease:
            lease.charge(2)
            raise RuntimeError("client error")
    snap = budget.snapshot()
    assert snap.releasing == 2 and snap.totals.cancelled == 1
    assert budget.confirm_release("a") and budget.confirm_release("b")
    snap = budget.snapshot()
    assert snap.reserved_blocks == 0
    assert snap.totals.completed == 1 and snap.totals.cancelled == 1


async def test_hard_limit() -> None:
    budget = Budget(Capacity(100, 16))
    async with budget.lease(spec(max_tokens=4), "a") as lease:
        lease.charge(4)
        with pytest.raises(HardLimitExceeded) as info:
            lease.charge()
        assert (info.value.request_id, info.value.hard_max, info.value.attempted) == ("a", 4, 5)
        with pytest.raises(HardLimitExceeded):
            await lease.wait_for_grant()
    assert budget.snapshot().releasing == 1  # finished with reason "length"


async def test_overloaded_at_once_with_retry_after() -> None:
    budget = Budget(Capacity(40, 16), config=SchedulerConfig(max_queued=0))
    async with budget.lease(spec(prompt=400, max_tokens=600), "big"):
        with anyio.fail_after(0.5), pytest.raises(Overloaded) as info:
            async with budget.lease(spec(prompt=400, max_tokens=600), "late"):
                pass
        err = info.value
        assert err.retry_after > 0 and err.reason == "queue-full" and err.request_id == "late"
    assert budget.snapshot().totals.rejected == 1


async def test_queued_caller_rejected_by_tick_gets_overloaded() -> None:
    fast = ServiceClass(
        "interactive",
        protected=True,
        preemptible=False,
        max_queue_delay_s=0.1,
        initial_quantile=0.5,
    )
    budget = Budget(Capacity(40, 16), classes=[fast, BATCH], tick_interval=0.01)
    async with budget, budget.lease(spec(prompt=400, max_tokens=600), "big"):
        t0 = anyio.current_time()
        with pytest.raises(Overloaded) as info:
            async with budget.lease(spec(prompt=400, max_tokens=600), "late"):
                pass
        waited = anyio.current_time() - t0
        assert info.value.reason == "queue-timeout" and info.value.retry_after > 0
        assert 0.09 <= waited < 0.5
        assert budget.snapshot().queued == 0


@pytest.mark.parametrize("how", ["lease", "generate"])
async def test_a_queued_callers_bound_runs_from_when_the_server_received_it(how: str) -> None:
    """``received_at`` (on the budget's clock, :meth:`Budget.now`): a caller the server held
    for 0.2 s before it reached the budget waits 0.1 s more of its 0.3 s bound, not 0.3 s."""
    fast = ServiceClass(
        "interactive", protected=True, preemptible=False, max_queue_delay_s=0.3,
        initial_quantile=0.5,
    )
    budget = Budget(Capacity(40, 16), classes=[fast, BATCH], tick_interval=0.01)
    engine = SimEngine()
    async with budget, budget.lease(spec(prompt=400, max_tokens=600), "big"):
        t0 = anyio.current_time()
        with pytest.raises(Overloaded) as info:
            received = budget.now() - 0.2
            big = spec(prompt=400, max_tokens=600)
            if how == "lease":
                async with budget.lease(big, "late", received_at=received):
                    pass
            else:
                steps = budget.generate(engine, big, request_id="late", received_at=received)
                async with aclosing(steps):
                    async for _ in steps:
                        pass
        waited = anyio.current_time() - t0
        assert info.value.reason == "queue-timeout"
        assert 0.08 <= waited < 0.25
        assert budget.snapshot().queued == 0


@pytest.mark.parametrize("received_at", [float("nan"), float("inf"), True, "now", 60.0])
async def test_a_receipt_that_is_not_a_time_before_the_arrival_is_refused_and_leaves_nothing(
    received_at: object,
) -> None:
    budget = Budget(Capacity(40, 16))
    async with budget:
        late = received_at == 60.0
        with pytest.raises(InvalidInput) as info:
            at = budget.now() + 60.0 if late else received_at
            async with budget.lease(spec(), "a", received_at=at):  # type: ignore[arg-type]
                pass
        assert info.value.field == "received_at"
        snap = budget.snapshot()
        assert snap.queued == snap.active == snap.reserved_blocks == 0
        async with budget.lease(spec(), "a", received_at=budget.now()) as lease:
            lease.charge(1)


async def test_cancelled_waiter_leaves_the_queue_at_no_cost() -> None:
    budget = Budget(Capacity(40, 16))
    async with budget.lease(spec(prompt=400, max_tokens=600), "big"):
        before = budget.snapshot()
        with anyio.move_on_after(0.05) as scope:
            async with budget.lease(spec(prompt=400, max_tokens=600), "waiting"):
                pytest.fail("must not be admitted")
        assert scope.cancelled_caught
        after = budget.snapshot()
        assert after.queued == 0 and after.reserved_blocks == before.reserved_blocks
        assert after.totals.cancelled == 1 and budget.pending_leases == 1


async def test_wake_exactly_on_admission_after_confirmation() -> None:
    budget = Budget(Capacity(40, 16))
    order: list[str] = []

    async def second() -> None:
        async with budget.lease(spec(prompt=400, max_tokens=600), "second"):
            order.append("second-admitted")

    async with anyio.create_task_group() as tg:
        async with budget.lease(spec(prompt=400, max_tokens=600), "first"):
            tg.start_soon(second)
            await anyio.sleep(0.02)
            assert budget.snapshot().queued == 1
        await anyio.sleep(0.02)
        assert order == []  # not before the engine confirmed
        order.append("confirm")
        budget.confirm_release("first")
    assert order == ["confirm", "second-admitted"]


async def test_extensions_ahead_of_the_boundary() -> None:
    budget = Budget(Capacity(200, 16), lengths=short_lengths())
    async with budget.lease(spec(max_tokens=2000), "a") as lease:
        first = lease.boundary
        assert first < 100
        for _ in range(first):
            lease.charge()  # asks ahead of the boundary: never has to stop
        assert lease.boundary > first and lease.remaining_in_grant > 0
        ahead = lease.boundary
        await lease.extend()  # room left: returns at once
        assert lease.boundary == ahead
    assert budget.snapshot().totals.extensions >= 1


async def test_wait_for_grant_blocks_until_blocks_come_back() -> None:
    budget = Budget(Capacity(14, 16), lengths=short_lengths())
    hog = await budget.lease(spec(prompt=100, max_tokens=2000), "hog").__aenter__()
    async with budget.lease(spec(max_tokens=2000), "a") as lease:
        while True:  # generate until the grant cannot grow any more
            while lease.remaining_in_grant:
                lease.charge()
            with anyio.move_on_after(0.03) as scope:
                await lease.wait_for_grant()
            if scope.cancelled_caught:
                break
        stuck = lease.boundary
        assert lease.generated == stuck and lease.state == "extending"
        woke: list[int] = []

        async def waiter() -> None:
            await lease.wait_for_grant()
            woke.append(lease.boundary)

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(0.02)
            assert woke == []
            hog.finish()
            await anyio.sleep(0.02)
            assert woke == []  # not before the engine confirms
            budget.confirm_release("hog")
        assert woke and woke[0] > stuck
    assert budget.snapshot().totals.extensions_denied >= 1


async def test_preemption_and_resumption_of_a_lease() -> None:
    budget = Budget(Capacity(24, 16), lengths=short_lengths())
    batch = await budget.lease(spec(prompt=200, max_tokens=300, cls="batch"), "b").__aenter__()
    batch.charge(3)
    resumed: list[int] = []

    async def interactive() -> None:
        async with budget.lease(spec(prompt=200, max_tokens=120), "i") as lease:
            lease.charge(2)
        budget.confirm_release("i")

    async with anyio.create_task_group() as tg:
        tg.start_soon(interactive)
        with anyio.fail_after(5):
            while not batch.preemptions:  # the interactive arrival preempts the batch lease
                await anyio.sleep(0.001)
        with pytest.raises(Preempted) as info:
            batch.charge()
        err = info.value
        # the checkpoint is what was charged when the preemption landed; the 4th token is waste
        assert err.checkpoint.request_id == "b" and err.checkpoint.generated_tokens == 3
        assert err.recompute_tokens == 203 and err.reason.startswith("admit:")
        assert batch.preemptions == 1
        with pytest.raises(Preempted):
            await batch.wait_for_grant()
        assert budget.confirm_release("b", attempt=0)
        ckpt = await batch.wait_resumed()
        resumed.append(ckpt.generated_tokens)
    # the resume checkpoint keeps the token charged after the preemption landed
    assert resumed == [4] and batch.attempt == 1 and batch.resume == ckpt
    assert not budget.confirm_release("b", attempt=0)  # stale: of the first attempt
    batch.charge()
    await batch.__aexit__(None, None, None)
    assert budget.confirm_release("b", attempt=1)
    assert budget.snapshot().reserved_blocks == 0


@pytest.mark.parametrize("waiting", [False, True])
async def test_a_preempted_lease_whose_last_token_came_before_the_preemption_landed_completes(
    waiting: bool,
) -> None:
    # (found by test_budget_stateful.py in CI: confirmed, such a request became a checkpoint
    # with nothing left to generate, and asking its policy for an allowance in [1, 0] raised
    # PolicyViolation out of confirm_release, leaving it checkpointed but in no queue)
    budget = Budget(Capacity(24, 16), lengths=short_lengths())
    batch = await budget.lease(spec(prompt=200, max_tokens=4, cls="batch"), "b").__aenter__()
    batch.charge(3)
    done = anyio.Event()
    told: list[BaseException] = []

    async def interactive() -> None:
        async with budget.lease(spec(prompt=200, max_tokens=120), "i") as lease:
            lease.charge(2)
            await done.wait()
        budget.confirm_release("i")

    async def wait_to_resume() -> None:
        try:
            await batch.wait_resumed()
        except AlreadyReleased as exc:
            told.append(exc)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(interactive)
            while not batch.preemptions:
                await anyio.sleep(0.001)
            with pytest.raises(Preempted):
                batch.charge()  # its 4th and last token, before the preemption landed
            assert budget.scheduler.requests["b"].generated == 4
            if waiting:  # its caller already waits to resume when the engine confirms
                tg.start_soon(wait_to_resume)
                await anyio.sleep(0.01)
            assert budget.confirm_release("b", attempt=0)
            # it finished at its hard max: completed, not a checkpoint with nothing to resume,
            # and a caller waiting to resume (or about to) is told so rather than left waiting
            assert "b" not in budget.scheduler.requests
            if not waiting:
                await wait_to_resume()
            while not told:
                await anyio.sleep(0.001)
            assert told[0].request_id == "b"
            await batch.__aexit__(None, None, None)
            done.set()
    snap = budget.snapshot()
    assert snap.by_class["batch"].completed == 1 and snap.by_class["batch"].failed == 0
    assert snap.queued == 0 and snap.reserved_blocks == 0 and snap.policy_faults == 0
    assert budget.pending_leases == 0


@pytest.mark.parametrize("give_up", ["cancel", "fail", "exit-with-error"])
async def test_a_lease_given_up_while_it_waits_to_resume_is_forgotten(give_up: str) -> None:
    # (the core ends such a request at once and sends no Released for it: the lease used to
    # stay tracked for good, one leaked lease per such caller in a long-running server)
    budget = Budget(Capacity(24, 16), lengths=short_lengths())
    batch = await budget.lease(spec(prompt=200, max_tokens=300, cls="batch"), "b").__aenter__()
    batch.charge(3)
    done = anyio.Event()

    async def interactive() -> None:
        async with budget.lease(spec(prompt=200, max_tokens=120), "i") as lease:
            lease.charge(2)
            await done.wait()
        budget.confirm_release("i")

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(interactive)
            while not batch.preemptions:
                await anyio.sleep(0.001)
            assert budget.confirm_release("b", attempt=0)
            assert budget.scheduler.requests["b"].state.value == "checkpointed"
            assert budget.pending_leases == 2
            if give_up == "cancel":
                batch.cancel()
            elif give_up == "fail":
                batch.fail("the engine went away")
            else:
                await batch.__aexit__(RuntimeError, RuntimeError("caller failed"), None)
            assert budget.pending_leases == 1 and "b" not in budget.scheduler.requests
            done.set()
    assert budget.pending_leases == 0
    snap = budget.snapshot()
    assert snap.queued == 0 and snap.reserved_blocks == 0
    assert not budget.confirm_release("b")  # a late confirmation finds nothing to return
    assert budget.pending_leases == 0


async def test_an_arrived_lease_cancelled_before_it_is_entered_is_forgotten() -> None:
    budget = Budget(Capacity(40, 16))
    async with budget.lease(spec(prompt=400, max_tokens=600), "big"):
        waiting = budget.lease(spec(prompt=400, max_tokens=600), "waiting")
        waiting.arrive()
        assert budget.snapshot().queued == 1 and budget.pending_leases == 2
        waiting.cancel()
        assert budget.snapshot().queued == 0 and budget.pending_leases == 1
    assert budget.confirm_release("big") and budget.pending_leases == 0


async def test_continuation_required() -> None:
    budget = Budget(Capacity(12, 16), lengths=short_lengths())
    async with budget.lease(spec(prompt=120, max_tokens=200, cls="batch"), "hog"), budget.lease(
        spec(prompt=16, max_tokens=500, cls="batch", on_exhausted="continue"), "c"
    ) as lease:
        while lease.remaining_in_grant:
            lease.charge()
        with pytest.raises(ContinuationRequired) as info:
            await lease.wait_for_grant()
        cont = info.value.continuation
        assert cont.request_id == "c" and cont.generated_tokens == lease.generated
        assert cont.remaining_tokens == 500 - lease.generated and cont.continuation_id
    snap = budget.snapshot()
    assert snap.releasing == 2
    budget.confirm_release("c")
    budget.confirm_release("hog")
    assert budget.snapshot().totals.continued == 1


async def test_duplicate_and_unknown_confirmations_are_swallowed_and_counted() -> None:
    budget = Budget(Capacity(100, 16))
    async with budget.lease(spec(), "a") as lease:
        lease.charge()
        assert not budget.confirm_release("a")  # still running: not a stop to confirm
        assert budget.snapshot().reserved_blocks > 0
    assert budget.confirm_release("a")
    assert not budget.confirm_release("a")
    assert not budget.confirm_release("never-seen")
    assert budget.counters.duplicate_confirms == 3
    assert budget.snapshot().reserved_blocks == 0


async def test_structlog_events_carry_request_class_tenant() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    with structlog.testing.capture_logs() as logs:
        budget = Budget(Capacity(100, 16))
        async with budget.lease(spec(tenant="acme"), "a") as lease:
            lease.charge()
        budget.confirm_release("a")
    names = [e["event"] for e in logs]
    assert "admission" in names and "confirmation" in names
    admission = next(e for e in logs if e["event"] == "admission")
    assert admission["request_id"] == "a" and admission["tenant"] == "acme"
    assert admission["service_class"] == "interactive"


# -- the driver ---------------------------------------------------------------------------------


async def collect(budget: Budget, engine: SimEngine, s: object, rid: str) -> list[int]:
    out = []
    async with aclosing(budget.generate(engine, s, request_id=rid)) as steps:  # type: ignore[arg-type]
        async for step in steps:
            out.append(step.generated)
    return out


async def test_generate_runs_to_completion_and_confirms() -> None:
    engine = SimEngine(lengths={"a": 150})
    async with Budget(Capacity(200, 16), lengths=short_lengths()) as budget:
        got = await collect(budget, engine, spec(max_tokens=1000), "a")
        assert got == list(range(1, 151))
        await anyio.sleep(0.05)
        snap = budget.snapshot()
        assert snap.reserved_blocks == 0 and snap.totals.completed == 1
        assert snap.totals.extensions >= 1  # grew through boundaries
        assert budget.engine is engine


class _PayloadEngine(SimEngine):
    """A SimEngine whose every third step carries a payload: (engine request id, tokens so far)."""

    async def _run(self, request_id, prompt, max_tokens, resume):  # type: ignore[no-untyped-def]
        done = resume.generated_tokens if resume is not None else 0
        async with aclosing(super()._run(request_id, prompt, max_tokens, resume)) as steps:
            async for step in steps:
                done += step.new_tokens
                keep = step.finished or done % 3 == 0
                yield attrs.evolve(step, payload=(request_id, done) if keep else None)


async def test_generate_payloads_yields_the_engine_outputs_and_charges_every_step() -> None:
    engine = _PayloadEngine(lengths={"a": 100, "b": 41})
    results: list[GenerationResult] = []
    async with Budget(Capacity(200, 16), lengths=short_lengths()) as budget:
        got = []
        outs = budget.generate_payloads(engine, spec(max_tokens=1000), request_id="a")
        async with aclosing(outs):
            async for out in outs:
                got.append(out)
        # durable, through the budget's own task: the same outputs, and the result to the sink
        durable = []
        async for out in budget.generate_payloads(
            engine, spec(max_tokens=40, durable=True), request_id="b", sink=results.append
        ):
            durable.append(out)
        await anyio.sleep(0.05)
        snap = budget.snapshot()
    want = [("a", n) for n in range(3, 100, 3)] + [("a", 100)]
    assert got == want  # the finishing step's payload last, steps without one skipped
    assert durable == [("b", n) for n in range(3, 40, 3)] + [("b", 40)]
    assert [(r.outcome, r.tokens) for r in results] == [("completed", 40)]
    assert snap.totals.completed == 2 and snap.reserved_blocks == 0
    assert snap.totals.extensions >= 1  # every step was charged: "a" grew through boundaries


async def test_generate_respects_hard_max() -> None:
    engine = SimEngine(lengths={"a": 500})
    async with Budget(Capacity(200, 16)) as budget:
        steps = []
        async for step in budget.generate(engine, spec(max_tokens=40), request_id="a"):
            steps.append(step)
        assert steps[-1].generated == 40 and steps[-1].finished and steps[-1].reason == "length"


async def test_generate_never_pulls_past_the_boundary() -> None:
    """The ledger's grant always covers what the engine holds for a live request."""
    engine = SimEngine(lengths=lambda rid: 300, capacity=Capacity(60, 16))
    violations = []
    async with Budget(engine.capacity, lengths=short_lengths(), engine=engine) as budget:

        async def watch() -> None:
            while True:
                await anyio.sleep(0.001)
                used = engine.kv_used_blocks() or 0
                if used > budget.snapshot().reserved_blocks:
                    violations.append(used)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            async with anyio.create_task_group() as inner:
                for i in range(8):
                    inner.start_soon(collect, budget, engine, spec(max_tokens=400, cls="batch"),
                                     f"r{i}")
            tg.cancel_scope.cancel()
    assert violations == [] and engine.overflows == 0


async def test_generate_preempts_and_resumes_batch_work() -> None:
    engine = SimEngine(lengths=lambda rid: 120 if rid.startswith("b") else 20)
    results: dict[str, list[int]] = {}
    async with Budget(Capacity(30, 16), lengths=short_lengths(), engine=engine) as budget:

        async def run(rid: str, cls: str) -> None:
            results[rid] = await collect(budget, engine, spec(prompt=100, max_tokens=200, cls=cls),
                                         rid)

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(run, f"b{i}", "batch")
            await anyio.sleep(0.02)
            for i in range(3):
                tg.start_soon(run, f"i{i}", "interactive")
        await anyio.sleep(0.05)
        snap = budget.snapshot()
        assert snap.totals.preemptions >= 1, snap.totals
        assert snap.reserved_blocks == 0 and snap.totals.completed == 6
    for rid, got in results.items():
        want = 120 if rid.startswith("b") else 20
        assert got[-1] == want and got == sorted(got)


async def test_generate_overloaded_and_continuation_reach_the_caller() -> None:
    engine = SimEngine(lengths=lambda rid: 400)
    async with Budget(Capacity(12, 16), lengths=short_lengths(), engine=engine,
                      config=SchedulerConfig(max_queued=0)) as budget:
        s = spec(prompt=16, max_tokens=500, cls="batch", on_exhausted="continue")
        with pytest.raises(ContinuationRequired) as info:
            await collect(budget, engine, s, "c")
        assert info.value.continuation.request_id == "c"
        await anyio.sleep(0.05)  # the engine confirms the stop of "c"
        assert budget.snapshot().reserved_blocks == 0
        async with budget.lease(spec(prompt=150, max_tokens=10), "hog"):
            with pytest.raises(Overloaded):
                await collect(budget, engine, spec(prompt=60, max_tokens=100), "x")
        budget.confirm_release("hog")
        await anyio.sleep(0.05)
        snap = budget.snapshot()
        assert snap.totals.continued == 1 and snap.totals.rejected == 1
        assert snap.reserved_blocks == 0


async def test_caller_cancellation_aborts_engine_and_holds_blocks_until_confirmed() -> None:
    engine = SimEngine(lengths={"a": 10_000},
                       faults=Faults(release_delay_p=1.0, release_delay_s=0.15))
    async with Budget(Capacity(200, 16), engine=engine) as budget:
        with anyio.move_on_after(0.05):
            await collect(budget, engine, spec(max_tokens=5000), "a")
        snap = budget.snapshot()
        assert snap.active == 0 and snap.releasing == 1 and snap.reserved_blocks > 0
        assert snap.totals.cancelled == 1 and engine.aborted == 1
        assert engine.kv_used_blocks() > 0
        await anyio.sleep(0.3)
        assert engine.kv_used_blocks() == 0
        assert budget.snapshot().reserved_blocks == 0


async def test_durable_request_survives_its_caller() -> None:
    engine = SimEngine(lengths={"d": 200})
    results: list[GenerationResult] = []

    async def async_sink(result: GenerationResult) -> None:
        await anyio.sleep(0)
        results.append(result)

    async with Budget(Capacity(200, 16), lengths=short_lengths()) as budget:
        seen = 0
        # the caller leaves (cancelled) once it has seen a few tokens: a deadline of 30 ms
        # here failed on a busy machine before the first token came
        with anyio.CancelScope() as caller:
            async for step in budget.generate(engine, spec(max_tokens=1000, durable=True),
                                              request_id="d", sink=async_sink):
                seen = step.generated
                if seen >= 5:
                    caller.cancel()
        assert caller.cancelled_caught and 0 < seen < 200
    # the budget drained: the durable request finished in its task group
    assert len(results) == 1
    res = results[0]
    assert res.request_id == "d" and res.outcome == "completed" and res.tokens == 200
    assert res.error is None
    assert budget.snapshot().reserved_blocks == 0 and budget.snapshot().totals.completed == 1


async def test_sink_for_non_durable_failure() -> None:
    engine = SimEngine(lengths={"a": 100}, faults=Faults(error_p=1.0))
    results: list[GenerationResult] = []
    async with Budget(Capacity(200, 16)) as budget:
        with pytest.raises(EngineError):
            async for _ in budget.generate(engine, spec(), request_id="a", sink=results.append):
                pass
    assert results[0].outcome == "failed" and isinstance(results[0].error, EngineError)


async def test_engine_error_mid_stream() -> None:
    engine = SimEngine(lengths={"a": 100}, faults=Faults(error_p=0.2), seed=3)
    async with Budget(Capacity(200, 16), engine=engine) as budget:
        with pytest.raises(EngineError) as info:
            await collect(budget, engine, spec(), "a")
        assert info.value.request_id == "a" and info.value.detail
        assert not isinstance(info.value, EngineDead | EngineStalled)
        await anyio.sleep(0.05)
        snap = budget.snapshot()
        assert snap.totals.failed == 1 and snap.reserved_blocks == 0  # the engine freed it
        assert budget.counters.engine_errors == 1


async def test_engine_death_frees_nothing() -> None:
    engine = SimEngine(lengths=lambda rid: 100, faults=Faults(die_after_steps=30))
    errors: list[BaseException] = []
    async with Budget(Capacity(200, 16), engine=engine, confirm_timeout=0.05) as budget:

        async def run(rid: str) -> None:
            try:
                await collect(budget, engine, spec(), rid)
            except EngineDead as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(run, f"r{i}")
        await anyio.sleep(0.15)
        snap = budget.snapshot()
        assert len(errors) == 4 and all(e.request_id for e in errors)
        assert snap.totals.failed == 4
        assert snap.reserved_blocks > 0 and snap.releasing == 4  # the engine never freed them
        assert budget.counters.confirm_timeouts == 4


async def test_engine_stall() -> None:
    engine = SimEngine(lengths={"a": 100}, faults=Faults(stall_p=0.05, stall_s=5.0), seed=1)
    async with Budget(Capacity(200, 16), engine=engine, stall_timeout=0.1) as budget:
        t0 = anyio.current_time()
        with pytest.raises(EngineStalled) as info:
            await collect(budget, engine, spec(), "a")
        assert anyio.current_time() - t0 < 2.0
        assert info.value.request_id == "a" and "0.1" in info.value.detail
        await anyio.sleep(0.05)
        assert budget.snapshot().totals.failed == 1
        assert budget.snapshot().reserved_blocks == 0


async def test_lost_confirmation_is_reconciled_against_engine_usage() -> None:
    engine = SimEngine(lengths=lambda rid: 30, faults=Faults(lost_confirm_p=1.0))
    config = SchedulerConfig(confirm_timeout_s=0.05)
    async with Budget(Capacity(200, 16), engine=engine, config=config,
                      confirm_timeout=0.05, tick_interval=0.01) as budget:
        await collect(budget, engine, spec(), "a")
        assert budget.snapshot().reserved_blocks > 0  # not confirmed: still charged
        await anyio.sleep(0.3)
        snap = budget.snapshot()
        assert snap.reserved_blocks == 0 and snap.totals.unconfirmed == 1
        assert snap.totals.reconciled == 1 and budget.counters.confirm_timeouts == 1


async def test_reconciliation_never_frees_what_the_engine_holds() -> None:
    """An unconfirmed stop whose KV the engine still holds is not released by reconciliation."""
    engine = SimEngine(lengths=lambda rid: 10_000,
                       faults=Faults(release_delay_p=1.0, release_delay_s=0.5))
    config = SchedulerConfig(confirm_timeout_s=0.03)
    async with Budget(Capacity(200, 16), engine=engine, config=config,
                      confirm_timeout=0.03, tick_interval=0.01) as budget:
        with anyio.move_on_after(0.03):
            await collect(budget, engine, spec(max_tokens=5000), "a")
        await anyio.sleep(0.2)
        snap = budget.snapshot()
        assert snap.totals.unconfirmed == 1 and snap.reserved_blocks > 0
        assert engine.kv_used_blocks() > 0
        await anyio.sleep(0.5)
        assert budget.snapshot().reserved_blocks == 0


# -- the budget's own lifecycle -----------------------------------------------------------------


async def test_shutdown_cancel_mode_and_closed_budget() -> None:
    engine = SimEngine(lengths={"d": 100_000})
    results: list[GenerationResult] = []
    budget = Budget(Capacity(200, 16), shutdown="cancel")
    before = task_count()
    async with budget, anyio.create_task_group() as tg:

        async def caller() -> None:
            async for _ in budget.generate(engine, spec(max_tokens=50_000, durable=True),
                                           request_id="d", sink=results.append):
                break

        tg.start_soon(caller)
    assert task_count() == before
    assert results and results[0].outcome == "cancelled"
    assert budget.closed
    with pytest.raises(BudgetClosed):
        budget.generate(engine, spec())
    with pytest.raises(BudgetClosed):
        async with budget.lease(spec()):
            pass


async def test_queued_callers_get_budget_closed_at_shutdown() -> None:
    budget = Budget(Capacity(40, 16))
    got: list[BaseException] = []

    async def waiter() -> None:
        try:
            async with budget.lease(spec(prompt=400, max_tokens=600), "w"):
                pass
        except BudgetClosed as exc:
            got.append(exc)

    async with anyio.create_task_group() as tg, budget:
        hog = await budget.lease(spec(prompt=400, max_tokens=600), "hog").__aenter__()
        tg.start_soon(waiter)
        await anyio.sleep(0.02)
    assert len(got) == 1 and budget.snapshot().queued == 0
    await hog.__aexit__(None, None, None)


async def test_interactive_class_constants_are_used() -> None:
    assert INTERACTIVE.protected and not INTERACTIVE.preemptible
