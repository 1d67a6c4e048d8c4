"""The queues of requests waiting for admission: one per service class, weighted stride
scheduling across the tenants inside each, and the earliest expiry of each class.

Strict class priority between the queues is the scheduler's (it walks :attr:`Queues.order`);
here is the order within a class: the tenant with the smallest pass goes next, and each
admission advances its pass by ``1 / weight``. An idle tenant does not bank credit. A request
put back at the front (a checkpoint of a policy that requeues in front) goes before all others.
(The scheduler may let an older caller of a tenant at most one admission ahead go before the
stride's head where the head's slack absorbs it: ``Scheduler._backfill``; its tenant's pass
advances as for any admission.)

Class queues and tenant stride are kvbudget's front (``BasePolicy.front``). An engine's own queue
has neither: ``Queues(by_tenant=False)`` keeps one first-come-first-served line per class, and
``by_class=False`` one line that every class shares (vLLM's FCFS waiting queue).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvbudget.core.lifecycle import Request
    from kvbudget.core.model import ServiceClass


class TenantQueue:
    __slots__ = ("items", "pass_", "weight")

    def __init__(self, weight: float) -> None:
        self.items: deque[Request] = deque()
        self.pass_ = 0.0
        self.weight = weight


class ClassQueue:
    """Weighted stride scheduling across tenants inside one service class (``by_tenant``), or
    one first-come-first-served line (not ``by_tenant``)."""

    __slots__ = ("by_tenant", "count", "tenants", "vtime", "want_blocks")

    def __init__(self, by_tenant: bool = True) -> None:
        self.tenants: dict[str, TenantQueue] = {}
        self.count = 0
        self.want_blocks = 0
        self.vtime = 0.0
        self.by_tenant = by_tenant

    def _tenant(self, req: Request) -> str:
        # without tenant fairness every tenant stands in the same line
        return req.spec.tenant if self.by_tenant else ""

    def push(self, req: Request, weight: float, front: bool = False) -> None:
        key = self._tenant(req)
        tq = self.tenants.get(key)
        if tq is None:
            tq = self.tenants[key] = TenantQueue(weight)
        if not tq.items:
            # an idle tenant does not bank credit while it sends nothing
            tq.pass_ = max(tq.pass_, self.vtime)
        if front:
            tq.items.appendleft(req)
        else:
            tq.items.append(req)
        self.count += 1
        self.want_blocks += req.want_blocks

    def head(self) -> Request | None:
        best: TenantQueue | None = None
        for tq in self.tenants.values():
            if tq.items:
                front = tq.items[0]
                if front.requeue_front:
                    return front
                if best is None or tq.pass_ < best.pass_:
                    best = tq
        return best.items[0] if best is not None else None

    def backfill_candidate(self, head: Request) -> Request:
        """``head`` (the stride's pick), or the front queued longest of the tenants at most one
        admission ahead of ``head``'s (a pass within one of their strides of its pass): the
        caller that may go before ``head`` without its tenant getting more than one admission
        beyond its share (``Scheduler._backfill`` decides whether it does)."""
        if len(self.tenants) < 2:
            return head  # (no other tenant's line to look at)
        own = self.tenants[self._tenant(head)]
        best = head
        for tq in self.tenants.values():
            if tq is own or not tq.items:
                continue
            front = tq.items[0]
            if front.arrival < best.arrival and tq.pass_ - own.pass_ <= 1.0 / tq.weight + 1e-9:
                best = front
        return best

    def pop(self, req: Request, admitted: bool = False) -> None:
        """Take ``req`` out of its line. Its tenant's pass advances when it was the line's front
        or is ``admitted`` from behind it (backfilled: every admission is paid for), not for a
        put-back checkpoint."""
        tq = self.tenants[self._tenant(req)]
        front = bool(tq.items) and tq.items[0] is req
        if front:
            tq.items.popleft()
        else:
            tq.items.remove(req)
        if (front or admitted) and not req.requeue_front:
            self.vtime = tq.pass_
            tq.pass_ += 1.0 / tq.weight
        req.requeue_front = False
        self.count -= 1
        self.want_blocks -= req.want_blocks

    def __iter__(self) -> Iterator[Request]:
        for tq in self.tenants.values():
            yield from tq.items



class Queues:
    """Every class's queue, in class-priority order, and a lower bound on each class's earliest
    expiry (it keeps :meth:`expired` from walking every queue on each tick).

    ``by_class=False``: every class shares one queue, listed in :attr:`by_class` under each
    class's name and in :attr:`order` once (under the most important class). ``by_tenant=False``:
    no tenant stride, first come first served.
    """

    __slots__ = (
        "_floor_of",
        "_served",
        "_through",
        "_weight_of",
        "by_class",
        "expiry_floor",
        "order",
    )

    def __init__(
        self,
        classes: Mapping[str, ServiceClass],
        tenant_weights: Mapping[str, float],
        *,
        by_class: bool = True,
        by_tenant: bool = True,
    ) -> None:
        #: classes by priority (lower first), then name
        order = sorted(classes.values(), key=lambda c: (c.priority, c.name))
        if by_class:
            self.by_class: dict[str, ClassQueue] = {n: ClassQueue(by_tenant) for n in classes}
            self.order: list[ServiceClass] = order
        else:
            shared = ClassQueue(by_tenant)
            self.by_class = dict.fromkeys(classes, shared)
            self.order = order[:1]
        #: each class's expiry floor is kept under the name its queue is walked by
        self._floor_of = {n: (n if by_class else self.order[0].name) for n in classes}
        self.expiry_floor: dict[str, float] = dict.fromkeys(classes, math.inf)
        #: each tenant's stride weight as a float (a tenant not listed weighs 1)
        self._weight_of = {tenant: float(w) for tenant, w in tenant_weights.items()}
        # (fixed with the classes, and asked at every arrival: kept rather than walked each time)
        self._served = tuple(self.by_class[c.name] for c in self.order)
        #: each class's queue and those of the classes served before it
        self._through: dict[str, tuple[ClassQueue, ...]] = {
            n: tuple(self.by_class[c.name] for c in self.order if c.priority <= cls.priority)
            for n, cls in classes.items()
        }

    def push(self, req: Request, front: bool = False) -> None:
        """Queue ``req`` (its ``expiry`` already set)."""
        weight = self._weight_of.get(req.spec.tenant, 1.0)  # (default weight 1)
        self.by_class[req.cls.name].push(req, weight, front)
        self.note_expiry(req)

    def note_expiry(self, req: Request) -> None:
        """``req`` is queued with ``req.expiry`` set (again): keep its class's expiry floor."""
        name = self._floor_of[req.cls.name]
        if req.expiry < self.expiry_floor[name]:
            self.expiry_floor[name] = req.expiry

    def remove(self, req: Request) -> None:
        self.by_class[req.cls.name].pop(req)

    def count(self) -> int:
        n = 0
        for queue in self._served:
            n += queue.count
        return n

    def count_ahead(self, cls: ServiceClass) -> int:
        """Requests queued in ``cls`` and in the classes served before it."""
        n = 0
        for queue in self._through[cls.name]:
            n += queue.count
        return n

    def blocks_ahead(self, cls: ServiceClass) -> int:
        """Blocks wanted by everything queued in ``cls`` and in the classes served before it."""
        n = 0
        for queue in self._through[cls.name]:
            n += queue.want_blocks
        return n

    def expired(self, now: float) -> list[Request]:
        """Queued requests whose expiry ``now`` has passed, in class order (refreshes the
        floors of the classes it walks)."""
        expired: list[Request] = []
        for cls in self.order:
            queue = self.by_class[cls.name]
            # nothing queued can have expired before the earliest expiry seen (margin: rounding)
            if not queue.count or now < self.expiry_floor[cls.name] - 1e-6:
                continue
            floor = math.inf
            for req in queue:
                expiry = req.expiry
                if now > expiry:
                    expired.append(req)
                elif expiry < floor:
                    floor = expiry
            self.expiry_floor[cls.name] = floor
        return expired


__all__ = ["ClassQueue", "Queues", "TenantQueue"]
