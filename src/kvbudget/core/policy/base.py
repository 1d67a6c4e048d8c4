"""The Policy protocol: the decisions a scheduler delegates (how much to grant, when to grow,
whom to stop), and :class:`BasePolicy`, the defaults every hook falls back to.

A policy answers a handful of questions; the scheduler owns the mechanism (the ledger, the queue,
the pool rules, the invariants) and checks every answer, so a policy cannot break an invariant:
an answer that would is refused with :class:`~kvbudget.errors.PolicyViolation`. A policy reads
the scheduler only through :class:`~kvbudget.core.view.SchedulerView`, which ``bind`` hands it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvbudget.core.lifecycle import Request
    from kvbudget.core.view import SchedulerView


class Blocked(enum.Enum):
    """What to do with a request stopped at its boundary whose grant cannot grow now."""

    WAIT = "wait"  # hold the grant and wait for blocks to come back
    PREEMPT_OTHERS = "preempt-others"  # checkpoint victims chosen by ``choose_victims``
    PREEMPT_SELF = "preempt-self"  # checkpoint this request; it resumes by re-prefill
    # end with an explicit continuation (only if the request allows it; asked ahead of the
    # boundary, it waits there: the answer may end by itself before, and its grant covers it)
    CONTINUE = "continue"


@runtime_checkable
class Policy(Protocol):
    """The decisions of a budget policy. See :class:`BasePolicy` for the defaults.

    Optional: ``acts_ahead(req) -> bool`` (:meth:`BasePolicy.acts_ahead`) and
    ``arrival_refusal(req) -> str | None`` (:meth:`BasePolicy.arrival_refusal`), which the
    scheduler calls when a policy has them; and the declared attributes ``front``,
    ``class_priority`` and ``preempts_in_engine`` (:class:`BasePolicy`), read with their
    defaults when a policy lacks them.
    """

    @property
    def name(self) -> str: ...  # read-only: shipped policies set it as a ClassVar

    requeue_front: bool
    preempt_for_admission: bool

    def bind(self, scheduler: SchedulerView) -> None: ...
    def headroom_target(self) -> int: ...
    def protected_blocks(self) -> int: ...
    def initial_allowance(self, req: Request) -> int: ...
    def lookahead_tokens(self, req: Request) -> int: ...
    def extension_tokens(self, req: Request) -> int | None: ...
    def admit(self, req: Request, blocks: int) -> bool: ...
    def on_blocked(self, req: Request) -> Blocked: ...
    def choose_victims(
        self, req: Request, need_blocks: int, candidates: Sequence[Request]
    ) -> list[Request]: ...
    def on_granted(self, req: Request) -> None: ...
    def on_leave(self, req: Request) -> None: ...
    def on_finished(self, req: Request, length: int) -> None: ...
    def on_step(self) -> None: ...


class BasePolicy:
    """Defaults for every hook: no headroom, grant the hard max, never preempt."""

    name: ClassVar[str] = "base"
    requeue_front: bool = True
    preempt_for_admission: bool = False
    #: kvbudget's own front: turn arrivals away when the queue ahead cannot be served within
    #: their bound (429 "deadline", "queue-full"), time queued callers out ("queue-timeout") or
    #: turn them away at admission when their first token would be late ("first-token-late"),
    #: hold an admission that would slow an active stream past its latency floor, and order the
    #: queue by class priority then weighted tenant stride. It is kvbudget's, so only its own
    #: policies have it; a baseline (False) runs the engine's own queue: first come first served
    #: (by class only with ``class_priority``), never an overload rejection ("too-large", a
    #: request that can never fit, is still refused: that is correctness, not overload).
    front: ClassVar[bool] = True
    #: without the front: order the queue (and growth) by class priority, first come first
    #: served within a class (vLLM's ``--scheduling-policy priority``). With the front, class
    #: priority always holds.
    class_priority: bool = False
    #: the engine preempts inside its own step and frees the victim's blocks at once (vLLM,
    #: SGLang, LightLLM); False: a preemption is an abort through the engine's API, whose blocks
    #: come back only once the engine confirms it (kvbudget's own policies). The simulator reads
    #: it (:mod:`kvbudget.sim.driver`).
    preempts_in_engine: ClassVar[bool] = False
    _s: SchedulerView
    #: the engine's block size in tokens (the bound scheduler's: kept, as it is asked several
    #: times in every admission and extension)
    block_size: int

    def bind(self, scheduler: SchedulerView) -> None:
        self._s = scheduler
        self.block_size = scheduler.capacity.block_size

    @property
    def scheduler(self) -> SchedulerView:
        """The scheduler this policy is bound to, read-only."""
        return self._s

    def headroom_target(self) -> int:
        return 0

    def protected_blocks(self) -> int:
        return 0

    def initial_allowance(self, req: Request) -> int:
        return req.remaining

    def lookahead_tokens(self, req: Request) -> int:
        return 0

    def extension_tokens(self, req: Request) -> int | None:
        return None

    def admit(self, req: Request, blocks: int) -> bool:
        return True

    def on_blocked(self, req: Request) -> Blocked:
        return Blocked.CONTINUE if req.spec.on_exhausted == "continue" else Blocked.WAIT

    def choose_victims(
        self, req: Request, need_blocks: int, candidates: Sequence[Request]
    ) -> list[Request]:
        return []

    def on_granted(self, req: Request) -> None:
        pass

    def on_leave(self, req: Request) -> None:
        pass

    def on_finished(self, req: Request, length: int) -> None:
        pass

    def on_step(self) -> None:
        pass

    def arrival_refusal(self, req: Request) -> str | None:
        """Refuse a newcomer at arrival, with this reason (a 429/503 ``Reject``), or None. The
        engine's own admission limits (vLLM's queue caps) live here. (Optional in
        :class:`Policy`.)"""
        return None

    def acts_ahead(self, req: Request) -> bool:
        """Decide for ``req`` when an extension asked ahead of its boundary is refused, rather
        than when it reaches the boundary? (Optional in :class:`Policy`: a policy without it
        decides at the boundary.)"""
        return False

    def first_token_pause_at(self, req: Request) -> float | None:
        """Once the queued ``req``'s slack (the seconds it may still wait) falls to this, its
        first token is due and running streams may be paused for it (those :meth:`gives_way`
        allows); None: never. The scheduler pauses only for a head that the blocks released at
        the recent rate would not admit in time, and then for every caller queued behind it that
        is due as well; a caller such pauses could serve is not turned away at arrival on its
        wait forecast. (Optional in :class:`Policy`: a policy without it pauses no one for a
        first token.)"""
        return None

    def gives_way(self, victim: Request, head: Request) -> bool:
        """May the live ``victim`` be paused for the due first token of ``head``? (The
        scheduler pauses it only once it has had its own first token, and requeues it behind
        the callers queued then, not in front.) (Optional in :class:`Policy`.)"""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _most_recent(req: Request, candidates: Sequence[Request]) -> list[Request]:
    """vLLM/LightLLM victim: the most recently admitted running request (maybe ``req`` itself)."""
    pool = list(candidates)
    if req not in pool:
        pool.append(req)
    return [max(pool, key=lambda r: r.seq)]


__all__ = ["BasePolicy", "Blocked", "Policy"]
