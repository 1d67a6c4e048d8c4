"""The held-out table of docs/benchmarks.md ("Held-out traces"), one cell per process.

    .venv/bin/python benchmarks/held_out_cells.py [--traces DIR] [--policy P ...] [--jobs 2]
        [--seed 0] [--cell SUBSTRING ...] [--limit N] [--json FILE] [--mooncake DIR]
        [--simulate-arg ARG ...] [--shapes DIR] [--markdown FILE]

Cells (37): the tiny CPU engine's profile (``vllm-cpu-tiny``) at 0.6x, 1x, 2x and 4x and the
default engine model (Llama-2-7B on an A100) at 1x and 4x, on the five synthetic traces of
``benchmarks/synthetic_traces.py`` (written to ``--traces`` when absent there) and on the Azure
conversation trace's first 3,000 requests (``--azure``; its cells are left out when the file is
absent), and the built-in workload on the A100 model at 1x. With ``--mooncake DIR`` (a checkout's
``FAST25-release/traces`` of https://github.com/kvcache-ai/Mooncake: ``conversation_trace.jsonl``,
``synthetic_trace.jsonl``, read where they are; a file absent there leaves its cells out) ten
more: each trace's first 1,000 requests on
the A100 model at 0.05x, 0.1x, 0.25x, 1x and 4x, as a 128K-context model
(``--model-max-len 131072``: their prompts run to 126K and 191K tokens; a longer one is cut to
it). A cell is named
``TRACE/PROFILE/LOAD`` (``bursty/tiny/2``); ``--cell`` keeps the cells whose name contains one of
the substrings given. With ``--shapes DIR`` 66 more: the eleven trace shapes of
``benchmarks/shape_traces.py`` (written to DIR when absent there; the thirty-first session's
held-out shapes) at the synthetic traces' six loads, named ``shape-NAME/PROFILE/LOAD``
(``--cell shape-`` keeps only them). Each cell runs what ``kvbudget simulate --trace T
--rate-scale X [--engine-profile vllm-cpu-tiny] [--limit 3000] --seed S --policy P`` runs, through
:mod:`kvbudget.cli`'s own builders; ``--limit N`` replays only each trace's first N requests (a
quick look, not the table). Prints per cell and policy the good requests, goodput and
interactive stalls; with calibrated and other policies, per cell the best other one and whether
calibrated is >= it. ``--simulate-arg ARG`` (repeatable) adds ``ARG`` to every cell's
``kvbudget simulate`` arguments: the same cells under another scenario overlay
(``--simulate-arg=--interactive-share=1.0 --simulate-arg=--abandon-share=0``). ``--markdown
FILE`` writes the cells as the markdown table of docs/benchmarks.md (calibrated beside the best
faithful baseline, vLLM's ``reserve-current`` and the oracle). Last line: one JSON object,
``{"cells": {NAME: {POLICY: {...}}}}``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SYNTHETIC = {
    "bursty": "bursty.csv", "code": "code.csv", "longctx": "longctx.jsonl",
    "reason": "reason.csv", "sessions": "sessions.jsonl",
}
TINY_LOADS = (0.6, 1.0, 2.0, 4.0)
A100_LOADS = (1.0, 4.0)
AZURE_LIMIT = 3000
#: the real Mooncake traces (FAST'25 release), by cell name: file, loads, first N requests
MOONCAKE = {"mooncake-conv": "conversation_trace.jsonl", "mooncake-syn": "synthetic_trace.jsonl"}
MOONCAKE_LOADS = (0.05, 0.1, 0.25, 1.0, 4.0)
MOONCAKE_LIMIT = 1000
MOONCAKE_MODEL_MAX_LEN = 131072
#: the cell-name prefix of benchmarks/shape_traces.py's traces
SHAPE_PREFIX = "shape-"


def cells(mooncake: bool = False, shapes: bool = False) -> list[tuple[str, str, float]]:
    """Every cell of the table, as (trace, profile, load), in the table's order (``mooncake``:
    and the real Mooncake traces' cells after them; ``shapes``: and then the trace shapes')."""
    out = [(t, "tiny", x) for t in ("azure", *SYNTHETIC) for x in TINY_LOADS]
    out += [("azure", "A100", x) for x in A100_LOADS] + [("builtin", "A100", 1.0)]
    out += [(t, "A100", x) for t in SYNTHETIC for x in A100_LOADS]
    if mooncake:
        out += [(t, "A100", x) for t in MOONCAKE for x in MOONCAKE_LOADS]
    if shapes:
        for name in _shape_traces().SHAPES:
            out += [(SHAPE_PREFIX + name, "tiny", x) for x in TINY_LOADS]
            out += [(SHAPE_PREFIX + name, "A100", x) for x in A100_LOADS]
    return out


def cell_name(cell: tuple[str, str, float]) -> str:
    trace, profile, load = cell
    return f"{trace}/{profile}/{load:g}"


def simulate_argv(
    cell: tuple[str, str, float], traces: Path, azure: Path, seed: int, limit: int | None,
    mooncake: Path | None = None, shapes: Path | None = None,
) -> list[str]:
    """The ``kvbudget simulate`` arguments of ``cell``."""
    trace, profile, load = cell
    argv = ["simulate"]
    if trace.startswith(SHAPE_PREFIX):
        if shapes is None:
            raise ValueError(f"cell {cell_name(cell)} needs the trace shapes' directory")
        argv += ["--trace", str(shapes / f"{trace.removeprefix(SHAPE_PREFIX)}.csv")]
        if limit is not None:
            argv += ["--limit", str(limit)]
    elif trace in MOONCAKE:
        if mooncake is None:
            raise ValueError(f"cell {cell_name(cell)} needs the Mooncake traces' directory")
        argv += ["--trace", str(mooncake / MOONCAKE[trace]),
                 "--limit", str(min(limit or MOONCAKE_LIMIT, MOONCAKE_LIMIT)),
                 "--model-max-len", str(MOONCAKE_MODEL_MAX_LEN)]
    elif trace == "azure":
        argv += ["--trace", str(azure), "--limit", str(min(limit or AZURE_LIMIT, AZURE_LIMIT))]
    elif trace != "builtin":
        argv += ["--trace", str(traces / SYNTHETIC[trace])]
        if limit is not None:
            argv += ["--limit", str(limit)]
    elif limit is not None:
        argv += ["--limit", str(limit)]
    argv += ["--rate-scale", f"{load:g}", "--seed", str(seed)]
    if profile == "tiny":
        argv += ["--engine-profile", "vllm-cpu-tiny"]
    return argv


def run_cell(argv: list[str], policy: str) -> dict[str, Any]:
    """One cell under one policy: good, goodput (r/s) and interactive stalls."""
    from kvbudget import cli
    from kvbudget.core.config import SchedulerConfig
    from kvbudget.sim.driver import simulate
    from kvbudget.sim.scenario import apply_scenario

    ns = cli.build_parser().parse_args(argv)
    scenario = cli._scenario_from(ns, ns.rate_scale)
    requests = apply_scenario(cli._workload_from(ns), scenario)
    result = simulate(
        requests, scenario, cli._engine_from(ns), policy, seed=ns.seed, config=SchedulerConfig()
    )
    return {"good": result.good, "goodput_rps": round(result.goodput_rps, 3),
            "stalls": result.stalls}


def verdicts(table: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per cell with calibrated and another policy: the best other one and whether calibrated
    is >= it (by good requests)."""
    out: dict[str, dict[str, Any]] = {}
    for name, row in table.items():
        others = {p: r for p, r in row.items() if p != "calibrated"}
        if "calibrated" not in row or not others:
            continue
        best = max(others, key=lambda p: others[p]["good"])
        out[name] = {"best_other": best, "ok": row["calibrated"]["good"] >= others[best]["good"]}
    return out


def baselines_good(row: dict[str, dict[str, Any]]) -> dict[str, int]:
    """The good requests of each faithful baseline among one cell's (or one run's) policies:
    every policy but calibrated and the oracle (which knows every length: no baseline)."""
    return {p: r["good"] for p, r in row.items() if p not in ("calibrated", "oracle")}


def markdown(table: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The cells as a markdown table (docs/benchmarks.md): per cell calibrated's good requests,
    the best faithful baseline's (the oracle is no baseline: it knows every length), the ratio,
    ``reserve-current``'s (vLLM) and the ratio to it, and the oracle's, where they were run.
    A cell where calibrated is below a baseline is marked **below**."""
    lines = [
        "| cell | calibrated | best baseline | calibrated / best | reserve-current "
        "| calibrated / reserve-current | oracle |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for name, row in table.items():
        if "calibrated" not in row:
            continue
        cal = row["calibrated"]["good"]
        bases = baselines_good(row)
        best = max(bases, key=lambda p: bases[p]) if bases else None
        rc = bases.get("reserve-current")
        oracle = row.get("oracle", {}).get("good")
        ratio = "" if best is None else f"{cal / max(1, bases[best]):.3f}"
        if best is not None and cal < bases[best]:
            ratio = f"**{ratio}, below**"
        lines.append(
            f"| {name} | {cal:,} | "
            + ("-" if best is None else f"{best} {bases[best]:,}")
            + f" | {ratio or '-'} | "
            + ("-" if rc is None else f"{rc:,}")
            + " | "
            + ("-" if rc is None else f"{cal / max(1, rc):.2f}x")
            + " | "
            + ("-" if oracle is None else f"{oracle:,}")
            + " |"
        )
    return "\n".join(lines)


def _sibling(name: str) -> Any:
    """Another script of benchmarks/, imported as a module."""
    here = str(ROOT / "benchmarks")
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module(name)


def _shape_traces() -> Any:
    return _sibling("shape_traces")


def _ensure_shapes(shapes: Path) -> None:
    module = _shape_traces()
    if not all((shapes / f"{name}.csv").exists() for name in module.SHAPES):
        module.write(shapes)


def _ensure_traces(traces: Path) -> None:
    if not all((traces / f).exists() for f in SYNTHETIC.values()):
        _sibling("synthetic_traces").main([str(traces)])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", type=Path, default=Path("/tmp/kvbudget-traces"),
                   help="the synthetic traces' directory (written there when absent)")
    p.add_argument("--azure", type=Path,
                   default=ROOT.parent / "shared" / "traces" / "azure-llm-2023-conv.csv",
                   help="the Azure conversation trace (its cells are left out when absent)")
    p.add_argument("--mooncake", type=Path, default=None, metavar="DIR",
                   help="the real Mooncake traces' directory (FAST25-release/traces): "
                        "adds their cells")
    p.add_argument("--shapes", type=Path, default=None, metavar="DIR",
                   help="adds the cells of benchmarks/shape_traces.py's eleven trace shapes, "
                        "written to DIR when absent there")
    p.add_argument("--policy", action="append", default=None,
                   help="repeatable (default: calibrated)")
    p.add_argument("--cell", action="append", default=None, metavar="SUBSTRING")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="each trace's first N requests")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--markdown", type=Path, default=None, metavar="FILE",
                   help="also write the cells as a markdown table here (docs/benchmarks.md)")
    p.add_argument("--simulate-arg", action="append", default=[], metavar="ARG",
                   help="one more `kvbudget simulate` argument for every cell (repeatable; "
                        "another scenario overlay: --simulate-arg=--interactive-share=1.0)")
    ns = p.parse_args(argv)
    if ns.jobs < 1 or (ns.limit is not None and ns.limit < 1):
        p.error("--jobs and --limit must be >= 1")
    if ns.mooncake is not None and not any((ns.mooncake / f).exists() for f in MOONCAKE.values()):
        p.error(f"--mooncake {ns.mooncake}: none of {', '.join(MOONCAKE.values())} there")
    policies = list(dict.fromkeys(ns.policy or ["calibrated"]))
    chosen = [
        c for c in cells(ns.mooncake is not None, ns.shapes is not None)
        if (not ns.cell or any(s in cell_name(c) for s in ns.cell))
        and (c[0] != "azure" or ns.azure.exists())
        and (c[0] not in MOONCAKE or (ns.mooncake / MOONCAKE[c[0]]).exists())
    ]
    if any(c[0] in SYNTHETIC for c in chosen):
        _ensure_traces(ns.traces)
    if ns.shapes is not None and any(c[0].startswith(SHAPE_PREFIX) for c in chosen):
        _ensure_shapes(ns.shapes)
    jobs = [(c, pol) for c in chosen for pol in policies]
    with ProcessPoolExecutor(ns.jobs) as pool:
        futures = [
            pool.submit(
                run_cell,
                simulate_argv(c, ns.traces, ns.azure, ns.seed, ns.limit, ns.mooncake, ns.shapes)
                + ns.simulate_arg,
                pol,
            )
            for c, pol in jobs
        ]
        results = [f.result() for f in futures]
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for (c, pol), res in zip(jobs, results, strict=True):
        table.setdefault(cell_name(c), {})[pol] = res
    judged = verdicts(table)
    for name, row in table.items():
        figures = "  ".join(
            f"{pol} {r['good']} ({r['goodput_rps']:.3f} r/s, {r['stalls']} stalls)"
            for pol, r in row.items()
        )
        v = judged.get(name)
        verdict = "" if v is None else (
            f"  best other {v['best_other']}: {'ok' if v['ok'] else 'BELOW'}"
        )
        print(f"{name:20s} {figures}{verdict}")
    if judged:
        below = [n for n, v in judged.items() if not v["ok"]]
        print(f"calibrated >= every other policy in {len(judged) - len(below)} of {len(judged)} "
              f"cells" + (f"; below in {', '.join(below)}" if below else ""))
    out = {
        "cells": table, "verdicts": judged, "seed": ns.seed, "limit": ns.limit,
        "simulate_args": ns.simulate_arg,
    }
    line = json.dumps(out)
    if ns.markdown is not None:
        ns.markdown.write_text(markdown(table) + "\n", encoding="utf-8")
    if ns.json is not None:
        ns.json.write_text(line + "\n", encoding="utf-8")
    print(line)
    return out


if __name__ == "__main__":
    main()
