"""The anyio shell around the core: :class:`Budget`, :class:`Lease` and the generic driver.

This module owns waiting and waking, nothing else: every decision (admission, extension,
preemption, continuation, rejection, release) is taken by :class:`kvbudget.core.scheduler.Scheduler`
and arrives here as an action. The shell

* turns calls on a :class:`Lease` into core calls with ``now`` from its clock, and carries out
  the actions that come back by updating the leases they name and setting the ``anyio.Event``
  of exactly the lease that waits for them (one event per waiting lease, no polling);
* owns a task group (inside ``async with budget``) for durable requests, for waiting on engine
  confirmations, and for a background ticker that calls :meth:`Scheduler.tick` and, when stops
  went unconfirmed, :meth:`Scheduler.reconcile` against the engine's reported KV usage;
* runs requests end to end over any :class:`~kvbudget.engines.base.Engine` in
  :meth:`Budget.generate` (admission, charging, extensions, preemption and resumption,
  continuation, cancellation, durability, engine failures).

It runs on asyncio and trio alike (anyio only). Events are logged to structlog's ``"kvbudget"``
logger through :func:`kvbudget.observability.get_logger` (never per token).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
import os
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from contextlib import aclosing
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc
import attrs
from anyio.streams.memory import MemoryObjectSendStream

from kvbudget.core import events as ev
from kvbudget.core.config import SHELL_TICK_INTERVAL_S, SchedulerConfig
from kvbudget.core.lifecycle import (
    LIVE_STATES,
    QUEUED_STATES,
    STOPPING_STATES,
    TERMINAL_STATES,
    Request,
    State,
)
from kvbudget.core.model import Capacity, RequestSpec, ServiceClass
from kvbudget.core.resume import Checkpoint
from kvbudget.core.scheduler import Scheduler
from kvbudget.core.stats import Snapshot
from kvbudget.engines.base import Engine, EngineStep, engine_request_id
from kvbudget.errors import (
    AlreadyReleased,
    BudgetClosed,
    ContinuationRequired,
    DuplicateRequest,
    EngineDead,
    EngineError,
    EngineStalled,
    InvalidInput,
    InvalidTransition,
    KvBudgetError,
    Overloaded,
    Preempted,
    UnknownRequest,
)
from kvbudget.names import NameFolder, NameLimits
from kvbudget.observability import get_logger
from kvbudget.validate import check_float

if TYPE_CHECKING:
    from kvbudget.core.cost import CostModel
    from kvbudget.core.lengths import LengthModel
    from kvbudget.core.policy import Policy

log = get_logger("kvbudget")

ShutdownMode = Literal["drain", "cancel"]
Outcome = Literal["completed", "cancelled", "rejected", "failed", "continued"]

_LIVE = LIVE_STATES
_STOPPED = STOPPING_STATES
_WAITING = QUEUED_STATES


@attrs.frozen(slots=True)
class GenerationStep:
    """One engine step as :meth:`Budget.generate` yields it.

    ``tokens``: new tokens in this step; ``generated``: output tokens so far (a resumed request
    counts the tokens of its checkpoint); ``at``: the budget clock when the step arrived;
    ``resumed``: the first step after a resumption from a checkpoint; ``finished``/``reason``:
    the last step, ``reason`` ``"stop"`` or ``"length"``.
    """

    tokens: int
    generated: int
    at: float
    resumed: bool = False
    finished: bool = False
    reason: Literal["stop", "length"] | None = None
    #: the engine's native output for this step (``EngineStep.payload``, e.g. a vLLM
    #: ``RequestOutput``); None for engines that pass none
    payload: object = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen(slots=True)
class GenerationResult:
    """What a request came to, delivered to the ``sink`` of :meth:`Budget.generate`.

    ``outcome``: ``completed``, ``cancelled``, ``rejected``, ``failed`` or ``continued``;
    ``tokens``: output tokens generated (checkpointed ones included); ``preemptions``: how often
    it was preempted and resumed; ``error``: the exception the caller saw (None if completed).
    """

    request_id: str
    outcome: Outcome
    tokens: int
    preemptions: int = 0
    error: BaseException | None = None


@attrs.frozen(slots=True)
class ShellCounters:
    """What the shell itself counts (the core counts everything else, see ``snapshot()``).

    ``duplicate_confirms``: confirmations swallowed because the stop they named was already
    released (or was of an earlier attempt); ``confirm_timeouts``: engine confirmations that did
    not come within ``confirm_timeout``; ``engine_errors``: requests failed by the engine
    (stalls and deaths included); ``reconciliations``: reconcile passes run.
    """

    duplicate_confirms: int = 0
    confirm_timeouts: int = 0
    engine_errors: int = 0
    reconciliations: int = 0


Sink = Callable[[GenerationResult], Any]


class Lease:
    """The per-request handle: ``async with budget.lease(spec) as lease: ...``.

    Entering waits for admission or raises :class:`~kvbudget.errors.Overloaded`. While held:
    :meth:`charge` books generated tokens (synchronous, O(1)); :meth:`wait_for_grant` waits for
    room past the boundary; :meth:`finish` ends it. Leaving the block finishes it (normal exit)
    or cancels it (exception, cancellation). Its blocks return to the budget only when
    :meth:`Budget.confirm_release` is called for it.
    """

    __slots__ = (
        "__weakref__",
        "_admits",
        "_admitted",
        "_arrived",
        "_attempt_base",
        "_budget",
        "_charge",
        "_clock",
        "_ended",
        "_event",
        "_handed",
        "_interrupt",
        "_received_at",
        "_req",
        "_resume",
        "attempt",
        "checkpoint",
        "preemptions",
        "request_id",
        "spec",
    )

    def __init__(
        self,
        budget: Budget,
        spec: RequestSpec,
        request_id: str,
        received_at: float | None = None,
    ) -> None:
        if not isinstance(spec, RequestSpec):
            raise InvalidInput("spec", spec, "a kvbudget.RequestSpec")
        if received_at is not None:
            received_at = check_float("received_at", received_at, minimum=-math.inf)
        self._received_at = received_at
        self._budget = budget
        self.spec = spec
        self.request_id = request_id
        self._charge = budget._sched.charge
        self._clock = budget._clock
        self._req: Request | None = None
        self._event: anyio.Event | None = None
        self._interrupt: KvBudgetError | None = None
        self._admitted = False
        self._arrived = False
        self._ended = False
        self._attempt_base = 0
        self._admits = 0
        self._handed = -1  # the last attempt handed to the caller (it may have started it)
        self._resume: Checkpoint | None = None
        #: engine attempt: 0 for the first run, +1 for each resumption after a preemption
        self.attempt = 0
        #: how often the lease was preempted
        self.preemptions = 0
        #: the checkpoint of the last preemption (None if never preempted)
        self.checkpoint: Checkpoint | None = None

    # -- read-only views -----------------------------------------------------------------------

    @property
    def generated(self) -> int:
        """Output tokens charged so far (a resumed lease counts its checkpoint's tokens)."""
        return self._req.generated if self._req is not None else 0

    @property
    def boundary(self) -> int:
        """Output tokens the grant covers: generating past it needs an extension."""
        return self._req.boundary if self._req is not None else 0

    @property
    def hard_max(self) -> int:
        """The most output tokens this request may ever generate."""
        return self.spec.hard_max

    @property
    def remaining_in_grant(self) -> int:
        """Tokens that may still be generated before the boundary."""
        req = self._req
        return max(0, req.boundary - req.generated) if req is not None else 0

    @property
    def blocks(self) -> int:
        """KV blocks the lease holds in the budget right now."""
        return self._req.blocks if self._req is not None else 0

    @property
    def state(self) -> str:
        """The core's lifecycle state of the request (``queued``, ``running``, ...)."""
        return self._req.state.value if self._req is not None else "new"

    @property
    def resume(self) -> Checkpoint | None:
        """The checkpoint the current attempt resumes from (None for the first attempt).

        It holds every token charged before the engine stopped, so it may be a little ahead of
        the :class:`~kvbudget.errors.Preempted` checkpoint, taken when the preemption was
        decided."""
        return self._resume

    # -- the hot path --------------------------------------------------------------------------

    def charge(self, n: int = 1) -> None:
        """Book ``n`` generated tokens. Raises HardLimitExceeded past the hard max, and the
        budget's interruption (Preempted, ContinuationRequired, ...) if one is pending."""
        actions = self._charge(self.request_id, n, self._clock())
        if actions:
            self._budget._apply(actions)
        if self._interrupt is not None:
            raise self._interrupt

    def note_cached(self, cached_tokens: int) -> bool:
        """The engine found ``cached_tokens`` of this request's prompt in its prefix cache (vLLM:
        the first output's ``num_cached_tokens``). Fewer whole blocks than the budget counted as
        shared with a twin: the engine's copies are charged to this request and counted
        (``prefix_mismatches``; :meth:`Scheduler.note_cached`). Returns whether it was a
        mismatch."""
        return self._budget._sched.note_cached(self.request_id, cached_tokens)

    def _book(self, n: int) -> None:
        """Like :meth:`charge` without raising a pending interruption (the driver checks)."""
        actions = self._charge(self.request_id, n, self._clock())
        if actions:
            self._budget._apply(actions)

    # -- waiting -------------------------------------------------------------------------------

    def _wake(self) -> None:
        event = self._event
        if event is not None:
            event.set()

    async def _wait_change(self) -> None:
        event = self._event = anyio.Event()
        try:
            await event.wait()
        finally:
            self._event = None

    async def wait_for_grant(self) -> None:
        """Return when the lease may generate again.

        At once if the grant has room (``remaining_in_grant > 0``); otherwise reports
        BoundaryReached to the core and waits until the grant has been extended past the
        current boundary. Raises Preempted (``checkpoint``, ``recompute_tokens``, ``reason``),
        ContinuationRequired (``continuation``), Overloaded (reason ``capacity-exhausted``: the
        request needs more KV than the engine has) or HardLimitExceeded (at the hard max).
        """
        if self._interrupt is not None:
            raise self._interrupt
        req = self._req
        if req is None or not self._admitted:
            raise InvalidTransition(self.request_id, self.state, "wait_for_grant")
        if req.generated < req.boundary:
            return
        budget = self._budget
        budget._apply(budget._sched.boundary_reached(self.request_id, self._clock()))
        while req.generated >= req.boundary and self._interrupt is None:
            await self._wait_change()
        if self._interrupt is not None:
            raise self._interrupt

    extend = wait_for_grant

    async def wait_resumed(self) -> Checkpoint:
        """After a Preempted: wait until the budget re-admits the request; returns the
        checkpoint to resume from. Raises Preempted (reason ``deadline``) if the request's
        deadline passed while it waited, AlreadyReleased if it finished instead (its last
        token, charged after the preemption was decided, was its hard max: the engine confirmed
        the stop with nothing left to generate), or BudgetClosed. Cancellation while waiting
        gives the place up at no cost."""
        ckpt = self.checkpoint
        if self._ended and isinstance(self._interrupt, Preempted | AlreadyReleased):
            # its deadline passed while it waited, or it finished before its preemption landed
            raise self._interrupt
        if (
            ckpt is None
            or self._ended
            or (self._interrupt is not None and not isinstance(self._interrupt, Preempted))
        ):
            raise InvalidTransition(self.request_id, self.state, "wait_resumed")
        if self.attempt == self._handed:
            self._interrupt = None  # the preemption the caller is handling
        await self._wait_admission()
        return self._resume or ckpt

    async def _wait_admission(self) -> None:
        """Wait for the admission of an attempt the caller has not been handed yet."""
        try:
            while True:
                interrupt = self._interrupt
                if interrupt is not None:
                    if (
                        isinstance(interrupt, Preempted)
                        and not self._ended
                        and self.attempt > self._handed
                    ):
                        self._confirm_unstarted()  # preempted before the caller saw it
                        continue
                    raise interrupt
                if self._admitted:
                    break
                await self._wait_change()
        except BaseException:
            self._abandon_unstarted()
            raise
        self._handed = self.attempt

    def _confirm_unstarted(self) -> None:
        """The current attempt was stopped before the caller was handed it: the engine never
        saw it, so its blocks are free now."""
        self._interrupt = None
        budget = self._budget
        budget._apply(budget._sched.confirm_release(self.request_id, self._clock()))

    def _end_for_cancel(self) -> Request | None:
        """Mark the lease ended; its core request if there is still one to cancel, else None
        (already ended, never arrived, or already released: then the lease is forgotten)."""
        if self._ended:
            return None
        self._ended = True
        req = self._req
        if req is None or req.state in TERMINAL_STATES:
            self._budget._leases.pop(self.request_id, None)
            return None
        return req

    def _abandon_unstarted(self) -> None:
        """The caller left while waiting for an admission: cancel at no cost."""
        req = self._end_for_cancel()
        if req is None:
            return
        budget = self._budget
        now = self._clock()
        state = req.state
        actions = budget._sched.cancel(self.request_id, now)
        if self.attempt > self._handed and state in (State.ADMITTED, State.PREEMPTING):
            # this attempt was never handed to the caller: the engine never saw it
            actions.extend(budget._sched.confirm_release(self.request_id, now))
        budget._apply(actions)
        self._forget_if_over()

    def _forget_if_over(self) -> None:
        """The budget stops tracking a lease whose request is over. Needed where the core
        ends a queued request at once (cancelled or failed while it waited, after a
        preemption too): no Released or Reject comes for it to do so."""
        req = self._req
        if req is not None and req.state in TERMINAL_STATES:
            self._budget._leases.pop(self.request_id, None)

    # -- ending --------------------------------------------------------------------------------

    def finish(self, reason: Literal["stop", "length"] = "stop") -> None:
        """The request stopped by itself (``stop``) or at its hard max (``length``). Its blocks
        stay charged until :meth:`Budget.confirm_release`."""
        if self._ended:
            raise InvalidTransition(self.request_id, self.state, "finish")
        budget = self._budget
        actions = budget._sched.finish(self.request_id, reason, self._clock())
        self._ended = True
        if isinstance(self._interrupt, Preempted):
            self._interrupt = None  # it finished before the preemption landed
        budget._log("finished", self, reason=reason, generated=self.generated)
        budget._apply(actions)

    def cancel(self) -> None:
        """Give the request up (the caller went away). Queued: gone at no cost. Running: the
        engine must abort it; its blocks stay charged until confirmed."""
        if self._end_for_cancel() is None:
            return
        budget = self._budget
        actions = budget._sched.cancel(self.request_id, self._clock())
        budget._log("cancelled", self, generated=self.generated)
        budget._apply(actions)
        self._forget_if_over()

    def fail(self, detail: str) -> None:
        """The engine failed the request. Its blocks stay charged until confirmed."""
        if self._ended:
            return
        self._ended = True
        budget = self._budget
        actions = budget._sched.fail(self.request_id, detail, self._clock())
        budget._log("failed", self, detail=detail, level="warning")
        budget._apply(actions)
        self._forget_if_over()

    # -- the context manager -------------------------------------------------------------------

    def arrive(self) -> None:
        """Arrive at the budget now, synchronously: raises Overloaded (or BudgetClosed,
        DuplicateRequest) at once, before anything is awaited, so that a server can answer
        429 before it starts a response. Entering the lease afterwards waits for the
        admission (or, left unentered, is given up with :meth:`cancel`)."""
        if self._arrived:
            raise InvalidTransition(self.request_id, self.state, "arrive")
        budget = self._budget
        if budget._closed:
            raise BudgetClosed()
        rid = self.request_id
        if rid in budget._leases:
            raise DuplicateRequest(rid)
        self._arrived = True
        sched = budget._sched
        now = self._clock()
        try:
            actions = sched.arrive(rid, self.spec, now, received_at=self._received_at)
        except Exception:
            # (a policy answer refused in the admission pass: the caller gets the error, and
            # the request the core queued for it is given up, not left to be admitted for
            # nobody; what the pass had decided for others comes out of the next one)
            if rid in sched.requests:
                with contextlib.suppress(Exception):
                    budget._apply(sched.cancel(rid, now))
            raise
        self._req = sched.requests.get(rid)
        if self._req is not None:
            budget._leases[rid] = self
        budget._apply(actions, arriving=self)
        if self._interrupt is not None:
            raise self._interrupt

    async def __aenter__(self) -> Lease:
        if not self._arrived:
            self.arrive()
        elif self._interrupt is not None:
            raise self._interrupt
        if self._admitted:
            self._handed = self.attempt
        else:
            await self._wait_admission()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._ended:
            return
        req = self._req
        if req is None:
            return
        if exc_type is None and req.state in _LIVE:
            self.finish("length" if req.generated >= req.hard_max else "stop")
        else:
            self.cancel()

    def __repr__(self) -> str:
        return (
            f"Lease({self.request_id!r}, {self.state}, generated={self.generated}, "
            f"boundary={self.boundary}, hard_max={self.hard_max})"
        )


def _stream_error(exc: Exception, eid: str) -> EngineError:
    """What an engine stream's failure to yield a step means for the request."""
    if isinstance(exc, StopAsyncIteration):
        return EngineError(eid, "the stream ended without a finished step")
    return EngineError(eid, f"{type(exc).__name__}: {exc}")


class _Holder:
    """Mutable result of one generation while it runs."""

    __slots__ = ("error", "lease", "outcome", "preemptions", "tokens")

    def __init__(self) -> None:
        self.lease: Lease | None = None
        self.outcome: Outcome | None = None
        self.tokens = 0
        self.preemptions = 0
        self.error: BaseException | None = None


_RELEASED_STATES = frozenset({State.CHECKPOINTED, State.QUEUED, State.RELEASED, State.REJECTED})


def _give_up_unstarted(lease: Lease) -> None:
    """The iterator of a request that arrived at :meth:`Budget.generate` was dropped without
    being started: its place in the queue (or its admission, which no engine ever saw) goes."""
    if lease._ended or lease._req is None or lease._handed >= 0:
        return  # ended, never queued, or handed to the driver (whose own exit handles it)
    lease._abandon_unstarted()


class _Superseded(Exception):
    """The attempt being consumed was already preempted and released."""


def _classify(exc: BaseException) -> Outcome:
    """How a request that ended with ``exc`` is counted."""
    if isinstance(exc, ContinuationRequired):
        return "continued"
    if isinstance(exc, BudgetClosed) or not isinstance(exc, Exception):
        return "cancelled"
    return "failed"


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Budget:
    """A KV-cache budget for one engine: admission, grants, extensions, release on confirmation.

    ``capacity``: the engine's KV cache. ``classes``/``policy``/``config``/``lengths``/``cost``
    configure the core :class:`~kvbudget.core.scheduler.Scheduler`. ``clock``: seconds, monotonic
    (default ``time.monotonic``). ``shutdown``: on leaving ``async with budget``, ``"drain"``
    waits for durable requests and pending confirmations, ``"cancel"`` cancels them.
    ``confirm_timeout``: how long the driver waits for an engine's release confirmation (default:
    the config's ``confirm_timeout_s``). ``tick_interval``: seconds between background ticks.
    ``stall_timeout``: the longest an engine step may take in :meth:`generate` before
    EngineStalled (None: no limit). ``engine``: the engine whose ``kv_used_blocks()`` reconciles
    unconfirmed stops (:meth:`generate` attaches the engine it is given if none is set).
    ``names``: how many client-chosen tenants and tasks are kept apart before the rest fold into
    ``other`` (:class:`~kvbudget.names.NameLimits`, default 64 of each; the keys of
    ``config.tenant_weights`` are always kept); applied to every spec :meth:`lease` and
    :meth:`generate` take, so the core never sees an unbounded set of names.
    """

    def __init__(
        self,
        capacity: Capacity,
        *,
        classes: Mapping[str, ServiceClass] | Iterable[ServiceClass] | None = None,
        policy: Policy | str | None = None,
        config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        lengths: LengthModel | None = None,
        cost: CostModel | None = None,
        shutdown: ShutdownMode = "drain",
        confirm_timeout: float | None = None,
        tick_interval: float = SHELL_TICK_INTERVAL_S,
        stall_timeout: float | None = None,
        engine: Engine | None = None,
        names: NameLimits | NameFolder | None = None,
    ) -> None:
        if shutdown not in ("drain", "cancel"):
            raise InvalidInput("shutdown", shutdown, "'drain' or 'cancel'")
        self._sched = Scheduler(
            capacity, classes=classes, policy=policy, lengths=lengths, cost=cost, config=config
        )
        self.config = self._sched.config
        if not isinstance(names, NameFolder):
            limits = names if names is not None else NameLimits()
            names = NameFolder(limits.with_known(tenants=self.config.tenant_weights))
        #: the folder that bounds client-chosen tenants and tasks (see :mod:`kvbudget.names`)
        self.names = names
        self._clock = clock
        self.shutdown = shutdown
        self.confirm_timeout = check_float(
            "confirm_timeout",
            confirm_timeout if confirm_timeout is not None else self.config.confirm_timeout_s,
            open_min=True,
        )
        self.tick_interval = check_float("tick_interval", tick_interval, open_min=True)
        if stall_timeout is not None:
            check_float("stall_timeout", stall_timeout, open_min=True)
        self.stall_timeout = stall_timeout
        self.engine = engine
        self._leases: dict[str, Lease] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._policy_faults_logged = 0
        self._policy_fault_logged_at = -math.inf
        #: ticks that raised (logged as ``tick_failed``, at most once a second)
        self.tick_failures = 0
        self._tick_failure_logged = -math.inf
        self._closed = False
        self._running = False
        self._jobs = 0
        self._idle: anyio.Event | None = None
        self._ids = itertools.count(1)
        self._prefix = os.urandom(4).hex()
        self._duplicate_confirms = 0
        self._confirm_timeouts = 0
        self._engine_errors = 0
        self._reconciliations = 0

    # -- introspection -------------------------------------------------------------------------

    @property
    def scheduler(self) -> Scheduler:
        """The core this budget drives (read it; do not feed it events behind the budget)."""
        return self._sched

    @property
    def capacity(self) -> Capacity:
        return self._sched.capacity

    @property
    def closed(self) -> bool:
        return self._closed

    def snapshot(self) -> Snapshot:
        """The core's frozen :class:`~kvbudget.core.stats.Snapshot` of the budget now."""
        return self._sched.snapshot()

    @property
    def counters(self) -> ShellCounters:
        return ShellCounters(
            duplicate_confirms=self._duplicate_confirms,
            confirm_timeouts=self._confirm_timeouts,
            engine_errors=self._engine_errors,
            reconciliations=self._reconciliations,
        )

    @property
    def pending_leases(self) -> int:
        """Leases the budget still tracks (queued, running, or awaiting confirmation)."""
        return len(self._leases)

    def new_request_id(self) -> str:
        return f"kvb-{self._prefix}-{next(self._ids)}"

    # -- leases --------------------------------------------------------------------------------

    def lease(
        self,
        spec: RequestSpec,
        request_id: str | None = None,
        *,
        received_at: float | None = None,
    ) -> Lease:
        """A lease for one request; enter it (``async with``) to wait for admission.

        ``received_at``: when the server received the request, on this budget's clock
        (:meth:`now`), if that was before it arrives at the budget: the request's first-token
        objective, queue delay and deadline then run from that moment, as its caller's clock
        does, not from the arrival after the server's parsing and tokenization. Not a finite
        number, or later than the arrival: InvalidInput."""
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise InvalidInput("request_id", request_id, "a non-empty string or None")
        return Lease(
            self, self.names.fold(spec), request_id or self.new_request_id(), received_at
        )

    def now(self) -> float:
        """The budget's clock (``clock``, by default ``time.monotonic``): what a server stamps
        a request's receipt with (``received_at``)."""
        return self._clock()

    def confirm_release(self, request_id: str, *, attempt: int | None = None) -> bool:
        """The engine confirms that the stopped request's KV is free: its blocks return now.

        ``attempt``: the engine attempt the confirmation is about (see
        :func:`~kvbudget.engines.base.engine_request_id`); a confirmation of an earlier attempt
        than the lease's current one is stale. Stale, duplicated and unknown confirmations are
        swallowed, counted in ``counters.duplicate_confirms`` and return False; True when
        blocks were returned.
        """
        lease = self._leases.get(request_id)
        if lease is not None and attempt is not None and attempt != lease.attempt:
            return self._duplicate(request_id, "stale-attempt")
        try:
            actions = self._sched.confirm_release(request_id, self._clock())
        except (InvalidTransition, UnknownRequest):
            return self._duplicate(request_id, "not-awaiting-confirmation")
        self._apply(actions)
        return True

    def _duplicate(self, request_id: str, why: str) -> bool:
        self._duplicate_confirms += 1
        log.info("duplicate_confirmation", request_id=request_id, why=why)
        return False

    # -- applying actions ----------------------------------------------------------------------

    def _log(self, event: str, lease: Lease, level: str = "debug", **kw: Any) -> None:
        if level == "debug" and not log.debug_wanted():
            return
        spec = lease.spec
        getattr(log, level)(
            event,
            request_id=lease.request_id,
            service_class=spec.service_class,
            tenant=spec.tenant,
            **kw,
        )

    def _log_policy_faults(self) -> None:
        """The policy faults the core went on after since the last report: the latest, with
        how many (at most once a second: a policy broken for good faults on every tick)."""
        sched = self._sched
        now = self._clock()
        if now - self._policy_fault_logged_at < 1.0:
            return  # (the ticker's next apply after that second reports them)
        self._policy_fault_logged_at = now
        new = sched.policy_faults - self._policy_faults_logged
        self._policy_faults_logged = sched.policy_faults
        fault = sched.policy_fault_log[-1]
        log.error(
            "policy_fault",
            policy=fault.policy,
            detail=fault.detail,
            faults=sched.policy_faults,
            new=new,
        )

    def _apply(self, actions: Iterable[ev.Action], arriving: Lease | None = None) -> None:
        """Carry out the core's actions: update the leases they name and wake their waiters."""
        if self._sched.policy_faults != self._policy_faults_logged:
            self._log_policy_faults()
        leases = self._leases
        for a in actions:
            rid = a.request_id
            lease = leases.get(rid)
            if lease is None:
                if arriving is None or arriving.request_id != rid:
                    log.debug("action_without_lease", action=type(a).__name__, request_id=rid)
                    continue
                lease = arriving
            if isinstance(a, ev.Extend):
                self._log("extension", lease, boundary=a.boundary, blocks=a.blocks)
                lease._wake()
            elif isinstance(a, ev.Admit):
                if lease._admits:
                    lease.attempt += 1
                lease._admits += 1
                lease._resume = a.resume
                lease._interrupt = None  # a new attempt begins
                lease._attempt_base = a.resume.generated_tokens if a.resume is not None else 0
                lease._admitted = True
                self._log(
                    "admission",
                    lease,
                    boundary=a.boundary,
                    blocks=a.blocks,
                    resumed=a.resume is not None,
                )
                lease._wake()
            elif isinstance(a, ev.Deny):
                self._log("denial", lease, reason=a.reason)
            elif isinstance(a, ev.Preempt):
                lease.preemptions += 1
                lease._admitted = False
                lease.checkpoint = a.checkpoint
                lease._interrupt = Preempted(a.checkpoint, a.recompute_tokens, a.reason)
                self._log(
                    "preemption",
                    lease,
                    level="info",
                    reason=a.reason,
                    recompute_tokens=a.recompute_tokens,
                    generated=a.checkpoint.generated_tokens,
                )
                lease._wake()
            elif isinstance(a, ev.Continue):
                lease._ended = True
                lease._interrupt = ContinuationRequired(a.continuation)
                self._log(
                    "continuation",
                    lease,
                    level="info",
                    continuation_id=a.continuation.continuation_id,
                    generated=a.continuation.generated_tokens,
                )
                lease._wake()
            elif isinstance(a, ev.Abort):
                self._log("abort", lease, level="info", reason=a.reason)
                if a.reason != "cancelled":
                    # the core ended it (capacity-exhausted: it needs more KV than there is)
                    lease._ended = True
                    lease._interrupt = Overloaded(self.config.max_retry_after_s, a.reason, rid)
                    lease._wake()
            elif isinstance(a, ev.Reject):
                lease._ended = True
                leases.pop(rid, None)
                ckpt = lease.checkpoint
                if ckpt is not None:
                    # a checkpointed request whose deadline passed while it waited to resume
                    lease._interrupt = Preempted(ckpt, ckpt.recompute_tokens, a.reason)
                else:
                    lease._interrupt = Overloaded(a.retry_after, a.reason, rid)
                self._log(
                    "rejection", lease, level="info", reason=a.reason, retry_after=a.retry_after
                )
                lease._wake()
            elif isinstance(a, ev.Released):
                self._log(
                    "confirmation",
                    lease,
                    blocks=a.blocks,
                    outcome=a.outcome,
                    resumable=a.resumable,
                )
                if not a.resumable:
                    leases.pop(rid, None)
                    if not lease._ended:
                        # a preempted request whose last token came before its preemption
                        # landed finished: its caller, waiting to resume, has nothing to resume
                        lease._ended = True
                        lease._interrupt = AlreadyReleased(rid, "wait_resumed")
                lease._wake()

    # -- the task group, ticker and shutdown ---------------------------------------------------

    async def __aenter__(self) -> Budget:
        if self._running or self._closed:
            raise InvalidTransition("budget", "running" if self._running else "closed", "enter")
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        self._running = True
        tg.start_soon(self._ticker)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        tg = self._tg
        assert tg is not None
        self._closed = True
        try:
            if exc_type is None and self.shutdown == "drain":
                while self._jobs:
                    idle = self._idle = anyio.Event()
                    await idle.wait()
        finally:
            tg.cancel_scope.cancel()
            try:
                suppressed = await tg.__aexit__(exc_type, exc, tb)
            finally:
                self._tg = None
                self._running = False
                self._close_waiters()
        return suppressed

    def _close_waiters(self) -> None:
        """The budget is closed: callers still queued get BudgetClosed at no cost."""
        now = self._clock()
        for lease in list(self._leases.values()):
            req = lease._req
            if req is not None and req.state in _WAITING and not lease._ended:
                lease._ended = True
                self._leases.pop(lease.request_id, None)
                self._apply(self._sched.cancel(lease.request_id, now))
                lease._interrupt = BudgetClosed()
                lease._wake()

    def _start_job(self, fn: Callable[..., Any], *args: Any) -> None:
        tg = self._tg
        if tg is None:
            raise BudgetClosed()
        self._jobs += 1
        tg.start_soon(self._job, fn, *args)

    async def _job(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            await fn(*args)
        finally:
            self._jobs -= 1
            if not self._jobs and self._idle is not None:
                self._idle.set()

    async def _ticker(self) -> None:
        sched = self._sched
        while True:
            await anyio.sleep(self.tick_interval)
            now = self._clock()
            try:
                self._apply(sched.tick(now))
                engine = self.engine
                if engine is not None and self._has_unconfirmed():
                    used = engine.kv_used_blocks()
                    if used is not None:
                        self.reconcile(used)
            except Exception as exc:
                # (the core keeps a policy's faults itself; this is anything else, an engine's
                # KV usage read that raised, say: the ticker goes on, and says so at most once
                # a second)
                self.tick_failures += 1
                if now - self._tick_failure_logged >= 1.0:
                    self._tick_failure_logged = now
                    log.error("tick_failed", failures=self.tick_failures, error=repr(exc))

    def _has_unconfirmed(self) -> bool:
        if not self._sched.releasing:
            return False
        return any(
            lease._req is not None and lease._req.unconfirmed and lease._req.state in _STOPPED
            for lease in self._leases.values()
        )

    def observe_step(self, batch_size: int, context_tokens: int, seconds: float) -> None:
        """Feed one measured engine decode step to the core's cost model, which predicts the
        step time the latency floor is checked against (adapters call it once per step)."""
        self._apply(self._sched.observe_step(batch_size, context_tokens, seconds, self._clock()))

    def reconcile(self, engine_used_blocks: int) -> None:
        """Reconcile the ledger with the engine's own KV usage: stops that were never confirmed
        and whose blocks the engine no longer holds are released.

        Live requests whose engine attempt has not produced a token yet may not hold their
        prompt's blocks in the engine yet; their blocks are added to the figure the core sees,
        so that the core cannot take blocks the engine still holds for a stop as theirs.
        """
        not_started = 0
        for lease in self._leases.values():
            req = lease._req
            if (
                req is not None
                and req.state in _LIVE
                and req.generated <= max(lease._attempt_base, 0)
            ):
                not_started += req.used_blocks
        self._reconciliations += 1
        actions = self._sched.reconcile(engine_used_blocks + not_started, self._clock())
        released = [a for a in actions if isinstance(a, ev.Released)]
        if released:
            log.info(
                "reconciliation",
                released=[a.request_id for a in released],
                blocks=sum(a.blocks for a in released),
                engine_used_blocks=engine_used_blocks,
            )
        self._apply(actions)

    # -- the generic driver --------------------------------------------------------------------

    def generate(
        self,
        engine: Engine,
        spec: RequestSpec,
        *,
        request_id: str | None = None,
        sink: Sink | None = None,
        stall_timeout: float | None = None,
        arrive_now: bool = False,
        received_at: float | None = None,
    ) -> AsyncGenerator[GenerationStep, None]:
        """Run one request end to end over ``engine``; yields a :class:`GenerationStep` per step.

        ``arrive_now``: the request arrives at the budget during this call, so that a refusal
        raises :class:`~kvbudget.errors.Overloaded` here, before anything is awaited (a server
        answers 429 before it starts a response); a returned iterator that is dropped without
        being started gives its place (or its admission) up. ``received_at``: when the server
        received the request, on the budget's clock (:meth:`lease`).

        Admission through a lease (Overloaded at once if refused), every step charged, the
        engine pulled only inside the grant (at the boundary the driver waits for the
        extension), preemption handled (abort, confirmation, re-admission, resumption from the
        checkpoint), continuation raised as ContinuationRequired, engine failures raised as
        EngineError/EngineDead/EngineStalled after failing the request. Blocks return to the
        budget only on the engine's confirmation (``wait_released``), awaited in the budget's
        task group. Cancelling the caller aborts the engine request unless ``spec.durable``: a
        durable request keeps running in the budget's task group and its
        :class:`GenerationResult` goes to ``sink`` (a callable or async callable; also called
        for non-durable requests when given). Use ``contextlib.aclosing`` to close the iterator
        promptly when breaking out of the loop. Requires ``async with budget``.
        """
        return self._start(
            engine, spec, request_id, sink, stall_timeout, arrive_now, False, received_at
        )

    def generate_payloads(
        self,
        engine: Engine,
        spec: RequestSpec,
        *,
        request_id: str | None = None,
        sink: Sink | None = None,
        stall_timeout: float | None = None,
        arrive_now: bool = False,
        received_at: float | None = None,
    ) -> AsyncGenerator[Any, None]:
        """:meth:`generate`, yielding each step's engine payload (``EngineStep.payload``, e.g. a
        vLLM ``RequestOutput``) rather than a :class:`GenerationStep`; steps without a payload
        are charged and not yielded. For adapters that translate the engine's own outputs and
        read nothing else of a step: one object fewer built on every token."""
        return self._start(
            engine, spec, request_id, sink, stall_timeout, arrive_now, True, received_at
        )

    def _start(
        self,
        engine: Engine,
        spec: RequestSpec,
        request_id: str | None,
        sink: Sink | None,
        stall_timeout: float | None,
        arrive_now: bool,
        payloads: bool,
        received_at: float | None,
    ) -> AsyncGenerator[Any, None]:
        if not self._running or self._closed:
            raise BudgetClosed()
        if self.engine is None:
            self.engine = engine
        rid = request_id or self.new_request_id()
        stall = stall_timeout if stall_timeout is not None else self.stall_timeout
        # (made now, arrived or not: its spec and received_at are checked here, and a lazy
        # generator's request arrives with them when it starts)
        lease = self.lease(spec, rid, received_at=received_at)
        spec = lease.spec
        if arrive_now:
            lease.arrive()
        if spec.durable:
            gen = self._durable(engine, spec, rid, sink, stall, lease, payloads)
        elif sink is None:  # (one async-generator layer fewer on every token)
            gen = self._steps(engine, spec, rid, _Holder(), stall, lease, payloads)
        else:
            gen = self._inline(engine, spec, rid, sink, stall, lease, payloads)
        if arrive_now:
            weakref.finalize(gen, _give_up_unstarted, lease)
        return gen

    async def _inline(
        self,
        engine: Engine,
        spec: RequestSpec,
        rid: str,
        sink: Sink | None,
        stall: float | None,
        lease: Lease | None = None,
        payloads: bool = False,
    ) -> AsyncGenerator[Any, None]:
        holder = _Holder()
        try:
            async with aclosing(
                self._steps(engine, spec, rid, holder, stall, lease, payloads)
            ) as steps:
                async for step in steps:
                    yield step
        except BaseException as exc:
            holder.error = exc
            raise
        finally:
            if sink is not None:
                await self._deliver(sink, rid, holder)

    async def _durable(
        self,
        engine: Engine,
        spec: RequestSpec,
        rid: str,
        sink: Sink | None,
        stall: float | None,
        lease: Lease | None = None,
        payloads: bool = False,
    ) -> AsyncGenerator[Any, None]:
        send, recv = anyio.create_memory_object_stream[Any](math.inf)
        self._start_job(self._durable_job, engine, spec, rid, sink, stall, send, lease, payloads)
        with recv:
            async for item in recv:
                if isinstance(item, _Failure):
                    raise item.error
                yield item

    async def _durable_job(
        self,
        engine: Engine,
        spec: RequestSpec,
        rid: str,
        sink: Sink | None,
        stall: float | None,
        send: MemoryObjectSendStream[Any],
        lease: Lease | None = None,
        payloads: bool = False,
    ) -> None:
        holder = _Holder()
        with send:
            try:
                async with aclosing(
                    self._steps(engine, spec, rid, holder, stall, lease, payloads)
                ) as steps:
                    async for step in steps:
                        with contextlib.suppress(anyio.BrokenResourceError):
                            send.send_nowait(step)  # the caller may be gone: it runs on
            except Exception as exc:
                holder.error = exc
                with contextlib.suppress(anyio.BrokenResourceError):
                    send.send_nowait(_Failure(exc))
            except BaseException as exc:  # cancelled by a "cancel" shutdown
                holder.error = exc
                raise
            finally:
                if sink is not None:
                    await self._deliver(sink, rid, holder)

    async def _deliver(self, sink: Sink, rid: str, holder: _Holder) -> None:
        # the core's word on how the request ended wins over what the shell saw: a caller
        # cancelled at the instant the core turned it away was rejected, not cancelled
        req = holder.lease._req if holder.lease is not None else None
        decided: Outcome | None = (
            req.outcome.value if req is not None and req.outcome is not None else None
        )
        result = GenerationResult(
            request_id=rid,
            outcome=decided or holder.outcome or "cancelled",
            tokens=holder.tokens,
            preemptions=holder.preemptions,
            error=holder.error,
        )
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.confirm_timeout):
            try:
                out = sink(result)
                if inspect.isawaitable(out):
                    await out
            except Exception:
                log.exception("sink_failed", request_id=rid)

    async def _steps(
        self,
        engine: Engine,
        spec: RequestSpec,
        rid: str,
        holder: _Holder,
        stall: float | None,
        arrived: Lease | None = None,
        payloads: bool = False,
    ) -> AsyncGenerator[Any, None]:
        lease = arrived if arrived is not None else self.lease(spec, rid)
        holder.lease = lease
        clock = self._clock
        released = _RELEASED_STATES
        try:
            await lease.__aenter__()
        except BaseException as exc:
            holder.outcome = "rejected" if isinstance(exc, Overloaded) else _classify(exc)
            raise
        final: GenerationStep | None = None
        core = lease._req  # (the core's request: read directly on every step below)
        assert core is not None  # admitted
        hard_max = spec.hard_max
        try:
            while final is None:  # one engine attempt per iteration
                attempt = lease.attempt
                eid = engine_request_id(rid, attempt)
                stream = engine.generate(
                    eid, spec.prompt_tokens, lease.hard_max, resume=lease.resume
                )
                resumed = attempt > 0
                anext = stream.__anext__
                try:
                    while True:
                        if lease._interrupt is not None:
                            raise lease._interrupt
                        generated = core.generated
                        if generated >= core.boundary and generated < hard_max:
                            await lease.wait_for_grant()
                        if lease.attempt != attempt:
                            raise _Superseded()
                        if stall is None:
                            try:
                                step = await anext()
                            except KvBudgetError:
                                raise
                            except Exception as exc:
                                raise _stream_error(exc, eid) from exc
                        else:
                            step = await self._pull(stream, eid, stall)
                        if lease.attempt != attempt or core.state in released:
                            # this attempt was preempted and its stop already confirmed (the
                            # engine freed it) before its output was consumed: drop the output
                            if lease._ended and lease._interrupt is not None:
                                raise lease._interrupt  # (it ended: continuation, ...)
                            raise _Superseded()
                        if step.new_tokens:
                            lease._book(step.new_tokens)
                        holder.tokens = core.generated
                        if step.finished:
                            reason = step.finish_reason
                            if reason == "stop" or reason == "length":
                                lease.finish(reason)
                                holder.outcome = "completed"
                                final = GenerationStep(
                                    step.new_tokens,
                                    lease.generated,
                                    clock(),
                                    resumed,
                                    True,
                                    reason,
                                    step.payload,
                                )
                                break
                            raise EngineError(eid, f"the engine ended the stream ({reason!r})")
                        if step.new_tokens:
                            # (a token booked after a preemption landed is kept in the resume
                            # checkpoint, so the caller gets it too)
                            if not payloads:
                                yield GenerationStep(
                                    step.new_tokens, core.generated, clock(), resumed, False,
                                    None, step.payload,
                                )
                            elif step.payload is not None:
                                yield step.payload
                            resumed = False
                        if lease._interrupt is not None:
                            raise lease._interrupt
                except BaseException as exc:
                    superseded = (
                        isinstance(exc, Exception)
                        and not lease._ended
                        and (lease.attempt != attempt or core.state in released)
                    )
                    if superseded or (
                        isinstance(exc, Preempted) and lease._interrupt is exc and not lease._ended
                    ):
                        holder.preemptions = lease.preemptions
                        await self._stop_engine(engine, stream, eid)
                        if not superseded:
                            self._after_stop(engine, eid, rid, attempt)
                        await lease.wait_resumed()  # raises if it will not resume
                        continue
                    self._on_error(lease, holder, exc)
                    await self._stop_engine(engine, stream, eid)
                    if lease._req is not None and lease._req.state in _STOPPED:
                        self._after_stop(engine, eid, rid, attempt)
                    raise
                await self._close_stream(stream)
                self._after_stop(engine, eid, rid, attempt)
        except BaseException as exc:
            if holder.outcome is None:
                holder.outcome = _classify(exc)
            await lease.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        await lease.__aexit__(None, None, None)
        if not payloads:
            yield final
        elif final.payload is not None:
            yield final.payload

    def _on_error(self, lease: Lease, holder: _Holder, exc: BaseException) -> None:
        """Record how the request ended and tell the core, before the engine is stopped."""
        holder.outcome = _classify(exc)
        if isinstance(exc, ContinuationRequired | Overloaded | Preempted):
            return  # the core itself stopped the request
        if isinstance(exc, Exception):
            if isinstance(exc, EngineError):
                self._engine_errors += 1
            lease.fail(f"{type(exc).__name__}: {exc}")
        else:  # cancellation, GeneratorExit: the caller went away
            lease.cancel()

    async def _pull(self, stream: Any, eid: str, stall: float) -> EngineStep:
        """The engine stream's next step within ``stall`` seconds (without a stall timeout
        :meth:`_steps` awaits the stream itself: the hot path)."""
        try:
            with anyio.fail_after(stall):
                return await stream.__anext__()  # type: ignore[no-any-return]
        except TimeoutError:
            raise EngineStalled(eid, f"no step within {stall}s") from None
        except KvBudgetError:
            raise
        except Exception as exc:
            raise _stream_error(exc, eid) from exc

    async def _close_stream(self, stream: Any) -> None:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            with anyio.CancelScope(shield=True):
                try:
                    await aclose()
                except Exception:
                    log.debug("stream_close_failed", exc_info=True)

    async def _stop_engine(self, engine: Engine, stream: Any, eid: str) -> None:
        """Abort the engine request and close its stream, shielded from the caller's cancel."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.confirm_timeout):
            try:
                await engine.abort(eid)
            except EngineDead:
                pass
            except Exception:
                log.exception("abort_failed", engine_request_id=eid)
            await self._close_stream(stream)

    def _after_stop(self, engine: Engine, eid: str, rid: str, attempt: int) -> None:
        """Wait for the engine's confirmation in the budget's task group, then confirm."""
        if self._tg is None:
            log.warning("unconfirmed_no_task_group", request_id=rid, engine_request_id=eid)
            return
        self._start_job(self._confirm_job, engine, eid, rid, attempt)

    async def _confirm_job(self, engine: Engine, eid: str, rid: str, attempt: int) -> None:
        try:
            ok = await engine.wait_released(eid, self.confirm_timeout)
        except EngineError:
            ok = False
        if ok:
            self.confirm_release(rid, attempt=attempt)
        else:
            self._confirm_timeouts += 1
            log.info("unconfirmed", request_id=rid, engine_request_id=eid)


__all__ = ["Budget", "GenerationResult", "GenerationStep", "Lease", "ShellCounters"]
