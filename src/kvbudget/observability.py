"""Observability: the structlog event catalogue, snapshot serialisation and the Prometheus exporter.

This module owns how kvbudget is *watched* (DESIGN §9); it decides nothing.

Structlog events
----------------
Every event is logged to structlog's ``"kvbudget"`` logger through :func:`get_logger`, never per
token; an application that has not configured structlog sees them from ``info`` up only
(:class:`KvbudgetLogger`). The lifecycle events are emitted by the anyio shell
(:mod:`kvbudget.budget`), which already logs them as the core's actions are carried out; this
module does not log them a second time but catalogues them in :data:`EVENTS` (name, level,
fields, meaning) so the catalogue, the docs (``docs/operations.md``) and the tests agree. Each
per-request event carries ``request_id``, ``service_class`` and ``tenant`` (the field is
``service_class``, not ``class``: ``class`` is a Python keyword and cannot be a structlog keyword
argument).

Adapters and applications that need to log one of these events themselves (e.g. an engine adapter
that reconciles against the engine's reported KV usage) use :func:`emit`, which checks the name
against the catalogue and fills in the level, and :func:`log_drift` for reconciliation drift. The
periodic :func:`log_snapshot` logs the whole budget as one ``snapshot`` event.

Snapshot serialisation
----------------------
:func:`snapshot_to_dict` turns a :class:`~kvbudget.core.stats.Snapshot` into plain JSON-able data
(what the examples serve at ``GET /kvbudget/snapshot`` and ``kvbudget inspect`` reads back);
:func:`format_snapshot` renders such a dict as a text table.

Prometheus
----------
:class:`PrometheusExporter` is a custom collector: it holds no metric objects and costs nothing on
the hot path; at scrape time it calls ``snapshot()`` once and turns it into ``kvbudget_`` metric
families (:data:`GAUGES`, :data:`COUNTERS`, the underestimation gauges). ``prometheus_client`` is
the optional extra ``kvbudget[prometheus]``, imported only when an exporter is built.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

import attrs
import structlog

from kvbudget.core.forecast import wait_pressure_band_from
from kvbudget.core.stats import COUNTER_FIELDS, CounterValues, Snapshot
from kvbudget.errors import InvalidInput, UnknownName

if TYPE_CHECKING:
    from kvbudget.core.lengths import UnderestimationStats

LOGGER_NAME: Final = "kvbudget"

#: the fields every per-request event carries
REQUEST_FIELDS: Final[tuple[str, ...]] = ("request_id", "service_class", "tenant")


@attrs.frozen(slots=True)
class EventSpec:
    """One structlog event: its ``name``, default ``level``, extra ``fields`` (besides
    :data:`REQUEST_FIELDS` when ``per_request``), who emits it and what it means."""

    name: str
    level: str
    fields: tuple[str, ...]
    meaning: str
    emitted_by: str = "kvbudget.budget"
    per_request: bool = True


_EVENT_LIST: tuple[EventSpec, ...] = (
    EventSpec(
        "admission",
        "debug",
        ("boundary", "blocks", "resumed"),
        "the request was admitted (or re-admitted after a preemption: resumed=True) with a grant "
        "of `blocks` blocks covering `boundary` output tokens",
    ),
    EventSpec(
        "extension",
        "debug",
        ("boundary", "blocks"),
        "the grant grew to cover `boundary` output tokens (`blocks` blocks in all)",
    ),
    EventSpec(
        "denial",
        "debug",
        ("reason",),
        "an extension could not be granted now; the request waits at its boundary (or the "
        "policy preempts, checkpoints or continues it)",
    ),
    EventSpec(
        "preemption",
        "info",
        ("reason", "recompute_tokens", "generated"),
        "the request was preempted; it keeps a checkpoint of `generated` tokens and resuming "
        "it costs `recompute_tokens` of re-prefill",
    ),
    EventSpec(
        "continuation",
        "info",
        ("continuation_id", "generated"),
        "the request ended with an explicit continuation (on_exhausted='continue') instead of "
        "waiting for its grant to grow",
    ),
    EventSpec(
        "abort",
        "info",
        ("reason",),
        "the core told the engine to abort the request (reason 'cancelled': the caller left; "
        "'capacity-exhausted': it needs more KV than the engine has)",
    ),
    EventSpec(
        "rejection",
        "info",
        ("reason", "retry_after"),
        "overload: the request was refused at once (Overloaded, HTTP 429, RESOURCE_EXHAUSTED); "
        "the caller was told to retry after `retry_after` seconds",
    ),
    EventSpec(
        "confirmation",
        "debug",
        ("blocks", "outcome", "resumable"),
        "the engine confirmed the stop; `blocks` blocks returned to the budget",
    ),
    EventSpec(
        "finished",
        "debug",
        ("reason", "generated"),
        "the request stopped by itself (reason 'stop') or at its hard max ('length')",
    ),
    EventSpec(
        "cancelled",
        "debug",
        ("generated",),
        "the caller gave the request up (disconnect, cancellation)",
    ),
    EventSpec(
        "failed",
        "warning",
        ("detail",),
        "the engine failed the request; its blocks stay charged until confirmed",
    ),
    EventSpec(
        "unconfirmed",
        "info",
        ("engine_request_id",),
        "the engine did not confirm a stop within confirm_timeout; the blocks stay charged "
        "until a reconciliation releases them",
    ),
    EventSpec(
        "duplicate_confirmation",
        "info",
        ("why",),
        "a confirmation for a stop already released (or for an earlier attempt) was swallowed",
        per_request=False,
    ),
    EventSpec(
        "policy_fault",
        "error",
        ("policy", "detail", "faults", "new"),
        "a policy fault the budget went on after: a notification (on_granted, on_leave, "
        "on_finished, on_step) that raised, or an answer refused (or a hook that raised) in "
        "the pass after a stop, a release or a tick (counted in Snapshot.policy_faults); the "
        "latest (detail) with how many (faults: all, new: since the last), at most once a second",
        per_request=False,
    ),
    EventSpec(
        "tick_failed",
        "error",
        ("failures", "error"),
        "the budget's periodic tick raised (not a policy fault, which the core keeps itself: "
        "an engine's KV usage read, say); the ticker went on; logged at most once a second "
        "(failures: all so far)",
        per_request=False,
    ),
    EventSpec(
        "reconciliation",
        "info",
        ("released", "blocks", "engine_used_blocks"),
        "unconfirmed stops whose blocks the engine no longer holds were released",
        per_request=False,
    ),
    EventSpec(
        "drift",
        "warning",
        ("drift_blocks", "engine_used_blocks", "ledger_used_blocks"),
        "the engine's reported KV usage differs from what the ledger expects (positive: the "
        "engine holds more than kvbudget thinks)",
        emitted_by="kvbudget.observability.log_drift (adapters)",
        per_request=False,
    ),
    EventSpec(
        "snapshot",
        "info",
        (
            "reserved_blocks",
            "used_blocks",
            "free_blocks",
            "active",
            "queued",
            "releasing",
            "unconfirmed_releasing",
            "drift_blocks",
        ),
        "a periodic summary of the budget (kvbudget.observability.log_snapshot)",
        emitted_by="kvbudget.observability.log_snapshot (applications)",
        per_request=False,
    ),
)

#: every structlog event kvbudget emits, by name
EVENTS: Final[Mapping[str, EventSpec]] = {e.name: e for e in _EVENT_LIST}


class KvbudgetLogger:
    """kvbudget's structlog logger, polite to an application that never configured structlog.

    Once the application has configured structlog (``structlog.configure``), every event goes
    through its configuration, at whatever level it filters. Until then structlog would print
    everything, and a server that embeds kvbudget would see an admission, an extension and a
    confirmation line for every request: so, unconfigured, kvbudget's events are printed with
    structlog's defaults from ``info`` up only (see ``docs/operations.md``).
    """

    __slots__ = ("_bound", "_bound_for", "_configured", "_quiet")

    def __init__(self, name: str) -> None:
        self._configured = structlog.get_logger(name)
        self._quiet = structlog.wrap_logger(
            None,
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
            logger_name=name,
        )
        self._bound: Any = None
        self._bound_for: tuple[int, ...] = ()

    def _target(self) -> Any:
        if not structlog.is_configured():
            return self._quiet
        # structlog's lazy proxy binds a new logger on every call (about 10 us, several times
        # per request), unless the application asked it to cache; the logger bound for the
        # current configuration is kept until the application configures structlog again
        cfg = structlog.get_config()
        key = (
            id(cfg["wrapper_class"]),
            id(cfg["processors"]),
            id(cfg["logger_factory"]),
            id(cfg["context_class"]),
        )
        if key != self._bound_for:
            self._bound = self._configured.bind()
            self._bound_for = key
        return self._bound

    @staticmethod
    def debug_wanted() -> bool:
        """False while the quiet logger is in use, which drops debug events: a caller with
        fields to gather for a debug event can skip them (several such events per request)."""
        return structlog.is_configured()

    def debug(self, event: str, **fields: Any) -> None:
        if self.debug_wanted():  # (unconfigured: the quiet logger would drop it, but only
            # after structlog's lazy proxy bound a new logger: 2.4 us against 0.2 us)
            self._target().debug(event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        self._target().info(event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._target().warning(event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self._target().error(event, **fields)

    def exception(self, event: str, **fields: Any) -> None:
        self._target().exception(event, **fields)


_LOGGERS: dict[str, KvbudgetLogger] = {}


#: the levels :func:`configure_events` takes by name
EVENT_LEVELS: Final[tuple[str, ...]] = ("debug", "info", "warning", "error")
#: timestamps to the microsecond: the events of one request (or one round of preemptions)
#: often fall within the same second
EVENT_TIME_FORMAT: Final[str] = "%Y-%m-%d %H:%M:%S.%f"


def is_terminal(stream: object) -> bool:
    """Is ``stream`` an interactive terminal? Output meant for a person at one (colours, a
    redrawn progress bar) is written there only, never into a log file or a pipe."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # (a closed or detached stream)
        return False


def configure_events(level: int | str = logging.INFO) -> None:
    """Configure structlog for a server that has no structlog configuration of its own:
    kvbudget's events (and any other structlog event) at ``level`` and above (a name of
    :data:`EVENT_LEVELS` or a :mod:`logging` level), rendered as structlog's defaults render
    them but with timestamps to the microsecond (:data:`EVENT_TIME_FORMAT`). The servers'
    ``--events`` / ``--kvbudget-events`` options call it; an application that configures
    structlog itself does not need it."""
    by_name = logging.getLevelNamesMapping()
    if isinstance(level, str):
        name = level.strip().lower()
        if name not in EVENT_LEVELS:
            raise InvalidInput("events", level, "one of " + ", ".join(EVENT_LEVELS))
        level = by_name[name.upper()]
    elif isinstance(level, bool) or level not in {by_name[n.upper()] for n in EVENT_LEVELS}:
        raise InvalidInput("events", level, f"one of {', '.join(EVENT_LEVELS)} or its level")
    # colours as structlog's defaults choose them: on a terminal, unless NO_COLOR; FORCE_COLOR
    # anywhere (a server's log file gets none)
    force = os.environ.get("FORCE_COLOR", "") != ""
    tty = is_terminal(sys.stdout)
    colors = os.environ.get("NO_COLOR", "") == "" and (force or tty)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.StackInfoRenderer(),
            structlog.dev.set_exc_info,
            structlog.processors.TimeStamper(fmt=EVENT_TIME_FORMAT, utc=False),
            structlog.dev.ConsoleRenderer(colors=colors, force_colors=force),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
    )


def get_logger(name: str = LOGGER_NAME) -> KvbudgetLogger:
    """The logger kvbudget logs to: structlog's ``"kvbudget"`` (or ``name``), through
    :class:`KvbudgetLogger`."""
    logger = _LOGGERS.get(name)
    if logger is None:
        logger = _LOGGERS[name] = KvbudgetLogger(name)
    return logger


def emit(
    event: str,
    *,
    request_id: str,
    service_class: str,
    tenant: str,
    level: str | None = None,
    **fields: Any,
) -> None:
    """Log one catalogued per-request event (for adapters and applications; the budget logs its
    own). ``level`` defaults to the event's level in :data:`EVENTS`."""
    spec = EVENTS.get(event)
    if spec is None:
        raise UnknownName("event", event, tuple(EVENTS))
    getattr(get_logger(), level or spec.level)(
        event, request_id=request_id, service_class=service_class, tenant=tenant, **fields
    )


def log_drift(drift_blocks: int, engine_used_blocks: int, ledger_used_blocks: int) -> None:
    """Log reconciliation drift (a ``drift`` warning) when it is not zero."""
    if drift_blocks:
        get_logger().warning(
            "drift",
            drift_blocks=drift_blocks,
            engine_used_blocks=engine_used_blocks,
            ledger_used_blocks=ledger_used_blocks,
        )


def log_snapshot(snapshot: Snapshot) -> None:
    """Log the budget as one ``snapshot`` event (call it periodically, not per request)."""
    get_logger().info(
        "snapshot",
        policy=snapshot.policy,
        capacity_blocks=snapshot.capacity_blocks,
        reserved_blocks=snapshot.reserved_blocks,
        used_blocks=snapshot.used_blocks,
        free_blocks=snapshot.free_blocks,
        headroom_free_blocks=snapshot.headroom_free_blocks,
        active=snapshot.active,
        queued=snapshot.queued,
        releasing=snapshot.releasing,
        unconfirmed_releasing=snapshot.unconfirmed_releasing,
        drift_blocks=snapshot.drift_blocks,
        completed=snapshot.completed,
        rejected=snapshot.rejected,
        preemptions=snapshot.preemptions,
    )


# == snapshot as plain data ======================================================================

#: the scalar fields of a Snapshot, in display order
SNAPSHOT_SCALARS: Final[tuple[str, ...]] = (
    "policy",
    "capacity_blocks",
    "block_size",
    "reserved_blocks",
    "used_blocks",
    "free_blocks",
    "headroom_blocks",
    "headroom_free_blocks",
    "protected_blocks",
    "admission_free_blocks",
    "active",
    "queued",
    "releasing",
    "unconfirmed_releasing",
    "drift_blocks",
    "shared_prefix_blocks",
    "engine_preemptions",
    "wait_in_time_share",
    "wait_forecast_samples",
    "release_rate_blocks_per_s",
    "policy_faults",
    "turned_away_behind",
)


def _counters(c: CounterValues) -> dict[str, int]:
    return {name: int(getattr(c, name)) for name in COUNTER_FIELDS}


def _under(u: UnderestimationStats) -> dict[str, Any]:
    return {
        "count": u.count,
        "underestimated": u.underestimated,
        "rate": u.rate,
        "coverage": u.coverage,
        "target": u.target,
        "shortfall_p50": u.shortfall_p50,
        "shortfall_p90": u.shortfall_p90,
        "shortfall_p99": u.shortfall_p99,
    }


def snapshot_to_dict(snapshot: Snapshot) -> dict[str, Any]:
    """The snapshot as JSON-able data (``by_class_tenant`` becomes a list of rows)."""
    out: dict[str, Any] = {name: getattr(snapshot, name) for name in SNAPSHOT_SCALARS}
    out["stranded_blocks"] = snapshot.stranded_blocks
    for name in KEYED_COUNTERS:
        out[name] = dict(sorted(getattr(snapshot, name).items()))
    out["totals"] = _counters(snapshot.totals)
    out["by_class"] = {k: _counters(v) for k, v in sorted(snapshot.by_class.items())}
    out["by_tenant"] = {k: _counters(v) for k, v in sorted(snapshot.by_tenant.items())}
    out["by_class_tenant"] = [
        {"service_class": cls, "tenant": tenant, **_counters(v)}
        for (cls, tenant), v in sorted(snapshot.by_class_tenant.items())
    ]
    out["wait_outcomes_by_band"] = [
        {"pressure_from": round(wait_pressure_band_from(band), 3), "seen": seen,
         "in_time": in_time}
        for band, (seen, in_time) in enumerate(snapshot.wait_outcomes_by_band)
    ]
    under = snapshot.underestimation
    if under is None:
        out["underestimation"] = None
    else:
        out["underestimation"] = {
            "overall": _under(under.overall),
            "dimensions": {
                dim: {value: _under(s) for value, s in sorted(values.items())}
                for dim, values in sorted(under.dimensions.items())
            },
        }
    return out


_TABLE_COUNTERS: Final[tuple[str, ...]] = (
    "admitted",
    "completed",
    "rejected",
    "cancelled",
    "continued",
    "failed",
    "preemptions",
    "extensions",
    "extensions_denied",
    "unconfirmed",
    "tokens",
    "wasted_tokens",
)


def format_snapshot(data: Mapping[str, Any]) -> str:
    """Render :func:`snapshot_to_dict` output as a plain text table (for ``kvbudget inspect``)."""
    lines: list[str] = []
    scalars = [(k, data[k]) for k in (*SNAPSHOT_SCALARS, "stranded_blocks") if k in data]
    width = max((len(k) for k, _ in scalars), default=0)
    lines.append("budget")
    for key, value in scalars:
        lines.append(f"  {key:<{width}}  {value}")
    rows = list(data.get("by_class_tenant") or [])
    if rows:
        cols = ["service_class", "tenant", *_TABLE_COUNTERS]
        cells = [[str(r.get(c, "")) for c in cols] for r in rows]
        totals = data.get("totals") or {}
        cells.append(["total", "", *(str(totals.get(c, "")) for c in _TABLE_COUNTERS)])
        widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
        lines.append("")
        lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip())
        lines.append("  ".join("-" * w for w in widths))
        for row in cells:
            lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    under = data.get("underestimation")
    if under:
        o = under["overall"]
        lines.append("")
        lines.append(
            f"underestimation: {o['underestimated']}/{o['count']} "
            f"(rate {o['rate']:.3f}, coverage {o['coverage']:.3f}, target {o['target']:.3f}); "
            f"shortfall p50/p90/p99 = {o['shortfall_p50']}/{o['shortfall_p90']}/"
            f"{o['shortfall_p99']} tokens"
        )
    bands = [b for b in data.get("wait_outcomes_by_band") or () if b.get("seen")]
    if bands:
        lines.append("")
        lines.append(
            "queued callers admitted in time, by forecast wait / what they might wait: "
            + ", ".join(f"from {b['pressure_from']:g}: {b['in_time']}/{b['seen']}" for b in bands)
        )
    return "\n".join(lines)


# == Prometheus ==================================================================================

#: gauge name (without the ``kvbudget_`` prefix) -> (Snapshot attribute, help)
GAUGES: Final[Mapping[str, tuple[str, str]]] = {
    "capacity_blocks": ("capacity_blocks", "KV blocks the engine holds."),
    "block_size_tokens": ("block_size", "Tokens per KV block."),
    "reserved_blocks": (
        "reserved_blocks",
        "KV blocks held by grants (including stops awaiting confirmation).",
    ),
    "used_blocks": ("used_blocks", "KV blocks the generated tokens really occupy."),
    "free_blocks": ("free_blocks", "capacity - reserved."),
    "stranded_blocks": ("stranded_blocks", "reserved - used: KV reserved but not in use."),
    "headroom_blocks": ("headroom_blocks", "The headroom target admissions must leave free."),
    "headroom_free_blocks": ("headroom_free_blocks", "The part of the headroom still free."),
    "protected_blocks": (
        "protected_blocks",
        "Headroom protected for interactive extensions only.",
    ),
    "admission_free_blocks": (
        "admission_free_blocks",
        "Blocks new admissions may take now.",
    ),
    "active_requests": ("active", "Requests admitted and not yet stopped."),
    "queued_requests": ("queued", "Requests waiting for admission or resumption."),
    "releasing_requests": ("releasing", "Stopped requests awaiting engine confirmation."),
    "unconfirmed_requests": (
        "unconfirmed_releasing",
        "Stops not confirmed within the confirm timeout.",
    ),
    "drift_blocks": (
        "drift_blocks",
        "Last reconciliation: engine-reported minus ledger-expected blocks.",
    ),
    "shared_prefix_blocks": (
        "shared_prefix_blocks",
        "Prompt blocks charged once for every live request that shares them.",
    ),
    "wait_in_time_share": (
        "wait_in_time_share",
        "Share of recent queued callers admitted in time, of those forecast to wait about as "
        "long for what they might wait as the caller judged last (a caller is turned away at "
        "arrival on its forecast only below turn_away_wait_quantile; 1 with none seen).",
    ),
    "wait_forecast_samples": (
        "wait_forecast_samples",
        "Outcomes of queued callers the turn-away at arrival read for that forecast.",
    ),
    "release_rate_blocks_per_second": (
        "release_rate_blocks_per_s",
        "Blocks per second the engine returned recently, on a clock that runs only while it "
        "holds blocks (after an idle spell: the rate the last busy spell ended at).",
    ),
    "policy_faults": (
        "policy_faults",
        "Policy faults the budget went on after, since start (each logged as policy_fault).",
    ),
}

#: counters of the whole budget keyed by one label: the ``Snapshot`` mapping of that name
#: (without ``kvbudget_`` and ``_total``) -> (label, help)
KEYED_COUNTERS: Final[Mapping[str, tuple[str, str]]] = {
    "rejections_by_reason": ("reason", "Rejections (HTTP 429 / RESOURCE_EXHAUSTED) by reason."),
    "turned_away_held_by": (
        "cause",
        "Callers turned away after they queued, by what last kept each from admission "
        "(no-room, policy, latency-floor, batch-cap, prefill-queue, behind); one never its "
        "queue's head by what held the head it waited behind.",
    ),
}

#: counters of the whole budget: the ``Snapshot`` field of that name (without ``kvbudget_`` and
#: ``_total``) -> help; a field that is None (not known) has no sample
BUDGET_COUNTERS: Final[Mapping[str, str]] = {
    "engine_preemptions": "The engine's own preemptions (vLLM: by recompute; 0 under the "
    "budget). No sample where the engine does not report them.",
    "turned_away_behind": "Callers turned away after they queued without ever being their "
    "queue's head (of turned_away_held_by: a deep queue behind a held head).",
}

#: counter name (without ``kvbudget_`` and ``_total``) -> (Counters field, help)
COUNTERS: Final[Mapping[str, tuple[str, str]]] = {
    "arrived": ("arrived", "Requests that arrived."),
    "admitted": ("admitted", "Admissions (re-admissions after preemption included)."),
    "completed": ("completed", "Requests completed (stop or hard max): useful tasks."),
    "rejected": ("rejected", "Overload rejections (HTTP 429 / RESOURCE_EXHAUSTED)."),
    "cancelled": ("cancelled", "Requests cancelled by their caller."),
    "continued": ("continued", "Requests ended with an explicit continuation."),
    "failed": ("failed", "Requests failed by the engine."),
    "preemptions": ("preemptions", "Preemptions."),
    "recompute_tokens": ("recompute_tokens", "Tokens to re-prefill because of preemptions."),
    "wasted_decoded_tokens": (
        "wasted_tokens",
        "Tokens decoded for work that was abandoned, preempted without resume or discarded.",
    ),
    "tokens": ("tokens", "Output tokens generated."),
    "stalls": ("stalls", "Inter-token stalls over the class latency floor."),
    "first_tokens": (
        "first_tokens",
        "Callers' own first tokens under a first-token objective (not a resumed checkpoint's).",
    ),
    "first_tokens_late": (
        "first_tokens_late",
        "Of those, first tokens later than the class's objective, from the caller's receipt.",
    ),
    "extensions_granted": ("extensions", "Grant extensions granted."),
    "extensions_denied": ("extensions_denied", "Grant extensions denied (the request waited)."),
    "unconfirmed_aborts": (
        "unconfirmed",
        "Stops the engine did not confirm within the confirm timeout.",
    ),
    "reconciled": ("reconciled", "Unconfirmed stops released by reconciliation."),
    "drift_events": ("drift_events", "Reconciliations that found drift."),
    "pauses": ("pauses", "Engine requests paused at a grant boundary (stopped there)."),
    "resubmissions": (
        "resubmissions",
        "Engine requests re-submitted to continue a paused or preempted request.",
    ),
    "reprefill_tokens": ("reprefill_tokens", "Tokens those re-submissions re-prefilled."),
    "dropped_tokens": (
        "dropped_tokens",
        "Tokens the engine produced past a grant, dropped and generated again later.",
    ),
    "full_grants": (
        "full_grants",
        "Requests granted their hard max because a pause would change their output.",
    ),
    "prefix_shared_blocks": (
        "prefix_shared_blocks",
        "Prompt blocks a grant found charged to another holder already (charged once).",
    ),
    "prefix_mismatches": (
        "prefix_mismatches",
        "Grants whose engine cached fewer prompt blocks than the ledger counted as shared.",
    ),
}

#: the budget shell's own counters (only when the exporter reads a Budget)
SHELL_COUNTERS: Final[Mapping[str, tuple[str, str]]] = {
    "shell_duplicate_confirms": (
        "duplicate_confirms",
        "Stale or duplicated engine confirmations swallowed.",
    ),
    "shell_confirm_timeouts": (
        "confirm_timeouts",
        "Engine confirmations that did not come within the timeout.",
    ),
    "shell_engine_errors": ("engine_errors", "Requests failed by engine errors."),
    "shell_reconciliations": ("reconciliations", "Reconciliation passes run."),
}

#: underestimation gauges: name -> (UnderestimationStats field, help)
UNDERESTIMATION: Final[Mapping[str, tuple[str, str]]] = {
    "underestimation_rate": (
        "rate",
        "Fraction of requests whose initial allowance fell short of their length.",
    ),
    "underestimation_coverage": ("coverage", "1 - underestimation rate."),
    "underestimation_target": ("target", "Mean quantile the allowances were asked at."),
    "underestimation_samples": ("count", "Finished requests the rate is computed over."),
    "underestimation_shortfall_p50_tokens": (
        "shortfall_p50",
        "p50 of (true length - initial allowance) over underestimated requests.",
    ),
    "underestimation_shortfall_p90_tokens": (
        "shortfall_p90",
        "p90 of (true length - initial allowance) over underestimated requests.",
    ),
    "underestimation_shortfall_p99_tokens": (
        "shortfall_p99",
        "p99 of (true length - initial allowance) over underestimated requests.",
    ),
}

PREFIX: Final = "kvbudget_"

_INSTALL_HINT = (
    "the Prometheus exporter needs prometheus_client: pip install 'kvbudget[prometheus]'"
)


def _prometheus() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(_INSTALL_HINT) from exc
    return prometheus_client


class PrometheusExporter:
    """A Prometheus collector that reads ``snapshot()`` at scrape time (no hot-path cost).

    ``source``: a :class:`~kvbudget.Budget` (or anything with a ``snapshot()`` method, e.g. a
    ``BudgetedEngine`` or a ``Scheduler``), or a zero-argument callable returning a
    :class:`~kvbudget.core.stats.Snapshot`. If the source also has ``counters`` (the Budget's
    :class:`~kvbudget.ShellCounters`), those are exported as ``kvbudget_shell_*_total``.
    ``registry``: the ``prometheus_client`` registry to register with (default: the global
    ``prometheus_client.REGISTRY``); :meth:`unregister` removes it again.
    ``namespace_labels``: constant labels added to every series (e.g. ``{"engine": "a"}`` when
    one process runs several budgets). Raises ImportError with the install hint if
    ``prometheus_client`` is missing.
    """

    def __init__(
        self,
        source: Any,
        registry: Any = None,
        *,
        namespace_labels: Mapping[str, str] | None = None,
    ) -> None:
        prom = _prometheus()
        if callable(getattr(source, "snapshot", None)):
            self._snapshot: Callable[[], Snapshot] = source.snapshot
            self._owner: Any = source
        elif callable(source):
            self._snapshot = source
            self._owner = None
        else:
            raise TypeError(
                f"PrometheusExporter needs an object with snapshot() or a callable returning a "
                f"Snapshot, got {type(source).__name__}"
            )
        self._const = dict(namespace_labels or {})
        self.registry = registry if registry is not None else prom.REGISTRY
        self.registry.register(self)

    def unregister(self) -> None:
        """Remove the exporter from its registry."""
        self.registry.unregister(self)

    def render(self) -> tuple[bytes, str]:
        """The registry's text exposition and its content type (for a ``/metrics`` handler)."""
        prom = _prometheus()
        return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST

    # -- the collector protocol ------------------------------------------------------------------

    def describe(self) -> list[Any]:
        """The metric families, without samples (lets the registry check for name clashes)."""
        return list(self._families(None))

    def collect(self) -> Iterator[Any]:
        yield from self._families(self._snapshot())

    def _families(self, snap: Snapshot | None) -> Iterator[Any]:
        core = _prometheus().core
        gauge = core.GaugeMetricFamily
        counter = core.CounterMetricFamily
        const_names = list(self._const)
        const_values = list(self._const.values())

        info = gauge(PREFIX + "info", "The budget's policy.", labels=[*const_names, "policy"])
        if snap is not None:
            info.add_metric([*const_values, snap.policy], 1.0)
        yield info

        for name, (attr, doc) in GAUGES.items():
            fam = gauge(PREFIX + name, doc, labels=const_names)
            if snap is not None:
                fam.add_metric(const_values, float(getattr(snap, attr)))
            yield fam

        labels = [*const_names, "class", "tenant"]
        rows = sorted(snap.by_class_tenant.items()) if snap is not None else []
        for name, (attr, doc) in COUNTERS.items():
            fam = counter(PREFIX + name, doc, labels=labels)
            for (cls, tenant), values in rows:
                fam.add_metric([*const_values, cls, tenant], float(getattr(values, attr)))
            yield fam

        for name, (label, doc) in KEYED_COUNTERS.items():
            fam = counter(PREFIX + name, doc, labels=[*const_names, label])
            if snap is not None:
                by_key: Mapping[str, int] = getattr(snap, name)
                for key, n in sorted(by_key.items()):
                    fam.add_metric([*const_values, key], float(n))
            yield fam

        for name, doc in BUDGET_COUNTERS.items():
            fam = counter(PREFIX + name, doc, labels=const_names)
            total: int | None = getattr(snap, name) if snap is not None else None
            if total is not None:
                fam.add_metric(const_values, float(total))
            yield fam

        shell = getattr(self._owner, "counters", None) if self._owner is not None else None
        if shell is not None and hasattr(shell, "confirm_timeouts"):
            for name, (attr, doc) in SHELL_COUNTERS.items():
                fam = counter(PREFIX + name, doc, labels=const_names)
                if snap is not None:
                    fam.add_metric(const_values, float(getattr(shell, attr)))
                yield fam

        folder = _name_folder(self._owner)
        fam = counter(
            PREFIX + "folded_names",
            "Requests whose client-chosen tenant or task was folded into 'other' (the limits "
            "of kvbudget.names.NameLimits), by kind.",
            labels=[*const_names, "kind"],
        )
        if snap is not None and folder is not None:
            for kind in ("tenant", "task"):
                fam.add_metric([*const_values, kind], float(folder.folded[kind]))
        yield fam

        ulabels = [*const_names, "dimension", "value"]
        under = snap.underestimation if snap is not None else None
        series: list[tuple[str, str, UnderestimationStats]] = []
        if under is not None:
            series.append(("all", "all", under.overall))
            for dim, per_value in sorted(under.dimensions.items()):
                for value, stats in sorted(per_value.items()):
                    series.append((dim, value, stats))
        for name, (attr, doc) in UNDERESTIMATION.items():
            fam = gauge(PREFIX + name, doc, labels=ulabels)
            for dim, value, stats in series:
                v = float(getattr(stats, attr))
                fam.add_metric([*const_values, dim, value], v if math.isfinite(v) else 0.0)
            yield fam


def _name_folder(owner: Any) -> Any:
    """The owner's :class:`~kvbudget.names.NameFolder` (a Budget's, or a BudgetedEngine's
    budget's), or None."""
    for source in (owner, getattr(owner, "budget", None)):
        folder = getattr(source, "names", None)
        if folder is not None and hasattr(folder, "folded"):
            return folder
    return None


def metric_names() -> list[str]:
    """Every metric name the exporter exposes (counters with their ``_total`` suffix)."""
    names = [PREFIX + "info", *(PREFIX + n for n in GAUGES)]
    names += [PREFIX + n + "_total" for n in COUNTERS]
    names += [PREFIX + n + "_total" for n in KEYED_COUNTERS]
    names += [PREFIX + n + "_total" for n in BUDGET_COUNTERS]
    names += [PREFIX + n + "_total" for n in SHELL_COUNTERS]
    names += [PREFIX + "folded_names_total"]
    names += [PREFIX + n for n in UNDERESTIMATION]
    return names


__all__ = [
    "COUNTERS",
    "EVENTS",
    "EVENT_LEVELS",
    "EVENT_TIME_FORMAT",
    "GAUGES",
    "SHELL_COUNTERS",
    "UNDERESTIMATION",
    "EventSpec",
    "KvbudgetLogger",
    "PrometheusExporter",
    "configure_events",
    "emit",
    "format_snapshot",
    "get_logger",
    "is_terminal",
    "log_drift",
    "log_snapshot",
    "metric_names",
    "snapshot_to_dict",
]
