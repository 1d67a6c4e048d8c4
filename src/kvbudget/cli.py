"""The ``kvbudget`` command line (console script ``kvbudget = kvbudget.cli:main``).

This module owns argument parsing and the ``simulate`` subcommand: build a workload (a trace or
the built-in synthetic one), overlay a scenario, replay it through each policy with the
discrete-event driver (:mod:`kvbudget.sim.driver`) against the engine model
(:mod:`kvbudget.sim.engine`), print one table, and optionally write JSON and a PNG
(:mod:`kvbudget.sim.report`). A text progress bar goes to stderr when it is a terminal.

Subcommands are registered in :data:`SUBCOMMANDS` (name -> function that adds its subparser);
add a new one with :func:`subcommand` -- e.g. ``kvbudget inspect URL`` lives in its own module and
registers itself there, or is added to :data:`SUBCOMMANDS` below the "other subcommands" marker.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import attrs

__all__ = ["SUBCOMMANDS", "build_parser", "main", "subcommand"]

Handler = Callable[[argparse.Namespace], int]
Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

#: name -> function that adds the subcommand's parser (and sets ``handler`` as its default).
SUBCOMMANDS: dict[str, Registrar] = {}


def subcommand(name: str) -> Callable[[Registrar], Registrar]:
    """Register a subcommand: the decorated function adds its subparser to ``subparsers``."""

    def register(fn: Registrar) -> Registrar:
        SUBCOMMANDS[name] = fn
        return fn

    return register


# =============================================================================================
# kvbudget simulate
# =============================================================================================


class ProgressBar:
    """A dependency-free text progress bar on a stream (stderr), redrawn at most 10 times/s."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30) -> None:
        self.total = max(1, total)
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.start = time.perf_counter()
        self._last = 0.0
        self.label = ""

    def update(self, done_units: float, label: str = "", force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        share = min(1.0, max(0.0, done_units / self.total))
        filled = round(share * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(
            f"\r[{bar}] {share * 100:5.1f}%  {now - self.start:6.1f}s  {label:<40.40}"
        )
        self.stream.flush()

    def close(self) -> None:
        self.update(self.total, "done", force=True)
        self.stream.write("\n")
        self.stream.flush()


def _float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas, got {text!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _float_above(minimum: float, *, inclusive: bool) -> Callable[[str], float]:
    """An argparse type: a number above ``minimum`` (or equal to it when ``inclusive``)."""
    words = f">= {minimum:g}" if inclusive else f"> {minimum:g}"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (v >= minimum if inclusive else v > minimum) or v != v or v == float("inf"):
            raise argparse.ArgumentTypeError(f"expected a finite number {words}, got {text!r}")
        return v

    return parse


_positive_float = _float_above(0.0, inclusive=False)
_nonneg_float = _float_above(0.0, inclusive=True)


def _share(text: str) -> float:
    v = _nonneg_float(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1], got {text!r}")
    return v


def quantile_or_off(text: str) -> float | None:
    """An ``argparse`` type: ``off`` (None) or a quantile strictly between 0 and 1 (the
    examples' servers use it too)."""
    if text == "off":
        return None
    v = _positive_float(text)
    if v >= 1:
        raise argparse.ArgumentTypeError(f"expected a quantile in (0, 1) or 'off', got {text!r}")
    return v


def _int_at_least(minimum: int, text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
    return v


def _nonneg_int(text: str) -> int:
    return _int_at_least(0, text)


def _positive_int(text: str) -> int:
    return _int_at_least(1, text)


@subcommand("simulate")
def _add_simulate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvbudget.core.config import SchedulerConfig
    from kvbudget.core.policy import POLICY_NAMES
    from kvbudget.sim.engine_model import (
        DEFAULT_ABORT_LATENCY_S,
        DEFAULT_BLOCK_SIZE,
        DEFAULT_CAPACITY_BLOCKS,
        DEFAULT_MAX_BATCH,
        DEFAULT_PREFILL_CHUNK_TOKENS,
        DEFAULT_TICK_S,
    )

    p = sub.add_parser(
        "simulate",
        help="replay a workload through every policy in virtual time and compare them",
        description=(
            "Replay a trace (Azure CSV, BurstGPT CSV or Mooncake JSONL) or the built-in "
            "synthetic workload through kvbudget's scheduler under each policy, against a "
            "simulated engine (Llama-2-7B on one A100-80GB by default), and print one row "
            "per policy."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("workload")
    g.add_argument(
        "--trace",
        metavar="PATH",
        help="trace file: Azure LLM inference CSV (2023 or 2024), BurstGPT CSV or Mooncake "
        "JSON lines (default: built-in synthetic)",
    )
    g.add_argument(
        "--limit",
        type=_positive_int,
        metavar="N",
        help="use only the first N requests (synthetic: generate N; default 3000)",
    )
    g.add_argument(
        "--duration",
        type=_positive_float,
        metavar="S",
        help="use only requests arriving in the first S seconds (replayed timeline)",
    )
    g.add_argument(
        "--rate-scale",
        type=_positive_float,
        default=1.0,
        metavar="X",
        help="replay X times faster than the workload's own arrivals",
    )
    g.add_argument(
        "--sweep-rate",
        type=_float_list,
        metavar="A,B,C",
        help="run at each of these rate multipliers and report goodput against load",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the workload and scenario")
    g = p.add_argument_group("policies")
    g.add_argument(
        "--policy",
        action="append",
        choices=POLICY_NAMES,
        metavar="NAME",
        help=f"policy to run (repeatable; default: all: {', '.join(POLICY_NAMES)})",
    )
    g = p.add_argument_group("scenario")
    g.add_argument("--interactive-share", type=_share, default=0.7)
    g.add_argument(
        "--abandon-share",
        type=_share,
        default=0.1,
        help="share of interactive callers that disconnect early",
    )
    g.add_argument("--max-tokens-interactive", type=_positive_int, default=2048)
    g.add_argument("--max-tokens-batch", type=_positive_int, default=4096)
    g.add_argument("--model-max-len", type=_positive_int, default=8192)
    g.add_argument(
        "--ttft-slo",
        type=_positive_float,
        default=2.0,
        help="interactive time-to-first-token objective (s)",
    )
    g.add_argument(
        "--itl-floor",
        type=_positive_float,
        default=0.2,
        help="interactive latency floor: slowest allowed inter-token gap (s)",
    )
    g.add_argument(
        "--batch-deadline",
        type=_positive_float,
        default=600.0,
        help="batch completion deadline after arrival (s)",
    )
    g.add_argument(
        "--wave-at",
        type=_nonneg_float,
        metavar="S",
        help="add a synchronized wave of long interactive outputs at S seconds",
    )
    g.add_argument("--wave-count", type=_positive_int, default=64)
    g.add_argument(
        "--wave-tokens",
        type=_positive_int,
        default=2000,
        help="true output tokens of each wave request",
    )
    g.add_argument("--wave-prompt-tokens", type=_positive_int, default=512)
    g.add_argument(
        "--system-prompts",
        type=_nonneg_int,
        default=0,
        metavar="N",
        help="N distinct shared system prompts, prepended to requests without prefix data of "
        "their own (Mooncake hash_ids); 0: none",
    )
    g.add_argument(
        "--system-prompt-tokens",
        type=_nonneg_int,
        default=0,
        metavar="T",
        help="tokens of each system prompt (counted in the request's prompt)",
    )
    g.add_argument(
        "--system-prompt-share",
        type=_share,
        default=1.0,
        metavar="F",
        help="share of requests (without prefix data) that start with a system prompt",
    )
    g = p.add_argument_group("engine")
    g.add_argument(
        "--engine-profile",
        metavar="FILE|NAME",
        help="the engine model from a profile (kvbudget.sim.profile.EngineProfile JSON, or a "
        "shipped one by name: "
        + ", ".join(_shipped_profiles())
        + "); the engine flags below override its figures",
    )
    g.add_argument(
        "--capacity-blocks",
        type=_positive_int,
        help=f"KV cache blocks (default {DEFAULT_CAPACITY_BLOCKS})",
    )
    g.add_argument(
        "--block-size", type=_positive_int, help=f"tokens per block (default {DEFAULT_BLOCK_SIZE})"
    )
    g.add_argument(
        "--max-batch", type=_positive_int, help=f"batch cap (default {DEFAULT_MAX_BATCH})"
    )
    g.add_argument(
        "--prefill-chunk",
        type=_positive_int,
        help=f"prefill tokens per engine step (default {DEFAULT_PREFILL_CHUNK_TOKENS})",
    )
    g.add_argument(
        "--abort-latency",
        type=_nonneg_float,
        help="seconds until an abort or preemption is confirmed "
        f"(default {DEFAULT_ABORT_LATENCY_S})",
    )
    g.add_argument(
        "--intake-ms",
        type=_nonneg_float,
        help="engine time each arriving request costs, taken from the next step (ms; default "
        "the profile's, else 0)",
    )
    g.add_argument(
        "--tick-ms",
        type=_positive_float,
        help="how often the simulated shell ticks the scheduler: a queued caller past its bound "
        f"is turned away at the next tick (ms; default {1e3 * DEFAULT_TICK_S:g}, as a real "
        "Budget ticks; docs/benchmarks-history.md's figures dated before the thirty-eighth session "
        "were made at 100)",
    )
    g.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="turn the engine's prefix cache off: every prompt is prefilled and charged in full",
    )
    g.add_argument("--step-fixed-ms", type=_nonneg_float, help="decode step fixed cost (ms)")
    g.add_argument(
        "--step-per-seq-us", type=_nonneg_float, help="decode step cost per running sequence (us)"
    )
    g.add_argument(
        "--step-per-token-ns", type=_nonneg_float, help="decode step cost per context token (ns)"
    )
    g.add_argument(
        "--prefill-per-token-us", type=_nonneg_float, help="prefill cost per prompt token (us)"
    )
    g = p.add_argument_group("scheduler (every policy)")

    def quantile_flag(flag: str, field: str, help: str) -> None:
        """A ``Q|off`` flag for the ``SchedulerConfig`` quantile ``field``, defaulting to it."""
        g.add_argument(
            flag,
            type=quantile_or_off,
            default=getattr(attrs.fields(SchedulerConfig), field).default,
            metavar="Q|off",
            help=f"{help} (SchedulerConfig.{field}, default: %(default)s)",
        )

    g.add_argument(
        "--turn-away-late-first-tokens",
        choices=("auto", "on", "off"),
        default="auto",
        help="turn away callers whose first token the prefill queued in the engine would make "
        "late: auto (while >5%% of recent first tokens are late), on, off "
        "(SchedulerConfig.turn_away_late_first_tokens)",
    )
    quantile_flag(
        "--deadline-service-quantile",
        "deadline_service_quantile",
        "turn away a queued request with a deadline once its prefill and its Q-quantile "
        "output length could no longer finish by it; off: at the deadline itself",
    )
    quantile_flag(
        "--first-token-quantile",
        "first_token_quantile",
        "judge first-token objectives against this quantile of the learned time from "
        "admission to a first token; off: its mean",
    )
    quantile_flag(
        "--turn-away-wait-quantile",
        "turn_away_wait_quantile",
        "turn away a newcomer on its estimated wait only when fewer than Q of the recent "
        "queued callers estimated at about its pressure (estimate / bound) were admitted in "
        "time; off: when the raw estimate passes its bound",
    )
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    g.add_argument("--plot", metavar="PATH", help="write a PNG chart")
    g.add_argument("--markdown", action="store_true", help="print the table as markdown")
    g.add_argument(
        "--quiet", action="store_true",
        help="no progress bar (there is none unless stderr is a terminal)",
    )
    p.set_defaults(handler=_simulate)


def _shipped_profiles() -> list[str]:
    from kvbudget.sim.profile import shipped_profiles

    return shipped_profiles()


def _engine_from(args: argparse.Namespace) -> Any:
    """The engine model: the defaults, or a profile's figures, each overridden by its flag."""
    from kvbudget.core.model import Capacity
    from kvbudget.sim.engine_model import EngineModel

    base = EngineModel()
    if getattr(args, "engine_profile", None):
        from kvbudget.sim.profile import EngineProfile

        base = EngineProfile.load(args.engine_profile).engine_model()
    step = base.step
    changes: dict[str, float] = {}
    if args.step_fixed_ms is not None:
        changes["fixed_s"] = args.step_fixed_ms / 1e3
    if args.step_per_seq_us is not None:
        changes["per_seq_s"] = args.step_per_seq_us / 1e6
    if args.step_per_token_ns is not None:
        changes["per_context_token_s"] = args.step_per_token_ns / 1e9
    if args.prefill_per_token_us is not None:
        changes["prefill_per_token_s"] = args.prefill_per_token_us / 1e6
    if changes:
        step = attrs.evolve(step, **changes)

    def given(value: Any, default: Any) -> Any:
        return default if value is None else value

    return EngineModel(
        capacity=Capacity(
            given(args.capacity_blocks, base.capacity.blocks),
            given(args.block_size, base.capacity.block_size),
        ),
        step=step,
        abort_latency_s=given(args.abort_latency, base.abort_latency_s),
        max_batch=given(args.max_batch, base.max_batch),
        prefill_chunk_tokens=given(args.prefill_chunk, base.prefill_chunk_tokens),
        prefix_caching=base.prefix_caching and not args.no_prefix_cache,
        front_end=base.front_end,
        intake_s=base.intake_s if args.intake_ms is None else args.intake_ms / 1e3,
        tick_s=base.tick_s if args.tick_ms is None else args.tick_ms / 1e3,
    )


def _scenario_from(args: argparse.Namespace, rate_scale: float) -> Any:
    from kvbudget.sim.scenario import Scenario, Wave

    wave = None
    if args.wave_at is not None:
        wave = Wave(
            at_s=args.wave_at,
            count=args.wave_count,
            output_tokens=args.wave_tokens,
            prompt_tokens=args.wave_prompt_tokens,
        )
    return Scenario(
        seed=args.seed,
        interactive_share=args.interactive_share,
        interactive_max_tokens=args.max_tokens_interactive,
        batch_max_tokens=args.max_tokens_batch,
        model_max_len=args.model_max_len,
        ttft_slo_s=args.ttft_slo,
        itl_floor_s=args.itl_floor,
        batch_deadline_s=args.batch_deadline,
        abandon_share=args.abandon_share,
        rate_scale=rate_scale,
        wave=wave,
        system_prompts=args.system_prompts,
        system_prompt_tokens=args.system_prompt_tokens,
        system_prompt_share=args.system_prompt_share,
    )


def _workload_from(args: argparse.Namespace) -> Any:
    from kvbudget.sim.workload import read_trace, synthetic_workload

    if args.trace:
        return read_trace(args.trace, limit=args.limit)
    if args.limit is not None:
        return synthetic_workload(seed=args.seed, n_requests=args.limit)
    return synthetic_workload(seed=args.seed)


def _workload_notes(summary: Mapping[str, Any], model_max_len: int) -> list[str]:
    """What the replay changed of the trace, said under its table (also in the JSON)."""
    notes = []
    overlay = summary.get("overlay", {})
    n = overlay.get("count", 0)
    cut = overlay.get("prompts_clamped", 0)
    if cut:
        notes.append(
            f"{cut} of {n} prompts are longer than --model-max-len {model_max_len} and were cut "
            f"to {model_max_len - 1} tokens (a longer-context model: --model-max-len)"
        )
    if overlay.get("outputs_clamped", 0):
        notes.append(
            f"{overlay['outputs_clamped']} of {n} true outputs run past their hard maximum "
            "(max_tokens, or the model's length less the prompt) and end there"
        )
    if summary.get("rows_skipped", 0):
        notes.append(f"{summary['rows_skipped']} rows of the trace are not requests an engine "
                     "ran (failed calls) and were skipped")
    return notes


def _simulate(args: argparse.Namespace) -> int:
    from kvbudget.core.config import SchedulerConfig
    from kvbudget.core.policy import POLICY_NAMES
    from kvbudget.errors import KvBudgetError
    from kvbudget.observability import is_terminal
    from kvbudget.sim import report
    from kvbudget.sim.driver import run_policies
    from kvbudget.sim.scenario import apply_scenario, overlay_summary

    turn_away = {"auto": None, "on": True, "off": False}[args.turn_away_late_first_tokens]
    config = SchedulerConfig(
        turn_away_late_first_tokens=turn_away,
        deadline_service_quantile=args.deadline_service_quantile,
        first_token_quantile=args.first_token_quantile,
        turn_away_wait_quantile=args.turn_away_wait_quantile,
    )
    try:
        engine = _engine_from(args)
        workload = _workload_from(args)
        rates = args.sweep_rate or [args.rate_scale]
        scenarios = [_scenario_from(args, r) for r in rates]
    except (KvBudgetError, OSError) as exc:
        print(f"kvbudget simulate: {exc}", file=sys.stderr)
        return 2
    policies = list(dict.fromkeys(args.policy or POLICY_NAMES))
    # (a bar redrawn with carriage returns is for a terminal: piped or logged, it would write
    # one frame per redraw into the file)
    bar = (
        None
        if args.quiet or not is_terminal(sys.stderr)
        else ProgressBar(len(policies) * len(rates))
    )
    runs: list[report.RunResult] = []
    for k, scenario in enumerate(scenarios):
        requests = apply_scenario(workload, scenario)
        if args.duration is not None:
            t0 = requests[0].arrival_s if requests else 0.0
            requests = tuple(r for r in requests if r.arrival_s - t0 <= args.duration)
        if not requests:
            print("kvbudget simulate: the workload has no requests", file=sys.stderr)
            return 2

        def progress(i: int, share: float, _k: int = k, _rate: float = rates[k]) -> None:
            if bar is not None:
                bar.update(_k * len(policies) + i + share, f"{policies[i]} at x{_rate:g}")

        results = run_policies(
            requests,
            scenario,
            engine,
            policies,
            seed=args.seed,
            progress=progress,
            config=config,
        )
        wl_summary = dict(workload.summary())
        wl_summary["overlay"] = overlay_summary(requests)
        runs.append(
            report.RunResult(
                policies=results,
                workload=wl_summary,
                scenario={
                    **scenario.to_dict(),
                    "turn_away_late_first_tokens": args.turn_away_late_first_tokens,
                    "deadline_service_quantile": args.deadline_service_quantile,
                    "first_token_quantile": args.first_token_quantile,
                    "turn_away_wait_quantile": args.turn_away_wait_quantile,
                },
                engine=engine.to_dict(),
                rate_scale=scenario.rate_scale,
            )
        )
    if bar is not None:
        bar.close()
    out = sys.stdout
    for run in runs:
        n = run.workload.get("overlay", {}).get("count", 0)
        out.write(
            f"\n{run.workload.get('name')}: {n} requests, rate x{run.rate_scale:g}, "
            f"capacity {engine.capacity.blocks} blocks x {engine.capacity.block_size} tokens\n"
        )
        out.write(report.format_markdown(run) if args.markdown else report.format_table(run))
        out.write("\n")
        for note in _workload_notes(run.workload, args.model_max_len):
            out.write(f"note: {note}\n")
    if len(runs) > 1:
        sweep = report.SweepResult(runs=tuple(runs))
        out.write("\ngoodput (requests within SLO per second) against load\n")
        out.write(report.format_sweep_table(sweep) + "\n")
        if args.json:
            report.write_json(report.sweep_to_json(sweep), args.json)
        if args.plot:
            report.plot_sweep(sweep, args.plot)
    else:
        if args.json:
            report.write_json(report.run_to_json(runs[0]), args.json)
        if args.plot:
            report.plot_run(runs[0], args.plot)
    return 0


# =============================================================================================
# other subcommands register here (e.g. ``kvbudget inspect URL``) with @subcommand("name")
# =============================================================================================


# -- kvbudget inspect URL ---------------------------------------------------------------------


@subcommand("inspect")
def _add_inspect(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "inspect",
        help="print the budget snapshot of a running server (GET URL/kvbudget/snapshot)",
        description=(
            "Fetch URL/kvbudget/snapshot from a server that exposes it (examples/fastapi_server.py"
            " does) and print the budget snapshot as a table."
        ),
    )
    p.add_argument("url", metavar="URL", help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--timeout", type=_positive_float, default=5.0, help="seconds (default 5)")
    p.add_argument("--json", action="store_true", help="print the raw JSON instead of a table")
    p.set_defaults(handler=_inspect)


def fetch_snapshot(url: str, timeout: float = 5.0) -> dict[str, Any]:
    """GET ``url``/kvbudget/snapshot (urllib, no extra dependency) and return the decoded JSON."""
    import json
    import urllib.request

    target = url.rstrip("/")
    if not target.endswith("/kvbudget/snapshot"):
        target += "/kvbudget/snapshot"
    req = urllib.request.Request(target, headers={"Accept": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        data = json.loads(resp.read().decode("utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{target} returned {type(data).__name__}, expected a JSON object")
    return data


def _inspect(args: argparse.Namespace) -> int:
    import json
    import urllib.error

    from kvbudget.observability import format_snapshot

    try:
        data = fetch_snapshot(args.url, args.timeout)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"kvbudget inspect: cannot read a snapshot from {args.url}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else format_snapshot(data))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="kvbudget", description="KV-cache budgets for LLM serving."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in SUBCOMMANDS.values():
        register(sub)
    sub.add_parser(
        "serve",
        help="vLLM's own OpenAI server with the budget inside (every `vllm serve` option, "
        "plus --kvbudget-policy and --kvbudget-classes; `kvbudget serve --help`)",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvbudget`` console script. Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        # vLLM's own parser takes every argument after `serve` (kvbudget.serve.make_parser)
        from kvbudget.serve import main as serve_main

        return serve_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    return handler(args)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
