"""The scheduler: events in, actions out. It owns the passes; the rules it applies live in the
modules it uses, once each.

Theory of operation
-------------------
A shell calls :meth:`Scheduler.handle` with an event (or the equivalent direct method, which the
hot path uses to avoid allocating an event) and carries out the returned actions. One method per
event: :meth:`arrive`, :meth:`charge` (the O(1) per-token path), :meth:`boundary_reached`,
:meth:`finish`, :meth:`cancel`, :meth:`fail`, :meth:`confirm_release`, :meth:`observe_step`,
:meth:`tick`, :meth:`reconcile`. After anything that may have freed blocks or changed demand,
:meth:`_pump` runs three passes:

1. *extensions* (:meth:`_serve_extensions`): requests that asked to grow (ahead of their
   boundary, or stopped at it) are served first, protected classes first, from free blocks under
   the pool rules of the ledger; a request stopped at its boundary that still cannot grow is
   handed to the policy, which says wait, preempt others (victims chosen by the policy, their
   cost carried in the action), checkpoint itself, or end with a continuation (only if the
   request allowed it);
2. *admissions* (:meth:`_admit`): queue heads in class-priority order and, within a class,
   weighted stride order across tenants (:mod:`~kvbudget.core.queue`); each needs its grant to
   fit the admission budget and to pass the gates (:meth:`_may_admit`: the policy's own, the
   concurrency cap, the latency floor of active streams). A protected head that does not fit
   may take the headroom beyond its protected part, or checkpoint batch work for it at its last
   responsible moment (:meth:`_protected_head_room`);
3. *progress* (:meth:`_ensure_progress`): if requests wait at their boundaries and nothing else
   runs or is being released, the most important grows from what is free, else the least
   important that can resume is checkpointed (no silent truncation, no deadlock).

kvbudget's front -- arrivals turned away when the queue ahead cannot be admitted within their
bound, queue timeouts, the latency-floor gate, class priority and tenant stride -- belongs to
kvbudget's own policies (``BasePolicy.front``). A baseline runs as its engine does: one
first-come-first-served queue, no rejection for overload (:attr:`Scheduler.front`).

Where the rules live: states, transitions and each outcome's bookkeeping in
:mod:`~kvbudget.core.lifecycle`; blocks and pools in :mod:`~kvbudget.core.ledger`; waits,
expiries, retry-after and first-token lateness in :mod:`~kvbudget.core.forecast` (arrivals are
turned away at once when the queue ahead cannot be admitted within their bound); decisions in
the policy (:mod:`~kvbudget.core.policy`), which reads the scheduler through
:class:`~kvbudget.core.view.SchedulerView`; counters in :mod:`~kvbudget.core.stats`.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import accumulate
from typing import TypeVar, TypeVarTuple

from kvbudget.core import events as ev
from kvbudget.core import lifecycle
from kvbudget.core.config import SchedulerConfig
from kvbudget.core.cost import CostModel
from kvbudget.core.forecast import Ahead, Forecast
from kvbudget.core.ledger import Ledger
from kvbudget.core.lengths import LengthModel, UnderestimationReport
from kvbudget.core.lifecycle import (
    HOLDING_STATES,
    LIVE_STATES,
    QUEUED_STATES,
    STOPPING_STATES,
    Outcome,
    Request,
    State,
    Trigger,
)
from kvbudget.core.model import Capacity, RequestSpec, ServiceClass, class_table, lookup_class
from kvbudget.core.policy import BasePolicy, Blocked, Policy, resolve_policy
from kvbudget.core.queue import ClassQueue, Queues
from kvbudget.core.resume import Continuation
from kvbudget.core.stats import Counters, Snapshot, sum_counters
from kvbudget.errors import (
    AlreadyReleased,
    DuplicateRequest,
    GrantExceeded,
    HardLimitExceeded,
    InvalidInput,
    KvBudgetError,
    PolicyViolation,
    UnknownRequest,
)
from kvbudget.validate import check_float, check_int, whole

_Args = TypeVarTuple("_Args")
_R = TypeVar("_R")
_NOTHING: tuple[ev.Action, ...] = ()
_LIVE = LIVE_STATES
# module-level aliases: enum attribute look-ups are slow on the per-token path
_ADMITTED = State.ADMITTED
_RUNNING = State.RUNNING
_EXTENDING = State.EXTENDING
_RELEASING = State.RELEASING
_PREEMPTING = State.PREEMPTING
#: weight of each new inter-token gap in Scheduler.token_gap (about the last 100 tokens)
_GAP_ALPHA = 0.01
#: gaps this long are a wait (at a boundary, for a reader), not the pace: left out of it
_GAP_MAX = 0.25
#: weight of each new confirmation in Scheduler.confirm_seconds (about the last 20 stops)
_CONFIRM_ALPHA = 0.05
#: Scheduler._backfill: an older caller goes before the tenant stride's head where its service
#: with its length at this quantile takes at most this share of the time the head may still wait
BACKFILL_LENGTH_QUANTILE = 0.9
BACKFILL_SLACK_SHARE = 0.5
#: Scheduler._backfill_behind: how many callers behind a head waiting for blocks are looked at
BACKFILL_LOOKAHEAD = 8


class Scheduler:
    """The sans-I/O core. Pass ``now`` in; get actions out."""

    def __init__(
        self,
        capacity: Capacity,
        *,
        classes: Mapping[str, ServiceClass] | Iterable[ServiceClass] | None = None,
        policy: Policy | str | None = None,
        lengths: LengthModel | None = None,
        cost: CostModel | None = None,
        config: SchedulerConfig | None = None,
    ) -> None:
        if not isinstance(capacity, Capacity):
            raise InvalidInput("capacity", capacity, "a kvbudget.Capacity")
        self.capacity = capacity
        self.classes = class_table(
            classes if classes is None or isinstance(classes, Mapping) else tuple(classes)
        )
        self.config = config or SchedulerConfig()
        self.ledger = Ledger(capacity, slack_tokens=self.config.slack_tokens)
        self.lengths = lengths if lengths is not None else LengthModel()
        self.cost = cost if cost is not None else CostModel()
        self.policy: Policy = resolve_policy(policy)
        #: kvbudget's own front (``BasePolicy.front``): overload turn-away, queue timeouts, the
        #: latency-floor gate on admissions and the class/tenant queue order. A baseline runs
        #: without it, as its engine does: one first-come-first-served queue (by class only with
        #: ``class_priority``) and no rejection but "too-large" and the policy's own refusals.
        self.front = bool(getattr(self.policy, "front", True))
        #: the queue, growth and progress orders honour class priority
        self.class_order = self.front or bool(getattr(self.policy, "class_priority", False))
        refusal = getattr(self.policy, "arrival_refusal", None)
        # (BasePolicy's own refuses no one: not asked at every arrival)
        if getattr(refusal, "__func__", None) is BasePolicy.arrival_refusal:
            refusal = None
        self._arrival_refusal = refusal
        self.requests: dict[str, Request] = {}
        self._released: OrderedDict[str, None] = OrderedDict()
        self.queues = Queues(
            self.classes,
            self.config.tenant_weights,
            by_class=self.class_order,
            by_tenant=self.front,
        )
        self._queues = self.queues.by_class  # (the old name, which tests read)
        self.forecast = Forecast(self, self.queues, self.config)
        self._waiting_ext: dict[str, Request] = {}
        #: callers queued on a placeholder wait forecast (no release seen when they came): the
        #: turn-away at arrival judges them again once the releases are measured
        self._placeholder_waits: list[Request] = []
        #: the allowance an arrival was just asked, while nothing has moved since (the queues
        #: were empty, no extension waited): the pass that admits it grants that very answer
        #: rather than asking again (:meth:`_pump_arrival`)
        self._fresh_allowance: tuple[Request, int] | None = None
        # stopped requests awaiting confirmation: they keep tick() from walking every request
        self._stopping: dict[str, Request] = {}
        #: requests holding a live grant (admitted, running or extending), in admission order
        self.live: dict[str, Request] = {}
        #: prompt (and recompute) tokens of admitted requests whose first token has not come yet:
        #: the prefill queued in the engine ahead of the next admission
        self.prefill_backlog = 0
        #: (admitted at, prefill_ahead) of the newest admission that added to the backlog
        self.newest_prefill: tuple[float, int] = (0.0, 0)
        self._seq = 0
        self.active = 0  # requests holding a live grant (admitted/running/extending)
        self.releasing = 0  # requests stopped, blocks held until the engine confirms
        self.preempting = 0  # of those, preempted ones that will resume
        self.drift = 0  # last reconciliation: engine-reported minus ledger-expected blocks
        self.active_context = 0  # prompt + generated over live requests, for the cost model
        #: live requests of protected classes: the protected part of the headroom is kept for
        #: their extensions, so only while there is one (:meth:`_refresh_headroom`)
        self.protected_live = 0
        #: seconds per token between a stream's charges, as the shell sees them (a moving
        #: average; 0 before any): the engine's step plus everything around it
        self.token_gap = 0.0
        #: seconds from a stop to the engine's confirmation of it (a moving average; None
        #: before any): when the blocks of a stop still to be confirmed are due back
        self.confirm_seconds: float | None = None
        self._active_by_floor: dict[float, int] = {}
        #: actions already in effect in the ledger when a pass was cut short by an exception
        #: (a policy's answer refused, or a policy that raised): the next pass returns them
        #: first, so the shell still carries them out (its tick, at the latest)
        self._stranded: list[ev.Action] = []
        #: policy faults the core went on after: notifications (on_granted, on_leave,
        #: on_finished, on_step) that raised, which decide nothing, and answers refused (or
        #: hooks that raised) in the pass after a change already made (:meth:`_pass_after`);
        #: the last few are kept (:attr:`policy_fault_log`) for the shell to report
        self.policy_faults = 0
        self.policy_fault_log: deque[PolicyViolation] = deque(maxlen=16)
        self.now = 0.0
        self.counters: dict[tuple[str, str], Counters] = {}
        #: rejections by reason ("deadline", "queue-timeout", "first-token-late", "too-large", ...)
        self.rejections_by_reason: dict[str, int] = {}
        #: callers turned away after they queued, by what last kept each from admission
        #: (:data:`~kvbudget.core.stats.HELD_BY`): its own cause as its queue's head, else the
        #: cause of the head the last admission pass stopped at; and how many of them were never
        #: their queue's head
        self.turned_away_held_by: dict[str, int] = {}
        self.turned_away_behind = 0
        #: what held the head the last admission pass stopped at (None: it stopped at none)
        self._pass_held_by: str | None = None
        self.policy.bind(self)
        self._refresh_headroom()

    # == the generic entry point ===================================================================

    def handle(self, event: ev.Event) -> list[ev.Action]:
        """Apply one event and return the actions the shell must carry out."""
        if isinstance(event, ev.TokensGenerated):
            return list(self.charge(event.request_id, event.tokens, event.now))
        if isinstance(event, ev.Arrived):
            return self.arrive(event.request_id, event.spec, event.now)
        if isinstance(event, ev.BoundaryReached):
            return self.boundary_reached(event.request_id, event.now)
        if isinstance(event, ev.Finished):
            return self.finish(event.request_id, event.reason, event.now)
        if isinstance(event, ev.CancelRequested):
            return self.cancel(event.request_id, event.now)
        if isinstance(event, ev.Failed):
            return self.fail(event.request_id, event.detail, event.now)
        if isinstance(event, ev.ReleaseConfirmed):
            return self.confirm_release(event.request_id, event.now)
        if isinstance(event, ev.StepObserved):
            return self.observe_step(
                event.batch_size, event.context_tokens, event.seconds, event.now
            )
        if isinstance(event, ev.Tick):
            return self.tick(event.now)
        if isinstance(event, ev.KvUsageReported):
            return self.reconcile(event.used_blocks, event.now)
        raise InvalidInput("event", event, "a kvbudget.core.events event")

    # == lookups ===================================================================================

    def get(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            if request_id in self._released:
                raise AlreadyReleased(request_id, "event")
            raise UnknownRequest(request_id)
        return req

    def _stats(self, cls: str, tenant: str) -> Counters:
        key = (cls, tenant)
        c = self.counters.get(key)
        if c is None:
            c = self.counters[key] = Counters()
        return c

    def _time(self, now: float) -> float:
        if not (now == now and now not in (math.inf, -math.inf)):  # NaN / inf check, cheap
            raise InvalidInput("now", now, "a finite time in seconds")
        if now > self.now:
            self.now = now
        return self.now

    # == arrivals ==================================================================================

    def arrive(
        self, request_id: str, spec: RequestSpec, now: float, *, received_at: float | None = None
    ) -> list[ev.Action]:
        """A new request. Returns its Admit or Reject (or nothing: it waits) plus side actions.

        ``received_at``: when the server received the request, if before ``now`` (a server
        tokenizes and validates a request before it reaches the budget, and under load that
        takes tens of milliseconds). Its first-token objective, queue delay and deadline run
        from then, as its caller's clock does; None: from ``now``. Later than ``now``, or not
        a finite number: InvalidInput.
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidInput("request_id", request_id, "a non-empty string")
        if not isinstance(spec, RequestSpec):
            raise InvalidInput("spec", spec, "a kvbudget.RequestSpec")
        if request_id in self.requests or request_id in self._released:
            raise DuplicateRequest(request_id)
        cls = lookup_class(self.classes, spec.service_class)
        if len(spec.prefix_blocks) * self.capacity.block_size > spec.prompt_tokens:
            raise InvalidInput(
                "prefix_blocks",
                len(spec.prefix_blocks),
                f"at most one hash per full block of the {spec.prompt_tokens}-token prompt "
                f"({spec.prompt_tokens // self.capacity.block_size} at block size "
                f"{self.capacity.block_size})",
            )
        now = self._time(now)
        arrival = (
            now
            if received_at is None
            else check_float("received_at", received_at, minimum=-math.inf, maximum=now)
        )
        stats = self._stats(cls.name, spec.tenant)
        req = Request(request_id, spec, cls, now, stats, arrival)
        allowance = self._allowance(req)  # may raise PolicyViolation: count after it
        grant = self._want_blocks(req, allowance)
        stats.arrived += 1
        self.forecast.note_arrival(req, now)
        if grant > self.ledger.room():
            return [self._reject_new(req, self.config.max_retry_after_s, "too-large")]
        refusal = (
            self._ask(self._arrival_refusal, req) if self._arrival_refusal is not None else None
        )
        if refusal is not None:
            if not isinstance(refusal, str) or not refusal:
                raise PolicyViolation(self.policy.name, f"arrival refusal {refusal!r}: a reason")
            return [self._reject_new(req, self.forecast.retry_after(req), refusal)]
        if not self.front:
            # the engine's own queue: every caller waits its turn (its expiry stays infinite)
            self.requests[request_id] = req
            return self._pump_arrival(req, allowance, now)
        forecast = self.forecast
        queued = self.queues.by_class[cls.name].count
        wait, measured = forecast.wait_estimate(req)
        if queued >= self.config.max_queued and (queued or wait > 0.0):
            # a full queue turns away callers that would wait, not one admitted at once
            return [self._reject_new(req, forecast.retry_after(req), "queue-full")]
        # the service forecast of a deadline only matters to a caller that waits: one admitted
        # at once skips it (it is most of an arrival's cost), one that stays queued gets it below
        req.expiry = forecast.queue_expiry(req, service=wait > 0.0)
        if wait > 0.0:  # (no wait forecast: never turned away, and no forecast to learn from)
            bound = forecast.wait_bound(req, now)
            if self._turned_away(req, wait, bound):
                return [self._reject_new(req, wait, "deadline")]
            if measured and bound is not None:
                req.wait_forecast, req.wait_bound = wait, bound
        self.requests[request_id] = req
        actions = self._pump_arrival(req, allowance, now)
        if not measured and req.state is State.QUEUED and self._first_token_pause_at(req) is None:
            # (a caller streams may be paused for is served by rounds of pauses, which the
            # release forecast does not see: judged again on it, most of a wave they serve
            # would be turned away)
            self._placeholder_waits.append(req)
        if wait <= 0.0 and req.state is State.QUEUED and req.deadline_at is not None:
            req.expiry = forecast.queue_expiry(req)
            self.queues.note_expiry(req)
        return actions

    def _turned_away(
        self, req: Request, wait: float, bound: float | None, ahead: Ahead | None = None
    ) -> bool:
        """The turn-away at arrival: is a caller forecast to wait ``wait`` seconds, who may wait
        ``bound``, told "overloaded" rather than queued (:meth:`Forecast.turns_away`), unless
        pauses for its first token would serve it? ``ahead``: the blocks and callers queued
        ahead of a caller already queued (:meth:`Forecast.deficit`)."""
        forecast = self.forecast
        # (asked of the policy only where a turn-away is possible: most arrivals wait for nothing;
        # a pause frees blocks, and the admission pass stops at the batch cap before weighing
        # one, so none serves a caller the cap holds back)
        pauses = (
            wait > 0.0
            and bound is not None
            and self._first_token_pause_at(req) is not None
            and forecast.slot_deficit(req, ahead) <= 0
        )
        return forecast.turns_away(req, wait, bound, pauses, ahead) and not (
            pauses and self._served_by_pauses(req, ahead)
        )

    def _pump_arrival(self, req: Request, allowance: int, now: float) -> list[ev.Action]:
        """Queue the arrival ``req`` (asked ``allowance``) and run the pass that may admit it.

        Where nothing else is queued and no extension waits, the pass comes to ``req`` first,
        at the same instant, with no grant made or changed since its allowance was asked (only
        the headroom may be resized first, which the allowance does not depend on): it grants
        that answer rather than asking the policy again (the most repeated question of an
        admission; the queue demand and the grant then agree by construction)."""
        if not self._waiting_ext and not self.queues.count():
            self._fresh_allowance = (req, allowance)
        self.queues.push(req)
        try:
            return self._pump(now)
        finally:
            self._fresh_allowance = None

    def _want_blocks(self, req: Request, allowance: int | None = None) -> int:
        """The blocks of ``req``'s next grant (``allowance``: the policy's answer, if already
        asked), which it may never exceed ``room`` by; its queue demand (``req.want_blocks``)
        is what the grant would take now, less the prompt blocks a live twin holds (estimated
        waits are then not inflated by a shared prefix counted once per queued twin)."""
        if allowance is None:
            allowance = self._allowance(req)
        blocks = self.ledger.grant_blocks(req, req.generated + allowance)
        req.want_blocks = blocks - self.ledger.reusable(req) if req.prefix else blocks
        return blocks

    def _allowance(self, req: Request) -> int:
        if not req.spec.resumable:
            # a request the engine cannot resume exactly is never paused: its whole hard max
            return req.remaining
        fresh = self._fresh_allowance
        if fresh is not None:
            self._fresh_allowance = None  # (one use: the first question of the pass is its)
            if fresh[0] is req:
                return fresh[1]
        policy = self.policy
        try:
            answer = policy.initial_allowance(req)
        except KvBudgetError:
            raise
        except Exception as exc:  # (as _ask: see _refused)
            raise self._refused(policy.initial_allowance, exc) from exc
        allowance = whole(answer)
        if allowance is None or allowance < 1 or allowance > req.remaining:
            raise PolicyViolation(
                self.policy.name,
                f"initial allowance for {req.request_id!r} must be in [1, {req.remaining}], "
                f"got {answer!r}",
            )
        return allowance

    def first_token_delay(self, req: Request, extra_tokens: int = 0) -> float:
        """Predicted seconds from admitting ``req`` now to its first token, behind the prefill
        queued in the engine (and ``extra_tokens`` more of it ahead)."""
        return self.forecast.first_token_delay(req, extra_tokens)

    def released_in_time(self, req: Request, blocks: int) -> bool:
        """Would the blocks released at the recent rate admit the queued ``req`` (``blocks``
        wanted beyond what is free past the headroom target) while it may still wait, by its
        queue bound, which leaves room for its prefill under a first-token objective? False
        when it has no such bound, when the bound has passed, and when no release was seen yet
        (no evidence that blocks come back in time)."""
        slack = self.queue_slack(req)
        rate = self.forecast.release_rate(self.now)
        if slack is None or rate <= 0.0 or slack <= 0.0:
            return False
        return self._deficit(blocks) / rate <= slack

    def _deficit(self, blocks: int) -> int:
        """Blocks of ``blocks`` that what is free past the headroom target does not cover."""
        return blocks - (self.ledger.free - self.ledger.headroom_target)

    def queue_slack(self, req: Request) -> float | None:
        """Seconds the queued ``req`` may still wait for admission (None: unbounded)."""
        return self.forecast.wait_bound(req, self.now)

    def first_token_prefill_rate(self) -> float:
        """Prompt tokens per second that callers under a first-token objective brought recently:
        the prefill such callers are expected to queue in the engine (:class:`Forecast`)."""
        return self.forecast.first_token_prefill_rate()

    @property
    def late_first_token_share(self) -> float:
        """Exponential average (~100 first tokens) of how many first tokens missed their
        objective."""
        return self.forecast.late_first_token_share

    def _count_rejection(self, reason: str) -> None:
        self.rejections_by_reason[reason] = self.rejections_by_reason.get(reason, 0) + 1

    def note_engine(
        self,
        request_id: str,
        *,
        pauses: int = 0,
        resubmissions: int = 0,
        reprefill_tokens: int = 0,
        dropped_tokens: int = 0,
    ) -> None:
        """Count what an engine adapter did for a request to keep its grant (pauses at a
        boundary, re-submissions and their re-prefill, tokens dropped past the grant). Decides
        nothing; a request already forgotten is ignored."""
        req = self.requests.get(request_id)
        if req is None:
            return
        c = req.stats
        c.pauses += pauses
        c.resubmissions += resubmissions
        c.reprefill_tokens += reprefill_tokens
        c.dropped_tokens += dropped_tokens

    def _reject_new(self, req: Request, wait: float, reason: str) -> ev.Reject:
        lifecycle.transition(req, Trigger.REJECT)
        lifecycle.settle(req, Outcome.REJECTED)
        self._count_rejection(reason)
        self._remember(req.request_id)
        return ev.Reject(req.request_id, self.forecast.clamp_retry(wait), reason)

    # == the hot path ==============================================================================

    def charge(
        self, request_id: str, tokens: int, now: float
    ) -> tuple[ev.Action, ...] | list[ev.Action]:
        """Book ``tokens`` newly generated tokens. O(1); returns actions only near a boundary."""
        req = self.requests.get(request_id)
        if req is None:
            self.get(request_id)  # raises the right error
        assert req is not None
        if tokens.__class__ is not int or tokens < 1:
            raise InvalidInput("tokens", tokens, "an integer >= 1")
        g = req.generated + tokens
        if g > req.hard_max:
            raise HardLimitExceeded(request_id, req.hard_max, g)
        state = req.state
        ledger = self.ledger
        if g > req.boundary + ledger.slack_tokens and state in HOLDING_STATES:
            raise GrantExceeded(request_id, req.boundary, ledger.slack_tokens, g)
        if state is _RUNNING:
            pass
        elif state is _ADMITTED:
            lifecycle.first_token(req)
            self._first_token_came(req, now)
            req.first_token_at = now
            if req.prefill_pending:
                self._prefill_done(req)
                self.cost.observe_first_token(req.prefill_ahead, max(0.0, now - req.admitted_at))
        elif state is _PREEMPTING:
            # produced before the preemption landed: its checkpoint keeps them and the caller
            # receives them (the first may be the caller's own first token)
            if not req.generated:
                self._first_token_came(req, now)
            req.stats.tokens += tokens
            ledger.charge(req, tokens)
            return _NOTHING
        elif state is _RELEASING:
            req.stats.wasted_tokens += tokens  # produced after the stop: nobody receives them
            ledger.charge(req, tokens)
            return _NOTHING
        elif state is _EXTENDING:
            pass
        else:
            lifecycle.check_transition(req, Trigger.TOKENS)
        last = req.last_token_at
        if last is not None:
            gap = now - last
            if gap > req.latency_floor:
                req.stats.stalls += 1
            elif gap < _GAP_MAX and state is not _ADMITTED:  # (not a resume's re-prefill)
                # (the pace streams see, the shell's overhead included)
                self.token_gap += _GAP_ALPHA * (gap / tokens - self.token_gap)
        req.last_token_at = now
        self.active_context += tokens
        # Ledger.charge, inlined for a live request (this runs once per generated token)
        req.generated = g
        ledger.active_generated += tokens
        used = -(-(req.prompt + g) // ledger.block_size)
        if used != req.used_blocks:
            ledger.used += used - req.used_blocks
            req.used_blocks = used
        req.stats.tokens += tokens
        if (g >= req.ask_at or g > req.boundary) and g < req.hard_max:
            return self._near_boundary(req, now)
        return _NOTHING

    def _first_token_came(self, req: Request, now: float) -> None:
        """A first token of ``req`` at ``now``: counted as the caller's own unless a resumed
        checkpoint's, where its class has a first-token objective."""
        late = req.first_token_past_objective(now)
        if late is not None:
            if not req.generated:
                req.stats.first_tokens += 1
                if late:
                    req.stats.first_tokens_late += 1
            self.forecast.note_first_token(req, late)

    def _near_boundary(self, req: Request, now: float) -> list[ev.Action]:
        # past its boundary (an engine that overshoots, into the reserved slack) a request is
        # not stopped yet: its extension is asked for as near the boundary, and what becomes of
        # it if none comes waits until the engine says it stopped (boundary_reached) or ended
        # (finish) -- the overshooting token may be its last one
        if not req.ext_pending:
            self._want_extension(req)
            actions = self._pump(now)
            if req.ext_pending:
                actions.append(ev.Deny(req.request_id, "no-headroom"))
            return actions
        return []

    def _want_extension(self, req: Request) -> None:
        req.ext_pending = True
        self._waiting_ext[req.request_id] = req
        req.ask_at = req.hard_max + 1  # asked once per boundary

    def boundary_reached(self, request_id: str, now: float) -> list[ev.Action]:
        """The engine stopped at the boundary and the request wants more tokens."""
        req = self.get(request_id)
        now = self._time(now)
        if req.state not in _LIVE:
            lifecycle.check_transition(req, Trigger.BLOCK)
        if req.generated < req.boundary:
            raise InvalidInput(
                "boundary_reached",
                request_id,
                f"only after {req.boundary} tokens (has {req.generated})",
            )
        if req.generated >= req.hard_max:
            raise HardLimitExceeded(request_id, req.hard_max, req.generated + 1)
        return self._blocked(req, now)

    def _blocked(self, req: Request, now: float) -> list[ev.Action]:
        if req.state is not State.EXTENDING:
            lifecycle.transition(req, Trigger.BLOCK)
            req.blocked_handled = False
        if not req.ext_pending:
            self._want_extension(req)
        return self._pump(now)

    # == stops =====================================================================================

    def finish(self, request_id: str, reason: str, now: float) -> list[ev.Action]:
        """The engine reports that the request stopped by itself or at its hard max."""
        req = self.get(request_id)
        now = self._time(now)
        if reason not in ("stop", "length"):
            raise InvalidInput("reason", reason, "'stop' or 'length'")
        if reason == "length" and req.generated < req.hard_max and req.state in _LIVE:
            # an engine that stops short of the hard max for "length" would be a silent cut
            raise InvalidInput(
                "reason",
                reason,
                f"'length' only at the hard max ({req.hard_max}); request has {req.generated}",
            )
        if req.state is State.RELEASING:
            lifecycle.transition(req, Trigger.FINISH)
            return []
        self._finish(req, now)
        return self._pass_after(now)

    def _finish(self, req: Request, now: float) -> None:
        """``req`` ended by itself or at its hard max: completed."""
        was_preempting = req.state is State.PREEMPTING
        self._stop(req, Trigger.FINISH, now, Outcome.COMPLETED)
        if was_preempting:
            req.resume = None  # it finished before its preemption landed: nothing to resume
        self.lengths.observe(req.key, req.generated, censored=False)
        if req.preemptions == 0 and req.allowance > 0:
            self.lengths.record_outcome(
                req.key, req.allowance, req.generated, req.cls.initial_quantile
            )
        self._notify("on_finished", req.request_id, req, req.generated)

    def cancel(self, request_id: str, now: float) -> list[ev.Action]:
        """The caller went away.

        Queued: gone at no cost. Live: abort; its blocks stay held until the engine confirms.
        """
        req = self.get(request_id)
        now = self._time(now)
        if req.state in QUEUED_STATES:
            self._dequeue(req)
            lifecycle.transition(req, Trigger.CANCEL)
            lifecycle.settle(req, Outcome.CANCELLED)  # (a checkpoint's tokens are wasted)
            self._forget(req)
            return self._pass_after(now)
        if req.state is State.RELEASING:
            lifecycle.transition(req, Trigger.CANCEL)  # late news of the same stop
            return []
        lifecycle.check_transition(req, Trigger.CANCEL)
        was_live = req.state in _LIVE
        self._stop(req, Trigger.CANCEL, now, Outcome.CANCELLED)
        if req.generated > 0:
            self.lengths.observe(req.key, req.generated, censored=True)
        actions: list[ev.Action] = []
        if was_live:
            actions.append(ev.Abort(request_id, "cancelled"))
        return self._pass_after(now, actions)

    def fail(self, request_id: str, detail: str, now: float) -> list[ev.Action]:
        """The engine failed the request. Blocks stay charged until it confirms."""
        req = self.get(request_id)
        now = self._time(now)
        if req.state in QUEUED_STATES:
            self._dequeue(req)
            lifecycle.transition(req, Trigger.FAIL)
            lifecycle.settle(req, Outcome.FAILED)  # (a checkpoint's tokens are lost)
            self._forget(req)
            return self._pass_after(now)
        if req.state is State.RELEASING:
            lifecycle.transition(req, Trigger.FAIL)  # late news of the same stop
            return []
        self._stop(req, Trigger.FAIL, now, Outcome.FAILED)
        return self._pass_after(now)

    def _stop(
        self, req: Request, trigger: Trigger, now: float, outcome: Outcome | None = None
    ) -> None:
        """Stop ``req`` in the engine's name (its blocks stay charged until the confirmation)
        and, unless it will resume (a preemption), book how it ended (``outcome``)."""
        was_live = req.state in _LIVE
        self.ledger.stop(req, trigger)
        if was_live:
            # a new stop: the confirmation clock starts now (a later cancel/fail/finish of a
            # request already stopping must not restart it), and no earlier stop's flag carries
            req.release_started_at = now
            req.unconfirmed = False
        if req.ext_pending:
            req.ext_pending = False
            self._waiting_ext.pop(req.request_id, None)
        if was_live:
            self._leave_active(req)
            self.forecast.note_end(now)
            self.releasing += 1
            self._stopping[req.request_id] = req
        elif req.state is State.RELEASING and trigger is not Trigger.PREEMPT:
            self.preempting -= 1  # a preempted request stopped for good before its confirmation
        if outcome is not None:
            lifecycle.settle(req, outcome)

    def _prefill_done(self, req: Request) -> None:
        """``req``'s prefill leaves the engine's queue (its first token came, or it left)."""
        self.prefill_backlog -= req.prefill_pending
        req.prefill_pending = 0

    def _leave_active(self, req: Request) -> None:
        if req.prefill_pending:
            self._prefill_done(req)
        self.active -= 1
        del self.live[req.request_id]
        self.active_context -= req.prompt + req.generated
        self._notify("on_leave", req.request_id, req)
        if req.cls.protected:
            self.protected_live -= 1
            if not self.protected_live:
                self._refresh_headroom()
        n = self._active_by_floor[req.latency_floor] - 1
        if n:
            self._active_by_floor[req.latency_floor] = n
        else:
            del self._active_by_floor[req.latency_floor]

    @property
    def _idle(self) -> bool:
        """Nothing in flight: no live request and none whose release is unconfirmed."""
        return self.active == 0 and self.releasing == 0

    def _enter_active(self, req: Request) -> None:
        if self._idle:
            self.forecast.note_idle(self.now, False)
        self.active += 1
        self.live[req.request_id] = req
        self.active_context += req.prompt + req.generated
        floor = req.latency_floor
        self._active_by_floor[floor] = self._active_by_floor.get(floor, 0) + 1
        if req.cls.protected:
            self.protected_live += 1
            if self.protected_live == 1:
                self._refresh_headroom()  # (before any other grant of this pass)

    # == confirmation ==============================================================================

    def confirm_release(self, request_id: str, now: float) -> list[ev.Action]:
        """The engine confirms the stopped request's KV is free: its blocks return now."""
        req = self.get(request_id)
        now = self._time(now)
        return self._release(req, now, [])

    def _release(self, req: Request, now: float, actions: list[ev.Action]) -> list[ev.Action]:
        if req.state is State.PREEMPTING and req.remaining <= 0:
            # its last token came before the preemption landed: an engine stops a request at
            # its hard max by itself, so it finished, and there is nothing left to resume
            # (checkpointed, it would ask for an allowance of at most 0 tokens)
            self._finish(req, now)
        preempting = req.state is State.PREEMPTING
        freed = self.ledger.release(req)
        self._stopping.pop(req.request_id, None)
        started = req.release_started_at
        if started is not None:
            took = max(0.0, now - started)
            known = self.confirm_seconds
            self.confirm_seconds = (
                took if known is None else known + _CONFIRM_ALPHA * (took - known)
            )
        self.releasing -= 1
        if preempting:
            self.preempting -= 1
        self.forecast.note_release(freed, now)
        if self._idle:
            self.forecast.note_idle(now, True)
        if preempting:  # (the confirmation moved it to checkpointed)
            req.resume = req.checkpoint()
            # one paused for another caller's first token goes behind the callers queued now
            req.requeue_front = self.policy.requeue_front and not req.gave_way
            req.gave_way = False
            grant = self._want_blocks(req)
            actions.append(ev.Released(req.request_id, freed, "preempted", resumable=True))
            if grant > self.ledger.room():
                # it grew past what the cache can ever hold again: it cannot resume, and queued
                # it would block its class until its deadline. End it explicitly.
                actions.append(self._expire(req, self.config.max_retry_after_s, "too-large"))
            else:
                # (without the front a checkpoint, like any caller, never times out queued)
                req.expiry = self.forecast.queue_expiry(req) if self.front else math.inf
                self.queues.push(req, front=req.requeue_front)
        else:
            outcome = lifecycle.count_release(req)
            actions.append(ev.Released(req.request_id, freed, outcome))
            self._forget(req)
        return self._pass_after(now, actions)

    def _turn_away(self, req: Request, reason: str) -> ev.Reject:
        """Take a queued request out of its queue for good: a caller is rejected (``reason``),
        a checkpoint that can no longer resume in time ends as failed ("deadline")."""
        self._dequeue(req)
        if req.state is State.CHECKPOINTED:
            return self._expire(req, self.config.min_retry_after_s, "deadline")
        if req.wait_forecast:
            # its bound ran out, or its first token would have been late: not in time
            self.forecast.note_waited(req.wait_forecast, req.wait_bound, False, self.now)
        lifecycle.transition(req, Trigger.REJECT)
        lifecycle.settle(req, Outcome.REJECTED)
        self._count_rejection(reason)
        held = req.held_by
        if held is None:
            # never its queue's head: what held the head it waited behind held it
            self.turned_away_behind += 1
            held = self._pass_held_by or "behind"
        self.turned_away_held_by[held] = self.turned_away_held_by.get(held, 0) + 1
        self.requests.pop(req.request_id, None)
        self._remember(req.request_id)
        return ev.Reject(req.request_id, self.forecast.retry_after(req), reason)

    def _expire(self, req: Request, retry_after: float, reason: str) -> ev.Reject:
        """A checkpointed request that can no longer resume ends explicitly, as failed."""
        lifecycle.transition(req, Trigger.EXPIRE)
        lifecycle.settle(req, Outcome.FAILED)
        self._forget(req)
        return ev.Reject(req.request_id, retry_after, reason)

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self._remember(req.request_id)

    def _remember(self, request_id: str) -> None:
        if self.config.remember_released:
            self._released[request_id] = None
            if len(self._released) > self.config.remember_released:
                self._released.popitem(last=False)

    # == time, steps, reconciliation ===============================================================

    def observe_step(
        self, batch_size: int, context_tokens: int, seconds: float, now: float
    ) -> list[ev.Action]:
        if not (
            batch_size.__class__ is int
            and context_tokens.__class__ is int
            and seconds.__class__ is float
            and batch_size >= 0
            and context_tokens >= 0
            and 0.0 <= seconds < math.inf
        ):  # the checks below, skipped on the common path (once per engine step)
            check_int("batch_size", batch_size, minimum=0)
            check_int("context_tokens", context_tokens, minimum=0)
            check_float("seconds", seconds)
        self._time(now)
        if batch_size > 0:
            self.cost.observe_decode(batch_size, context_tokens, seconds)
        self._notify("on_step", None)
        return []

    def tick(self, now: float) -> list[ev.Action]:
        """Time passed: turn away queued callers past their bound, count unconfirmed stops."""
        now = self._time(now)
        actions: list[ev.Action] = []
        for req in self.queues.expired(now) if self.front else ():
            if req.paused_for:
                # streams were paused for it: turned away, it and the pauses would both be
                # lost; it waits for their blocks (its expiry kept in its class's floor, which
                # expired() has just left it out of)
                self.queues.note_expiry(req)
            else:
                actions.append(self._turn_away(req, "queue-timeout"))
        if self._placeholder_waits:
            if self.forecast.release_rate(now) > 0.0:
                self._judge_placeholder_waits(now, actions)
            else:  # (those admitted or gone meanwhile are no longer waiting to be judged)
                self._placeholder_waits = [
                    r for r in self._placeholder_waits if r.state is State.QUEUED
                ]
        if self.front and self.queues.count() and not self.preempting:
            # a queued head's bound runs down with time alone: the admission pass decides at
            # its last responsible moment, not only at the next release
            self._pass_after(now, actions)
        timeout = self.config.confirm_timeout_s
        for req in list(self._stopping.values()):
            if (
                req.state in STOPPING_STATES
                and not req.unconfirmed
                and req.release_started_at is not None
                and now - req.release_started_at > timeout
            ):
                req.unconfirmed = True
                req.stats.unconfirmed += 1
        return self._pass_after(now, actions)

    def _judge_placeholder_waits(self, now: float, actions: list[ev.Action]) -> None:
        """The callers queued before any release was seen had a placeholder for a wait
        forecast, which turns no one away: once releases are measured, the turn-away at
        arrival judges them as it would judge them arriving now, and tells those it would not
        have queued "overloaded" then rather than at their bound."""
        forecast = self.forecast
        judged = {
            r.request_id for r in self._placeholder_waits
            if r.state is State.QUEUED and not r.paused_for
        }
        self._placeholder_waits = []
        for cls in self.queues.order:
            queue = self.queues.by_class[cls.name]
            if not judged.intersection(r.request_id for r in queue):
                continue
            # each judged behind the callers of its class (and those before it) that came first
            blocks = self.queues.blocks_ahead(cls) - queue.want_blocks
            count = self.queues.count_ahead(cls) - queue.count
            for req in sorted(queue, key=lambda r: r.arrival):
                if req.request_id in judged:
                    ahead = (blocks, count)
                    wait, measured = forecast.wait_estimate(req, ahead)
                    if not measured:
                        self._placeholder_waits.append(req)
                    elif self._turned_away(req, wait, forecast.wait_bound(req, now), ahead):
                        actions.append(self._turn_away(req, "deadline"))
                        continue  # (turned away, it is no longer ahead of anyone)
                blocks += req.want_blocks
                count += 1

    def reconcile(self, engine_used_blocks: int, now: float) -> list[ev.Action]:
        """Compare the engine's KV usage with the ledger; free unconfirmed stops it no longer holds.

        Requests that still run account for their used blocks (a prompt block they share
        counted once); whatever the engine holds beyond that may belong to stopped requests. An
        unconfirmed stop that needs more blocks of its own than that cannot still be held by the
        engine, and is released.
        """
        check_int("engine_used_blocks", engine_used_blocks, minimum=0)
        now = self._time(now)
        running_used = 0
        running_prefix: set[int] = set()
        stopped: list[Request] = []
        for req in self.requests.values():
            if req.state in _LIVE:
                running_used += req.used_blocks - len(req.prefix)
                running_prefix.update(req.prefix)
            elif req.state in STOPPING_STATES:
                stopped.append(req)
        running_used += len(running_prefix)
        drift = engine_used_blocks - self.ledger.used
        self.drift = drift
        if drift != 0:
            self._stats("*", "*").drift_events += 1
        phantom = max(0, engine_used_blocks - running_used)
        # At most ``phantom`` blocks can belong to stopped requests. The engine frees a request's
        # blocks all at once and, while it holds them, holds at least the ledger's ``used_blocks``
        # for it, less the prompt blocks a running request holds too, so an unconfirmed stop
        # needing more than ``phantom`` is provably free. (Releasing "the oldest" stops instead
        # could free one the engine still holds; counting shared blocks per holder would free a
        # twin whose blocks the engine holds.)
        candidates = sorted(
            (r for r in stopped if r.unconfirmed), key=lambda r: r.release_started_at or 0.0
        )
        actions: list[ev.Action] = []
        for req in candidates:
            if req.state not in HOLDING_STATES:
                continue
            own = req.used_blocks - sum(1 for h in req.prefix if h in running_prefix)
            if own > phantom:
                req.stats.reconciled += 1
                self._release(req, now, actions)
        return actions

    def note_cached(self, request_id: str, cached_tokens: int) -> bool:
        """The engine reports how many of the request's prompt tokens it found in its prefix
        cache (vLLM: the first output's ``num_cached_tokens``). Fewer whole blocks than the
        ledger counted as shared at the grant: the request holds copies of its own, which are
        charged to it now (:meth:`Ledger.unshare`) and counted as a mismatch. More is the
        engine's gain (a cached block no live request holds) and changes nothing. Returns
        whether a mismatch was counted."""
        cached = check_int("cached_tokens", cached_tokens, minimum=0)
        req = self.requests.get(request_id)
        if req is None or req.state not in HOLDING_STATES:
            return False
        blocks = cached // self.capacity.block_size
        if blocks >= req.shared_at_grant:
            return False
        req.stats.prefix_mismatches += 1
        self.ledger.unshare(req, blocks)
        return True

    # == the pump ==================================================================================

    def _refresh_headroom(self) -> None:
        """The ledger's headroom target and protected part, as the policy sizes them. The
        protected part protects the extensions of live protected streams: with none live, it is
        none (an interactive stream admitted later extends into what is free, or preempts the
        preemptible work that took it), so work of other classes may grow to the whole cache
        rather than end short of one that holds it."""
        policy = self.policy
        try:
            target = policy.headroom_target()
        except KvBudgetError:
            raise
        except Exception as exc:  # (as _ask: see _refused)
            raise self._refused(policy.headroom_target, exc) from exc
        protected = self._ask(self.policy.protected_blocks) if self.protected_live else 0
        ledger = self.ledger
        blocks: int | None
        kept: int | None
        if target.__class__ is int and protected.__class__ is int:
            if target == ledger.headroom_target and protected == ledger.protected_blocks:
                return  # (unchanged, and the ledger checked these very values when it took them)
            blocks, kept = target, protected  # (whole already: the common answer)
        else:
            blocks, kept = whole(target), whole(protected)
        if blocks is not None and kept is not None:
            target = min(blocks, self.capacity.blocks)
            protected = min(kept, target)
        # (else the ledger refuses it: min() would pass a NaN through as a number)
        ledger.set_headroom(target, protected, self.policy.name)

    def _pump(self, now: float, actions: list[ev.Action] | None = None) -> list[ev.Action]:
        """One pass: the headroom, waiting extensions, admissions, progress. ``actions``: what
        the caller decided before the pass (returned first). A pass cut short by an exception
        (a refused policy answer) strands what it had decided (:attr:`_stranded`), and the
        next pass returns it: every action a ledger change was made for reaches the shell."""
        if actions is None:
            actions = []
        if self._stranded:
            actions[:0], self._stranded = self._stranded, []
        try:
            self._refresh_headroom()
            if self._waiting_ext:
                self._serve_extensions(now, actions)
            self._admit(now, actions)
            if self._waiting_ext:
                self._ensure_progress(now, actions)
        except BaseException:
            self._stranded = actions
            raise
        return actions

    def _pass_after(self, now: float, actions: list[ev.Action] | None = None) -> list[ev.Action]:
        """The pass after a change already made (a stop, a release, time passing). A policy
        answer refused there, or a policy that raised, is not the caller's error: its change
        stands (an engine's confirmation, a caller gone). It is kept as a fault
        (:attr:`policy_faults`), and what the pass had decided is returned."""
        try:
            return self._pump(now, actions)
        except Exception as exc:
            self._fault(exc if isinstance(exc, PolicyViolation) else None, f"raised {exc!r}", exc)
            done, self._stranded = self._stranded, []
            return done

    def _ask(self, decide: Callable[[*_Args], _R], *args: *_Args) -> _R:
        """A decision of the policy's (``decide``, one of its hooks). One that raises is a
        refused answer (:class:`PolicyViolation`, the exception as its cause) wherever it is
        asked: typed for the caller whose pass asked it, kept as a fault in a pass after a
        change already made (:meth:`_pass_after`). kvbudget's own errors pass as raised."""
        try:
            return decide(*args)
        except KvBudgetError:
            raise
        except Exception as exc:
            raise self._refused(decide, exc) from exc

    def _refused(self, decide: Callable[..., object], exc: Exception) -> PolicyViolation:
        """The refused answer of a policy hook ``decide`` that raised ``exc`` (:meth:`_ask`).
        The four hooks every admission asks (``headroom_target``, ``initial_allowance``,
        ``admit``, ``lookahead_tokens``) are called in a ``try`` of their own that raises this,
        rather than through :meth:`_ask`: its extra call, four times over, was about a twentieth
        of an admission's cost (``benchmarks/core_hot_path.py``)."""
        name = getattr(decide, "__name__", repr(decide))
        return PolicyViolation(self.policy.name, f"{name} raised {exc!r}")

    def _notify(self, hook: str, request_id: str | None, *args: object) -> None:
        """Tell the policy (``hook``: a notification, which decides nothing) what happened. One
        that raises is kept as a fault (:attr:`policy_faults`), not let out half-way through
        the change it reports."""
        try:
            getattr(self.policy, hook)(*args)
        except Exception as exc:
            about = "" if request_id is None else f" for {request_id!r}"
            self._fault(None, f"{hook}{about} raised {exc!r}", exc)

    def _fault(self, fault: PolicyViolation | None, detail: str, cause: Exception) -> None:
        if fault is None:
            fault = PolicyViolation(self.policy.name, detail)
            fault.__cause__ = cause
        self.policy_faults += 1
        self.policy_fault_log.append(fault)

    def _serve_extensions(self, now: float, actions: list[ev.Action]) -> None:
        by_class = self.class_order
        waiting = (
            list(self._waiting_ext.values())
            if len(self._waiting_ext) == 1  # (the common case: one stream near its boundary)
            else sorted(
                self._waiting_ext.values(),
                key=lambda r: (
                    r.cls.priority if by_class else 0,
                    r.state is not State.EXTENDING,
                    r.seq,
                ),
            )
        )
        for req in waiting:
            if not req.ext_pending:
                continue
            if self._try_extend(req, actions):
                continue
            if req.blocked_handled and self.preempting:
                continue  # its last decision is still returning blocks
            if req.state is State.EXTENDING or self.policy_acts_ahead(req):
                req.blocked_handled = True
                self._handle_blocked(req, now, actions)

    def policy_acts_ahead(self, req: Request) -> bool:
        """Does the policy decide for ``req`` when its extension asked ahead of the boundary is
        refused (``Policy.acts_ahead``, optional), rather than when it reaches the boundary? A
        preemption decided then has returned its blocks by the time the boundary comes, so
        ``req`` is never paused. Only while it is short of its boundary: the token that reaches
        it may be its last one, so from there on the decision waits for the engine's word
        (:meth:`boundary_reached` or :meth:`finish`), as past it."""
        ahead = getattr(self.policy, "acts_ahead", None)
        return (
            ahead is not None
            and req.generated < req.boundary < req.hard_max
            and bool(self._ask(ahead, req))
        )

    def _extension_answer(self, req: Request) -> int | None:
        """The policy's extension for ``req`` (``Policy.extension_tokens``), checked: None (no
        extension now) or a whole number >= 1."""
        answer = self._ask(self.policy.extension_tokens, req)
        if answer is None:
            return None
        tokens = whole(answer)
        if tokens is None or tokens < 1:
            raise PolicyViolation(self.policy.name, f"extension must be >= 1 token, got {answer!r}")
        return tokens

    def _try_extend(self, req: Request, actions: list[ev.Action]) -> bool:
        tokens = self._extension_answer(req)
        if tokens is None:
            return False
        boundary = req.boundary + tokens
        if boundary > req.hard_max:
            raise PolicyViolation(
                self.policy.name,
                f"extension of {req.request_id!r} to {boundary} tokens passes its hard max "
                f"{req.hard_max}",
            )
        extra = self.ledger.grant_blocks(req, boundary) - req.blocks
        if not self.ledger.fits_extension(extra, req.cls.protected):
            # bounded increments: take what the pool allows now, the rest later
            extra = self.ledger.spare(req.cls.protected)
            if extra < 1:
                return False
            boundary = min(boundary, self.ledger.covered_boundary(req, req.blocks + extra))
            if boundary <= req.boundary:
                return False
        # (no latency-floor check here: the stream is already in the batch, and a denial would
        # stall it at its boundary, which breaks its own floor for certain; the floor guards
        # admissions, the work that is added)
        self._extend_to(req, boundary, actions)
        return True

    def _extend_to(self, req: Request, boundary: int, actions: list[ev.Action]) -> None:
        """Grow ``req``'s grant to ``boundary`` (already checked against the pool rules)."""
        ahead = self._lookahead(req)  # (asked first: an answer it refuses changes nothing)
        self.ledger.extend(req, boundary, self.policy.name)
        req.ext_pending = False
        req.blocked_handled = False
        del self._waiting_ext[req.request_id]
        self._set_ask_at(req, ahead)
        self._notify("on_granted", req.request_id, req)
        req.stats.extensions += 1
        actions.append(ev.Extend(req.request_id, req.boundary, req.blocks))

    def _lookahead(self, req: Request) -> int:
        """The policy's lookahead for ``req``'s next grant (``Policy.lookahead_tokens``)."""
        policy = self.policy
        try:
            answer = policy.lookahead_tokens(req)
        except KvBudgetError:
            raise
        except Exception as exc:  # (as _ask: see _refused)
            raise self._refused(policy.lookahead_tokens, exc) from exc
        ahead = whole(answer)
        if ahead is None or ahead < 0:
            raise PolicyViolation(
                self.policy.name,
                f"lookahead for {req.request_id!r} must be >= 0 tokens, got {answer!r}",
            )
        return ahead

    @staticmethod
    def _set_ask_at(req: Request, ahead: int) -> None:
        """When ``req`` asks to grow its new grant: ``ahead`` tokens before its boundary."""
        if req.boundary >= req.hard_max:
            req.ask_at = req.hard_max + 1  # the grant covers the hard max: nothing more to ask
        else:
            req.ask_at = max(req.boundary - ahead, req.generated + 1)

    def _checked_victims(
        self, victims: Sequence[Request], candidates: Sequence[Request], what: str
    ) -> list[Request]:
        """``victims`` as the policy chose them from ``candidates``, refused whole
        (:class:`PolicyViolation`, before anyone is stopped) if one was not offered or comes
        twice: a request the engine cannot resume, one at its hard max, or an interactive
        stream that does not give way is never a candidate."""
        if isinstance(victims, (str, bytes)) or not isinstance(victims, Iterable):
            raise PolicyViolation(
                self.policy.name, f"{what} victims must be a list of requests, got {victims!r}"
            )
        victims = list(victims)
        offered = {r.request_id for r in candidates}
        chosen: set[str] = set()
        for victim in victims:
            rid = getattr(victim, "request_id", None)
            if rid not in offered or self.live.get(rid) is not victim:
                # (named by its id where it has one; else as given: a bare id, say)
                name = victim if rid is None else rid
                raise PolicyViolation(
                    self.policy.name,
                    f"{what} victim {name!r} is not one of the candidates offered (requests)",
                )
            if rid in chosen:
                raise PolicyViolation(self.policy.name, f"{what} victim {rid!r} chosen twice")
            chosen.add(rid)
        return victims

    def _handle_blocked(self, req: Request, now: float, actions: list[ev.Action]) -> None:
        decision = self._ask(self.policy.on_blocked, req)
        req.stats.extensions_denied += 1
        if decision is Blocked.WAIT:
            return
        if decision is Blocked.CONTINUE:
            if req.spec.on_exhausted != "continue":
                raise PolicyViolation(
                    self.policy.name,
                    f"continuation for {req.request_id!r}, which did not allow one "
                    "(on_exhausted='extend'): that would be a silent truncation",
                )
            if req.state is State.EXTENDING:
                self._continue(req, now, actions)
            # (else asked ahead of its boundary: a continuation ends the answer where it stands,
            # short of the tokens its grant still covers, and the token just charged may be its
            # last; it is decided at the boundary, once the engine says it wants more)
            return
        if decision is Blocked.PREEMPT_SELF:
            self._preempt(req, now, actions, reason="boundary")
            return
        if decision is Blocked.PREEMPT_OTHERS:
            want = self._extension_answer(req) or 1
            boundary = min(req.hard_max, req.boundary + want)
            need = self.ledger.grant_blocks(req, boundary) - req.blocks
            need = max(1, need - self.ledger.spare(req.cls.protected))
            # a request at its hard max is finishing; its checkpoint could never resume; one the
            # engine cannot resume exactly is never preempted
            candidates = [
                r for r in self.live.values() if r.generated < r.hard_max and r.spec.resumable
            ]
            chosen = self._ask(self.policy.choose_victims, req, need, candidates)
            for victim in self._checked_victims(chosen, candidates, "boundary"):
                self._preempt(victim, now, actions, reason=f"for:{req.request_id}")
                if victim is req:
                    return
            return
        raise PolicyViolation(self.policy.name, f"unknown blocked decision {decision!r}")

    def _preempt(self, req: Request, now: float, actions: list[ev.Action], reason: str) -> None:
        ckpt = req.checkpoint()
        self._stop(req, Trigger.PREEMPT, now)
        req.preemptions += 1
        req.stats.preemptions += 1
        req.stats.recompute_tokens += ckpt.recompute_tokens
        self.preempting += 1
        if req.generated > 0:
            # a preempted request is known to be longer than what it generated so far
            self.lengths.observe(req.key, req.generated, censored=True)
        actions.append(
            ev.Preempt(req.request_id, ckpt, ckpt.recompute_tokens, req.deadline_at, reason)
        )

    def _continue(self, req: Request, now: float, actions: list[ev.Action]) -> None:
        self._stop(req, Trigger.CONTINUE, now, Outcome.CONTINUED)
        req.continuation_seq += 1
        cont = Continuation(
            request_id=req.request_id,
            continuation_id=f"{req.request_id}~{req.continuation_seq}",
            prompt_tokens=req.prompt,
            generated_tokens=req.generated,
            remaining_tokens=req.remaining,
        )
        actions.append(ev.Continue(req.request_id, cont))

    def _within_floor(self, req: Request, allowance: int) -> bool:
        """Would the steps after admitting ``req`` for ``allowance`` tokens stay under every
        active stream's floor? Its sequence and context join the batch, and the steps that
        prefill its prompt carry up to ``prefill_chunk_tokens`` of it beside the decode of
        every active stream.
        """
        if not self._active_by_floor:
            return True
        floor = min(self._active_by_floor)
        if floor == math.inf:
            return True
        model = self.cost.current()  # (CostModel.predict_decode and predict_prefill, once)
        predicted = model.decode_time(
            self.active + 1, self.active_context + req.prompt + req.generated + allowance
        )
        prefill_tokens = self.ledger.prefill_tokens(req)
        if prefill_tokens:
            chunk = self.config.prefill_chunk_tokens
            predicted += model.prefill_time(
                prefill_tokens if chunk is None else min(prefill_tokens, chunk)
            )
        return predicted <= floor

    def _admit(self, now: float, actions: list[ev.Action]) -> None:
        """The admission pass: queue heads in class-priority order, each admitted while
        :meth:`_may_admit` allows it (strict priority: nothing behind a head jumps it)."""
        cap = self.config.max_active
        self._pass_held_by = None
        for cls in self.queues.order:
            queue = self.queues.by_class[cls.name]
            while queue.count:
                req = self._head(queue)
                if cap is not None and self.active >= cap:
                    req.held_by = self._pass_held_by = "batch-cap"
                    return
                allowance = self._allowance(req)
                boundary = req.generated + allowance
                # (prompt blocks a live twin holds are charged once: only the rest is taken)
                blocks = self.ledger.admission_blocks(req, boundary)
                if not self._may_admit(req, blocks, allowance, now, actions):
                    behind = self._backfill_behind(queue, req, blocks, now)
                    if behind is None:
                        self._pass_held_by = req.held_by
                        return
                    req, allowance, blocks = behind
                    boundary = req.generated + allowance
                if (
                    self.front
                    and not req.paused_for
                    and self.forecast.first_token_late(req, now)
                ):
                    # behind the prefill already queued in the engine its first token would be
                    # late: a fast "overloaded" now, and its prefill is not taken from callers
                    # who can still be served in time
                    req.held_by = "prefill-queue"
                    actions.append(self._turn_away(req, "first-token-late"))
                    continue
                ahead = self._lookahead(req)  # (asked first: an answer refused changes nothing)
                queue.pop(req, True)  # (admitted)
                if req.wait_forecast:
                    self.forecast.note_waited(req.wait_forecast, req.wait_bound, True, now)
                    req.wait_forecast = 0.0
                self._grant(req, boundary, allowance, ahead, now, actions)

    def _head(self, queue: ClassQueue) -> Request:
        """The next of ``queue`` to admit: its head, unless that is a checkpoint waiting to
        resume and a fresh caller behind it has its first token due
        (``Policy.first_token_pause_at``): the checkpoint has had its first token and paces
        itself; the caller's first token is the most urgent thing in the queue. A fresh head
        may have an older caller backfilled before it (:meth:`_backfill`)."""
        head = queue.head()
        assert head is not None
        if head.resume is None:
            return self._backfill(queue, head) if self.front else head
        if getattr(self.policy, "first_token_pause_at", None) is None:
            return head
        for req in queue:
            if req.resume is None and self._first_token_due(req):
                return req
        return head

    def _backfill(self, queue: ClassQueue, head: Request) -> Request:
        """The fresh ``head`` the tenant stride picked in a class under a first-token objective,
        or an older fresh caller of that class (the front queued longest of the tenants at most
        one admission ahead of the head's: :meth:`ClassQueue.backfill_candidate`) where it goes
        first without costing the head its bound: it fits the admission budget and passes the
        gates now, the two do not fit together, and its service (its prefill and its length at
        :data:`BACKFILL_LENGTH_QUANTILE`, at the current step) takes at most
        :data:`BACKFILL_SLACK_SHARE` of the time the head may still wait.

        Backfilling, as batch schedulers do it around a reservation: the stride says whose turn
        it is, not that an older caller must time out while the head takes the cache. The older
        caller's tenant pays for its admission in its pass as for any other, and being at most
        one admission ahead it gets at most one beyond its share: the weights hold under
        saturation. Classes without a first-token objective (batch) keep the stride's order:
        their bounds are long, and most conflicts would be decided by arrival.
        (Held out, both overlay seeds over the 37 cells: docs/policies.md.)"""
        if head.cls.ttft_slo_s is None or head.paused_for or head.requeue_front:
            return head
        older = queue.backfill_candidate(head)
        if older is head or older.resume is not None or older.requeue_front:
            return head
        slack = self.queue_slack(head)
        if slack is None:
            return head
        goes = self._goes_now_within(older, BACKFILL_SLACK_SHARE * slack)
        if goes is None:
            return head
        ledger = self.ledger
        head_blocks = ledger.admission_blocks(head, head.generated + self._allowance(head))
        if ledger.fits_admission(goes[1] + head_blocks):
            return head  # (both go now: the stride's order costs no one)
        return older

    def _backfill_behind(
        self, queue: ClassQueue, head: Request, head_blocks: int, now: float
    ) -> tuple[Request, int, int] | None:
        """A caller to admit behind a ``head`` that waits for blocks, in a class under a
        first-token objective, without delaying it: EASY backfilling. The head's reservation is
        when the releases at the recent rate return the blocks it wants beyond what is free
        (fixed when first forecast, so that callers admitted behind it cannot push it back); a
        fresh caller among the next :data:`BACKFILL_LOOKAHEAD` in the queue goes now if it fits
        the admission budget, passes the gates, and its service (its length at
        :data:`BACKFILL_LENGTH_QUANTILE`) ends before the reservation: that caller, with its
        allowance and the blocks its grant takes. None: the head waits alone (not a head the
        blocks are short for, none measured, or no caller ends in time)."""
        if not self.front or self.preempting or head.cls.ttft_slo_s is None:
            return None
        until = head.reserved_until
        if until is None:
            rate = self.forecast.release_rate(now)
            deficit = self._deficit(head_blocks)
            if rate <= 0.0 or deficit <= 0:
                return None  # (held back by a gate, not by blocks; or no release measured)
            until = head.reserved_until = now + deficit / rate
        left = until - now
        if left <= 0.0:
            return None
        looked = 0
        for req in queue:
            if req is head or req.resume is not None or req.requeue_front:
                continue
            looked += 1
            if looked > BACKFILL_LOOKAHEAD:
                break
            goes = self._goes_now_within(req, left)
            if goes is not None:
                return req, *goes
        return None

    def _goes_now_within(self, req: Request, seconds: float) -> tuple[int, int] | None:
        """Could the queued ``req`` be admitted now and be done within ``seconds``: its grant
        fits the admission budget, it passes the gates, and its service (its prefill and its
        length at :data:`BACKFILL_LENGTH_QUANTILE`, at the current step) takes at most that
        long? Its allowance and the blocks of its grant if so (the rule both backfills ask)."""
        allowance = self._allowance(req)
        blocks = self.ledger.admission_blocks(req, req.generated + allowance)
        if (
            self.ledger.fits_admission(blocks)
            and all(self._gates(req, blocks, allowance, self._idle))
            and self.forecast.predicted_service(req, BACKFILL_LENGTH_QUANTILE) <= seconds
        ):
            return allowance, blocks
        return None

    def _gates(self, req: Request, blocks: int, allowance: int, idle: bool) -> tuple[bool, bool]:
        """The gates of an admission of ``req`` (``blocks`` for ``allowance`` tokens): does the
        policy admit it (always when the engine is ``idle``), and does it keep the active
        streams within their latency floor?"""
        within_floor = (
            self.active == 0
            or not self.front  # (the latency-floor gate is kvbudget's front: no engine has it)
            or self._within_floor(req, allowance)
        )
        policy = self.policy
        try:
            admits = policy.admit(req, blocks)
        except KvBudgetError:
            raise
        except Exception as exc:  # (as _ask: see _refused)
            raise self._refused(policy.admit, exc) from exc
        return admits or idle, within_floor

    def _may_admit(
        self, req: Request, blocks: int, allowance: int, now: float, actions: list[ev.Action]
    ) -> bool:
        """May the head ``req`` be granted ``blocks`` now?

        It must fit the admission budget and pass the gates (the policy's own, unless nothing
        runs or is being released; the latency floor of active streams). A protected head of a
        policy that preempts for admission that does not fit may instead take the headroom
        beyond its protected part, or checkpoint batch work for it
        (:meth:`_protected_head_room`). Refused, the head records what held it
        (``req.held_by``, :data:`~kvbudget.core.stats.HELD_BY`): room, where its grant fits
        neither the admission budget nor the headroom it may take; else the latency floor,
        else the policy's gate, else room (the headroom kept for extensions waiting).
        """
        idle = self._idle
        # (the headroom is kept for the extensions of grants in flight: with none, a head that
        # fits what is free takes it, as one that needs nearly the whole cache must)
        fits = self.ledger.fits_admission(blocks) or (idle and blocks <= self.ledger.free)
        protected_head = req.cls.protected and self.policy.preempt_for_admission
        if not (fits or protected_head):
            req.held_by = "no-room"
            return False
        policy_admits, within_floor = self._gates(req, blocks, allowance, idle)
        gates = policy_admits and within_floor
        if fits and gates:
            return True
        if protected_head and self._protected_head_room(
            req, blocks, policy_admits, within_floor, now, actions
        ):
            return True
        # (a gate is named only where it stood between the head and room it could take)
        room = fits or self.ledger.fits_extension(blocks, protected=False)
        req.held_by = (
            "no-room" if not room
            else "latency-floor" if not within_floor
            else "policy" if not policy_admits
            else "no-room"
        )
        return False

    def _protected_head_room(
        self,
        req: Request,
        blocks: int,
        policy_admits: bool,
        within_floor: bool,
        now: float,
        actions: list[ev.Action],
    ) -> bool:
        """A protected head that does not fit its admission budget: may it take the headroom
        beyond the protected part now (True), or does it wait, checkpointing batch work for it
        at its last responsible moment (False; the preemptions are in ``actions``)?

        It takes that headroom (only if the gates pass: the policy's and the latency floor)
        at once while no extension waits, and otherwise only where batch work would be
        checkpointed, or where its first token is due and the work in the engine would not
        bring it in time: then the policy's gate, which may keep the headroom on the recent
        release rate, gives way to the drain forecast.
        """
        gates = policy_admits and within_floor
        takes_headroom = self.ledger.fits_extension(blocks, protected=False)
        if gates and not self._waiting_ext and takes_headroom:
            # The headroom is a forecast of extension demand, and no extension is waiting for
            # it; the head's wait is certain and its first-token clock runs. An extension that
            # later finds the pool short can still preempt batch work (protected) or wait at its
            # boundary (batch). The policy's gate decides when the forecast is to be kept whole.
            return True
        if self.preempting:
            return False  # room is already on its way back; do not preempt twice for one head
        due = self._first_token_due(req)
        # the fresh callers queued behind a due head whose first tokens are due as well: one
        # round of pauses serves all of them, so whether it may wait is judged for all of them
        # (for the head alone, a wave's head is "back in time" while the callers behind it run
        # out of the slack their own pause cycles need)
        served = self._due_round(req) if due else [req]
        wants = [blocks] + [
            self.ledger.admission_blocks(r, r.generated + self._allowance(r)) for r in served[1:]
        ]
        round_blocks = sum(wants)
        if self._back_in_time(served, wants) if due else self.released_in_time(req, blocks):
            # checkpoint others only at the last responsible moment: a preemption now would
            # only trade the victim's recompute for nothing
            return False
        # A victim whose class is backlogged (more work queued than the whole cache holds, so
        # more than one turnover of the cache away) is spared: the engine is saturated for that
        # class, the victim's recompute would displace its work one for one, and the head, served
        # before that backlog by strict priority, gets the next release anyway.
        # A policy may also pause running streams for a first token that would come too late
        # (Policy.first_token_pause_at / gives_way): the backlog spares none of those, the point
        # being a first token now for work deferred.
        gives_way = getattr(self.policy, "gives_way", None) if due else None
        candidates = [
            r
            for r in self.live.values()
            if r.spec.resumable
            and r.generated < r.hard_max
            and (
                (
                    r.cls.preemptible
                    and self.queues.by_class[r.cls.name].want_blocks <= self.capacity.blocks
                )
                # (paused for a first token only once it has had its own)
                or (gives_way is not None and r.generated >= 1 and self._ask(gives_way, r, req))
            )
        ]
        if not candidates:
            return False
        # Where a checkpoint would be taken, the headroom beyond its protected part is taken
        # first: it is a forecast of extension demand, not blocks anyone holds (a protected
        # extension it displaces can still preempt batch work at its own boundary; a batch one
        # waits for the next release). Only what that does not cover is checkpointed.
        if takes_headroom:
            # (a due caller got here only if the drain would not serve it in time)
            return within_floor and (policy_admits or due)
        need = round_blocks - self.ledger.spare(protected=False)
        victims = self._checked_victims(
            self._ask(self.policy.choose_victims, req, need, candidates), candidates, "admission"
        )
        if due and victims:
            # the callers this round pauses streams for are never turned away as late, nor at
            # their queue bound, until they are admitted: streams paused for a caller then
            # refused are lost twice
            for r in served:
                r.paused_for = True
        for victim in victims:
            if not victim.cls.preemptible:
                victim.gave_way = True  # (paused for a first token: requeued behind it)
            self._preempt(victim, now, actions, reason=f"admit:{req.request_id}")
        return False

    def _due_round(self, head: Request) -> list[Request]:
        """The due ``head`` and the fresh callers queued behind it in its class whose first
        tokens are due as well: one round of pauses for all of them, not one confirmation
        round trip each."""
        return [head] + [
            other
            for other in self.queues.by_class[head.cls.name]
            if other is not head and self._first_token_due(other)
        ]

    def paused_for(self, request_id: str) -> bool:
        """Were streams paused for the queued caller ``request_id``'s first token? Such a
        caller is not turned away at its queue bound nor as late: it waits for their blocks."""
        req = self.requests.get(request_id)
        return req is not None and req.paused_for

    def _first_token_pause_at(self, req: Request) -> float | None:
        at = getattr(self.policy, "first_token_pause_at", None)
        if at is None:
            return None
        share: float | None = self._ask(at, req)
        return share

    def _first_token_due(self, req: Request) -> bool:
        """Does the policy pause running streams for ``req``'s first token now
        (``Policy.first_token_pause_at``, optional)?"""
        at = self._first_token_pause_at(req)
        if at is None:
            return False
        slack = self.queue_slack(req)
        return slack is not None and slack <= at

    def _back_in_time(self, due: Sequence[Request], wants: Sequence[int]) -> bool:
        """For callers whose first tokens are due (a round: the head first, ``wants`` the
        blocks each wants): may the pauses for them wait?

        Only if the work in the engine itself returns what the head wants beyond what is free
        past the headroom target within half the time it may still wait: judged by the drain
        of what the engine holds (:meth:`Forecast.drain_wait`: each stream at its conditional
        median length at the current pace), not from the recent release rate, which after a
        quiet spell or a previous wave says little about the streams running now. Half: the
        forecast of a first token is the optimistic side of a race with its objective.

        And only if no caller behind the head needs the pauses to begin now: one whose need
        with the callers ahead of it the drain would not return in half its slack either, and
        that would take more pause cycles than half its slack holds (a cycle frees what the
        streams hold: its length is their prefill, a confirmation and a step), while its whole
        slack still holds them (pauses that cannot bring it in time are not begun for it). A
        wave's head is served by the first streams to end; the callers behind it, each a cycle
        later, are not, and waiting for the head's own last moment left them too few cycles."""
        head_slack = self.queue_slack(due[0])
        deficits = [self._deficit(blocks) for blocks in accumulate(wants)]
        judged: list[tuple[float, int]] = []
        if head_slack is not None and deficits[0] > 0:
            judged.append((head_slack, deficits[0]))
        held = sum(self.ledger.footprint(r) for r in self.live.values())
        if len(due) > 1 and held > 0:
            cycle = (
                self.cost.predict_prefill(held * self.capacity.block_size)
                + 2.0 * self.step_seconds()
            )
            for req, deficit in zip(due[1:], deficits[1:], strict=True):
                slack = self.queue_slack(req)
                if slack is None or deficit <= 0:
                    continue
                cycles = -(-deficit // held) * cycle
                if slack / 2.0 < cycles <= slack:
                    judged.append((slack, deficit))
        if not judged:
            return True
        drains = self.forecast.drain_waits(
            [deficit for _, deficit in judged], self.forecast.predicted_service(due[0], 0.5)
        )
        return all(
            drain is not None and drain <= slack / 2.0
            for (slack, _), drain in zip(judged, drains, strict=True)
        )

    def expected_length(self, req: Request) -> int:
        """The output length ``req`` is expected to stop at, given what it has generated: its
        conditional median, capped at its hard max."""
        return min(req.hard_max, self.lengths.conditional_quantile(req.key, 0.5, req.generated))

    def seconds_left(self, req: Request, step: float | None = None) -> float:
        """Seconds the live ``req`` is expected to hold its blocks still: the tokens to its
        :meth:`expected_length` at ``step`` seconds each (default :meth:`step_seconds`)."""
        left = self.expected_length(req) - req.generated
        return left * (self.step_seconds() if step is None else step)

    @property
    def stopping(self) -> Mapping[str, Request]:
        """Stopped requests whose release the engine has not confirmed yet (they hold blocks)."""
        return self._stopping

    def step_seconds(self) -> float:
        """Seconds per token a running stream gets now: the cost model's decode step for the
        active batch, or the pace observed between charges where that is slower (the engine's
        own step timing leaves out the scheduling, output processing and serving around it)."""
        decode = self.cost.predict_decode(max(1, self.active), self.active_context)
        return max(decode, self.token_gap)

    def _served_by_pauses(self, req: Request, ahead: Ahead | None = None) -> bool:
        """Could pauses for first tokens (``gives_way``) admit the newcomer ``req``, whose first
        token may have streams paused for it (``Policy.first_token_pause_at``: the caller
        checks), by its last responsible moment, whatever the releases? The blocks wanted ahead
        of it and its own fit what is free plus what the streams that would give way for it
        hold."""
        gives_way = getattr(self.policy, "gives_way", None)
        if gives_way is None:
            return False
        want = self.forecast.deficit(req, ahead)
        for r in self.live.values():
            if want <= 0:
                break
            if r.spec.resumable and r.generated < r.hard_max and self._ask(gives_way, r, req):
                want -= self.ledger.footprint(r)
        return want <= 0

    def _grant(
        self, req: Request, boundary: int, allowance: int, ahead: int, now: float,
        actions: list[ev.Action],
    ) -> None:
        resume = req.resume
        if req.allowance == 0:
            req.allowance = allowance
        self._seq += 1
        req.seq = self._seq
        self.ledger.grant(req, boundary, self.policy.name)
        if not req.spec.resumable:
            req.stats.full_grants += 1  # (never preempted: granted once)
        self._enter_active(req)
        req.admitted_at = now
        req.paused_for = False  # (served: a later pause of its own is a checkpoint's)
        req.reserved_until = None  # (a reservation is a queued head's: it starts again if requeued)
        req.prefill_pending = self.ledger.prefill_tokens(req)  # (shared blocks are cached)
        # (what is left of the backlog, not all of it: a long prompt nearly prefilled is
        # mostly behind this one already; see Forecast.queued_prefill)
        req.prefill_ahead = self.forecast.queued_prefill() + req.prefill_pending
        self.prefill_backlog += req.prefill_pending
        if req.prefill_pending:
            self.newest_prefill = (now, req.prefill_ahead)
        self._set_ask_at(req, ahead)
        # (last_token_at is kept across a checkpoint: the caller's gap from the token before it
        # to the first after the resume is a stall like any other)
        self._notify("on_granted", req.request_id, req)
        req.stats.admitted += 1
        req.stats.prefix_shared_blocks += req.shared_at_grant
        actions.append(ev.Admit(req.request_id, req.boundary, req.blocks, resume))

    def _dequeue(self, req: Request) -> None:
        self.queues.remove(req)

    def _ensure_progress(self, now: float, actions: list[ev.Action]) -> None:
        """If every live request waits at its boundary and nothing will free blocks: grow the
        most important one from whatever is free (beyond the protected part, for batch work),
        else checkpoint the least important so the rest can move. Only a
        request alone with every block and still short (it needs more KV than the engine has)
        ends, explicitly."""
        if self._stopping:
            return  # a stopped request will return its blocks
        for req in self.live.values():
            if req.state is not State.EXTENDING:
                return
        by_class = self.class_order
        stuck = sorted(
            (r for r in self._waiting_ext.values() if r.state is State.EXTENDING),
            key=lambda r: (
                (r.cls.priority, not r.cls.protected, r.seq) if by_class else (0, False, r.seq)
            ),
        )
        if not stuck:
            return
        head = stuck[0]
        if self._try_extend(head, actions):
            return  # (the pool rules of _try_extend already let it take all but protected)
        # the least important, most recently admitted one that can resume gives way
        victims = [r for r in stuck[1:] if r.spec.resumable or r.spec.on_exhausted == "continue"]
        if victims:
            victim = victims[-1]
            if victim.spec.on_exhausted == "continue":
                self._continue(victim, now, actions)
            else:
                self._preempt(victim, now, actions, reason="progress")
            return
        if head.spec.on_exhausted == "continue":
            self._continue(head, now, actions)
            return
        # alone (or beside work that cannot resume), holding every block it could get, and
        # still short: the request needs more KV than the engine has. End it explicitly rather
        # than cut it silently.
        self._stop(head, Trigger.FAIL, now, Outcome.FAILED)
        actions.append(ev.Abort(head.request_id, "capacity-exhausted"))

    # == reporting =================================================================================

    def snapshot(self) -> Snapshot:
        """The budget now: the ledger's pools, the request counts and the counters."""
        led = self.ledger
        by_class: dict[str, list[Counters]] = {}
        by_tenant: dict[str, list[Counters]] = {}
        for (cls, tenant), c in self.counters.items():
            by_class.setdefault(cls, []).append(c)
            by_tenant.setdefault(tenant, []).append(c)
        unconfirmed = sum(
            1 for r in self.requests.values() if r.unconfirmed and r.state in STOPPING_STATES
        )
        try:
            under: UnderestimationReport | None = self.lengths.underestimation()
        except Exception:  # a user length model without tracking
            under = None
        return Snapshot(
            capacity_blocks=led.capacity.blocks,
            block_size=led.block_size,
            reserved_blocks=led.reserved,
            used_blocks=led.used,
            free_blocks=led.free,
            headroom_blocks=led.headroom_target,
            headroom_free_blocks=led.headroom_free,
            protected_blocks=led.protected_blocks,
            admission_free_blocks=led.admission_free,
            active=self.active,
            queued=self.queued(),
            releasing=self.releasing,
            unconfirmed_releasing=unconfirmed,
            policy=self.policy.name,
            totals=sum_counters(list(self.counters.values())),
            by_class={k: sum_counters(v) for k, v in by_class.items()},
            by_tenant={k: sum_counters(v) for k, v in by_tenant.items()},
            by_class_tenant={k: sum_counters([v]) for k, v in self.counters.items()},
            underestimation=under,
            drift_blocks=self.drift,
            shared_prefix_blocks=len(led.shared),
            rejections_by_reason=dict(self.rejections_by_reason),
            turned_away_held_by=dict(self.turned_away_held_by),
            turned_away_behind=self.turned_away_behind,
            wait_in_time_share=self.forecast.in_time_share(),
            wait_forecast_samples=self.forecast.wait_outcome_samples,
            wait_outcomes_by_band=self.forecast.wait_outcomes_by_band(),
            release_rate_blocks_per_s=self.forecast.release_rate(self.now),
            policy_faults=self.policy_faults,
        )

    def queued(self) -> int:
        return self.queues.count()

    def all_requests(self) -> list[Request]:
        return list(self.requests.values())

    def check_invariants(self) -> None:
        """Assert the ledger invariants (used by the property harness and in debugging)."""
        self.ledger.check(list(self.requests.values()))
        assert self.active == sum(1 for r in self.requests.values() if r.state in _LIVE)
        assert set(self.live) == {r.request_id for r in self.requests.values() if r.state in _LIVE}
        assert set(self._stopping) == {
            r.request_id for r in self.requests.values() if r.state in STOPPING_STATES
        }


__all__ = ["Scheduler", "SchedulerConfig"]
