"""benchmarks/held_out_cells.py: the held-out table's cells, the arguments each runs, the
verdict per cell, and one real (short) run end to end."""

from __future__ import annotations

import json
import pathlib

import pytest

from _bench_loader import load_benchmark

hc = load_benchmark("held_out_cells")


def test_the_table_has_its_37_cells() -> None:
    names = [hc.cell_name(c) for c in hc.cells()]
    assert len(names) == len(set(names)) == 37
    assert names[0] == "azure/tiny/0.6" and "builtin/A100/1" in names
    assert sum(n.endswith("/tiny/4") for n in names) == 6
    assert {n.split("/")[1] for n in names} == {"tiny", "A100"}


def test_each_cell_runs_what_kvbudget_simulate_runs(tmp_path: pathlib.Path) -> None:
    azure = tmp_path / "azure.csv"
    argv = hc.simulate_argv(("bursty", "tiny", 2.0), tmp_path, azure, 3, None)
    assert argv == ["simulate", "--trace", str(tmp_path / "bursty.csv"), "--rate-scale", "2",
                    "--seed", "3", "--engine-profile", "vllm-cpu-tiny"]
    argv = hc.simulate_argv(("azure", "A100", 1.0), tmp_path, azure, 0, None)
    assert argv[:5] == ["simulate", "--trace", str(azure), "--limit", "3000"]
    assert "--engine-profile" not in argv
    assert hc.simulate_argv(("azure", "A100", 4.0), tmp_path, azure, 0, 50)[4] == "50"
    assert hc.simulate_argv(("builtin", "A100", 1.0), tmp_path, azure, 0, 80)[:3] == [
        "simulate", "--limit", "80"
    ]


def test_the_real_mooncake_traces_add_ten_cells_when_given(tmp_path: pathlib.Path) -> None:
    names = [hc.cell_name(c) for c in hc.cells(mooncake=True)]
    assert len(names) == len(set(names)) == 47
    assert names[37:39] == ["mooncake-conv/A100/0.05", "mooncake-conv/A100/0.1"]
    argv = hc.simulate_argv(("mooncake-syn", "A100", 4.0), tmp_path, tmp_path / "a.csv", 0, None,
                            tmp_path)
    assert argv[:7] == ["simulate", "--trace", str(tmp_path / "synthetic_trace.jsonl"),
                        "--limit", "1000", "--model-max-len", "131072"]
    with pytest.raises(ValueError, match="Mooncake"):
        hc.simulate_argv(("mooncake-syn", "A100", 4.0), tmp_path, tmp_path, 0, None)
    with pytest.raises(SystemExit):  # a directory without the traces
        hc.main(["--mooncake", str(tmp_path), "--cell", "mooncake"])
    # one of the two there: its cells run, the other's are left out
    lines = [
        f'{{"timestamp": {k * 700}, "input_length": {600 + 50 * k}, "output_length": 40, '
        f'"hash_ids": [0, {k + 1}]}}'
        for k in range(30)
    ]
    (tmp_path / "synthetic_trace.jsonl").write_text("\n".join(lines) + "\n")
    out = hc.main(["--mooncake", str(tmp_path), "--cell", "mooncake", "--cell", "code/tiny/1",
                   "--traces", str(tmp_path / "traces"), "--limit", "30", "--jobs", "1"])
    assert set(out["cells"]) == {f"mooncake-syn/A100/{x:g}" for x in hc.MOONCAKE_LOADS} | {
        "code/tiny/1"
    }
    assert all(0 < row["calibrated"]["good"] <= 30 for row in out["cells"].values())


def test_the_verdict_is_calibrated_against_the_best_other_policy() -> None:
    row = {"calibrated": {"good": 10}, "a": {"good": 9}, "b": {"good": 11}}
    assert hc.verdicts({"x": row}) == {"x": {"best_other": "b", "ok": False}}
    row["calibrated"]["good"] = 11
    assert hc.verdicts({"x": row})["x"]["ok"] is True  # a tie is >=
    assert hc.verdicts({"x": {"calibrated": {"good": 1}}}) == {}  # nothing to compare with


def test_a_short_run_end_to_end(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = hc.main([
        "--traces", str(tmp_path / "traces"), "--azure", str(tmp_path / "absent.csv"),
        "--cell", "code/tiny/1", "--cell", "azure", "--limit", "150", "--jobs", "1",
        "--policy", "calibrated", "--policy", "reserve-current",
        "--json", str(tmp_path / "out.json"),
    ])
    assert (tmp_path / "traces" / "code.csv").exists()  # written when absent
    assert list(out["cells"]) == ["code/tiny/1"]  # the Azure cells: no trace, left out
    row = out["cells"]["code/tiny/1"]
    assert set(row) == {"calibrated", "reserve-current"}
    assert all(0 < r["good"] <= 150 for r in row.values())
    assert out["verdicts"]["code/tiny/1"]["best_other"] == "reserve-current"
    assert json.loads((tmp_path / "out.json").read_text()) == out
    assert "of 1 cells" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        hc.main(["--jobs", "0"])


def test_another_scenario_overlay_reaches_every_cell(tmp_path: pathlib.Path) -> None:
    # the same cell and requests, every one batch: no first-token objective to miss (the
    # default overlay's interactive callers miss some at 4x) and no interactive stalls to
    # count, and the overlay is recorded with the result
    common = ["--traces", str(tmp_path / "traces"), "--cell", "code/tiny/4", "--limit", "150",
              "--jobs", "1"]
    default = hc.main(common)
    batch = hc.main([*common, "--simulate-arg=--interactive-share=0"])
    assert batch["simulate_args"] == ["--interactive-share=0"] and default["simulate_args"] == []
    assert default["cells"]["code/tiny/4"]["calibrated"]["good"] < 150
    assert batch["cells"]["code/tiny/4"]["calibrated"]["good"] == 150
    assert batch["cells"]["code/tiny/4"]["calibrated"]["stalls"] == 0
    with pytest.raises(SystemExit):  # an argument kvbudget simulate refuses
        hc.main([*common, "--simulate-arg=--interactive-share=2"])


def test_the_trace_shapes_add_66_cells_on_their_own_files(tmp_path: pathlib.Path) -> None:
    plain = [hc.cell_name(c) for c in hc.cells()]
    names = [hc.cell_name(c) for c in hc.cells(shapes=True)]
    assert names[:37] == plain and len(names) == len(set(names)) == 37 + 66
    assert names[37:43] == [f"shape-pareto/{p}/{x}" for p, x in (
        ("tiny", "0.6"), ("tiny", "1"), ("tiny", "2"), ("tiny", "4"), ("A100", "1"), ("A100", "4")
    )]
    argv = hc.simulate_argv(("shape-bimodal-l1", "tiny", 2.0), tmp_path, tmp_path, 1, None,
                            None, tmp_path / "shapes")
    assert argv == ["simulate", "--trace", str(tmp_path / "shapes" / "bimodal-l1.csv"),
                    "--rate-scale", "2", "--seed", "1", "--engine-profile", "vllm-cpu-tiny"]
    with pytest.raises(ValueError, match="shapes"):
        hc.simulate_argv(("shape-mice", "A100", 1.0), tmp_path, tmp_path, 0, None)
    # written where absent, then read: one short cell end to end
    out = hc.main(["--shapes", str(tmp_path / "shapes"), "--cell", "shape-mice/A100/4",
                   "--limit", "100", "--jobs", "1", "--traces", str(tmp_path / "traces")])
    assert set(out["cells"]) == {"shape-mice/A100/4"}
    assert 0 < out["cells"]["shape-mice/A100/4"]["calibrated"]["good"] <= 100
    assert not (tmp_path / "traces").exists()  # no synthetic trace was wanted


def test_the_markdown_table_judges_against_the_faithful_baselines_only() -> None:
    """The oracle knows every length and is no baseline: a cell where only the oracle is ahead is
    not marked below; one where a baseline is ahead is; ratios against the best baseline and
    reserve-current by good requests."""
    table = {
        "a/tiny/1": {
            "calibrated": {"good": 100}, "reserve-current": {"good": 50},
            "past-future": {"good": 80}, "oracle": {"good": 120},
        },
        "b/tiny/1": {
            "calibrated": {"good": 99}, "reserve-current": {"good": 99},
            "new-token-ratio": {"good": 100},
        },
        "c/A100/4": {"calibrated": {"good": 7}},
    }
    lines = hc.markdown(table).splitlines()
    assert lines[0].startswith("| cell | calibrated | best baseline |")
    assert lines[2] == "| a/tiny/1 | 100 | past-future 80 | 1.250 | 50 | 2.00x | 120 |"
    assert lines[3] == (
        "| b/tiny/1 | 99 | new-token-ratio 100 | **0.990, below** | 99 | 1.00x | - |"
    )
    assert lines[4] == "| c/A100/4 | 7 | - | - | - | - | - |"
