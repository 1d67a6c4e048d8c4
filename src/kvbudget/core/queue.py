"""The queues of requests waiting for admission: one per service class, weighted stride
scheduling across the tenants inside each, and the earliest expiry of each class.

Strict class priority between the queues is the scheduler's (it walks :attr:`Queues.order`);
here is the order within a class: the tenant with the smallest pass goes next, and each
admission advances its pass by ``1 / weight``. An idle tenant does not bank credit. A request
put back at the front (a checkpoint of a policy that requeues in front) goes before all others.
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
    """Weighted stride scheduling across tenants inside one service class."""

    __slots__ = ("count", "tenants", "vtime", "want_blocks")

    def __init__(self) -> None:
        self.tenants: dict[str, TenantQueue] = {}
        self.count = 0
        self.want_blocks = 0
        self.vtime = 0.0

    def push(self, req: Request, weight: float, front: bool = False) -> None:
        tq = self.tenants.get(req.spec.tenant)
        if tq is None:
            tq = self.tenants[req.spec.tenant] = TenantQueue(weight)
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

    def pop(self, req: Request) -> None:
        tq = self.tenants[req.spec.tenant]
        if tq.items and tq.items[0] is req:
            tq.items.popleft()
            if not req.requeue_front:
                self.vtime = tq.pass_
                tq.pass_ += 1.0 / tq.weight
        else:
            tq.items.remove(req)
        req.requeue_front = False
        self.count -= 1
        self.want_blocks -= req.want_blocks

    def __iter__(self) -> Iterator[Request]:
        for tq in self.tenants.values():
            yield from tq.items



class Queues:
    """Every class's queue, in class-priority order, and a lower bound on each class's earliest
    expiry (it keeps :meth:`expired` from walking every queue on each tick)."""

    __slots__ = ("by_class", "expiry_floor", "order", "tenant_weights")

    def __init__(
        self, classes: Mapping[str, ServiceClass], tenant_weights: Mapping[str, float]
    ) -> None:
        self.by_class: dict[str, ClassQueue] = {name: ClassQueue() for name in classes}
        #: classes by priority (lower first), then name
        self.order: list[ServiceClass] = sorted(
            classes.values(), key=lambda c: (c.priority, c.name)
        )
        self.expiry_floor: dict[str, float] = dict.fromkeys(classes, math.inf)
        self.tenant_weights = tenant_weights

    def weight(self, tenant: str) -> float:
        return float(self.tenant_weights.get(tenant, 1.0))

    def push(self, req: Request, front: bool = False) -> None:
        """Queue ``req`` (its ``expiry`` already set)."""
        self.by_class[req.cls.name].push(req, self.weight(req.spec.tenant), front=front)
        self.note_expiry(req)

    def note_expiry(self, req: Request) -> None:
        """``req`` is queued with ``req.expiry`` set (again): keep its class's expiry floor."""
        if req.expiry < self.expiry_floor[req.cls.name]:
            self.expiry_floor[req.cls.name] = req.expiry

    def remove(self, req: Request) -> None:
        self.by_class[req.cls.name].pop(req)

    def count(self) -> int:
        return sum(q.count for q in self.by_class.values())

    def blocks_ahead(self, cls: ServiceClass) -> int:
        """Blocks wanted by everything queued in ``cls`` and in the classes served before it."""
        ahead = 0
        for c in self.order:
            if c.priority > cls.priority:
                break
            ahead += self.by_class[c.name].want_blocks
        return ahead

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
