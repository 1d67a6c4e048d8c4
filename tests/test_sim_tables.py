"""benchmarks/sim_tables.py: every job's command is one `kvbudget simulate` accepts, the
comparison it prints is calibrated against the faithful baselines, and one job end to end."""

from __future__ import annotations

import json
import pathlib

from _bench_loader import load_benchmark
from kvbudget.cli import build_parser

st = load_benchmark("sim_tables")


def test_every_job_is_a_command_kvbudget_simulate_accepts(tmp_path: pathlib.Path) -> None:
    jobs = st.jobs()
    names = [j.name for j in jobs]
    assert len(names) == len(set(names))
    assert {"default", "azure-1.1", "tiny-0.6", "wave-a100", "prefix-off", "sessions-4"} <= set(
        names
    )
    parser = build_parser()
    for job in jobs:
        cmd = st.command(job, tmp_path, tmp_path / "traces")
        if job.ablation:
            assert cmd[1].endswith("sim_ablation.py")
            args = cmd[2:]
        else:
            assert cmd[1:4] == ["-m", "kvbudget", "simulate"]
            assert cmd[-1] == str(tmp_path / f"{job.name}.json")
            args = cmd[4:]
        ns = parser.parse_args(["simulate", *args])  # (a typo in a flag exits here)
        assert (ns.trace is not None) == (job.trace or job.sessions), job.name
        if job.trace:
            assert ns.trace.endswith(st.AZURE)


def test_the_comparison_leaves_the_oracle_out_and_flags_a_loss() -> None:
    policies = {
        "calibrated": {"good": 90}, "reserve-max": {"good": 10}, "segmented": {"good": 20},
        "reserve-current": {"good": 60}, "new-token-ratio": {"good": 91},
        "past-future": {"good": 50}, "oracle": {"good": 200},
    }
    row = st.compare(policies)
    assert row["best_baseline"] == "new-token-ratio" and row["best_baseline_good"] == 91
    assert row["vs_best"] == round(90 / 91, 3) and row["vs_reserve_current"] == 1.5
    assert row["at_or_above_every_baseline"] is False
    policies["calibrated"]["good"] = 91
    assert st.compare(policies)["at_or_above_every_baseline"] is True


def test_one_job_end_to_end_writes_its_table_and_figures(tmp_path: pathlib.Path) -> None:
    rows = st.main([
        "--out", str(tmp_path), "--only", "default", "--jobs", "1",
        "--traces", str(tmp_path / "absent"), "--simulate-arg=--limit=120",
    ])
    table = (tmp_path / "default.md").read_text()
    assert table.startswith("<!-- -m kvbudget simulate --limit=120 --markdown --quiet --json ")
    rows_md = [line for line in table.splitlines() if line.startswith("| ")]
    assert rows_md[0].startswith("| policy | goodput r/s |") and len(rows_md) == 2 + 7
    doc = json.loads((tmp_path / "default.json").read_text())
    assert set(doc["policies"]) == {
        "calibrated", "reserve-max", "segmented", "reserve-current", "new-token-ratio",
        "past-future", "oracle",
    }
    assert sum(1 for p in doc["policies"].values() if p["requests"] == 120) == 7
    assert rows["default"]["calibrated"] == doc["policies"]["calibrated"]["good"]
