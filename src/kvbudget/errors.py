"""Every exception kvbudget raises, in one place.

All errors derive from :class:`KvBudgetError`. Input errors also derive from ``ValueError`` (or
``KeyError`` for unknown names) so that code catching the builtin kinds keeps working. Each error
carries the fields a caller needs to act on it (``field``/``expected`` for bad input,
``retry_after`` for overload, the checkpoint or continuation for preemption and continuation).
(Two private control-flow signals never leave the library and live beside their one use: the
vLLM adapter's caller abort and the shell's superseded wait.)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbudget.core.resume import Checkpoint, Continuation


def _rebuilt(cls: type[KvBudgetError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    """An error as it was pickled, without calling its ``__init__`` again."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class KvBudgetError(Exception):
    """Base class of every kvbudget error.

    Every one pickles with its fields (an error raised in a worker process reaches its parent
    whole): the subclasses' constructors take their fields, not the message that
    ``Exception`` would pass back to them, so pickling does not call them again."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuilt, (type(self), self.args, dict(self.__dict__))


class InvalidInput(KvBudgetError, ValueError):
    """A value given to kvbudget is outside its accepted range.

    ``field`` names the offending field, ``value`` is what was given and ``expected`` says what is
    accepted.
    """

    def __init__(self, field: str, value: Any, expected: str) -> None:
        self.field = field
        self.value = value
        self.expected = expected
        super().__init__(f"{field}={value!r} is invalid: expected {expected}")


class UnknownName(KvBudgetError, KeyError):
    """A name (service class, policy, ...) that kvbudget does not know."""

    def __init__(self, kind: str, name: str, known: list[str] | tuple[str, ...]) -> None:
        self.kind = kind
        self.name = name
        self.known = tuple(known)
        super().__init__(f"unknown {kind} {name!r}; known: {', '.join(self.known) or '(none)'}")

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0])


class UnknownClass(UnknownName):
    def __init__(self, name: str, known: list[str] | tuple[str, ...]) -> None:
        super().__init__("service class", name, known)


class UnknownPolicy(UnknownName):
    def __init__(self, name: str, known: list[str] | tuple[str, ...]) -> None:
        super().__init__("policy", name, known)


class UnknownRequest(KvBudgetError, KeyError):
    """An event named a request the core has never seen (or has long forgotten)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"unknown request {request_id!r}")

    def __str__(self) -> str:
        return str(self.args[0])


class DuplicateRequest(KvBudgetError, ValueError):
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"request {request_id!r} is already known to the budget")


class InvalidTransition(KvBudgetError):
    """An event that the request's current state does not accept (e.g. a second release)."""

    def __init__(self, request_id: str, state: str, event: str) -> None:
        self.request_id = request_id
        self.state = state
        self.event = event
        super().__init__(f"request {request_id!r} is {state}: it does not accept {event}")


class AlreadyReleased(InvalidTransition):
    """A confirmation or event for a request whose blocks were already returned."""

    def __init__(self, request_id: str, event: str) -> None:
        super().__init__(request_id, "released", event)


class HardLimitExceeded(KvBudgetError):
    """A caller charged output tokens past the request's hard maximum."""

    def __init__(self, request_id: str, hard_max: int, attempted: int) -> None:
        self.request_id = request_id
        self.hard_max = hard_max
        self.attempted = attempted
        super().__init__(
            f"request {request_id!r} would reach {attempted} output tokens; "
            f"its hard maximum is {hard_max}"
        )


class GrantExceeded(KvBudgetError):
    """A caller charged tokens past the grant boundary plus the reserved slack."""

    def __init__(self, request_id: str, boundary: int, slack: int, attempted: int) -> None:
        self.request_id = request_id
        self.boundary = boundary
        self.slack = slack
        self.attempted = attempted
        super().__init__(
            f"request {request_id!r} would reach {attempted} output tokens; its grant covers "
            f"{boundary} (+{slack} slack): wait for an extension before generating further"
        )


class PolicyViolation(KvBudgetError):
    """A policy returned a decision that would break an invariant, or one of its decision hooks
    raised (the exception is the ``__cause__``); the core refused it before it took effect."""

    def __init__(self, policy: str, detail: str) -> None:
        self.policy = policy
        self.detail = detail
        super().__init__(f"policy {policy!r}: {detail}")


class Overloaded(KvBudgetError):
    """The budget refused a new request at once; try again after ``retry_after`` seconds."""

    def __init__(
        self, retry_after: float, reason: str = "overloaded", request_id: str = ""
    ) -> None:
        self.retry_after = retry_after
        self.reason = reason
        self.request_id = request_id
        super().__init__(f"overloaded ({reason}); retry after {retry_after:.3f}s")


class Preempted(KvBudgetError):
    """The request was preempted; ``checkpoint`` holds what it had generated."""

    def __init__(self, checkpoint: Checkpoint, recompute_tokens: int, reason: str) -> None:
        self.checkpoint = checkpoint
        self.recompute_tokens = recompute_tokens
        self.reason = reason
        super().__init__(
            f"request {checkpoint.request_id!r} preempted ({reason}) after "
            f"{checkpoint.generated_tokens} tokens; resuming costs {recompute_tokens} tokens"
        )


class ContinuationRequired(KvBudgetError):
    """The request reached its grant and asked to end with a continuation instead of waiting."""

    def __init__(self, continuation: Continuation) -> None:
        self.continuation = continuation
        super().__init__(
            f"request {continuation.request_id!r} ended with a continuation after "
            f"{continuation.generated_tokens} tokens ({continuation.remaining_tokens} remain "
            f"under its hard maximum)"
        )


class EngineError(KvBudgetError):
    """The engine failed while running a request. Blocks stay charged until it confirms."""

    def __init__(self, request_id: str, detail: str) -> None:
        self.request_id = request_id
        self.detail = detail
        super().__init__(f"engine failed on request {request_id!r}: {detail}")


class EngineDead(EngineError):
    """The engine died; no request on it can continue."""


class EngineStalled(EngineError):
    """The engine produced no step within the configured stall timeout."""


class Unauthorized(KvBudgetError):
    """A request without a valid API key where the server requires one (HTTP 401, gRPC
    UNAUTHENTICATED). ``reason`` says what was wrong (missing, not a bearer token, unknown)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"invalid or missing API key: {reason}")


class Forbidden(KvBudgetError):
    """A valid API key asked for what it is not allowed (a service class not in its list):
    HTTP 403, gRPC PERMISSION_DENIED."""

    def __init__(self, tenant: str, what: str, allowed: tuple[str, ...]) -> None:
        self.tenant = tenant
        self.what = what
        self.allowed = allowed
        super().__init__(
            f"the API key of tenant {tenant!r} may not use {what}; allowed: "
            f"{', '.join(allowed) or '(none)'}"
        )


class BudgetClosed(KvBudgetError):
    """The budget is shutting down or closed and takes no new requests."""

    def __init__(self) -> None:
        super().__init__("the budget is closed")


class RequestAborted(KvBudgetError):
    """A durable request was aborted through :meth:`BudgetedEngine.abort`."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"request {request_id!r} was aborted")


class SimulationError(KvBudgetError, RuntimeError):
    """The simulation could not finish (a request never ended) or broke its own accounting."""


class TraceFormatError(InvalidInput):
    """A trace file that cannot be read as the format it claims to be.

    ``path`` is the file, ``line`` the 1-based line number (the CSV header is line 1),
    ``column`` the CSV column or JSON field at fault, ``expected`` what is accepted there and
    ``got`` what the file holds.
    """

    def __init__(self, path: str | Path, line: int, column: str, expected: str, got: Any) -> None:
        super().__init__(column, got, expected)
        self.path = str(path)
        self.line = line
        self.column = column
        self.got = got
        shown = got if isinstance(got, str) else repr(got)
        if isinstance(shown, str) and len(shown) > 80:
            shown = shown[:77] + "..."
        message = f"{self.path}:{line}: column {column!r}: expected {expected}, got {shown!r}"
        self.args = (message,)

    def __str__(self) -> str:
        return str(self.args[0])
