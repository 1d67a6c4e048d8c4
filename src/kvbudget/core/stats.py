"""Counters and the snapshot value (DESIGN §9): what the core counts, per class and tenant.

The counters are plain mutable slots bumped on the hot path; ``Scheduler.snapshot`` turns them
and the ledger into one frozen :class:`Snapshot` that shells expose as ``Budget.snapshot()``, log
as structlog events and export to Prometheus. Nothing here depends on the rest of the core but
the length model's report type (for typing only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from kvbudget.core.lengths import UnderestimationReport

#: what last kept a queued caller from admission, for the callers turned away after they queued
#: (``Snapshot.turned_away_held_by``): why a server says "overloaded" to them. A caller never
#: judged as its queue's head is counted by what held the head it waited behind (the head the
#: last admission pass stopped at, of its class or of one before it; ``turned_away_behind``
#: counts them), "behind" only where no head was held then
HELD_BY: Mapping[str, str] = {
    "no-room": "its grant fitted neither the admission budget nor, for a protected caller, the "
    "headroom it may take: the cache was held by the streams running",
    "policy": "the policy's own gate, where its grant fitted the admission budget or the "
    "headroom it may take (e.g. headroom kept for the running streams' growth while releases "
    "were due in time, or first tokens crowded by the prefill queued)",
    "latency-floor": "admitting it would have pushed running streams past their latency floor",
    "batch-cap": "the engine's batch was full (SchedulerConfig.max_active)",
    "prefill-queue": "admissible, but behind the prefill queued in the engine its first token "
    "would have been late",
    "behind": "never judged as its queue's head, and the last admission pass stopped at no held "
    "head (one a policy fault cut short)",
}

COUNTER_FIELDS: tuple[str, ...] = (
    "arrived",
    "admitted",
    "rejected",
    "completed",
    "cancelled",
    "continued",
    "failed",
    "preemptions",
    "recompute_tokens",
    "wasted_tokens",
    "tokens",
    "stalls",
    "first_tokens",
    "first_tokens_late",
    "extensions",
    "extensions_denied",
    "unconfirmed",
    "reconciled",
    "drift_events",
    "pauses",
    "resubmissions",
    "reprefill_tokens",
    "dropped_tokens",
    "full_grants",
    "prefix_shared_blocks",
    "prefix_mismatches",
)


class Counters:
    """Monotonic counters for one (service class, tenant)."""

    __slots__ = COUNTER_FIELDS

    def __init__(self) -> None:
        for name in COUNTER_FIELDS:
            setattr(self, name, 0)

    arrived: int
    admitted: int
    rejected: int
    completed: int
    cancelled: int
    continued: int
    failed: int
    preemptions: int
    recompute_tokens: int
    wasted_tokens: int
    tokens: int
    stalls: int
    first_tokens: int
    first_tokens_late: int
    extensions: int
    extensions_denied: int
    unconfirmed: int
    reconciled: int
    drift_events: int
    pauses: int
    resubmissions: int
    reprefill_tokens: int
    dropped_tokens: int
    full_grants: int
    prefix_shared_blocks: int
    prefix_mismatches: int

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in COUNTER_FIELDS}


@attrs.frozen(slots=True)
class CounterValues:
    """A frozen copy of :class:`Counters`."""

    arrived: int = 0
    admitted: int = 0
    rejected: int = 0
    completed: int = 0
    cancelled: int = 0
    continued: int = 0
    failed: int = 0
    preemptions: int = 0
    recompute_tokens: int = 0
    wasted_tokens: int = 0
    tokens: int = 0
    stalls: int = 0
    #: callers' own first tokens under a first-token objective (``ttft_slo_s``; a resumed
    #: checkpoint's first token after its resume is not one), and of them those that came
    #: later than the objective, counted from the caller's receipt: admitted callers the
    #: budget served late
    first_tokens: int = 0
    first_tokens_late: int = 0
    extensions: int = 0
    extensions_denied: int = 0
    unconfirmed: int = 0
    reconciled: int = 0
    drift_events: int = 0
    #: engine-side pauses at a grant boundary (the adapter stopped the engine request there)
    pauses: int = 0
    #: engine requests re-submitted to continue a paused or preempted request
    resubmissions: int = 0
    #: prompt + output tokens those re-submissions re-prefilled
    reprefill_tokens: int = 0
    #: tokens the engine produced past a grant (+ slack), dropped and regenerated later
    dropped_tokens: int = 0
    #: requests admitted with a grant to their hard max because they cannot be resumed exactly
    full_grants: int = 0
    #: prompt blocks a grant found charged to another holder already (charged once, shared)
    prefix_shared_blocks: int = 0
    #: grants whose engine found fewer prompt blocks in its cache than the ledger counted as
    #: shared (each such request is then charged its own copies)
    prefix_mismatches: int = 0


@attrs.frozen(slots=True)
class Snapshot:
    """The budget at one instant. Block figures are whole KV blocks.

    ``reserved_blocks`` = blocks held by grants (including stopped requests awaiting
    confirmation); ``free_blocks`` = capacity - reserved; ``headroom_blocks`` = the headroom
    target admissions must leave free, ``headroom_free_blocks`` the part of it still free;
    ``used_blocks`` = blocks the generated tokens really occupy (reserved - used is stranded).
    ``active`` = admitted and not yet stopped; ``queued`` waiting for admission (including
    checkpointed requests waiting to resume); ``releasing`` stopped and awaiting confirmation.
    """

    capacity_blocks: int
    block_size: int
    reserved_blocks: int
    used_blocks: int
    free_blocks: int
    headroom_blocks: int
    headroom_free_blocks: int
    protected_blocks: int
    admission_free_blocks: int
    active: int
    queued: int
    releasing: int
    unconfirmed_releasing: int
    policy: str
    totals: CounterValues
    by_class: dict[str, CounterValues]
    by_tenant: dict[str, CounterValues]
    by_class_tenant: dict[tuple[str, str], CounterValues]
    underestimation: UnderestimationReport | None
    drift_blocks: int
    #: distinct prompt blocks charged once for all the requests that share them
    shared_prefix_blocks: int = 0
    #: rejections (overload, queue timeouts, too-large, deadline) by reason
    rejections_by_reason: Mapping[str, int] = attrs.field(factory=dict)
    #: callers turned away after they queued (of ``rejections_by_reason``), by what last kept
    #: each from admission (:data:`HELD_BY`), a caller never its queue's head by what held the
    #: head it waited behind
    turned_away_held_by: Mapping[str, int] = attrs.field(factory=dict)
    #: of those, the callers never judged as their queue's head (a deep queue behind a held head)
    turned_away_behind: int = 0
    #: the engine's own preemptions, where the adapter can count them (vLLM: Σ
    #: ``num_preempted_reqs``; None: not known)
    engine_preemptions: int | None = None
    #: the share of recent queued callers admitted in time, of those whose forecast wait was
    #: of about the pressure (forecast / the wait they might have) of the forecast judged last
    #: (a caller is turned away at arrival on its forecast only where it is below
    #: ``SchedulerConfig.turn_away_wait_quantile`` and at least ``MIN_WAIT_OUTCOMES`` were
    #: seen; 1.0 with none), and how many such outcomes it read
    wait_in_time_share: float = 1.0
    wait_forecast_samples: int = 0
    #: those outcomes band by band of pressure (``kvbudget.core.forecast.wait_pressure_band``,
    #: band ``b`` >= 1 from pressure ``0.5 * 2 ** ((b - 1) / 2)``): ``(seen, in time)`` each,
    #: what the turn-away at arrival reads for a caller of that pressure
    wait_outcomes_by_band: tuple[tuple[int, int], ...] = ()
    #: blocks per second the engine returned recently, on a clock that runs only while it holds
    #: blocks (0 before the first release): what a queued caller's wait is forecast from, and
    #: what tells a fresh caller granted the vLLM way to wait for room rather than take the
    #: headroom; after an idle spell, the rate at which the last busy spell's streams ended
    release_rate_blocks_per_s: float = 0.0
    #: the policy's notifications that raised (the core went on without them; the shell logs
    #: each as ``policy_fault``)
    policy_faults: int = 0

    # convenience accessors for the DESIGN §9 names
    @property
    def completed(self) -> int:
        return self.totals.completed

    @property
    def rejected(self) -> int:
        return self.totals.rejected

    @property
    def cancelled(self) -> int:
        return self.totals.cancelled

    @property
    def preemptions(self) -> int:
        return self.totals.preemptions

    @property
    def recompute_tokens(self) -> int:
        return self.totals.recompute_tokens

    @property
    def wasted_tokens(self) -> int:
        return self.totals.wasted_tokens

    @property
    def stalls(self) -> int:
        return self.totals.stalls

    @property
    def extensions_granted(self) -> int:
        return self.totals.extensions

    @property
    def extensions_denied(self) -> int:
        return self.totals.extensions_denied

    @property
    def overload_rejections(self) -> int:
        return self.totals.rejected

    @property
    def unconfirmed_aborts(self) -> int:
        return self.totals.unconfirmed

    @property
    def stranded_blocks(self) -> int:
        return self.reserved_blocks - self.used_blocks


def sum_counters(counters: list[Counters]) -> CounterValues:
    """The counters added up, frozen."""
    totals = dict.fromkeys(COUNTER_FIELDS, 0)
    for c in counters:
        for name in COUNTER_FIELDS:
            totals[name] += getattr(c, name)
    return CounterValues(**totals)
