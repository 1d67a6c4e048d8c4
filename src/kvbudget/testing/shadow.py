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
    #: the prompt-block hashes charged as shared (the spec's, less those the engine did not
    #: find in its cache), and how many of them another holder held at the grant
    prefix: tuple[int, ...] = ()
    shared_at_grant: int = 0

    def __attrs_post_init__(self) -> None:
        self.prefix = self.spec.prefix_blocks

    @property
    def own_blocks(self) -> int:
        """Blocks of the grant that are this request's alone (the rest are shared hashes)."""
        return self.blocks - len(self.prefix) if self.blocks else 0

    @property
    def end(self) -> str | None:
        return self.ends[0] if self.ends else None

    @property
    def preempted_to_resume(self) -> bool:
        """Stopped by a preemption that nothing has ended since: it will resume (the core's
        preempting until the engine confirms the stop, then checkpointed)."""
        return self.stop_kind == "preempt" and self.end is None


__all__ = ["Shadow"]
