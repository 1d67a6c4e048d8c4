"""The state machine: the engine and the clients, played against a Scheduler.

This module owns :class:`BudgetStateMachine` (its rules, the replay of the actions the scheduler
returns, the teardown that drives every request to its end) and :func:`fingerprint` (everything
observable about a scheduler, to assert that an error changed nothing). Its record of each
request is a :class:`~kvbudget.testing.shadow.Shadow`; the checks of DESIGN §4 it runs live in
:mod:`kvbudget.testing.invariants`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvbudget.core import events as ev
from kvbudget.core.config import SchedulerConfig
from kvbudget.core.lengths import LengthModel
from kvbudget.core.model import (
    DEFAULT_CLASSES,
    Capacity,
    RequestSpec,
    ServiceClass,
    blocks_for,
    class_table,
)
from kvbudget.core.resume import Checkpoint
from kvbudget.core.scheduler import Scheduler
from kvbudget.errors import (
    AlreadyReleased,
    DuplicateRequest,
    GrantExceeded,
    HardLimitExceeded,
    InvalidInput,
    InvalidTransition,
    UnknownClass,
    UnknownRequest,
)
from kvbudget.testing import invariants as inv
from kvbudget.testing.shadow import Shadow
from kvbudget.testing.strategies import (
    NamedPolicyFactory,
    PolicyFactory,
    capacities,
    policy_factory,
    prefix_chain,
    request_specs,
    true_lengths,
)

__all__ = ["BudgetStateMachine", "Shadow", "fingerprint"]


def fingerprint(s: Scheduler) -> tuple[Any, ...]:
    """Everything observable about a scheduler's state (to assert that an error changed nothing)."""
    led = s.ledger
    reqs = tuple(
        sorted(
            (
                r.request_id,
                r.state.value,
                r.generated,
                r.boundary,
                r.blocks,
                r.used_blocks,
                r.ext_pending,
                r.unconfirmed,
                r.outcome,
            )
            for r in s.requests.values()
        )
    )
    snap = s.snapshot()
    return (
        led.reserved,
        led.used,
        led.headroom_target,
        led.protected_blocks,
        s.active,
        s.releasing,
        s.preempting,
        s.queued(),
        reqs,
        snap.totals,
        tuple(sorted(s._waiting_ext)),
        s.prefill_backlog,
        s.first_token_prefill_rate(),
    )


_TICKS = (0.01, 0.1, 0.5, 1.2, 2.5, 10.0, 700.0)


class BudgetStateMachine(RuleBasedStateMachine):
    """The engine and the clients, played against a Scheduler, with DESIGN §4 checked each step.

    Use :meth:`for_policy` to get a subclass for one policy factory; its ``TestCase`` attribute
    is a ``unittest.TestCase`` that pytest collects.
    """

    policy_factory: ClassVar[PolicyFactory] = NamedPolicyFactory("calibrated")
    fixed_capacity: ClassVar[Capacity | None] = None
    fixed_slack: ClassVar[int | None] = None
    classes: ClassVar[tuple[ServiceClass, ...]] = DEFAULT_CLASSES
    confirm_timeout_s: ClassVar[float] = 1.0
    #: every request runs to its hard max (its true length): the pressure that makes a policy
    #: which admits against a discounted future (new-token-ratio) retract, which short answers
    #: drawn at random rarely build up
    long_outputs: ClassVar[bool] = False
    drain_rounds: ClassVar[int] = 5000

    @classmethod
    def for_policy(
        cls,
        factory: PolicyFactory | str,
        *,
        capacity: Capacity | None = None,
        slack_tokens: int | None = None,
        classes: Iterable[ServiceClass] | None = None,
        name: str | None = None,
        long_outputs: bool = False,
    ) -> type[BudgetStateMachine]:
        """A state-machine class running ``factory``'s policy (a shipped policy's name works).

        ``capacity``: fixed KV cache (drawn per run when None). ``slack_tokens``: the scheduler's
        per-grant slack (drawn in [0, 4] when None). ``classes``: the service classes (the
        defaults, interactive and batch, when None). ``long_outputs``: every request runs to
        its hard max.
        """
        fac: PolicyFactory = policy_factory(factory) if isinstance(factory, str) else factory
        table = (
            tuple(class_table(tuple(classes)).values())
            if classes is not None
            else (DEFAULT_CLASSES)
        )
        label = name or (
            factory if isinstance(factory, str) else getattr(factory, "name", "custom")
        )
        attrs_: dict[str, Any] = {
            "policy_factory": staticmethod(fac),
            "fixed_capacity": capacity,
            "fixed_slack": slack_tokens,
            "classes": table,
            "long_outputs": long_outputs,
        }
        safe = "".join(ch if ch.isalnum() else "_" for ch in str(label))
        return type(f"BudgetStateMachine_{safe}", (cls,), attrs_)

    # -- set-up -------------------------------------------------------------------------------

    def __init__(self) -> None:
        super().__init__()
        self.s: Scheduler | None = None
        self.shadows: dict[str, Shadow] = {}
        self.now = 0.0
        self.last_tick = 0.0
        self.slack = 0
        self.seq = 0
        self.stale: dict[tuple[str, int], int] = {}  # engine KV of stopped instances (own)
        self.stale_prefix: dict[tuple[str, int], tuple[int, ...]] = {}  # and its shared blocks
        self.holders: dict[int, int] = {}  # prefix hash -> shadows holding a grant that name it
        self.delayed: list[tuple[str, int]] = []
        self.lost: set[tuple[str, int]] = set()
        self.n_admits = 0
        self.n_preempts = 0
        self.n_rejects = 0
        self.n_first_tokens = 0  # callers' own first tokens under an objective, received
        self._ok = True

    @property
    def sched(self) -> Scheduler:
        assert self.s is not None
        return self.s

    def _true_length(self, rid: str) -> int | None:
        sh = self.shadows.get(rid)
        return None if sh is None else sh.true_len

    @initialize(
        capacity=capacities(),
        slack=st.integers(0, 4),
        prior=st.sampled_from([8, 32, 128]),
        min_samples=st.sampled_from([2, 8]),
        max_active=st.one_of(st.none(), st.integers(1, 8)),
    )
    def setup(
        self, capacity: Capacity, slack: int, prior: int, min_samples: int, max_active: int | None
    ) -> None:
        cap = self.fixed_capacity or capacity
        self.slack = self.fixed_slack if self.fixed_slack is not None else slack
        policy = type(self).policy_factory(self._true_length)
        self.s = Scheduler(
            cap,
            classes=self.classes,
            policy=policy,
            lengths=LengthModel(prior_tokens=prior, min_samples=min_samples),
            config=SchedulerConfig(
                slack_tokens=self.slack,
                max_active=max_active,
                confirm_timeout_s=self.confirm_timeout_s,
            ),
        )
        self.protected_low = 0
        refresh = self.s._refresh_headroom

        def refresh_noting_the_least() -> None:
            refresh()
            self.protected_low = min(self.protected_low, self.sched.ledger.protected_blocks)

        self.s._refresh_headroom = refresh_noting_the_least  # type: ignore[method-assign]

    # -- helpers ------------------------------------------------------------------------------

    def _pick(
        self, i: int, phases: tuple[str, ...], pred: Callable[[Shadow], bool] | None = None
    ) -> Shadow | None:
        cands = [
            sh for sh in self.shadows.values() if sh.phase in phases and (pred is None or pred(sh))
        ]
        return cands[i % len(cands)] if cands else None

    def _has(self, phases: tuple[str, ...], pred: Callable[[Shadow], bool] | None = None) -> bool:
        return any(
            sh.phase in phases and (pred is None or pred(sh)) for sh in self.shadows.values()
        )

    def _expect_error(
        self,
        kinds: type[BaseException] | tuple[type[BaseException], ...],
        call: Callable[[], object],
    ) -> BaseException:
        before = fingerprint(self.sched)
        try:
            call()
        except kinds as e:
            after = fingerprint(self.sched)
            assert before == after, f"{type(e).__name__} changed the scheduler state"
            return e
        raise AssertionError(f"expected {kinds}, nothing was raised")

    def _engine_used(self) -> int:
        """The engine's KV: each running or not yet freed instance's own blocks, and every
        prompt block any of them names, once (the engine's prefix cache shares it)."""
        bs = self.sched.capacity.block_size
        running = 0
        prefix: set[int] = set()
        for sh in self.shadows.values():
            if sh.phase == "running":
                running += blocks_for(sh.spec.prompt_tokens + sh.generated, bs) - len(sh.prefix)
                prefix.update(sh.prefix)
        for p in self.stale_prefix.values():
            prefix.update(p)
        return running + sum(self.stale.values()) + len(prefix)

    def _free(self) -> int:
        """Free blocks by the harness's own count (shared prompt blocks once)."""
        held = [sh for sh in self.shadows.values() if sh.blocks]
        return self.sched.capacity.blocks - inv.charged_blocks(held)

    def _stop(self, sh: Shadow, kind: str) -> None:
        """The engine stopped running ``sh`` (its KV stays until the engine frees it)."""
        assert sh.phase == "running", (sh.rid, sh.phase, kind)
        sh.phase = "stopped"
        sh.stop_kind = kind
        sh.stop_clock = self.now
        sh.unconfirmed = False
        sh.instance += 1
        key = (sh.rid, sh.instance)
        self.stale[key] = blocks_for(
            sh.spec.prompt_tokens + sh.generated, self.sched.capacity.block_size
        ) - len(sh.prefix)
        self.stale_prefix[key] = sh.prefix

    def _end(self, sh: Shadow, how: str) -> None:
        sh.ends.append(how)
        assert len(sh.ends) == 1, f"{sh.rid} ended more than once: {sh.ends} (inv. 6)"

    def _apply(self, actions: Sequence[ev.Action], cause: str, free_before: int) -> None:
        """Check and carry out the actions of one call, replaying free blocks as they go."""
        s = self.sched
        cap = s.capacity
        free = free_before
        for a in actions:
            sh = self.shadows.get(a.request_id)
            assert sh is not None, f"action for a request the harness never sent: {a!r}"
            sh.actions.append(type(a).__name__)
            hard = sh.spec.hard_max
            prompt = sh.spec.prompt_tokens
            if isinstance(a, ev.Admit):
                assert sh.phase in ("queued", "checkpointed"), (a, sh.phase)
                if sh.phase == "checkpointed":
                    assert a.resume == Checkpoint(sh.rid, prompt, sh.generated), (a, sh.generated)
                else:
                    assert a.resume is None, a
                assert sh.generated < a.boundary <= hard, (a, sh.generated, hard)
                assert a.blocks == blocks_for(prompt + a.boundary + self.slack, cap.block_size), a
                # prompt blocks another holder is charged for are not taken again (inv. 8)
                reused = sum(1 for h in sh.prefix if h in self.holders)
                free -= a.blocks - reused
                for h in sh.prefix:
                    self.holders[h] = self.holders.get(h, 0) + 1
                sh.shared_at_grant = reused
                inv.grant_fits(a, free)
                inv.protected_headroom_kept(sh, a, free, self.protected_low)
                sh.phase = "running"
                sh.boundary = a.boundary
                sh.blocks = a.blocks
                sh.admitted = True
                self.n_admits += 1
            elif isinstance(a, ev.Extend):
                assert sh.phase == "running", (a, sh.phase)
                assert sh.boundary < a.boundary <= hard, (a, sh.boundary, hard)
                assert a.blocks == blocks_for(prompt + a.boundary + self.slack, cap.block_size), a
                assert a.blocks >= sh.blocks, a
                free -= a.blocks - sh.blocks
                inv.grant_fits(a, free)
                inv.protected_headroom_kept(sh, a, free, self.protected_low)
                sh.boundary = a.boundary
                sh.blocks = a.blocks
            elif isinstance(a, ev.Deny):
                assert sh.phase == "running", (a, sh.phase)
            elif isinstance(a, ev.Reject):
                assert a.retry_after > 0 and math.isfinite(a.retry_after), a
                assert sh.blocks == 0, (a, sh.blocks)
                if sh.phase == "queued":
                    sh.phase = "rejected"
                    self.n_rejects += 1
                else:
                    assert sh.phase == "checkpointed", (a, sh.phase)
                    sh.phase = "ended"
                    self._end(sh, "failed")
            elif isinstance(a, ev.Preempt):
                assert sh.phase == "running", (a, sh.phase)
                expect = Checkpoint(sh.rid, prompt, sh.generated)
                assert a.checkpoint == expect, f"{a!r}: checkpoint must be {expect!r} (inv. 6)"
                assert a.recompute_tokens == prompt + sh.generated, a
                assert a.deadline == sh.deadline_at, (a, sh.deadline_at)
                self._stop(sh, "preempt")
                sh.preempt_checkpoint = a.checkpoint
                self.n_preempts += 1
            elif isinstance(a, ev.Abort):
                assert sh.phase == "running", (a, sh.phase)
                if a.reason == "cancelled":
                    assert cause == f"cancel:{sh.rid}", (a, cause)
                    self._stop(sh, "cancel")
                    self._end(sh, "cancelled")
                else:
                    self._stop(sh, "abort")
                    self._end(sh, "failed")
            elif isinstance(a, ev.Continue):
                assert sh.phase == "running", (a, sh.phase)
                assert sh.spec.on_exhausted == "continue", (
                    f"{a!r} for {sh.rid}, which did not allow a continuation (inv. 6)"
                )
                c = a.continuation
                assert (c.prompt_tokens, c.generated_tokens, c.remaining_tokens) == (
                    prompt,
                    sh.generated,
                    hard - sh.generated,
                ), a
                assert sh.generated < sh.true_len, f"{a!r}: the request had finished by itself"
                self._stop(sh, "continue")
                self._end(sh, "continued")
            elif isinstance(a, ev.Released):
                assert cause.startswith(("confirm", "reconcile")), (
                    f"{a!r} released blocks without a confirmation ({cause}) (inv. 4)"
                )
                assert sh.phase == "stopped", f"{a!r} for a request that is {sh.phase} (inv. 4/6)"
                if cause.startswith("confirm"):
                    assert cause == f"confirm:{sh.rid}", (a, cause)
                    assert (sh.rid, sh.instance) not in self.stale, (
                        f"{a!r}: the engine still holds it"
                    )
                else:
                    assert sh.unconfirmed, f"{a!r}: reconciled before its confirm timeout"
                    assert (sh.rid, sh.instance) not in self.stale, (
                        f"{a!r}: reconciled while the engine still holds its KV (inv. 4)"
                    )
                # its own blocks, and the prompt blocks no other holder names (inv. 8)
                last = sum(1 for h in sh.prefix if self.holders[h] == 1)
                assert a.blocks == sh.own_blocks + last, (
                    f"{a!r} returns {a.blocks} blocks; {sh.rid} holds {sh.own_blocks} of its "
                    f"own and is the last holder of {last} prompt blocks (inv. 8)"
                )
                for h in sh.prefix:
                    self.holders[h] -= 1
                    if not self.holders[h]:
                        del self.holders[h]
                free += a.blocks
                sh.blocks = 0
                sh.prefix = sh.spec.prefix_blocks
                sh.shared_at_grant = 0
                if sh.preempted_to_resume and sh.generated >= hard:
                    # its last token came before the preemption landed: it finished
                    assert a.outcome == "completed" and not a.resumable, a
                    self._end(sh, "completed")
                    sh.phase = "ended"
                elif sh.preempted_to_resume:
                    assert a.outcome == "preempted" and a.resumable, a
                    sh.phase = "checkpointed"
                else:
                    assert a.outcome == sh.end and not a.resumable, (a, sh.end)
                    sh.phase = "ended"
            else:  # pragma: no cover - every action type is handled above
                raise AssertionError(f"unknown action {a!r}")

    def _call(self, cause: str, fn: Callable[[], Sequence[ev.Action]]) -> None:
        free_before = self._start_call()
        self._apply(fn(), cause, free_before)

    def _start_call(self) -> int:
        """The free blocks before a call to the scheduler, whose actions :meth:`_apply` checks;
        the protected part's low-water mark starts over from its size now."""
        led = self.sched.ledger
        self.protected_low = led.protected_blocks
        return led.free

    def _rule(self) -> None:
        self._ok = False

    # -- rules: arrivals ---------------------------------------------------------------------

    @rule(data=st.data())
    def arrive(self, data: st.DataObject) -> None:
        self._rule()
        self._draw_arrival(data)

    @rule(data=st.data(), n=st.integers(2, 6))
    def arrive_wave(self, data: st.DataObject, n: int) -> None:
        """``n`` callers at the same instant: the pressure of a burst, which single arrivals
        drawn among every other rule rarely build (retraction under new-token-ratio, a wave of
        first tokens, victims that have not produced a token yet)."""
        self._rule()
        for _ in range(n):
            self._draw_arrival(data)

    def _draw_arrival(self, data: st.DataObject) -> None:
        names = [c.name for c in self.classes]
        spec = data.draw(request_specs(names), label="spec")
        # a few "system prompts": requests of one chain share its leading blocks (inv. 8)
        room = spec.prompt_tokens // self.sched.capacity.block_size
        if room and data.draw(st.booleans(), label="shares"):
            chain = data.draw(st.integers(1, 3), label="chain")
            k = data.draw(st.integers(0, room), label="prefix_blocks")
            spec = attrs.evolve(spec, prefix_blocks=prefix_chain(chain, k))
        true_len = (
            spec.hard_max
            if self.long_outputs
            else data.draw(true_lengths(spec.hard_max), label="true_len")
        )
        # a server that received it a while before it reached the budget: its bounds and
        # deadline run from then (the tick's check below reads them from the receipt)
        ago = data.draw(st.sampled_from([None, None, 0.0, 0.05, 0.5, 1.5]), label="received_ago")
        self._arrive(spec, true_len, None if ago is None else self.now - ago)

    def _arrive(self, spec: RequestSpec, true_len: int, received_at: float | None = None) -> str:
        s = self.sched
        self.seq += 1
        rid = f"r{self.seq}"
        cls = class_table(self.classes)[spec.service_class]
        deadline = spec.deadline if spec.deadline is not None else cls.default_deadline_s
        since = self.now if received_at is None else received_at
        sh = Shadow(rid, spec, cls, true_len, since, None if deadline is None else since + deadline)
        self.shadows[rid] = sh
        free_before = self._start_call()
        actions = s.arrive(rid, spec, self.now, received_at=received_at)
        for a in actions:
            if isinstance(a, ev.Reject) and a.request_id == rid:
                assert rid not in s.requests
        self._apply(actions, f"arrive:{rid}", free_before)
        return rid

    @rule(
        kind=st.sampled_from(
            [
                "duplicate", "unknown-class", "no-room", "bad-field", "not-a-spec", "bad-id",
                "bad-receipt",
            ]
        ),
        data=st.data(),
    )
    def arrive_invalid(self, kind: str, data: st.DataObject) -> None:
        self._rule()
        s = self.sched
        good = RequestSpec(8, 8, 64)
        if kind == "duplicate":
            if not self.shadows:
                return
            rid = data.draw(st.sampled_from(sorted(self.shadows)))
            self._expect_error(
                (DuplicateRequest, AlreadyReleased), lambda: s.arrive(rid, good, self.now)
            )
        elif kind == "unknown-class":
            spec = RequestSpec(8, 8, 64, service_class="no-such-class")
            e = self._expect_error(UnknownClass, lambda: s.arrive("x-bad", spec, self.now))
            assert isinstance(e, UnknownClass) and e.name == "no-such-class"
        elif kind == "no-room":
            # invariant 2: a prompt that leaves no room is refused at construction
            mml = data.draw(st.integers(1, 64))
            prompt = data.draw(st.integers(mml, mml + 64))
            try:
                RequestSpec(prompt, 16, mml)
            except InvalidInput as e:
                assert e.field == "prompt_tokens", e
            else:
                raise AssertionError("a spec with no room under model_max_len was accepted")
        elif kind == "bad-field":
            field, value = data.draw(
                st.sampled_from(
                    [
                        ("prompt_tokens", 0),
                        ("prompt_tokens", -3),
                        ("prompt_tokens", 2.5),
                        ("prompt_tokens", True),
                        ("max_tokens", 0),
                        ("max_tokens", float("nan")),
                        ("model_max_len", 0),
                        ("on_exhausted", "truncate"),
                        ("deadline", float("inf")),
                        ("deadline", -1.0),
                        ("service_class", ""),
                    ]
                )
            )
            kwargs: dict[str, Any] = {"prompt_tokens": 8, "max_tokens": 8, "model_max_len": 64}
            kwargs[field] = value
            try:
                RequestSpec(**kwargs)
            except InvalidInput as e:
                assert e.field == field, (e.field, field)
                assert e.expected, e
            else:
                raise AssertionError(f"RequestSpec accepted {field}={value!r}")
        elif kind == "bad-receipt":
            # received later than it arrives, or not a time: refused, nothing changed
            at = data.draw(st.sampled_from([self.now + 0.5, float("nan"), float("-inf")]))
            refused = self._expect_error(
                InvalidInput, lambda: s.arrive("x-bad", good, self.now, received_at=at)
            )
            assert isinstance(refused, InvalidInput) and refused.field == "received_at", refused
        elif kind == "not-a-spec":
            self._expect_error(InvalidInput, lambda: s.arrive("x-bad", "spec", self.now))  # type: ignore[arg-type]
        else:
            self._expect_error(InvalidInput, lambda: s.arrive("", good, self.now))

    # -- rules: the engine runs requests ------------------------------------------------------

    def _gen_limit(self, sh: Shadow) -> int:
        return min(sh.true_len, sh.boundary + self.slack, sh.spec.hard_max)

    @precondition(
        lambda self: self._has(("running",), lambda sh: sh.generated < self._gen_limit(sh))
    )
    @rule(i=st.integers(0, 1000), n=st.integers(1, 40), into_slack=st.booleans())
    def generate(self, i: int, n: int, into_slack: bool) -> None:
        self._rule()
        sh = self._pick(i, ("running",), lambda sh: sh.generated < self._gen_limit(sh))
        assert sh is not None
        limit = self._gen_limit(sh)
        if not into_slack:
            limit = max(min(limit, sh.boundary), sh.generated + 1)
        n = min(n, limit - sh.generated)
        rid = sh.rid

        def go() -> Sequence[ev.Action]:
            out = self.sched.charge(rid, n, self.now)
            self._received(sh, n)
            return list(out)

        self._call(f"charge:{rid}", go)

    def _received(self, sh: Shadow, n: int) -> None:
        """``n`` tokens the caller receives came for ``sh`` (the first: its first token)."""
        if not sh.generated and sh.cls.ttft_slo_s is not None:
            self.n_first_tokens += 1
        sh.generated += n

    def _writes_after_stop(self, sh: Shadow) -> bool:
        """Is ``sh`` stopped with tokens still in flight: the engine holds its KV yet and may
        write up to what it would have written running?"""
        return (sh.rid, sh.instance) in self.stale and sh.generated < self._gen_limit(sh)

    @precondition(lambda self: self._has(("stopped",), self._writes_after_stop))
    @rule(i=st.integers(0, 1000), n=st.integers(1, 8))
    def generate_after_stop(self, i: int, n: int) -> None:
        """Tokens the engine made after the stop was sent (nobody receives them; a preempted
        request's checkpoint keeps them), its hard max included: one whose last token comes
        before its preemption lands finished (its confirmation ends it as completed)."""
        self._rule()
        sh = self._pick(i, ("stopped",), self._writes_after_stop)
        assert sh is not None
        n = min(n, self._gen_limit(sh) - sh.generated)
        rid = sh.rid

        def go() -> Sequence[ev.Action]:
            out = self.sched.charge(rid, n, self.now)
            if sh.preempted_to_resume:  # (kept in the checkpoint)
                self._received(sh, n)
            else:
                sh.generated += n  # (nobody receives them)
            key = (rid, sh.instance)  # (the engine holds the blocks the tokens opened)
            self.stale[key] = blocks_for(
                sh.spec.prompt_tokens + sh.generated, self.sched.capacity.block_size
            ) - len(self.stale_prefix[key])
            return list(out)

        self._call(f"charge-after-stop:{rid}", go)

    @precondition(lambda self: self._has(("running",)))
    @rule(
        i=st.integers(0, 1000),
        kind=st.sampled_from(["hard", "grant", "zero", "neg", "bool", "float"]),
    )
    def overcharge(self, i: int, kind: str) -> None:
        self._rule()
        sh = self._pick(i, ("running",))
        assert sh is not None
        s = self.sched
        rid = sh.rid
        hard_room = sh.spec.hard_max - sh.generated
        grant_room = sh.boundary + self.slack - sh.generated
        if kind == "hard":
            e = self._expect_error(
                HardLimitExceeded, lambda: s.charge(rid, hard_room + 1, self.now)
            )
            assert isinstance(e, HardLimitExceeded) and e.hard_max == sh.spec.hard_max
        elif kind == "grant":
            if grant_room + 1 > hard_room:
                self._expect_error(
                    HardLimitExceeded, lambda: s.charge(rid, grant_room + 1, self.now)
                )
            else:
                e = self._expect_error(
                    GrantExceeded, lambda: s.charge(rid, grant_room + 1, self.now)
                )
                assert isinstance(e, GrantExceeded) and e.boundary == sh.boundary
        else:
            bad: Any = {"zero": 0, "neg": -1, "bool": True, "float": 1.0}[kind]
            e = self._expect_error(InvalidInput, lambda: s.charge(rid, bad, self.now))
            assert isinstance(e, InvalidInput) and e.field == "tokens"

    def _wants_more(self, sh: Shadow) -> bool:
        return (
            sh.generated >= sh.boundary
            and sh.generated < sh.true_len
            and sh.generated < sh.spec.hard_max
        )

    @precondition(lambda self: self._has(("running",), self._wants_more))
    @rule(i=st.integers(0, 1000))
    def reach_boundary(self, i: int) -> None:
        self._rule()
        sh = self._pick(i, ("running",), self._wants_more)
        assert sh is not None
        self._call(f"boundary:{sh.rid}", lambda: self.sched.boundary_reached(sh.rid, self.now))

    @precondition(lambda self: self._has(("running",), lambda sh: sh.generated == sh.true_len))
    @rule(i=st.integers(0, 1000), length=st.booleans())
    def finish(self, i: int, length: bool) -> None:
        self._rule()
        sh = self._pick(i, ("running",), lambda sh: sh.generated == sh.true_len)
        assert sh is not None
        reason = "length" if length and sh.generated == sh.spec.hard_max else "stop"
        rid = sh.rid

        def go() -> Sequence[ev.Action]:
            out = self.sched.finish(rid, reason, self.now)
            self._stop(sh, "finish")
            self._end(sh, "completed")
            return out

        self._call(f"finish:{rid}", go)

    @precondition(lambda self: self._has(("running",), lambda sh: sh.generated < sh.spec.hard_max))
    @rule(i=st.integers(0, 1000), reason=st.sampled_from(["length", "bogus", ""]))
    def finish_invalid(self, i: int, reason: str) -> None:
        self._rule()
        sh = self._pick(i, ("running",), lambda sh: sh.generated < sh.spec.hard_max)
        assert sh is not None
        e = self._expect_error(InvalidInput, lambda: self.sched.finish(sh.rid, reason, self.now))
        assert isinstance(e, InvalidInput) and e.field == "reason"

    @precondition(lambda self: self._has(("queued", "running", "checkpointed", "stopped")))
    @rule(i=st.integers(0, 1000))
    def cancel(self, i: int) -> None:
        self._rule()
        sh = self._pick(i, ("queued", "running", "checkpointed", "stopped"))
        assert sh is not None
        rid = sh.rid
        phase = sh.phase
        s = self.sched
        before = fingerprint(s)
        free_before = self._start_call()
        actions = s.cancel(rid, self.now)
        if phase in ("queued", "checkpointed"):
            assert rid not in s.requests, "a cancelled queued request is still known"
            sh.phase = "ended"
            self._end(sh, "cancelled")
        elif phase == "running":
            assert any(isinstance(a, ev.Abort) and a.request_id == rid for a in actions), (
                "cancelling a running request must abort it in the engine"
            )
        elif sh.preempted_to_resume:
            self._end(sh, "cancelled")  # the checkpoint is abandoned
            assert actions == [] or all(a.request_id != rid for a in actions)
        else:
            assert actions == [] and fingerprint(s) == before, "a second stop changed the state"
        self._apply(actions, f"cancel:{rid}", free_before)

    @precondition(
        lambda self: (
            self._has(("running",))
            or self._has(("stopped",), lambda sh: sh.preempted_to_resume)
        )
    )
    @rule(i=st.integers(0, 1000))
    def engine_fails(self, i: int) -> None:
        self._rule()
        sh = self._pick(
            i,
            ("running", "stopped"),
            lambda sh: sh.phase == "running" or sh.preempted_to_resume,
        )
        assert sh is not None
        rid = sh.rid

        def go() -> Sequence[ev.Action]:
            out = self.sched.fail(rid, "engine error", self.now)
            sh.actions.append("sent:fail")
            if sh.phase == "running":
                self._stop(sh, "fail")
            self._end(sh, "failed")
            return out

        self._call(f"fail:{rid}", go)

    # -- rules: the engine's prefix cache ------------------------------------------------------

    @precondition(lambda self: self._has(("running", "stopped"), lambda sh: sh.shared_at_grant > 0))
    @rule(i=st.integers(0, 1000), data=st.data())
    def engine_cached_less(self, i: int, data: st.DataObject) -> None:
        """The engine found fewer of a request's prompt blocks in its cache than the ledger
        counted as shared (a twin's blocks were not yet allocated): the request holds copies,
        which must be charged to it as far as free blocks allow (inv. 8)."""
        self._rule()
        sh = self._pick(i, ("running", "stopped"), lambda sh: sh.shared_at_grant > 0)
        assert sh is not None
        s = self.sched
        bs = s.capacity.block_size
        cached = data.draw(st.integers(0, sh.shared_at_grant - 1), label="cached_blocks")
        free = self._free()
        copies = 0
        end = cached
        for h in sh.prefix[cached : sh.shared_at_grant]:
            extra = 1 if self.holders[h] > 1 else 0
            if copies + extra > free:
                break
            copies += extra
            end += 1
            self.holders[h] -= 1
            if not self.holders[h]:
                del self.holders[h]
        sh.shared_at_grant = cached + sh.shared_at_grant - end
        sh.prefix = sh.prefix[:cached] + sh.prefix[end:]
        if sh.phase == "stopped":  # the engine's stale instance holds the copies too
            key = (sh.rid, sh.instance)
            if key in self.stale:
                moved = len(self.stale_prefix[key]) - len(sh.prefix)
                self.stale[key] += moved
                self.stale_prefix[key] = sh.prefix
        before = s.snapshot().totals.prefix_mismatches
        s.note_cached(sh.rid, cached * bs + data.draw(st.integers(0, bs - 1), label="partial"))
        assert s.snapshot().totals.prefix_mismatches == before + 1
        assert self._free() == s.ledger.free, (self._free(), s.ledger.free)

    # -- rules: the engine frees KV and confirms ---------------------------------------------

    @precondition(lambda self: bool(self.stale))
    @rule(
        i=st.integers(0, 1000),
        fate=st.sampled_from(["confirm", "confirm", "delay", "lose", "duplicate"]),
    )
    def engine_frees(self, i: int, fate: str) -> None:
        self._rule()
        keys = sorted(self.stale)
        key = keys[i % len(keys)]
        del self.stale[key]
        del self.stale_prefix[key]
        if fate == "delay":
            self.delayed.append(key)
        elif fate == "lose":
            self.lost.add(key)
        else:
            self._deliver(key, twice=fate == "duplicate")

    def _deliver(self, key: tuple[str, int], *, twice: bool = False) -> None:
        rid, instance = key
        sh = self.shadows[rid]
        s = self.sched
        if sh.instance != instance:
            return  # a stale confirmation for an older stop: the engine adapter drops it
        if sh.phase == "stopped":
            self._call(f"confirm:{rid}", lambda: s.confirm_release(rid, self.now))
            assert sh.phase != "stopped", "a confirmation did not release the request (inv. 4)"
        if twice or sh.phase != "stopped":
            # already released (by the confirm above or by reconciliation): must raise
            e = self._expect_error(InvalidTransition, lambda: s.confirm_release(rid, self.now))
            if sh.phase in ("ended", "rejected"):
                assert isinstance(e, AlreadyReleased), e

    @precondition(lambda self: bool(self.delayed))
    @rule(i=st.integers(0, 1000))
    def deliver_delayed(self, i: int) -> None:
        self._rule()
        key = self.delayed.pop(i % len(self.delayed))
        self._deliver(key)

    @precondition(lambda self: not self.delayed)
    @rule()
    def reconcile(self) -> None:
        self._rule()
        used = self._engine_used()
        self._call("reconcile", lambda: self.sched.reconcile(used, self.now))

    def _reconcile_now(self) -> None:
        used = self._engine_used()
        self._call("reconcile", lambda: self.sched.reconcile(used, self.now))

    @rule(kind=st.sampled_from([-1, 1.5, True]))
    def reconcile_invalid(self, kind: Any) -> None:
        self._rule()
        e = self._expect_error(InvalidInput, lambda: self.sched.reconcile(kind, self.now))
        assert isinstance(e, InvalidInput) and e.field == "engine_used_blocks"

    @precondition(lambda self: self._has(("running", "queued")))
    @rule(i=st.integers(0, 1000))
    def confirm_not_stopped(self, i: int) -> None:
        self._rule()
        sh = self._pick(i, ("running", "queued"))
        assert sh is not None
        self._expect_error(InvalidTransition, lambda: self.sched.confirm_release(sh.rid, self.now))

    # -- rules: time, steps, unknown ids ------------------------------------------------------

    @rule(dt=st.sampled_from(_TICKS))
    def tick(self, dt: float) -> None:
        self._rule()
        self.now += dt
        self._tick()

    def _tick(self) -> None:
        s = self.sched
        self._call("tick", lambda: s.tick(self.now))
        self.last_tick = self.now
        for sh in self.shadows.values():
            if sh.phase == "stopped" and self.now - sh.stop_clock > self.confirm_timeout_s:
                sh.unconfirmed = True
        if not s.front:
            return  # an engine's own queue keeps its callers however long they wait
        # queued callers past their bound were turned away
        for sh in self.shadows.values():
            if sh.phase == "queued":
                bounds = [b for b in (sh.cls.max_queue_delay_s,) if b is not None]
                if sh.deadline_at is not None:
                    bounds.append(sh.deadline_at - sh.arrival)
                # (a caller streams were paused for waits to be served: turned away, the
                # pauses and the caller would both be lost)
                assert (
                    not bounds
                    or self.now - sh.arrival <= min(bounds)
                    or s.paused_for(sh.rid)
                ), f"{sh.rid} still queued past its bound after a tick"
            elif sh.phase == "checkpointed" and sh.deadline_at is not None:
                assert self.now <= sh.deadline_at, f"{sh.rid} checkpointed past its deadline"

    @rule(seconds=st.floats(0.0005, 0.3))
    def observe_step(self, seconds: float) -> None:
        self._rule()
        running = [sh for sh in self.shadows.values() if sh.phase == "running"]
        ctx = sum(sh.spec.prompt_tokens + sh.generated for sh in running)
        self._call("step", lambda: self.sched.observe_step(len(running), ctx, seconds, self.now))

    @rule(kind=st.sampled_from(["charge", "finish", "cancel", "confirm", "boundary", "fail"]))
    def unknown_request(self, kind: str) -> None:
        self._rule()
        s = self.sched
        rid = "never-sent"
        calls: dict[str, Callable[[], object]] = {
            "charge": lambda: s.charge(rid, 1, self.now),
            "finish": lambda: s.finish(rid, "stop", self.now),
            "cancel": lambda: s.cancel(rid, self.now),
            "confirm": lambda: s.confirm_release(rid, self.now),
            "boundary": lambda: s.boundary_reached(rid, self.now),
            "fail": lambda: s.fail(rid, "x", self.now),
        }
        e = self._expect_error(UnknownRequest, calls[kind])
        assert isinstance(e, UnknownRequest) and e.request_id == rid

    @precondition(lambda self: self._has(("ended", "rejected")))
    @rule(i=st.integers(0, 1000), kind=st.sampled_from(["charge", "finish", "confirm", "boundary"]))
    def event_after_release(self, i: int, kind: str) -> None:
        self._rule()
        sh = self._pick(i, ("ended", "rejected"), lambda sh: sh.rid not in self.sched.requests)
        if sh is None:
            return
        s, rid = self.sched, sh.rid
        calls: dict[str, Callable[[], object]] = {
            "charge": lambda: s.charge(rid, 1, self.now),
            "finish": lambda: s.finish(rid, "stop", self.now),
            "confirm": lambda: s.confirm_release(rid, self.now),
            "boundary": lambda: s.boundary_reached(rid, self.now),
        }
        self._expect_error(AlreadyReleased, calls[kind])

    # -- the invariants -----------------------------------------------------------------------

    @invariant()
    def invariants_hold(self) -> None:
        if self.s is None:
            return
        self.verify()
        self._ok = True

    def verify(self) -> None:
        """Check DESIGN §4 against the shadow model (see :mod:`kvbudget.testing.invariants`)."""
        s = self.sched
        if s.policy_faults:
            # the core went on without the notification; the policy under test is still wrong
            raise s.policy_fault_log[0]
        snap = s.snapshot()
        shadows = self.shadows.values()
        inv.reserved_within_capacity(s, snap, shadows)  # 1
        inv.core_matches_shadow(
            s,
            snap,
            shadows,
            admitted=self.n_admits,
            preempted=self.n_preempts,
            rejected=self.n_rejects,
            first_tokens=self.n_first_tokens,
        )
        inv.within_hard_max(s, shadows, self.slack)  # 2
        inv.tokens_within_grant(s, shadows, self.slack)  # 3
        inv.stopped_blocks_wait_for_confirmation(s, snap, shadows, self.stale)  # 4
        inv.idle_requests_cost_nothing(s, shadows)  # 7
        inv.shared_blocks_charged_once(s, shadows, self.stale_prefix)  # 8
        inv.prefill_backlog_consistent(s)

    # -- teardown: drive everything to completion ---------------------------------------------

    def teardown(self) -> None:
        if self.s is None or not self._ok:
            return  # a step already failed: do not mask its error
        self.drain()

    def drain(self) -> None:
        """Run every request to its end (engine frees everything, lost confirmations are
        reconciled), then assert that every block is back and every admitted request ended
        exactly once."""
        s = self.sched
        idle = 0
        last: object = None
        for _ in range(self.drain_rounds):
            live = [sh for sh in self.shadows.values() if sh.phase not in ("ended", "rejected")]
            if not live and not self.stale and not self.delayed:
                break
            state = [(sh.rid, sh.phase, sh.generated, sh.boundary) for sh in live]
            if state == last:
                # nothing moved: let time pass (deadlines and queue bounds end waiting work)
                idle += 1
                if idle > 20:
                    break
                self.now += 60.0
            else:
                idle = 0
            last = state
            while self.delayed:
                self._deliver(self.delayed.pop(0))
            for key in sorted(self.stale):
                del self.stale[key]
                del self.stale_prefix[key]
                self._deliver(key)
            if any(sh.phase == "stopped" for sh in self.shadows.values()):
                # confirmations were lost: let them time out, then reconcile
                self.now += self.confirm_timeout_s + 0.5
                self._tick()
                self._reconcile_now()
            self._call("step", lambda: s.observe_step(0, 0, 0.001, self.now))
            for sh in list(self.shadows.values()):
                if sh.phase != "running":
                    continue
                rid = sh.rid
                target = min(sh.true_len, sh.boundary)
                if sh.generated < target:
                    n = target - sh.generated

                    def go(sh: Shadow = sh, n: int = n) -> Sequence[ev.Action]:
                        out = list(s.charge(sh.rid, n, self.now))
                        self._received(sh, n)
                        return out

                    self._call(f"charge:{rid}", go)
                elif sh.generated == sh.true_len:

                    def fin(sh: Shadow = sh) -> Sequence[ev.Action]:
                        out = s.finish(sh.rid, "stop", self.now)
                        self._stop(sh, "finish")
                        self._end(sh, "completed")
                        return out

                    self._call(f"finish:{rid}", fin)
                else:

                    def blocked(rid: str = rid) -> Sequence[ev.Action]:
                        return s.boundary_reached(rid, self.now)

                    self._call(f"boundary:{rid}", blocked)
            self.now += 0.05
            self._tick()
            self.verify()
        stuck = [sh for sh in self.shadows.values() if sh.phase not in ("ended", "rejected")]
        assert not stuck, f"no progress: {len(stuck)} requests never ended: {stuck[:3]}"
        self.verify()
        assert s.ledger.reserved == 0, f"{s.ledger.reserved} blocks still reserved after drain"
        assert s.active == 0 and s.queued() == 0 and s.releasing == 0 and not s.requests
        inv.ended_exactly_once(self.shadows.values())  # 6
