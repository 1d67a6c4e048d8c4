"""The ledger: who holds which KV blocks, and the request lifecycle as one transition table.

Theory of operation
-------------------
Capacity is ``C`` whole blocks. Every block is in exactly one of two places: held by a request's
*grant* (``reserved``) or *free*. Free blocks are split by rule, not by bookkeeping:

* the *headroom pool* is the ``headroom_target`` blocks that an admission must leave free, so that
  in-flight grants can extend; its first ``protected_blocks`` are the *protected* part that only
  protected (interactive) classes may take;
* the *admission budget* is what is free beyond the headroom target.

So ``reserved + free == C`` always, an admission needs ``free - blocks >= headroom_target``, an
unprotected extension needs ``free - blocks >= protected_blocks`` and a protected one only
``free >= blocks``. One exception, decided by the scheduler: a protected request at the head of
the queue may take the headroom beyond the protected part (``free - blocks >= protected_blocks``)
when its policy's gate allows it and no extension is waiting, or, while extensions wait, instead
of checkpointing batch work to meet its bound. Headroom "in use" is how far ``free`` has fallen
below the target.

A grant covers ``boundary`` output tokens: ``blocks = ceil((prompt + boundary + slack) / B)``
where ``slack`` is a small per-grant reserve for engines that overshoot by a step before they can
be stopped. A request's blocks return only through :meth:`Ledger.release`, which the scheduler
calls on the engine's confirmation and on nothing else.

Every change of a request's lifecycle state goes through :data:`TRANSITIONS`: a table from
(state, trigger) to the next state. A trigger a state does not accept raises
:class:`~kvbudget.errors.InvalidTransition` before anything changes.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvbudget.core.model import (
    CalibrationKey,
    Capacity,
    Checkpoint,
    RequestSpec,
    ServiceClass,
    blocks_for,
    check_int,
)
from kvbudget.errors import AlreadyReleased, InvalidTransition, PolicyViolation

if TYPE_CHECKING:
    from kvbudget.core.stats import Counters


class State(enum.Enum):
    QUEUED = "queued"  # waiting for admission, holds nothing
    ADMITTED = "admitted"  # grant made, no token yet
    RUNNING = "running"  # generating inside its grant
    EXTENDING = "extending"  # at its boundary, waiting for the grant to grow
    PREEMPTING = "preempting"  # stopped with a checkpoint, blocks held until the engine confirms
    CHECKPOINTED = "checkpointed"  # preempted and confirmed: queued again to resume, holds nothing
    RELEASING = "releasing"  # stopped for good, blocks held until the engine confirms
    RELEASED = "released"  # terminal: blocks returned (or never held)
    REJECTED = "rejected"  # terminal: turned away before admission, never held blocks


class Outcome(enum.Enum):
    COMPLETED = "completed"  # stopped by itself or at its hard max
    CANCELLED = "cancelled"
    CONTINUED = "continued"  # ended with an explicit continuation
    FAILED = "failed"
    REJECTED = "rejected"


class Trigger(enum.Enum):
    ADMIT = "admit"
    REJECT = "reject"
    TOKENS = "tokens"
    BLOCK = "block"  # reached the boundary without an extension
    EXTEND = "extend"
    FINISH = "finish"
    CANCEL = "cancel"
    FAIL = "fail"
    CONTINUE = "continue"
    PREEMPT = "preempt"
    CONFIRM = "confirm"
    EXPIRE = "expire"  # a checkpointed request missed its deadline while queued


S, T = State, Trigger
_LIVE = (S.ADMITTED, S.RUNNING, S.EXTENDING)

#: (state, trigger) -> next state. Anything absent is an invalid transition.
TRANSITIONS: dict[tuple[State, Trigger], State] = {
    (S.QUEUED, T.ADMIT): S.ADMITTED,
    (S.QUEUED, T.REJECT): S.REJECTED,
    (S.QUEUED, T.CANCEL): S.RELEASED,
    (S.CHECKPOINTED, T.ADMIT): S.ADMITTED,
    (S.CHECKPOINTED, T.CANCEL): S.RELEASED,
    (S.CHECKPOINTED, T.EXPIRE): S.RELEASED,
    (S.QUEUED, T.FAIL): S.RELEASED,  # failed before it held anything
    (S.CHECKPOINTED, T.FAIL): S.RELEASED,
    (S.ADMITTED, T.TOKENS): S.RUNNING,
    (S.RUNNING, T.TOKENS): S.RUNNING,
    (S.EXTENDING, T.TOKENS): S.EXTENDING,  # tokens inside the reserved slack
    (S.RUNNING, T.BLOCK): S.EXTENDING,
    (S.ADMITTED, T.BLOCK): S.EXTENDING,
    (S.EXTENDING, T.BLOCK): S.EXTENDING,
    (S.ADMITTED, T.EXTEND): S.ADMITTED,
    (S.RUNNING, T.EXTEND): S.RUNNING,
    (S.EXTENDING, T.EXTEND): S.RUNNING,
    (S.PREEMPTING, T.CONFIRM): S.CHECKPOINTED,
    (S.RELEASING, T.CONFIRM): S.RELEASED,
    # a request that already stopped ignores late engine news about the same stop
    (S.RELEASING, T.TOKENS): S.RELEASING,
    (S.RELEASING, T.FINISH): S.RELEASING,
    (S.RELEASING, T.CANCEL): S.RELEASING,
    (S.RELEASING, T.FAIL): S.RELEASING,
    (S.PREEMPTING, T.TOKENS): S.PREEMPTING,
    (S.PREEMPTING, T.FINISH): S.RELEASING,  # it finished by itself before the preemption landed
    (S.PREEMPTING, T.CANCEL): S.RELEASING,
    (S.PREEMPTING, T.FAIL): S.RELEASING,
}
for _live in _LIVE:
    for _trigger in (T.FINISH, T.CANCEL, T.FAIL, T.CONTINUE):
        TRANSITIONS[(_live, _trigger)] = S.RELEASING
    TRANSITIONS[(_live, T.PREEMPT)] = S.PREEMPTING
del _live, _trigger

HOLDING_STATES = frozenset({S.ADMITTED, S.RUNNING, S.EXTENDING, S.PREEMPTING, S.RELEASING})
TERMINAL_STATES = frozenset({S.RELEASED, S.REJECTED})


class Request:
    """The core's record of one request. Mutable, slotted: it is touched on every token."""

    __slots__ = (
        "admitted_at",
        "allowance",
        "arrival",
        "ask_at",
        "blocked_handled",
        "blocks",
        "boundary",
        "cls",
        "continuation_seq",
        "deadline_at",
        "expiry",
        "ext_demand",
        "ext_pending",
        "first_token_at",
        "floor",
        "generated",
        "hard_max",
        "key",
        "last_token_at",
        "outcome",
        "preemptions",
        "prefill_ahead",
        "prefill_pending",
        "prompt",
        "release_started_at",
        "request_id",
        "requeue_front",
        "resume",
        "seq",
        "spec",
        "state",
        "stats",
        "unconfirmed",
        "used_blocks",
        "want_blocks",
        "wasted",
    )

    def __init__(
        self, request_id: str, spec: RequestSpec, cls: ServiceClass, now: float, stats: Counters
    ) -> None:
        self.request_id = request_id
        self.spec = spec
        self.cls = cls
        self.key: CalibrationKey = spec.calibration_key
        self.prompt = spec.prompt_tokens
        self.hard_max = spec.hard_max
        self.generated = 0
        self.boundary = 0
        self.blocks = 0
        self.used_blocks = 0
        self.want_blocks = 0
        self.state = State.QUEUED
        self.outcome: Outcome | None = None
        self.arrival = now
        deadline = spec.deadline if spec.deadline is not None else cls.default_deadline_s
        self.deadline_at: float | None = None if deadline is None else now + deadline
        self.seq = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        #: when the current grant was admitted; the prefill tokens queued in the engine ahead of
        #: its first token then (its own included); its own prefill still pending (0 once its
        #: first token came or it left)
        self.admitted_at = now
        self.prefill_ahead = 0
        self.prefill_pending = 0
        self.ask_at = 0
        self.ext_pending = False
        self.blocked_handled = False
        self.allowance = 0
        self.preemptions = 0
        self.resume: Checkpoint | None = None
        self.requeue_front = False
        self.release_started_at: float | None = None
        self.unconfirmed = False
        self.ext_demand = 0.0
        self.expiry = float("inf")  # when it is turned away if still queued (the scheduler's)
        self.floor = cls.latency_floor_s if cls.latency_floor_s is not None else float("inf")
        self.wasted = 0
        self.continuation_seq = 0
        self.stats = stats

    @property
    def remaining(self) -> int:
        """Output tokens still allowed under the hard max."""
        return self.hard_max - self.generated

    @property
    def context_tokens(self) -> int:
        return self.prompt + self.generated

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(self.request_id, self.prompt, self.generated)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.state.value}, gen={self.generated}, "
            f"boundary={self.boundary}, hard_max={self.hard_max}, blocks={self.blocks})"
        )


class Ledger:
    """Block accounting and lifecycle transitions; the scheduler decides, the ledger books."""

    __slots__ = (
        "active_generated",
        "active_hard_max",
        "block_size",
        "capacity",
        "headroom_target",
        "protected_blocks",
        "reserved",
        "slack_tokens",
        "used",
    )

    def __init__(self, capacity: Capacity, *, slack_tokens: int = 0) -> None:
        self.capacity = capacity
        self.block_size = capacity.block_size
        self.slack_tokens = check_int("slack_tokens", slack_tokens, minimum=0)
        self.reserved = 0
        self.used = 0
        self.headroom_target = 0
        self.protected_blocks = 0
        # aggregates over requests holding a grant, kept O(1) for policies that need them
        self.active_hard_max = 0
        self.active_generated = 0

    # -- pools ------------------------------------------------------------------------------

    @property
    def free(self) -> int:
        return self.capacity.blocks - self.reserved

    @property
    def headroom_free(self) -> int:
        return min(self.free, self.headroom_target)

    @property
    def admission_free(self) -> int:
        return max(0, self.free - self.headroom_target)

    def set_headroom(self, target: int, protected: int, policy: str) -> None:
        if target < 0 or protected < 0 or protected > target or target > self.capacity.blocks:
            raise PolicyViolation(
                policy,
                f"headroom target {target} / protected {protected} must satisfy "
                f"0 <= protected <= target <= capacity ({self.capacity.blocks})",
            )
        self.headroom_target = target
        self.protected_blocks = protected

    def grant_blocks(self, req: Request, boundary: int) -> int:
        """Blocks a grant covering ``boundary`` output tokens of ``req`` needs."""
        return blocks_for(req.prompt + boundary + self.slack_tokens, self.block_size)

    def covered_boundary(self, req: Request, blocks: int) -> int:
        """The output tokens ``blocks`` cover for ``req``, capped at its hard max."""
        return min(req.hard_max, blocks * self.block_size - req.prompt - self.slack_tokens)

    def fits_admission(self, blocks: int) -> bool:
        return self.free - blocks >= self.headroom_target

    def fits_extension(self, blocks: int, protected: bool) -> bool:
        floor = 0 if protected else self.protected_blocks
        return self.free - blocks >= floor

    # -- transitions ------------------------------------------------------------------------

    @staticmethod
    def transition(req: Request, trigger: Trigger) -> State:
        try:
            nxt = TRANSITIONS[(req.state, trigger)]
        except KeyError:
            if req.state in (State.RELEASED, State.REJECTED):
                raise AlreadyReleased(req.request_id, trigger.value) from None
            raise InvalidTransition(req.request_id, req.state.value, trigger.value) from None
        req.state = nxt
        return nxt

    def check_transition(self, req: Request, trigger: Trigger) -> None:
        if (req.state, trigger) not in TRANSITIONS:
            if req.state in (State.RELEASED, State.REJECTED):
                raise AlreadyReleased(req.request_id, trigger.value)
            raise InvalidTransition(req.request_id, req.state.value, trigger.value)

    def grant(self, req: Request, boundary: int, policy: str) -> int:
        """Admit ``req`` with a grant covering ``boundary`` output tokens. Returns the boundary
        actually covered (whole blocks may cover a little more)."""
        if boundary <= req.generated or boundary > req.hard_max:
            raise PolicyViolation(
                policy,
                f"grant for {req.request_id!r} must cover ({req.generated}, {req.hard_max}] "
                f"output tokens, got {boundary}",
            )
        blocks = self.grant_blocks(req, boundary)
        if blocks > self.free:
            raise PolicyViolation(policy, f"grant of {blocks} blocks exceeds {self.free} free")
        self.transition(req, Trigger.ADMIT)
        req.blocks = blocks
        req.boundary = self.covered_boundary(req, blocks)
        req.used_blocks = blocks_for(req.prompt + req.generated, self.block_size)
        self.reserved += blocks
        self.used += req.used_blocks
        self.active_hard_max += req.hard_max
        self.active_generated += req.generated
        return req.boundary

    def extend(self, req: Request, boundary: int, policy: str) -> int:
        if boundary <= req.boundary or boundary > req.hard_max:
            raise PolicyViolation(
                policy,
                f"extension for {req.request_id!r} must reach ({req.boundary}, {req.hard_max}] "
                f"output tokens, got {boundary}",
            )
        blocks = self.grant_blocks(req, boundary)
        extra = blocks - req.blocks
        if extra > self.free:
            raise PolicyViolation(policy, f"extension of {extra} blocks exceeds {self.free} free")
        self.transition(req, Trigger.EXTEND)
        req.blocks = blocks
        req.boundary = self.covered_boundary(req, blocks)
        self.reserved += extra
        return req.boundary

    def stop(self, req: Request, trigger: Trigger) -> None:
        """The request stopped generating (finish/cancel/fail/continue/preempt); its blocks stay
        charged until :meth:`release`."""
        was_live = req.state in _LIVE
        self.transition(req, trigger)
        if was_live:
            self.active_hard_max -= req.hard_max
            self.active_generated -= req.generated

    def release(self, req: Request) -> int:
        """The engine confirmed: return the request's blocks. Returns how many."""
        self.transition(req, Trigger.CONFIRM)
        freed = req.blocks
        self.reserved -= freed
        self.used -= req.used_blocks
        req.blocks = 0
        req.used_blocks = 0
        return freed

    def charge(self, req: Request, tokens: int) -> None:
        """Book ``tokens`` more generated tokens (bounds already checked by the scheduler)."""
        g = req.generated + tokens
        req.generated = g
        if req.state is not State.RELEASING and req.state is not State.PREEMPTING:
            self.active_generated += tokens
        used = -(-(req.prompt + g) // self.block_size)
        if used != req.used_blocks:
            self.used += used - req.used_blocks
            req.used_blocks = used

    # -- invariants -------------------------------------------------------------------------

    def check(self, requests: Iterator[Request] | list[Request]) -> None:
        """Assert the ledger's own invariants over ``requests`` (all requests it knows)."""
        reserved = 0
        for r in requests:
            if r.state in HOLDING_STATES:
                reserved += r.blocks
                assert r.blocks >= 0
                assert r.boundary <= r.hard_max, r
                assert r.generated <= r.hard_max, r
                assert r.blocks <= self.grant_blocks(r, r.hard_max), r
            else:
                assert r.blocks == 0, r
        assert reserved == self.reserved, (reserved, self.reserved)
        assert 0 <= self.reserved <= self.capacity.blocks
