"""The engine contract kvbudget drives: the :class:`Engine` protocol and :class:`EngineStep`.

This module owns what an adapter (``engines.fake``, ``engines.vllm``) must provide so that
:meth:`kvbudget.Budget.generate` can run a request end to end over it, and the naming of engine
requests across preemption attempts.

The contract
------------
* ``capacity``: the KV cache the engine holds, when it can tell (``None`` otherwise).
* ``generate(request_id, prompt_tokens, max_tokens, *, resume)``: an async iterator of
  :class:`EngineStep`. It is *pull-based*: the engine generates only while the consumer pulls,
  so a consumer that stops pulling at its grant boundary stops generation. ``max_tokens`` is the
  request's total output budget, *including* the ``resume.generated_tokens`` a checkpoint
  already holds; a resumed request re-prefills prompt + generated tokens and continues.
  The last step has ``finished=True`` and ``finish_reason`` ``"stop"`` (stopped by itself),
  ``"length"`` (reached ``max_tokens``) or ``"abort"`` (aborted). Failures raise
  :class:`~kvbudget.errors.EngineError` (or :class:`~kvbudget.errors.EngineDead`).
* ``abort(request_id)``: stop the request; idempotent; unknown ids are ignored.
* ``wait_released(request_id, timeout)``: ``True`` once the engine has freed the request's KV
  (after its finish or abort was processed), ``False`` if that is not confirmed within
  ``timeout`` seconds. kvbudget returns blocks to the budget only on ``True``.
* ``kv_used_blocks()``: the engine's own count of KV blocks in use (``None`` when unknown), used
  to reconcile stops that were never confirmed.

Engine request ids
------------------
Each attempt of a budget request (the first run, then one per resumption after a preemption)
is a distinct engine request, so that a late or duplicated confirmation of an earlier attempt can
never be taken for the current one: :func:`engine_request_id` names attempt ``k`` of request
``rid`` (attempt 0 is ``rid`` itself) and :func:`split_engine_request_id` inverts it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal, Protocol, runtime_checkable

import attrs

from kvbudget.core.model import Capacity
from kvbudget.core.resume import Checkpoint

FinishReason = Literal["stop", "length", "abort"]

#: separator between a budget request id and its attempt number in an engine request id
ATTEMPT_SEP = "#r"


def engine_request_id(request_id: str, attempt: int) -> str:
    """The engine request id of attempt ``attempt`` (0: the first run) of ``request_id``."""
    return request_id if attempt == 0 else f"{request_id}{ATTEMPT_SEP}{attempt}"


def split_engine_request_id(engine_id: str) -> tuple[str, int]:
    """``(request_id, attempt)`` for an id made by :func:`engine_request_id`."""
    base, sep, tail = engine_id.rpartition(ATTEMPT_SEP)
    if sep and base and tail.isdigit():
        return base, int(tail)
    return engine_id, 0


@attrs.frozen(slots=True)
class EngineStep:
    """One step of one request: ``new_tokens`` generated; ``finished`` with its reason last.

    ``payload``: the adapter's native output for this step (e.g. a vLLM ``RequestOutput``),
    passed through untouched to :class:`kvbudget.budget.GenerationStep.payload`.
    """

    new_tokens: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    payload: object = attrs.field(default=None, eq=False, repr=False)


@runtime_checkable
class Engine(Protocol):
    """What :meth:`kvbudget.Budget.generate` needs from an engine adapter (see module doc)."""

    @property
    def capacity(self) -> Capacity | None: ...

    def generate(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        *,
        resume: Checkpoint | None,
    ) -> AsyncIterator[EngineStep]: ...

    async def abort(self, request_id: str) -> None: ...

    async def wait_released(self, request_id: str, timeout: float) -> bool: ...

    def kv_used_blocks(self) -> int | None: ...


__all__ = [
    "ATTEMPT_SEP",
    "Engine",
    "EngineStep",
    "FinishReason",
    "engine_request_id",
    "split_engine_request_id",
]
