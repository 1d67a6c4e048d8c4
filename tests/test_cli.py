"""Tests of the ``kvbudget`` command line (kvbudget.cli)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvbudget.cli import SUBCOMMANDS, build_parser, main
from kvbudget.core.policy import POLICY_NAMES
from kvbudget.sim.report import JSON_POLICY_KEYS

TINY = ["simulate", "--limit", "40", "--capacity-blocks", "500", "--quiet"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "simulate" in capsys.readouterr().out


def test_simulate_is_registered_and_documented() -> None:
    assert "simulate" in SUBCOMMANDS
    help_text = build_parser().format_help()
    assert "simulate" in help_text


def test_simulate_end_to_end_writes_json_and_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "out.json"
    out_png = tmp_path / "out.png"
    rc = main([*TINY, "--json", str(out_json), "--plot", str(out_png), "--abort-latency", "0.1",
               "--step-fixed-ms", "10", "--wave-at", "2", "--wave-count", "4"])
    assert rc == 0
    text = capsys.readouterr().out
    for name in POLICY_NAMES:
        assert name in text
    doc = json.loads(out_json.read_text())
    assert set(doc) >= {"policies", "workload", "scenario"}
    assert list(doc["policies"]) == list(POLICY_NAMES)
    for name, figures in doc["policies"].items():
        assert list(figures)[: len(JSON_POLICY_KEYS)] == list(JSON_POLICY_KEYS), name
        assert figures["hard_max_violations"] == 0
        assert figures["silent_truncations"] == 0
    assert doc["policies"]["oracle"]["goodput_vs_oracle"] == pytest.approx(1.0)
    assert doc["scenario"]["wave"]["count"] == 4
    assert doc["engine"]["step_fixed_s"] == pytest.approx(0.010)
    assert doc["engine"]["abort_latency_s"] == pytest.approx(0.1)
    assert out_png.read_bytes()[:8] == PNG_MAGIC


def test_policy_is_repeatable_and_ratio_is_null_without_oracle(tmp_path: Path) -> None:
    out_json = tmp_path / "out.json"
    rc = main([*TINY, "--policy", "calibrated", "--policy", "reserve-max",
               "--json", str(out_json)])
    assert rc == 0
    doc = json.loads(out_json.read_text())
    assert list(doc["policies"]) == ["calibrated", "reserve-max"]
    assert doc["policies"]["calibrated"]["goodput_vs_oracle"] is None


def test_sweep_writes_goodput_against_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "sweep.json"
    out_png = tmp_path / "sweep.png"
    rc = main([*TINY, "--policy", "reserve-max", "--policy", "oracle", "--sweep-rate", "0.5,2",
               "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    assert "against load" in capsys.readouterr().out
    doc = json.loads(out_json.read_text())
    assert [run["rate_scale"] for run in doc["sweep"]] == [0.5, 2.0]
    assert out_png.read_bytes()[:8] == PNG_MAGIC


def test_trace_file_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"2023-11-16 18:15:{i:02d}.0000000,{100 + i},{20 + i}" for i in range(30)]
    trace.write_text("\n".join(rows) + "\n")
    assert main(["simulate", "--trace", str(trace), "--policy", "calibrated", "--quiet"]) == 0
    assert "30 requests" in capsys.readouterr().out
    assert main(["simulate", "--trace", str(tmp_path / "missing.csv"), "--quiet"]) == 2
    with pytest.raises(SystemExit):
        main(["simulate", "--policy", "no-such-policy"])
    with pytest.raises(SystemExit):
        main(["simulate", "--rate-scale", "-1"])


def test_what_the_replay_changed_of_a_trace_is_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Prompts cut to the model's length and a BurstGPT trace's skipped failures are noted
    under the table, not left for the reader to find in the JSON."""
    trace = tmp_path / "burst.csv"
    rows = ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"]
    rows += [f"{i},ChatGPT,{100 + 300 * i},{20 + i},0,API log" for i in range(20)]
    rows += ["21,GPT-4,50,0,50,API log"]  # a failed call
    trace.write_text("\n".join(rows) + "\n")
    argv = ["simulate", "--trace", str(trace), "--policy", "calibrated", "--quiet"]
    assert main([*argv, "--model-max-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "20 requests" in out
    assert "note: 6 of 20 prompts are longer than --model-max-len 4096" in out
    assert "note: 1 rows of the trace are not requests an engine ran" in out
    assert main([*argv, "--model-max-len", "8192"]) == 0
    assert "prompts are longer" not in capsys.readouterr().out


def test_turn_away_late_first_tokens_flag(tmp_path: Path) -> None:
    """A burst of 80 prompts in a fraction of a second: with the flag, callers whose first token
    the queued prefill would make late are turned away instead of admitted late; the run records
    which way it went. (calibrated: the turn-away is kvbudget's front, which the baselines, run as
    their engines do, do not have.)"""
    burst = ["simulate", "--limit", "80", "--quiet", "--rate-scale", "40", "--policy",
             "calibrated"]
    docs = []
    for setting in ("off", "on"):
        out_json = tmp_path / f"burst-{setting}.json"
        assert main([*burst, "--turn-away-late-first-tokens", setting,
                     "--json", str(out_json)]) == 0
        docs.append(json.loads(out_json.read_text()))
    off, on = (d["policies"]["calibrated"] for d in docs)
    assert [d["scenario"]["turn_away_late_first_tokens"] for d in docs] == ["off", "on"]
    assert off["rejected"] == 0 < on["rejected"]
    assert on["ttft_p99_s"] < off["ttft_p99_s"]


def _simulate_settings(
    tmp_path: Path, args: list[str], flag: str, settings: tuple[str, ...]
) -> dict[str, Any]:
    """``kvbudget simulate ARGS FLAG SETTING`` for each setting: its JSON, by setting (and the
    flag refuses values outside (0, 1) and non-numbers)."""
    docs = {}
    for setting in settings:
        out_json = tmp_path / f"{flag.strip('-')}-{setting}.json"
        assert main([*args, flag, setting, "--json", str(out_json)]) == 0
        docs[setting] = json.loads(out_json.read_text())
    for bad in ("0", "1", "nan", "x"):
        with pytest.raises(SystemExit):
            main(["simulate", flag, bad])
    return docs


def test_first_token_quantile_flag(tmp_path: Path) -> None:
    """The flag reaches the scheduler and is recorded in the JSON."""
    args = ["simulate", "--limit", "200", "--quiet", "--policy", "calibrated"]
    docs = _simulate_settings(tmp_path, args, "--first-token-quantile", ("off", "0.9"))
    assert docs["off"]["scenario"]["first_token_quantile"] is None
    assert docs["0.9"]["scenario"]["first_token_quantile"] == 0.9


def test_deadline_service_quantile_flag(tmp_path: Path) -> None:
    """The flag reaches the scheduler and is recorded in the JSON: under overload with a short
    batch deadline, on turns away the batch callers that could no longer finish in time, where
    off admits them to run late."""
    args = ["simulate", "--limit", "300", "--quiet", "--rate-scale", "3", "--policy",
            "calibrated", "--batch-deadline", "20"]
    docs = _simulate_settings(tmp_path, args, "--deadline-service-quantile", ("off", "0.5"))
    assert docs["off"]["scenario"]["deadline_service_quantile"] is None
    assert docs["0.5"]["scenario"]["deadline_service_quantile"] == 0.5
    off, on = (docs[k]["policies"]["calibrated"] for k in ("off", "0.5"))
    assert on["rejected"] > off["rejected"] and on["decoded_tokens"] < off["decoded_tokens"]


def test_tick_flag_sets_how_often_the_simulated_shell_ticks(tmp_path: Path) -> None:
    """``--tick-ms``: how often the simulated shell ticks the scheduler (queue time-outs);
    by default as often as a real Budget ticks its scheduler, with the flag any other period
    (the 100 ms of the figures made before the thirty-eighth session); the JSON's engine says
    which was used."""
    from kvbudget.core.config import SHELL_TICK_INTERVAL_S

    got = {}
    for name, extra in (("default", []), ("old", ["--tick-ms", "100"])):
        out = tmp_path / f"{name}.json"
        assert main([*TINY, "--policy", "calibrated", *extra, "--json", str(out)]) == 0
        got[name] = json.loads(out.read_text())["engine"]["tick_s"]
    assert got == {"default": SHELL_TICK_INTERVAL_S, "old": pytest.approx(0.1)}
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            main([*TINY, "--tick-ms", bad])


def test_intake_flag_overrides_the_profiles(tmp_path: Path) -> None:
    """``--intake-ms``: the engine's time per arriving request; by default the profile's (the
    tiny CPU profile's, measured on bursts), else 0; the JSON's engine says which was used."""
    from kvbudget.sim.profile import EngineProfile

    shipped = EngineProfile.load("vllm-cpu-tiny").intake_s
    assert shipped > 0.0
    got = {}
    for name, extra in (
        ("default", []),
        ("profile", ["--engine-profile", "vllm-cpu-tiny"]),
        ("given", ["--engine-profile", "vllm-cpu-tiny", "--intake-ms", "2.5"]),
    ):
        out = tmp_path / f"{name}.json"
        assert main([*TINY, "--policy", "calibrated", *extra, "--json", str(out)]) == 0
        got[name] = json.loads(out.read_text())["engine"]["intake_s"]
    assert got == {
        "default": 0.0, "profile": pytest.approx(shipped), "given": pytest.approx(0.0025)
    }
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            main([*TINY, "--intake-ms", bad])


class _Terminal:
    """A stderr that says it is a terminal, and keeps what is written to it."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


def test_the_progress_bar_is_drawn_on_a_terminal_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = ["simulate", "--limit", "40", "--capacity-blocks", "500", "--policy", "calibrated"]
    # piped or logged (pytest's captured stderr is no terminal): not one redrawn frame
    assert main(run) == 0
    assert "\r[" not in capsys.readouterr().err
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert main(run) == 0
    assert "\r[" in terminal.text and "done" in terminal.text
    # --quiet: none even on a terminal
    quiet = _Terminal()
    monkeypatch.setattr("sys.stderr", quiet)
    assert main([*run, "--quiet"]) == 0
    assert quiet.text == ""
