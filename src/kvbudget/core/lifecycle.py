"""The request lifecycle: states, triggers, outcomes, the transition table and its effects.

Everything that affects a request's state lives here, and this module is the only writer of
``Request.state`` and ``Request.outcome``:

* :data:`TRANSITIONS` maps (state, trigger) to the next state; a trigger a state does not accept
  raises :class:`~kvbudget.errors.InvalidTransition` (or
  :class:`~kvbudget.errors.AlreadyReleased` once the request is over) before anything changes;
* :data:`OUTCOME_EFFECTS` says, beside it, what each way of ending books: which counter, when
  (at the stop, or when the engine confirms the release), and whether the tokens the request
  generated count as wasted;
* the state sets (:data:`LIVE_STATES`, :data:`STOPPING_STATES`, :data:`HOLDING_STATES`, ...) are
  declared once, here;
* :class:`Request` is the core's mutable record of one request.

The ledger books blocks against these states; the scheduler decides which trigger to fire.
``docs/architecture.md`` renders :data:`TRANSITIONS` with :func:`transition_table_markdown`
(a test checks the two agree).
"""

from __future__ import annotations

import enum
import math
from typing import TYPE_CHECKING

import attrs

from kvbudget.core.resume import Checkpoint
from kvbudget.errors import AlreadyReleased, InvalidTransition

if TYPE_CHECKING:
    from kvbudget.core.model import CalibrationKey, RequestSpec, ServiceClass
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

    # members are singletons compared by identity: hash them so too, in C (Enum's own hash is
    # a Python call hashing the name, and the transition table is looked up on every change)
    __hash__ = object.__hash__


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

    __hash__ = object.__hash__  # (as State's)


S, T = State, Trigger

# -- the state sets (tuples where the per-token path tests membership: identity comparisons
# -- are faster there than hashing an enum) -----------------------------------------------------

#: holding a grant the engine is working on (admitted, running, extending)
LIVE_STATES: tuple[State, ...] = (S.ADMITTED, S.RUNNING, S.EXTENDING)
#: stopped in the engine, blocks held until it confirms
STOPPING_STATES: tuple[State, ...] = (S.RELEASING, S.PREEMPTING)
#: waiting in a queue for admission (a caller, or a checkpoint waiting to resume)
QUEUED_STATES: tuple[State, ...] = (S.QUEUED, S.CHECKPOINTED)
#: charged blocks in the ledger
HOLDING_STATES: frozenset[State] = frozenset(LIVE_STATES + STOPPING_STATES)
#: over: nothing more may happen to the request
TERMINAL_STATES: frozenset[State] = frozenset({S.RELEASED, S.REJECTED})

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
for _live in LIVE_STATES:
    for _trigger in (T.FINISH, T.CANCEL, T.FAIL, T.CONTINUE):
        TRANSITIONS[(_live, _trigger)] = S.RELEASING
    TRANSITIONS[(_live, T.PREEMPT)] = S.PREEMPTING
del _live, _trigger


@attrs.frozen(slots=True)
class OutcomeEffect:
    """What ending a request one way books in its counters."""

    #: the :class:`~kvbudget.core.stats.Counters` field it adds one to
    counter: str
    #: counted when the engine confirms the release (the request delivered what it produced),
    #: rather than at the stop
    at_release: bool
    #: the tokens it generated are counted in ``wasted_tokens`` (nobody receives them)
    wastes_output: bool


#: each outcome's bookkeeping; :func:`settle` and :func:`count_release` apply it
OUTCOME_EFFECTS: dict[Outcome, OutcomeEffect] = {
    Outcome.COMPLETED: OutcomeEffect("completed", at_release=True, wastes_output=False),
    Outcome.CONTINUED: OutcomeEffect("continued", at_release=True, wastes_output=False),
    Outcome.CANCELLED: OutcomeEffect("cancelled", at_release=False, wastes_output=True),
    Outcome.FAILED: OutcomeEffect("failed", at_release=False, wastes_output=True),
    Outcome.REJECTED: OutcomeEffect("rejected", at_release=False, wastes_output=False),
}


class Request:
    """The core's record of one request. Mutable, slotted: it is touched on every token.

    ``state`` and ``outcome`` are written only by this module's functions.
    """

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
        "ext_pending",
        "first_token_at",
        "gave_way",
        "generated",
        "hard_max",
        "held_by",
        "key",
        "last_token_at",
        "latency_floor",
        "outcome",
        "paused_for",
        "preemptions",
        "prefill_ahead",
        "prefill_pending",
        "prefix",
        "prompt",
        "release_started_at",
        "request_id",
        "requeue_front",
        "reserved_until",
        "resume",
        "seq",
        "shared_at_grant",
        "spec",
        "state",
        "stats",
        "unconfirmed",
        "used_blocks",
        "wait_bound",
        "wait_forecast",
        "want_blocks",
    )

    def __init__(
        self,
        request_id: str,
        spec: RequestSpec,
        cls: ServiceClass,
        now: float,
        stats: Counters,
        arrival: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.spec = spec
        self.cls = cls
        self.key: CalibrationKey = spec.calibration_key
        self.prompt = spec.prompt_tokens
        self.hard_max = spec.hard_max
        #: the prompt's full-block hashes (shared blocks are charged once, by the ledger) and how
        #: many of them the current grant found already charged to another holder
        self.prefix: tuple[int, ...] = spec.prefix_blocks
        self.shared_at_grant = 0
        self.generated = 0
        self.boundary = 0
        self.blocks = 0
        self.used_blocks = 0
        self.want_blocks = 0
        self.state = State.QUEUED
        self.outcome: Outcome | None = None
        #: when the caller's clock started: the server's receipt (``arrive(received_at=)``),
        #: which may be before ``now``; the objectives and the deadline run from it
        self.arrival = now if arrival is None else arrival
        deadline = spec.deadline if spec.deadline is not None else cls.default_deadline_s
        self.deadline_at: float | None = None if deadline is None else self.arrival + deadline
        self.seq = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        #: when the current grant was admitted; the prefill tokens queued in the engine ahead of
        #: its first token then, as far as the engine had not prefilled them yet
        #: (``Forecast.queued_prefill``; its own included); its own prefill still pending (0 once
        #: its first token came or it left)
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
        #: as a queue head waiting for blocks: when the releases were forecast to admit it
        #: (fixed when first forecast; callers backfilled behind it must be done by then)
        self.reserved_until: float | None = None
        #: paused for another caller's first token: requeued behind the callers then queued
        self.gave_way = False
        #: what last kept it from admission as a queue head (None: never judged as one): the
        #: cause counted if it is turned away (``Scheduler.turned_away_held_by``)
        self.held_by: str | None = None
        #: streams were paused for this caller's first token (it is not turned away as late)
        self.paused_for = False
        self.release_started_at: float | None = None
        self.unconfirmed = False
        self.expiry = math.inf  # when it is turned away if still queued (the scheduler's)
        #: the wait for admission forecast when it was queued (0: admitted at once, not
        #: forecast, or with no bound) and the wait it might have then; the forecast learns
        #: from whether it was admitted in time (Forecast.note_waited)
        self.wait_forecast = 0.0
        self.wait_bound = 0.0
        #: the slowest inter-token gap this stream may see (inf: none)
        floor = cls.latency_floor_s
        self.latency_floor = floor if floor is not None else math.inf
        self.continuation_seq = 0
        self.stats = stats

    def first_token_past_objective(self, now: float) -> bool | None:
        """Would a first token at ``now`` miss the class's first-token objective, counted from
        the caller's receipt (``arrival``)? None: the class has no such objective."""
        ttft = self.cls.ttft_slo_s
        return None if ttft is None else now - self.arrival > ttft

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


def _refuse(req: Request, trigger: Trigger) -> Exception:
    if req.state in TERMINAL_STATES:
        return AlreadyReleased(req.request_id, trigger.value)
    return InvalidTransition(req.request_id, req.state.value, trigger.value)


def check_transition(req: Request, trigger: Trigger) -> None:
    """Raise if ``req`` does not accept ``trigger`` in its current state."""
    if (req.state, trigger) not in TRANSITIONS:
        raise _refuse(req, trigger)


def transition(req: Request, trigger: Trigger) -> State:
    """Move ``req`` along the table (raising first when the table has no such row)."""
    try:
        nxt = TRANSITIONS[(req.state, trigger)]
    except KeyError:
        raise _refuse(req, trigger) from None
    req.state = nxt
    return nxt


def first_token(req: Request) -> None:
    """The (admitted, tokens) -> running row, for the per-token path (no table look-up)."""
    req.state = State.RUNNING


def settle(req: Request, outcome: Outcome) -> None:
    """``req`` ends as ``outcome``: record it, count it now unless it counts at the release,
    and count its generated tokens as wasted if nobody receives them."""
    req.outcome = outcome
    effect = OUTCOME_EFFECTS[outcome]
    stats = req.stats
    if not effect.at_release:
        setattr(stats, effect.counter, getattr(stats, effect.counter) + 1)
    if effect.wastes_output:
        stats.wasted_tokens += req.generated


def count_release(req: Request) -> str:
    """The engine confirmed ``req``'s release for good: count the outcomes counted then.
    Returns the outcome's name (``"released"`` when it had none)."""
    outcome = req.outcome
    if outcome is None:
        return "released"
    effect = OUTCOME_EFFECTS[outcome]
    if effect.at_release:
        stats = req.stats
        setattr(stats, effect.counter, getattr(stats, effect.counter) + 1)
    return outcome.value


def transition_table_markdown() -> str:
    """:data:`TRANSITIONS` as a Markdown table (rows in table order), for the docs."""
    lines = ["| from | trigger | to |", "| --- | --- | --- |"]
    for (state, trigger), nxt in TRANSITIONS.items():
        lines.append(f"| {state.value} | {trigger.value} | {nxt.value} |")
    return "\n".join(lines) + "\n"


def outcome_table_markdown() -> str:
    """:data:`OUTCOME_EFFECTS` as a Markdown table, for the docs."""
    lines = [
        "| outcome | counter | counted | its generated tokens count as wasted |",
        "| --- | --- | --- | --- |",
    ]
    for outcome, effect in OUTCOME_EFFECTS.items():
        when = "when the engine confirms the release" if effect.at_release else "at the stop"
        wasted = "yes" if effect.wastes_output else "no"
        lines.append(f"| {outcome.value} | `{effect.counter}` | {when} | {wasted} |")
    return "\n".join(lines) + "\n"


__all__ = [
    "HOLDING_STATES",
    "LIVE_STATES",
    "OUTCOME_EFFECTS",
    "QUEUED_STATES",
    "STOPPING_STATES",
    "TERMINAL_STATES",
    "TRANSITIONS",
    "Outcome",
    "OutcomeEffect",
    "Request",
    "State",
    "Trigger",
    "check_transition",
    "count_release",
    "first_token",
    "outcome_table_markdown",
    "settle",
    "transition",
    "transition_table_markdown",
]
