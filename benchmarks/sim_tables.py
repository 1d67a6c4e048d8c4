"""Every simulator table of docs/benchmarks.md, regenerated on this checkout in one command.

    PYTHONPATH=src .venv/bin/python benchmarks/sim_tables.py --out DIR [--jobs 2] [--only A,B]

Runs each job below (``kvbudget simulate ... --markdown --json``, or ``sim_ablation.py``) in its
own process, ``--jobs`` at a time, and keeps each one's table as ``DIR/NAME.md`` and its figures
as ``DIR/NAME.json``. Then prints, per job and load, calibrated's good requests beside the best
faithful baseline's and vLLM's ``reserve-current``'s, and the two ratios; the last line is one
JSON object with those figures. The docs' simulator sections quote these files: a reader who
re-runs this script on the same commit gets the same tables (the simulator is deterministic for
a seed; only ``wall_s`` differs).

Jobs that read the Azure conversation trace (``--traces``, default ``../shared/traces``) are
skipped with a note when it is absent; ``sessions`` first writes the synthetic traces
(``benchmarks/synthetic_traces.py``) under ``DIR/traces``. On the 2-core machine the whole set
takes about 9 min with ``--jobs 2``, the Azure loads most of it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from held_out_cells import baselines_good  # noqa: E402  (the rule of what is a baseline)

REPO = HERE.parent
AZURE = "azure-llm-2023-conv.csv"
AZURE_LOADS = ("0.6", "0.85", "1.1", "1.5", "2.0")
TINY_LOADS = ("0.6", "1.1")
ABLATION_LOADS = ("0.85", "1.1", "1.5")


@attrs.frozen
class Job:
    """One command whose output is one table of the docs."""

    name: str
    args: tuple[str, ...]  # after ``kvbudget simulate`` (or the ablation script)
    trace: bool = False  # reads the Azure trace (``{azure}`` in args)
    ablation: bool = False  # benchmarks/sim_ablation.py rather than kvbudget simulate
    sessions: bool = False  # reads DIR/traces/sessions.jsonl


def jobs() -> list[Job]:
    """The docs' simulator tables, largest first (so that ``--jobs 2`` ends them together)."""
    az = ("--trace", "{azure}")
    tiny = ("--engine-profile", "vllm-cpu-tiny", "--limit", "2000")
    out = [Job(f"azure-{x}", (*az, "--rate-scale", x), trace=True) for x in AZURE_LOADS[::-1]]
    out += [
        Job(f"ablation-azure-{x}", (*az, "--rate-scale", x), True, True) for x in ABLATION_LOADS
    ]
    out += [
        Job("ablation-builtin", (), ablation=True),
        Job("default", ()),
        Job("prefix-on", ("--system-prompts", "4", "--system-prompt-tokens", "1024",
                          "--system-prompt-share", "0.8")),
        Job("prefix-off", ("--system-prompts", "4", "--system-prompt-tokens", "1024",
                           "--system-prompt-share", "0.8", "--no-prefix-cache")),
        Job("wave-a100", (*az, "--limit", "2000", "--wave-at", "60", "--wave-count", "200",
                          "--wave-tokens", "2000"), trace=True),
        Job("wave-tiny", (*az, *tiny, "--wave-at", "60", "--wave-count", "40",
                          "--wave-tokens", "1000", "--wave-prompt-tokens", "200"), trace=True),
        *(Job(f"tiny-{x}", (*az, *tiny, "--rate-scale", x), trace=True) for x in TINY_LOADS),
        *(Job(f"sessions-{x}", ("--trace", "{sessions}", "--rate-scale", x), sessions=True)
          for x in ("1", "4")),
    ]
    return out


def command(job: Job, out: Path, traces: Path, extra: Sequence[str] = ()) -> list[str]:
    """The command of ``job`` (``extra``: more arguments, ``--simulate-arg``)."""
    args = [
        a.format(azure=traces / AZURE, sessions=out / "traces" / "sessions.jsonl")
        for a in job.args
    ] + list(extra)
    if job.ablation:
        return [sys.executable, str(HERE / "sim_ablation.py"), *args]
    return [
        sys.executable, "-m", "kvbudget", "simulate", *args, "--markdown", "--quiet",
        "--json", str(out / f"{job.name}.json"),
    ]


def run(job: Job, out: Path, traces: Path, extra: Sequence[str] = ()) -> float:
    """Run ``job``; its stdout goes to ``out/NAME.md`` (and, for an ablation, its last line,
    a JSON object, to ``out/NAME.json``). Seconds taken."""
    cmd = command(job, out, traces, extra)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    took = time.monotonic() - t0
    shown = " ".join(str(a).replace(str(REPO) + "/", "") for a in cmd[1:])
    if proc.returncode != 0:
        raise RuntimeError(f"{job.name} failed ({shown}):\n{proc.stderr[-3000:]}")
    (out / f"{job.name}.md").write_text(f"<!-- {shown} -->\n{proc.stdout}", encoding="utf-8")
    if job.ablation:
        (out / f"{job.name}.json").write_text(proc.stdout.strip().splitlines()[-1] + "\n")
    print(f"# {job.name}: {took:.0f} s", flush=True)
    return took


def compare(policies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Calibrated's good requests against the best baseline's and reserve-current's."""
    cal = policies["calibrated"]["good"]
    bases = baselines_good(policies)
    best = max(bases, key=lambda b: bases[b])
    rc = bases["reserve-current"]
    return {
        "calibrated": cal,
        "best_baseline": best,
        "best_baseline_good": bases[best],
        "vs_best": round(cal / max(1, bases[best]), 3),
        "reserve_current": rc,
        "vs_reserve_current": round(cal / max(1, rc), 3),
        "at_or_above_every_baseline": cal >= bases[best],
    }


def summary(out: Path, done: list[Job]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for job in done:
        if job.ablation:
            continue
        doc = json.loads((out / f"{job.name}.json").read_text())
        rows[job.name] = compare(doc["policies"])
    for name, row in rows.items():
        print(
            f"{name:18} calibrated {row['calibrated']:6}  best baseline "
            f"{row['best_baseline']:16} {row['best_baseline_good']:6}  "
            f"x{row['vs_best']:.3f}  reserve-current {row['reserve_current']:6}  "
            f"x{row['vs_reserve_current']:.3f}"
            + ("" if row["at_or_above_every_baseline"] else "  BELOW A BASELINE")
        )
    return rows


def load_table(out: Path, prefix: str, loads: tuple[str, ...]) -> str | None:
    """Goodput against load, one column per policy, from the jobs ``{prefix}-{load}`` (the table
    ``kvbudget simulate --sweep-rate`` prints, for loads run as separate jobs). None when a load
    was not run."""
    docs = []
    for x in loads:
        path = out / f"{prefix}-{x}.json"
        if not path.exists():
            return None
        docs.append((x, json.loads(path.read_text())["policies"]))
    names = list(docs[0][1])
    lines = [
        "| rate x | " + " | ".join(names) + " |",
        "| --- | " + " | ".join("---" for _ in names) + " |",
    ]
    for x, pols in docs:
        lines.append(
            f"| {float(x):g} | " + " | ".join(f"{pols[n]['goodput_rps']:.3f}" for n in names) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "traces")
    ap.add_argument("--only", help="comma-separated job names (default: all)")
    ap.add_argument("--list", action="store_true", help="print the jobs' commands and stop")
    ap.add_argument("--simulate-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for every job (repeatable; a quick look: "
                         "--simulate-arg=--limit=300; the docs' tables use none)")
    args = ap.parse_args(argv)
    out: Path = args.out.resolve()
    todo = jobs()
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {j.name for j in todo}
        if unknown:
            ap.error(f"unknown jobs {sorted(unknown)}; --list shows them")
        todo = [j for j in todo if j.name in wanted]
    if args.list:
        for job in todo:
            print(job.name, " ".join(command(job, out, args.traces, args.simulate_arg)[1:]))
        return {}
    skipped = [j.name for j in todo if j.trace] if not (args.traces / AZURE).exists() else []
    if skipped:
        print(f"# {args.traces / AZURE} is absent: skipping {', '.join(skipped)}")
        todo = [j for j in todo if not j.trace]
    out.mkdir(parents=True, exist_ok=True)
    if any(j.sessions for j in todo):
        subprocess.run(
            [sys.executable, str(HERE / "synthetic_traces.py"), str(out / "traces")],
            env={**os.environ, "PYTHONPATH": str(REPO / "src")}, check=True,
            capture_output=True,
        )
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(lambda j: run(j, out, args.traces, args.simulate_arg), todo))
    print(f"# all {len(todo)} jobs in {time.monotonic() - t0:.0f} s, tables in {out}")
    rows = summary(out, todo)
    for prefix, loads in (("azure", AZURE_LOADS), ("tiny", TINY_LOADS)):
        table = load_table(out, prefix, loads)
        if table is not None:
            (out / f"{prefix}-loads.md").write_text(table + "\n", encoding="utf-8")
            print(f"\n{prefix}: goodput (r/s) against load\n{table}")
    print(json.dumps({"out": str(out), "jobs": rows}))
    return rows


if __name__ == "__main__":
    main()
