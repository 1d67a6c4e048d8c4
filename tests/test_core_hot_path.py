"""benchmarks/core_hot_path.py: its side-by-side mode runs both trees alternated and reports
every run (timings are read in benchmarks, not asserted here)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from _bench_loader import BENCHMARKS

SRC = pathlib.Path(__file__).resolve().parent.parent / "src"


def test_side_by_side_reports_both_trees_per_round() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "core_hot_path.py"), "--quick",
         "--against", str(SRC), "--rounds", "2"],
        capture_output=True, text=True, check=True, timeout=300,
    ).stdout.strip().splitlines()
    result = json.loads(out[-1])
    assert result["against"] == str(SRC)
    figures = {
        "charge_ns_median", "admit_us_median_at_1000", "extend_us_median_at_1000",
        "admit_us_median_at_1000_finish_between", "admit_interactive_us_median_at_1000",
        "admit_prefix_us_median_at_1000",
    }
    for side in ("baseline", "this"):
        runs = result["rounds"][side]
        assert len(runs) == 2
        for run in runs:
            assert set(run) == figures
            assert all(value > 0 for value in run.values())
    for figure in figures:
        assert any(line.startswith(f"{figure}: baseline ") and "this/baseline" in line
                   for line in out)
