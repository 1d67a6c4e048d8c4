"""Events into the core and actions out of it (DESIGN §3).

The core is a state machine: a shell (the anyio ``Budget``, the simulator, a test harness) turns
what happened into an event, hands it to :meth:`kvbudget.core.scheduler.Scheduler.handle` with
the current time inside the event, and carries out the actions it gets back. Nothing here does
I/O or reads a clock.
"""

from __future__ import annotations

from typing import Literal

import attrs

from kvbudget.core.model import RequestSpec, StopReason
from kvbudget.core.resume import Checkpoint, Continuation

# -- events -------------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class Arrived:
    request_id: str
    spec: RequestSpec
    now: float


@attrs.frozen(slots=True)
class TokensGenerated:
    request_id: str
    tokens: int
    now: float


@attrs.frozen(slots=True)
class BoundaryReached:
    """The engine stopped at the grant boundary and the request wants more tokens."""

    request_id: str
    now: float


@attrs.frozen(slots=True)
class Finished:
    """The engine says the request stopped by itself (``stop``) or at its hard max (``length``)."""

    request_id: str
    reason: StopReason
    now: float


@attrs.frozen(slots=True)
class CancelRequested:
    """The caller went away (or the application cancelled the request)."""

    request_id: str
    now: float


@attrs.frozen(slots=True)
class Failed:
    request_id: str
    detail: str
    now: float


@attrs.frozen(slots=True)
class ReleaseConfirmed:
    """The engine confirms that the stopped request's KV is free."""

    request_id: str
    now: float


@attrs.frozen(slots=True)
class StepObserved:
    """One engine decode step: its batch, context and measured duration."""

    batch_size: int
    context_tokens: int
    seconds: float
    now: float


@attrs.frozen(slots=True)
class Tick:
    now: float


@attrs.frozen(slots=True)
class KvUsageReported:
    """The engine's own count of KV blocks in use (for reconciliation)."""

    used_blocks: int
    now: float


Event = (
    Arrived
    | TokensGenerated
    | BoundaryReached
    | Finished
    | CancelRequested
    | Failed
    | ReleaseConfirmed
    | StepObserved
    | Tick
    | KvUsageReported
)

# -- actions ------------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class Admit:
    """Start (or resume from ``resume``) the request; its grant covers ``boundary`` tokens."""

    request_id: str
    boundary: int
    blocks: int
    resume: Checkpoint | None = None


@attrs.frozen(slots=True)
class Reject:
    """Turn the caller away at once; it may retry after ``retry_after`` seconds."""

    request_id: str
    retry_after: float
    reason: str


@attrs.frozen(slots=True)
class Extend:
    """The grant now covers ``boundary`` output tokens with ``blocks`` blocks."""

    request_id: str
    boundary: int
    blocks: int


@attrs.frozen(slots=True)
class Deny:
    """An extension cannot be granted now: the request must not pass its boundary yet."""

    request_id: str
    reason: str


@attrs.frozen(slots=True)
class Preempt:
    """Stop the request in the engine, keeping ``checkpoint``; it resumes by re-prefill."""

    request_id: str
    checkpoint: Checkpoint
    recompute_tokens: int
    deadline: float | None
    reason: str


@attrs.frozen(slots=True)
class Abort:
    """Stop the request in the engine (it was cancelled or ended); confirm when its KV is free."""

    request_id: str
    reason: str


@attrs.frozen(slots=True)
class Continue:
    """End the request with an explicit continuation (it allowed that) instead of waiting."""

    request_id: str
    continuation: Continuation


@attrs.frozen(slots=True)
class Released:
    """The request's blocks are back in the budget."""

    request_id: str
    blocks: int
    outcome: str
    resumable: bool = False


Action = Admit | Reject | Extend | Deny | Preempt | Abort | Continue | Released

ActionKind = Literal[
    "admit", "reject", "extend", "deny", "preempt", "abort", "continue", "released"
]
