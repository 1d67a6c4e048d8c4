"""Where calibrated's lead over vLLM's reserve-current comes from: ablations in the simulator.

    PYTHONPATH=src python benchmarks/sim_ablation.py \
        --trace ../shared/traces/azure-llm-2023-conv.csv --rate-scale 1.1

Takes ``kvbudget simulate``'s workload, scenario and engine flags (its parser, so every flag
means the same) and runs these variants over the same requests:

* ``calibrated``: the shipped policy behind kvbudget's front (the default run).
* ``calibrated, turn-away off``: ``SchedulerConfig(turn_away_late_first_tokens=False)``.
* ``calibrated, turn-away + deadline forecast off``: also ``deadline_service_quantile=None``
  (a queued request with a deadline is turned away at the deadline itself).
* ``calibrated, no batch-prefill gate``: ``CalibratedPolicy(batch_prefill_share=None)``.
* ``calibrated, no front``: the same policy with ``front = False`` (a subclass here): one
  first-come-first-served queue, no overload turn-away, no queue timeouts, no latency-floor gate
  -- the scheduler as it runs the baselines. What remains is the policy's reservation (grant
  sizing, extensions, headroom) and its own admission gate.
* ``calibrated, no front, no batch-prefill gate``: the reservation alone.
* ``reserve-current``: vLLM v1 FCFS as shipped (no front).
* ``reserve-current + front``: the same policy with ``front = True`` (a subclass here):
  vLLM's reservation behind kvbudget's front.

The shipped policies are not changed; the subclasses live in this script. Prints a markdown
table and, last, one JSON line ``{"rate_scale": x, "variants": {NAME: {...figures...}}}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any, ClassVar

from kvbudget.cli import _engine_from, _scenario_from, _workload_from, build_parser
from kvbudget.core.config import SchedulerConfig
from kvbudget.core.policy import CalibratedPolicy, ReserveCurrentPolicy
from kvbudget.sim.driver import simulate
from kvbudget.sim.scenario import apply_scenario


class CalibratedNoFront(CalibratedPolicy):
    """Calibrated without kvbudget's front (as the scheduler runs the baselines)."""

    front: ClassVar[bool] = False


class ReserveCurrentWithFront(ReserveCurrentPolicy):
    """vLLM's reserve-current behind kvbudget's front."""

    front: ClassVar[bool] = True


def variants(turn_away: bool | None, quantile: float | None) -> list[tuple[str, Any, Any]]:
    base = SchedulerConfig(
        turn_away_late_first_tokens=turn_away, deadline_service_quantile=quantile
    )
    no_turn = SchedulerConfig(turn_away_late_first_tokens=False, deadline_service_quantile=quantile)
    no_turn_q = SchedulerConfig(turn_away_late_first_tokens=False, deadline_service_quantile=None)
    return [
        ("calibrated", lambda: CalibratedPolicy(), base),
        ("calibrated, turn-away off", lambda: CalibratedPolicy(), no_turn),
        ("calibrated, turn-away + deadline forecast off", lambda: CalibratedPolicy(), no_turn_q),
        (
            "calibrated, no batch-prefill gate",
            lambda: CalibratedPolicy(batch_prefill_share=None),
            base,
        ),
        ("calibrated, no front", lambda: CalibratedNoFront(), base),
        (
            "calibrated, no front, no batch-prefill gate",
            lambda: CalibratedNoFront(batch_prefill_share=None),
            base,
        ),
        ("reserve-current", lambda: ReserveCurrentPolicy(), base),
        ("reserve-current + front", lambda: ReserveCurrentWithFront(), base),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(["simulate", *(sys.argv[1:] if argv is None else argv)])
    turn_away = {"auto": None, "on": True, "off": False}[args.turn_away_late_first_tokens]
    engine = _engine_from(args)
    workload = _workload_from(args)
    scenario = _scenario_from(args, args.rate_scale)
    requests = apply_scenario(workload, scenario)
    if args.duration is not None and requests:
        t0 = requests[0].arrival_s
        requests = tuple(r for r in requests if r.arrival_s - t0 <= args.duration)
    out: dict[str, dict[str, Any]] = {}
    print(
        "| variant | goodput r/s | good | rejected | preempt | TTFT p50 | TTFT p99 "
        "| KV rsv % | KV used % |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, make, config in variants(turn_away, args.deadline_service_quantile):
        r = simulate(requests, scenario, engine, make(), seed=args.seed, config=config)
        out[name] = r.to_dict() | {"ttft_p50_s": r.ttft_p50_s}
        print(
            f"| {name} | {r.goodput_rps:.3f} | {r.good} | {r.rejected} | {r.preemptions} "
            f"| {r.ttft_p50_s:.2f} | {r.ttft_p99_s:.2f} | {r.kv_reserved_mean:.1f} "
            f"| {r.kv_used_mean:.1f} |",
            flush=True,
        )
    print(json.dumps({"rate_scale": args.rate_scale, "variants": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
