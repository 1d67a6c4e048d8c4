"""The ledger: who holds which KV blocks, and every pool rule (the protected floor once).

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

Shared prompt blocks (DESIGN §4, invariant 8). A request may name the chained hashes of its
prompt's full blocks (``Request.prefix``). A block with such a hash is charged once however many
holders name it: ``shared`` counts the holders per hash, and ``reserved`` is each holder's
*own* blocks (its grant less its prefix blocks) plus one block per hash in ``shared``. A hash
leaves ``shared`` only when its last holder is released, that is, after the engine confirmed
the last holder's stop. An admission costs its grant less the prefix blocks already charged
(:meth:`Ledger.admission_blocks`); stopping a holder frees its own blocks and the prefix blocks
no one else holds (:meth:`Ledger.footprint`). A grant's ``blocks`` stays the request's whole
grant, so extensions are unchanged by sharing.

The ledger books blocks as requests move through :mod:`kvbudget.core.lifecycle` (which owns
the states, the transition table and the only writes of a request's state); the lifecycle's
names stay importable from here.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import repeat

from kvbudget.core.lifecycle import (
    HOLDING_STATES,
    LIVE_STATES,
    STOPPING_STATES,
    TERMINAL_STATES,
    TRANSITIONS,
    Outcome,
    Request,
    State,
    Trigger,
    check_transition,
    transition,
)
from kvbudget.core.model import Capacity
from kvbudget.errors import PolicyViolation
from kvbudget.validate import check_int, whole

_ONE = 1  # (its bound comparisons count holders in C: 1 < n, 1 == n)

# the lifecycle's names stay importable from here, where they used to live
__all__ = [
    "HOLDING_STATES",
    "LIVE_STATES",
    "STOPPING_STATES",
    "TERMINAL_STATES",
    "TRANSITIONS",
    "Ledger",
    "Outcome",
    "Request",
    "State",
    "Trigger",
]


class Ledger:
    """Block accounting and the pool rules; the scheduler decides, the ledger books (states change
    through :mod:`kvbudget.core.lifecycle`)."""

    __slots__ = (
        "_reuse",
        "_shared_epoch",
        "active_generated",
        "active_hard_max",
        "block_size",
        "capacity",
        "headroom_target",
        "protected_blocks",
        "reserved",
        "shared",
        "slack_tokens",
        "used",
    )

    def __init__(self, capacity: Capacity, *, slack_tokens: int = 0) -> None:
        self.capacity = capacity
        self.block_size = capacity.block_size
        self.slack_tokens = check_int("slack_tokens", slack_tokens, minimum=0)
        self.reserved = 0
        self.used = 0
        #: prefix block hash -> how many holders are charged for it (each hash is one block)
        self.shared: dict[int, int] = {}
        # (reusable()'s last answer, for the request it was asked of while ``shared`` stood as
        # it did then: an admission asks it of the same request four or five times)
        self._shared_epoch = 0
        self._reuse: tuple[Request | None, int, int] = (None, -1, 0)
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
        blocks, kept = whole(target), whole(protected)  # (a NaN compares false with any bound)
        if (
            blocks is None
            or kept is None
            or blocks < 0
            or kept < 0
            or kept > blocks
            or blocks > self.capacity.blocks
        ):
            raise PolicyViolation(
                policy,
                f"headroom target {target!r} / protected {protected!r} must be whole blocks "
                f"with 0 <= protected <= target <= capacity ({self.capacity.blocks})",
            )
        self.headroom_target = blocks
        self.protected_blocks = kept

    def grant_blocks(self, req: Request, boundary: int) -> int:
        """Blocks a grant covering ``boundary`` output tokens of ``req`` needs."""
        # (model.blocks_for's rounding, written out here and for used_blocks: asked several
        # times in every admission, where a call is most of its cost)
        return -(-(req.prompt + boundary + self.slack_tokens) // self.block_size)

    def covered_boundary(self, req: Request, blocks: int) -> int:
        """The output tokens ``blocks`` cover for ``req``, capped at its hard max."""
        return min(req.hard_max, blocks * self.block_size - req.prompt - self.slack_tokens)

    def reusable(self, req: Request) -> int:
        """How many of ``req``'s prefix blocks another holder is charged for already."""
        asked, epoch, n = self._reuse
        if asked is req and epoch == self._shared_epoch:
            return n
        shared = self.shared
        # (counted in C, here and below: these run several times for every admission)
        n = sum(map(shared.__contains__, req.prefix)) if shared else 0
        self._reuse = (req, self._shared_epoch, n)
        return n

    def admission_blocks(self, req: Request, boundary: int) -> int:
        """What granting ``req`` a grant to ``boundary`` takes from the free blocks: the grant
        less the prefix blocks already charged to another holder."""
        blocks = self.grant_blocks(req, boundary)
        return blocks - self.reusable(req) if req.prefix else blocks

    def prefill_tokens(self, req: Request) -> int:
        """The tokens admitting ``req`` now would have the engine prefill: its context less the
        prompt blocks a holder keeps in the engine's cache (at least one token: the engine
        always computes the last one)."""
        if not req.prefix:
            return max(1, req.prompt + req.generated)
        reused = self.reusable(req) if req.blocks == 0 else req.shared_at_grant
        return max(1, req.prompt + req.generated - reused * self.block_size)

    def reprefill_tokens(self, req: Request) -> int:
        """The tokens re-prefilling ``req`` after a pause would compute: its context less the
        prompt blocks another holder keeps in the engine's cache meanwhile."""
        shared = self.shared
        if req.blocks:  # it holds its prefix itself: what others hold too stays cached
            kept = sum(map(_ONE.__lt__, map(shared.get, req.prefix, repeat(0))))
        else:
            kept = self.reusable(req)
        return max(1, req.prompt + req.generated - kept * self.block_size)

    def footprint(self, req: Request) -> int:
        """The blocks that releasing ``req`` would return: its own blocks and the prefix
        blocks no other holder is charged for."""
        if not req.blocks:
            return 0
        shared = self.shared
        alone = sum(map(_ONE.__eq__, map(shared.get, req.prefix, repeat(0))))
        return req.blocks - len(req.prefix) + alone

    def fits_admission(self, blocks: int) -> bool:
        return self.free - blocks >= self.headroom_target

    def protected_floor(self, protected: bool) -> int:
        """The free blocks a request may not take: the protected part of the headroom, unless
        the request is of a protected class. (The protected-floor rule: the one place it is.)"""
        return 0 if protected else self.protected_blocks

    def spare(self, protected: bool) -> int:
        """Free blocks a request of a protected class (or not) may take for an extension."""
        return self.free - self.protected_floor(protected)

    def room(self) -> int:
        """The most blocks one request could ever hold: a grant larger can never be made.
        (The whole cache: the scheduler keeps a protected part only while a protected stream
        is live.)"""
        return self.capacity.blocks

    def fits_extension(self, blocks: int, protected: bool) -> bool:
        return self.spare(protected) >= blocks

    # -- transitions ------------------------------------------------------------------------

    @staticmethod
    def transition(req: Request, trigger: Trigger) -> State:
        return transition(req, trigger)

    @staticmethod
    def check_transition(req: Request, trigger: Trigger) -> None:
        check_transition(req, trigger)

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
        reused = self.reusable(req) if req.prefix else 0
        cost = blocks - reused
        if cost > self.free:
            raise PolicyViolation(policy, f"grant of {cost} blocks exceeds {self.free} free")
        transition(req, Trigger.ADMIT)
        req.blocks = blocks
        req.boundary = self.covered_boundary(req, blocks)
        req.used_blocks = -(-(req.prompt + req.generated) // self.block_size)
        req.shared_at_grant = reused
        shared = self.shared
        for h in req.prefix:
            shared[h] = shared.get(h, 0) + 1
        self._shared_epoch += 1  # (what is shared, or who holds it, changed)
        self.reserved += cost
        self.used += req.used_blocks - reused
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
        transition(req, Trigger.EXTEND)
        req.blocks = blocks
        req.boundary = self.covered_boundary(req, blocks)
        self.reserved += extra
        return req.boundary

    def stop(self, req: Request, trigger: Trigger) -> None:
        """The request stopped generating (finish/cancel/fail/continue/preempt); its blocks stay
        charged until :meth:`release`."""
        was_live = req.state in LIVE_STATES
        transition(req, trigger)
        if was_live:
            self.active_hard_max -= req.hard_max
            self.active_generated -= req.generated

    def release(self, req: Request) -> int:
        """The engine confirmed: return the request's blocks. Returns how many."""
        transition(req, Trigger.CONFIRM)
        held = len(req.prefix)
        freed = req.blocks - held
        used = req.used_blocks - held
        shared = self.shared
        for h in req.prefix:
            n = shared[h] - 1
            if n:
                shared[h] = n
            else:  # its last holder: the block returns
                del shared[h]
                freed += 1
                used += 1
        self.reserved -= freed
        self.used -= used
        req.blocks = 0
        req.used_blocks = 0
        req.shared_at_grant = 0
        req.prefix = req.spec.prefix_blocks  # a resumed grant may share again what was unshared
        self._shared_epoch += 1
        return freed

    def unshare(self, req: Request, cached_blocks: int) -> int:
        """The engine reports that it found only ``cached_blocks`` of ``req``'s prompt blocks in
        its cache, fewer than the ledger counted as shared at the grant (``shared_at_grant``:
        with chained hashes, the leading ones). ``req`` holds copies of its own of the others:
        charge them to ``req``, as far as free blocks allow (what does not fit stays booked as
        shared; the engine holds it anyway). Returns the blocks charged."""
        cached = check_int("cached_blocks", cached_blocks, minimum=0)
        if req.state not in HOLDING_STATES or cached >= req.shared_at_grant:
            return 0
        shared = self.shared
        prefix = req.prefix
        free = self.free
        copies = 0
        end = cached
        for h in prefix[cached : req.shared_at_grant]:
            # a hash others still hold is a second copy, a block more; one only ``req`` holds
            # now (its other holders left) just becomes ``req``'s own, at no cost
            holders = shared[h]
            extra = 1 if holders > 1 else 0
            if copies + extra > free:
                break
            copies += extra
            end += 1
            if holders > 1:
                shared[h] = holders - 1
            else:
                del shared[h]
        req.prefix = prefix[:cached] + prefix[end:]
        self._shared_epoch += 1
        req.shared_at_grant = cached + (req.shared_at_grant - end)
        self.reserved += copies
        self.used += copies
        return copies

    def charge(self, req: Request, tokens: int) -> None:
        """Book ``tokens`` more generated tokens (bounds already checked by the scheduler)."""
        g = req.generated + tokens
        req.generated = g
        if req.state not in STOPPING_STATES:
            self.active_generated += tokens
        used = -(-(req.prompt + g) // self.block_size)
        if used != req.used_blocks:
            self.used += used - req.used_blocks
            req.used_blocks = used

    # -- invariants -------------------------------------------------------------------------

    def check(self, requests: Iterator[Request] | list[Request]) -> None:
        """Assert the ledger's own invariants over ``requests`` (all requests it knows)."""
        reserved = 0
        holders: dict[int, int] = {}
        for r in requests:
            if r.state in HOLDING_STATES:
                reserved += r.blocks - len(r.prefix)
                for h in r.prefix:
                    holders[h] = holders.get(h, 0) + 1
                assert r.blocks >= len(r.prefix), r
                assert r.boundary <= r.hard_max, r
                assert r.generated <= r.hard_max, r
                assert r.blocks <= self.grant_blocks(r, r.hard_max), r
            else:
                assert r.blocks == 0, r
        assert holders == self.shared, (holders, self.shared)
        reserved += len(holders)
        assert reserved == self.reserved, (reserved, self.reserved)
        assert 0 <= self.reserved <= self.capacity.blocks
