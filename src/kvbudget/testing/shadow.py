"""The harness's shadow of one request: what it sent and what it received, kept apart from the
scheduler's own bookkeeping so that the invariants can be checked against it."""

from __future__ import annotations

import attrs

from kvbudget.core.model import RequestSpec, ServiceClass
from kvbudget.core.resume import Checkpoint


@attrs.define
class Shadow:
    """What the harness knows about one request, from what it sent and what it received."""

    rid: str
    spec: RequestSpec
    cls: ServiceClass
    true_len: int
    arrival: float
    deadline_at: float | None
    phase: str = "queued"  # queued | running | stopped | checkpointed | ended | rejected
    generated: int = 0
    boundary: int = 0
    blocks: int = 0
    admitted: bool = False
    stop_kind: str | None = None  # finish | cancel | fail | continue | preempt | abort
    stop_clock: float = 0.0
    unconfirmed: bool = False
    ends: list[str] = attrs.Factory(list)
    instance: int = 0  # bumped at every stop; identifies engine-side stale KV
    preempt_checkpoint: Checkpoint | None = None
    actions: list[str] = attrs.Factory(list)

    @property
    def end(self) -> str | None:
        return self.ends[0] if self.ends else None


__all__ = ["Shadow"]
