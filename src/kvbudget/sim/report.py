"""Simulation results: value objects, the comparison table, JSON output and plots.

This module owns what a simulation run *reports*: :class:`PolicyResult` (the figures of one
policy on one workload), :class:`RunResult` (every policy of one run plus the workload, scenario
and engine it ran on), :class:`SweepResult` (runs at several loads), the text table
(:func:`format_table`, one row per policy), the JSON document (:func:`run_to_json`, shape below)
and the matplotlib figures (:func:`plot_run`, :func:`plot_sweep`; matplotlib is imported lazily
with the ``Agg`` backend, so importing this module never needs it).

JSON shape (``kvbudget simulate --json``)::

    {"policies": {"<name>": {"goodput_rps": ..., "goodput_vs_oracle": ..., "completed": ...,
                             "rejected": ..., "preemptions": ..., "recompute_tokens": ...,
                             "wasted_decoded_tokens": ..., "ttft_p99_s": ..., "itl_p99_s": ...,
                             "stalls": ..., "kv_reserved_mean": ..., "kv_used_mean": ...,
                             "hard_max_violations": ..., "silent_truncations": ...,
                             "prefix_cached_tokens": ..., "prefix_hit_rate": ...,
                             ...more figures of the table (see PolicyResult.to_dict)}},
     "workload": {...}, "scenario": {...}, "engine": {...}}

``kv_reserved_mean``/``kv_used_mean`` are percentages of capacity. ``goodput_vs_oracle`` is null
when ``oracle`` was not run. A sweep writes ``{"sweep": [{"rate_scale": x, ...run...}, ...]}``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvbudget.core.forecast import ForecastMemory

__all__ = [
    "JSON_POLICY_KEYS",
    "PolicyResult",
    "RequestRecord",
    "RunResult",
    "SweepResult",
    "format_sweep_table",
    "format_table",
    "plot_run",
    "plot_sweep",
    "run_to_json",
    "sweep_to_json",
    "write_json",
]

#: The per-policy keys of the JSON document, in order (the issue's contract).
JSON_POLICY_KEYS: tuple[str, ...] = (
    "goodput_rps",
    "goodput_vs_oracle",
    "completed",
    "rejected",
    "preemptions",
    "recompute_tokens",
    "wasted_decoded_tokens",
    "ttft_p99_s",
    "itl_p99_s",
    "stalls",
    "kv_reserved_mean",
    "kv_used_mean",
    "hard_max_violations",
    "silent_truncations",
    "prefix_cached_tokens",
    "prefix_hit_rate",
)


@attrs.frozen(slots=True, kw_only=True)
class RequestRecord:
    """One simulated request as its client saw it (``simulate(..., keep_requests=True)``).

    ``end``: how it ended (completed, rejected, abandoned, continued, failed).
    ``output_tokens``: tokens it generated (the engine's count, tokens decoded after its client
    left included); ``expected_tokens``: what it would have generated had nothing stopped it
    (its true length, cut to its hard max). Times are seconds on the replayed timeline;
    ``first_token_s``/``last_token_s``/``finished_s`` are None when that never happened.
    ``longest_gap_s``: an interactive request's longest gap between two of its tokens, as the
    engine made them (a pause included; None: not interactive, or fewer than two tokens).
    ``service_class``: the class it asked for.
    """

    request_id: str
    arrival_s: float
    end: str
    prompt_tokens: int
    output_tokens: int
    expected_tokens: int
    first_token_s: float | None
    last_token_s: float | None
    finished_s: float | None
    longest_gap_s: float | None = None
    service_class: str = "interactive"

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: (last - first) / (tokens - 1), as
        vLLM's benchmark client computes it (0.0 for a single token)."""
        if self.first_token_s is None or self.last_token_s is None:
            return None
        if self.output_tokens < 2:
            return 0.0
        return (self.last_token_s - self.first_token_s) / (self.output_tokens - 1)


@attrs.frozen(slots=True, kw_only=True)
class PolicyResult:
    """The figures of one policy on one workload (see ``docs/benchmarks.md`` for definitions).

    Counts: every request ends exactly once as ``completed``, ``rejected`` (turned away as
    overloaded before admission), ``abandoned`` (its caller left: cancelled while queued or
    running), ``continued`` (ended with an explicit continuation) or ``failed`` (a checkpoint
    that expired, or a request larger than the engine); ``requests`` is their sum.
    ``good``: requests completed within their class SLO; ``goodput_rps`` = good / ``window_s``
    (the replayed arrival span). Latency figures are over interactive requests; ``stalls`` counts
    interactive inter-token gaps longer than the latency floor. ``kv_*_mean``: time-averaged
    percent of capacity. ``under_p50/p90/p99``: underestimation of the initial allowance in
    tokens (over the requests it fell short for), ``coverage``: share of requests it covered.
    ``itl_cdf``: (gap seconds, cumulative share) points; ``kv_series``: (t, reserved %, used %).
    ``peak_resident``: the most requests whose blocks the engine held at once.
    ``rejections_by_reason``: the turned-away requests by the scheduler's reason;
    ``turned_away_held_by``: those turned away after they queued, by what last kept each from
    admission (:data:`kvbudget.core.stats.HELD_BY`); ``turned_away_behind``: how many of them
    were never their queue's head (counted there by what held the head they waited behind).
    ``prefix_cached_tokens``: prompt tokens the engine found in its prefix cache at first
    admissions; ``prefix_hit_rate``: those over the prompt tokens of first admissions.
    ``resume_cached_tokens``: tokens requests admitted again after a preemption found cached.
    """

    policy: str
    requests: int
    good: int
    good_interactive: int
    good_batch: int
    goodput_rps: float
    goodput_vs_oracle: float | None = None
    completed: int
    rejected: int
    abandoned: int
    continued: int
    failed: int
    preemptions: int
    recompute_tokens: int
    wasted_decoded_tokens: int
    decoded_tokens: int
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    stalls: int
    core_stalls: int
    kv_reserved_mean: float
    kv_used_mean: float
    hard_max_violations: int
    silent_truncations: int
    extensions: int
    extensions_denied: int
    under_p50: int
    under_p90: int
    under_p99: int
    coverage: float
    window_s: float
    makespan_s: float
    steps: int
    wall_s: float
    peak_resident: int = 0
    #: turned-away requests by the scheduler's reason ("deadline", "queue-timeout", ...)
    rejections_by_reason: Mapping[str, int] = attrs.field(factory=dict)
    #: callers turned away after they queued, by what last kept each from admission
    turned_away_held_by: Mapping[str, int] = attrs.field(factory=dict)
    turned_away_behind: int = 0
    prefix_cached_tokens: int = 0
    prefix_hit_rate: float = 0.0
    resume_cached_tokens: int = 0
    itl_cdf: tuple[tuple[float, float], ...] = ()
    kv_series: tuple[tuple[float, float, float], ...] = ()
    #: every request's record, when the run kept them (not part of the JSON figures)
    request_records: tuple[RequestRecord, ...] = ()
    #: what the scheduler's forecast had learned when the run ended, for a next run of the same
    #: server (``simulate(forecast=...)``; not part of the JSON figures)
    forecast_memory: ForecastMemory | None = attrs.field(default=None, eq=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The JSON figures: :data:`JSON_POLICY_KEYS` first, then the other table figures."""
        d: dict[str, Any] = {k: getattr(self, k) for k in JSON_POLICY_KEYS}
        for k in (
            "requests",
            "good",
            "good_interactive",
            "good_batch",
            "abandoned",
            "continued",
            "failed",
            "decoded_tokens",
            "ttft_p50_s",
            "itl_p50_s",
            "core_stalls",
            "extensions",
            "extensions_denied",
            "under_p50",
            "under_p90",
            "under_p99",
            "coverage",
            "window_s",
            "makespan_s",
            "steps",
            "wall_s",
            "peak_resident",
            "rejections_by_reason",
            "turned_away_held_by",
            "turned_away_behind",
            "resume_cached_tokens",
        ):
            d[k] = getattr(self, k)
        return d


@attrs.frozen(slots=True, kw_only=True)
class RunResult:
    """Every policy of one run, and what it ran on."""

    policies: Mapping[str, PolicyResult]
    workload: Mapping[str, Any]
    scenario: Mapping[str, Any]
    engine: Mapping[str, Any]
    rate_scale: float = 1.0


@attrs.frozen(slots=True, kw_only=True)
class SweepResult:
    """Runs of the same workload at several rate multipliers."""

    runs: tuple[RunResult, ...]


def with_oracle_ratio(results: Mapping[str, PolicyResult]) -> dict[str, PolicyResult]:
    """Fill ``goodput_vs_oracle`` from the ``oracle`` entry (None when it is absent or 0)."""
    oracle = results.get("oracle")
    base = oracle.goodput_rps if oracle is not None else 0.0
    out: dict[str, PolicyResult] = {}
    for name, r in results.items():
        ratio = (r.goodput_rps / base) if base > 0 else None
        out[name] = attrs.evolve(r, goodput_vs_oracle=ratio)
    return out


# -- text -----------------------------------------------------------------------------------

_COLUMNS: tuple[tuple[str, str], ...] = (
    ("policy", "policy"),
    ("goodput", "goodput r/s"),
    ("vs_oracle", "vs oracle"),
    ("completed", "done"),
    ("rejected", "rejected"),
    ("abandoned", "abandoned"),
    ("preemptions", "preempt"),
    ("recompute", "recompute tok"),
    ("wasted", "wasted tok"),
    ("ttft50", "TTFT p50"),
    ("ttft99", "TTFT p99"),
    ("itl99", "ITL p99"),
    ("stalls", "stalls"),
    ("reserved", "KV rsv %"),
    ("used", "KV used %"),
    ("hardmax", "hard-max viol"),
    ("silent", "silent trunc"),
    ("under", "under p50/p90/p99"),
    ("prefix", "prefix hit %"),
)


def _row(r: PolicyResult) -> dict[str, str]:
    ratio = "-" if r.goodput_vs_oracle is None else f"{r.goodput_vs_oracle:.3f}"
    return {
        "policy": r.policy,
        "goodput": f"{r.goodput_rps:.3f}",
        "vs_oracle": ratio,
        "completed": str(r.completed),
        "rejected": str(r.rejected),
        "abandoned": str(r.abandoned),
        "preemptions": str(r.preemptions),
        "recompute": str(r.recompute_tokens),
        "wasted": str(r.wasted_decoded_tokens),
        "ttft50": f"{r.ttft_p50_s:.3f}s",
        "ttft99": f"{r.ttft_p99_s:.3f}s",
        "itl99": f"{r.itl_p99_s * 1000:.0f}ms",
        "stalls": str(r.stalls),
        "reserved": f"{r.kv_reserved_mean:.1f}",
        "used": f"{r.kv_used_mean:.1f}",
        "hardmax": str(r.hard_max_violations),
        "silent": str(r.silent_truncations),
        "under": f"{r.under_p50}/{r.under_p90}/{r.under_p99}",
        "prefix": f"{100.0 * r.prefix_hit_rate:.1f}",
    }


def _table(rows: list[dict[str, str]], columns: Sequence[tuple[str, str]]) -> str:
    widths = {k: max(len(h), *(len(r[k]) for r in rows)) if rows else len(h) for k, h in columns}
    head = "  ".join(
        h.rjust(widths[k]) if k != "policy" else h.ljust(widths[k]) for k, h in columns
    )
    lines = [head, "  ".join("-" * widths[k] for k, _ in columns)]
    for r in rows:
        lines.append(
            "  ".join(
                r[k].ljust(widths[k]) if k == "policy" else r[k].rjust(widths[k])
                for k, _ in columns
            )
        )
    return "\n".join(lines)


def format_table(run: RunResult) -> str:
    """One row per policy, as printed by ``kvbudget simulate``."""
    return _table([_row(r) for r in run.policies.values()], _COLUMNS)


def format_markdown(run: RunResult) -> str:
    """The same table as GitHub markdown (for docs)."""
    rows = [_row(r) for r in run.policies.values()]
    heads = [h for _, h in _COLUMNS]
    lines = ["| " + " | ".join(heads) + " |", "|" + "|".join(" --- " for _ in heads) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(r[k] for k, _ in _COLUMNS) + " |")
    return "\n".join(lines)


def format_sweep_table(sweep: SweepResult) -> str:
    """Goodput (req/s) per policy (columns) at each rate multiplier (rows)."""
    if not sweep.runs:
        return "(empty sweep)"
    names = list(sweep.runs[0].policies)
    columns = [("policy", "rate x"), *((n, n) for n in names)]
    rows = []
    for run in sweep.runs:
        row = {"policy": f"{run.rate_scale:g}"}
        for n in names:
            r = run.policies.get(n)
            row[n] = "-" if r is None else f"{r.goodput_rps:.3f}"
        rows.append(row)
    return _table(rows, columns)


# -- JSON -----------------------------------------------------------------------------------


def _clean(value: Any) -> Any:
    """JSON cannot hold NaN/inf: map them to null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def run_to_json(run: RunResult) -> dict[str, Any]:
    """The JSON document of one run (module docstring)."""
    doc = {
        "policies": {name: r.to_dict() for name, r in run.policies.items()},
        "workload": dict(run.workload),
        "scenario": dict(run.scenario),
        "engine": dict(run.engine),
        "rate_scale": run.rate_scale,
    }
    cleaned: dict[str, Any] = _clean(doc)
    return cleaned


def sweep_to_json(sweep: SweepResult) -> dict[str, Any]:
    return {"sweep": [run_to_json(r) for r in sweep.runs]}


def write_json(doc: Mapping[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n", encoding="utf-8")


# -- plots ----------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(run: RunResult, path: str | Path, *, title: str | None = None) -> None:
    """Goodput per policy, KV reserved vs used over time, and the interactive ITL CDF."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    names = list(run.policies)
    results = [run.policies[n] for n in names]
    colors = {n: f"C{i}" for i, n in enumerate(names)}

    ax = axes[0]
    ax.bar(names, [r.goodput_rps for r in results], color=[colors[n] for n in names])
    for i, r in enumerate(results):
        if r.goodput_vs_oracle is not None:
            ax.annotate(
                f"{r.goodput_vs_oracle:.2f}x",
                (i, r.goodput_rps),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_ylabel("goodput (requests within SLO / s)")
    ax.set_title("goodput per policy (label: vs oracle)")
    ax.tick_params(axis="x", rotation=30)

    ax = axes[1]
    for n, r in zip(names, results, strict=True):
        if not r.kv_series:
            continue
        ts = [p[0] for p in r.kv_series]
        ax.plot(ts, [p[1] for p in r.kv_series], color=colors[n], lw=1.0, label=f"{n} reserved")
        ax.plot(ts, [p[2] for p in r.kv_series], color=colors[n], lw=0.8, ls=":")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("% of KV capacity")
    ax.set_title("KV reserved (solid) vs used (dotted)")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=7, loc="lower right")

    ax = axes[2]
    for n, r in zip(names, results, strict=True):
        if r.itl_cdf:
            ax.plot(
                [p[0] * 1000 for p in r.itl_cdf],
                [p[1] for p in r.itl_cdf],
                color=colors[n],
                label=n,
                drawstyle="steps-post",
            )
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency (ms, log)")
    ax.set_ylabel("share of interactive tokens")
    ax.set_title("interactive inter-token latency CDF")
    ax.set_ylim(0.0, 1.0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")

    fig.suptitle(
        title
        or f"kvbudget simulate: {run.workload.get('name', 'workload')}, rate x{run.rate_scale:g}"
    )
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)


def plot_sweep(sweep: SweepResult, path: str | Path, *, title: str | None = None) -> None:
    """Goodput against load (rate multiplier) for every policy."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    if sweep.runs:
        names = list(sweep.runs[0].policies)
        xs = [r.rate_scale for r in sweep.runs]
        for i, n in enumerate(names):
            ys = [r.policies[n].goodput_rps if n in r.policies else math.nan for r in sweep.runs]
            axes[0].plot(xs, ys, marker="o", color=f"C{i}", label=n)
            pre = [r.policies[n].preemptions if n in r.policies else math.nan for r in sweep.runs]
            axes[1].plot(xs, pre, marker="o", color=f"C{i}", label=n)
        axes[0].set_xlabel("rate multiplier (x trace rate)")
        axes[0].set_ylabel("goodput (requests within SLO / s)")
        axes[0].set_title("goodput against load")
        axes[0].grid(True, alpha=0.3)
        axes[0].legend(fontsize=8)
        axes[1].set_xlabel("rate multiplier (x trace rate)")
        axes[1].set_ylabel("preemptions")
        axes[1].set_yscale("symlog")
        axes[1].set_title("preemptions against load")
        axes[1].grid(True, alpha=0.3)
        wl = sweep.runs[0].workload.get("name", "workload")
        fig.suptitle(title or f"kvbudget simulate --sweep-rate: {wl}")
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
