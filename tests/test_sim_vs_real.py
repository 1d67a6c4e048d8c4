"""benchmarks/sim_vs_real.py, the simulated side only (no engine, no vLLM import): serve_bench's
workloads as the simulator's requests, the SLO rule on simulated requests, the comparison and
its JSON shape over a small ``--real`` fixture."""

from __future__ import annotations

import collections
import json
import math
import pathlib
from typing import Any

import attrs
import pytest

from _bench_loader import load_benchmark
from kvbudget.core.policy.calibrated import FIRST_TOKEN_PAUSE_SHARE as PAUSING
from kvbudget.sim.report import RequestRecord

sb = load_benchmark("serve_bench")
svr = load_benchmark("sim_vs_real")
TOK = svr.TINY_TOKENIZER


# -- the workload translation -------------------------------------------------------------------


def test_moderate_is_vllms_random_dataset() -> None:
    plan = svr.plan_workload("moderate", 0, TOK)
    assert len(plan) == sb.WORKLOADS["moderate"].num_prompts == 120
    # vLLM's get_sampling_params with numpy default_rng(0): 575 +- 50 % inputs (576 less the
    # BOS), 200 +- 50 % outputs; the lengths vLLM's client sent in a real run (request 0..3)
    assert [p.output_tokens for p in plan[:4]] == [214, 181, 300, 139]
    assert [p.prompt_tokens for p in plan[:4]] == [778, 655, 582, 443]
    assert all(1 + 287 <= p.prompt_tokens <= 1 + 863 for p in plan)
    assert all(100 <= p.output_tokens <= 300 for p in plan)
    # Poisson arrivals at 8/s, rescaled by vLLM so that the last is sent at n / rate
    arrivals = [p.arrival_s for p in plan]
    assert arrivals == sorted(arrivals)
    assert arrivals[-1] == pytest.approx(120 / 8)
    assert arrivals[0] == pytest.approx(0.10236, abs=1e-4)
    assert all(p.shared_prefix_tokens == 0 and p.leave_after is None for p in plan)


def test_simulated_requests_carry_the_calibration_keys_the_adapter_reads() -> None:
    """Each workload's simulated requests are keyed as the adapter keys the real ones (the
    sampling and stop profiles of what the client sends): the burst is greedy, vLLM's client's
    other workloads and serve_bench's own client sample at temperature 1, all run past the end
    of sequence; a ``--bench-arg`` temperature changes the key."""
    expected = {name: ("temp=1.0", "ignore-eos") for name in sb.WORKLOADS}
    expected["burst"] = ("greedy", "ignore-eos")
    for name, (sampling, stops) in expected.items():
        plan = svr.plan_workload(name, 0, TOK, scale=0.1)
        assert {(p.sampling, p.stops) for p in plan} == {(sampling, stops)}, name
        _scenario, reqs = svr.sim_requests(plan)
        assert {(r.spec.sampling, r.spec.stops) for r in reqs} == {(sampling, stops)}, name
    cooler = svr.plan_workload("moderate", 0, TOK, 0.1, ["--temperature=0.65"])
    assert {p.sampling for p in cooler} == {"temp=0.7"}


def test_fixed_lengths_prefix_burst_and_rates() -> None:
    overload = svr.plan_workload("overload", 0, TOK)
    assert len(overload) == 160
    assert {(p.prompt_tokens, p.output_tokens) for p in overload} == {(576, 200)}
    assert overload[-1].arrival_s == pytest.approx(160 / 40)
    shared = svr.plan_workload("shared-prefix", 0, TOK)
    assert {(p.prompt_tokens, p.output_tokens, p.shared_prefix_tokens) for p in shared} == {
        (1 + 512 + 63, 200, 513)
    }
    burst = svr.plan_workload("burst", 0, TOK)
    assert len(burst) == 30
    assert {(p.arrival_s, p.prompt_tokens, p.output_tokens) for p in burst} == {(0.0, 512, 300)}
    small = svr.plan_workload("overload", 0, TOK, scale=0.25)
    assert len(small) == 40 and small[-1].arrival_s == pytest.approx(1.0)


def test_options_default_as_vllm() -> None:
    w = sb.Workload("x", 5, ("--random-input-len", "100", "--request-rate", "2"))
    o = svr.bench_options(w)
    assert o["random_input_len"] == 100 and o["request_rate"] == 2
    assert o["random_output_len"] == 128 and o["random_range_ratio"] == 0
    assert o["burstiness"] == 1 and o["random_prefix_len"] == 0


def test_bench_flags_read_as_argparse_reads_them() -> None:
    flags = sb.bench_flags([
        "--random-input-len", "100", "--disable-shuffle", "--seed=3", "--goodput", "ttft:1",
        "tpot:2", "--random-input-len=200", "--use-beam-search",
    ])
    assert flags == {
        "random_input_len": "200", "disable_shuffle": None, "seed": "3", "goodput": "ttft:1",
        "use_beam_search": None,
    }


def test_vllms_general_lengths_replace_the_datasets_own_whatever_their_order() -> None:
    # vllm.benchmarks.serve.main maps --input-len / --output-len over the datasets' lengths
    for extra in (["--output-len=64"], ["--output-len=64", "--random-output-len=300"]):
        w = sb.WORKLOADS["moderate"].with_args([*extra, "--input-len", "300"])
        o = svr.bench_options(w)
        assert (o["random_output_len"], o["random_input_len"]) == (64, 300)
    plan = svr.plan_workload("moderate", 0, TOK, bench_args=["--output-len=64"])
    assert all(32 <= p.output_tokens <= 96 for p in plan)  # 64 +- 50 %, the workload's ratio
    multi = svr.plan_workload("multi-prefix", 0, TOK, bench_args=["--output-len=64"])
    assert {p.output_tokens for p in multi} == {64}


def test_a_bench_arg_overrides_the_dataset_count_and_seed_serve_bench_passes() -> None:
    plan = svr.plan_workload(
        "overload", 0, TOK,
        bench_args=["--dataset-name=prefix_repetition", "--num-prompts=20",
                    "--prefix-repetition-num-prefixes=4"],
    )
    assert len(plan) == 20
    assert collections.Counter(p.system_prompt for p in plan) == {k: 5 for k in range(4)}
    seeded = svr.plan_workload("moderate", 0, TOK, bench_args=["--seed=7"])
    assert [p.output_tokens for p in seeded] == [
        p.output_tokens for p in svr.plan_workload("moderate", 7, TOK)
    ]
    with pytest.raises(ValueError, match="--dataset-name sharegpt is not planned"):
        svr.plan_workload("moderate", 0, TOK, bench_args=["--dataset-name=sharegpt"])


def test_the_bench_args_the_simulator_does_not_follow_are_named() -> None:
    args = ["--max-concurrency=8", "--use-beam-search", "--temperature=0.3", "--output-len=9"]
    w = sb.WORKLOADS["overload"].with_args(args)
    assert svr.unmodelled_bench_args(w) == (["--use-beam-search"], ["--max-concurrency"])
    # serve_bench's own client takes none of vLLM's arguments
    assert svr.unmodelled_bench_args(sb.WORKLOADS["abandon"].with_args(args)) == ([], [])
    planned = svr.unmodelled_notes(["overload", "abandon"], args, "planned")
    assert len(planned) == 2
    assert "--use-beam-search" in planned[0] and "--max-concurrency" in planned[1]
    # the real client's send times carry a concurrency limit
    real = svr.unmodelled_notes(["overload"], args, "real")
    assert len(real) == 1 and "--use-beam-search" in real[0]
    assert svr.unmodelled_notes(["overload"], ["--temperature=0"], "planned") == []


def test_abandon_is_serve_benchs_own_plan() -> None:
    plan = svr.plan_workload("abandon", 0, TOK)
    theirs = sb.abandon_plan(80, 0, "x-", TOK.vocab_size, TOK.special_ids)
    assert len(plan) == 80
    for p, (at, rec, _payload) in zip(plan, theirs, strict=True):
        assert (p.arrival_s, p.prompt_tokens, p.output_tokens, p.leave_after) == (
            at, 256, rec.output_len, rec.leave_after
        )
    leaving = [p for p in plan if p.leave_after is not None]
    assert 10 < len(leaving) < 40
    assert all(1 <= p.leave_after < p.output_tokens for p in leaving)  # type: ignore[operator]


def test_sim_requests_ask_for_exactly_their_length() -> None:
    plan = svr.plan_workload("shared-prefix", 0, TOK)[:5] + svr.plan_workload("abandon", 0, TOK)[:5]
    plan = [
        svr.Planned(
            i, p.arrival_s, p.prompt_tokens, p.output_tokens, 513 if i < 5 else 0,
            system_prompt=0 if i < 5 else None, leave_after=p.leave_after,
        )
        for i, p in enumerate(plan)
    ]
    plan.sort(key=lambda p: p.arrival_s)
    scenario, reqs = svr.sim_requests(plan)
    assert scenario.interactive_share == 1.0 and scenario.abandon_share == 0.0
    for p, r in zip(plan, reqs, strict=True):
        assert r.request_id == f"r{p.index}"
        assert r.prompt_tokens == p.prompt_tokens
        assert r.spec.max_tokens == r.spec.hard_max == r.true_output_tokens == p.output_tokens
        assert r.spec.service_class == "interactive" and r.spec.tenant == "default"
        assert r.abandon_after_tokens == p.leave_after and r.abandon_after_s is None
        assert r.system_prompt_tokens == p.shared_prefix_tokens
        assert r.system_prompt == (0 if p.shared_prefix_tokens else None)


def test_the_multi_prefix_plan_is_vllms_prefix_repetition_dataset() -> None:
    plan = svr.plan_workload("multi-prefix", 0, TOK)
    assert len(plan) == 160
    assert {p.prompt_tokens for p in plan} == {1 + 384 + 128}
    assert {p.shared_prefix_tokens for p in plan} == {1 + 384}
    assert {p.output_tokens for p in plan} == {200}
    per_prefix = collections.Counter(p.system_prompt for p in plan)
    assert per_prefix == {k: 32 for k in range(5)}
    order = [p.system_prompt for p in plan]
    assert order != sorted(order)  # shuffled, as vLLM's dataset is
    arrivals = [p.arrival_s for p in plan]
    assert arrivals == sorted(arrivals) and arrivals[-1] == pytest.approx(160 / 40)
    again = svr.plan_workload("multi-prefix", 0, TOK)
    assert [p.system_prompt for p in again] == order
    held_out = svr.plan_workload(
        "multi-prefix", 0, TOK, bench_args=["--prefix-repetition-num-prefixes=2"]
    )
    assert collections.Counter(p.system_prompt for p in held_out) == {0: 80, 1: 80}
    longer = svr.plan_workload("shared-prefix", 0, TOK, bench_args=["--random-prefix-len=1024"])
    assert {p.shared_prefix_tokens for p in longer} == {1 + 1024}


# -- the SLO rule -------------------------------------------------------------------------------


def _sim_rec(**kw: Any) -> RequestRecord:
    base: dict[str, Any] = {
        "request_id": "r0", "arrival_s": 10.0, "end": "completed", "prompt_tokens": 100,
        "output_tokens": 101, "expected_tokens": 101, "first_token_s": 11.0,
        "last_token_s": 12.0, "finished_s": 12.0,
    }
    base.update(kw)
    return RequestRecord(**base)


def test_classify_simulated_requests_as_serve_bench() -> None:
    good = _sim_rec()
    assert good.ttft_s == 1.0 and good.tpot_s == pytest.approx(0.01)
    assert svr.classify_sim(good) == "good"
    assert svr.classify_sim(_sim_rec(first_token_s=12.0, last_token_s=13.0)) == "good"  # 2 s
    assert svr.classify_sim(_sim_rec(first_token_s=12.01, last_token_s=13.0)) == "late"
    # TPOT = (last - first) / (tokens - 1): 10.1 s over 100 gaps is 101 ms
    assert svr.classify_sim(_sim_rec(last_token_s=21.1)) == "late"
    assert svr.classify_sim(_sim_rec(last_token_s=20.9)) == "good"
    assert svr.classify_sim(_sim_rec(output_tokens=100)) == "failed"  # short of its request
    assert svr.classify_sim(_sim_rec(end="rejected", first_token_s=None)) == "rejected"
    assert svr.classify_sim(_sim_rec(end="abandoned")) == "abandoned"
    assert svr.classify_sim(_sim_rec(end="failed")) == "failed"
    one = _sim_rec(output_tokens=1, expected_tokens=1, last_token_s=11.0)
    assert one.tpot_s == 0.0 and svr.classify_sim(one) == "good"
    s = svr.summarize_sim([good, _sim_rec(request_id="r1", last_token_s=30.0, finished_s=30.0),
                           _sim_rec(request_id="r2", end="rejected", first_token_s=None,
                                    last_token_s=None, finished_s=10.0)])
    assert (s["sent"], s["good"], s["late"], s["rejected"], s["failed"]) == (3, 1, 1, 1, 0)
    assert s["duration_s"] == 20.0 and s["goodput"] == 0.05


def test_error_target_and_order() -> None:
    e = svr.error({"good": 100, "late": 0, "rejected": 0}, {"good": 86, "late": 14, "rejected": 0})
    assert e["good_rel"] == -0.14 and e["within_target"]
    assert not svr.error({"good": 100, "late": 0, "rejected": 0},
                         {"good": 84, "late": 0, "rejected": 0})["within_target"]
    # few requests: 5 requests of slack
    assert svr.error({"good": 10, "late": 0, "rejected": 0},
                     {"good": 15, "late": 0, "rejected": 0})["within_target"]
    assert svr.error({"good": 0, "late": 0, "rejected": 0},
                     {"good": 3, "late": 0, "rejected": 0})["good_rel"] is None
    real = {"vllm": {"good": 40}, "kvbudget": {"good": 60}}
    assert svr.same_order(real, {"vllm": {"good": 20}, "kvbudget": {"good": 50}})
    assert not svr.same_order(real, {"vllm": {"good": 60}, "kvbudget": {"good": 40}})
    assert svr.same_order(real, {"vllm": {"good": 52}, "kvbudget": {"good": 50}})  # a tie
    # judged wherever two servers have a real side (a run of vLLM's and kvbudget serve alone
    # too), not where one has
    counts = {"late": 0, "rejected": 0}
    sim = {"burst": {s: {"good": g, **counts} for s, g in
                     (("vllm", 20), ("kvbudget", 25), ("kvbudget-serve", 10))}}
    two = {"vllm": {"good": 30, **counts}, "kvbudget-serve": {"good": 12, **counts}}
    assert svr.compare({"burst": two}, sim)["burst"]["same_order"] is True
    swapped = {"vllm": {"good": 12, **counts}, "kvbudget-serve": {"good": 30, **counts}}
    assert svr.compare({"burst": swapped}, sim)["burst"]["same_order"] is False
    one = {"vllm": {"good": 30, **counts}}
    assert svr.compare({"burst": one}, sim)["burst"]["same_order"] is None


def test_a_miss_met_within_the_pace_band_is_named_and_stays_a_miss() -> None:
    """The pace band (``good_at_pace_band``): the target's verdict is the fitted pace's; a
    miss that a pace 2 % off meets is said so (sb42a's burst: 29 real, 23 simulated, 23-29)."""
    real = {"good": 29, "late": 1, "rejected": 0}
    at_edge = {"good": 23, "late": 7, "rejected": 0, "good_at_pace_band": [23, 29]}
    e = svr.error(real, at_edge)
    assert not e["within_target"] and e["within_target_in_pace_band"] is True
    off = svr.error(real, {**at_edge, "good_at_pace_band": [20, 23]})
    assert not off["within_target"] and off["within_target_in_pace_band"] is False
    assert svr.error(real, {"good": 23, "late": 7, "rejected": 0})[
        "within_target_in_pace_band"] is None
    # several runs: the median of each end
    sims = [{"burst": {"vllm": {**at_edge, "good_at_pace_band": band, "abandoned": 0,
                                "failed": 0}}}
            for band in ([23, 29], [22, 27], [24, 30])]
    assert svr.median_of_runs(sims)["burst"]["vllm"]["good_at_pace_band"] == [23, 29]


def test_the_order_within_the_pace_bands() -> None:
    """sb42d's shared prefix: real `kvbudget serve` 183 ahead of vLLM's server's 172; simulated
    178 behind 185, the order reversed; within their bands (178-191, 176-194) the real order is
    in reach. Bands apart by more than 5 requests against the real order are not."""
    real = {"vllm": {"good": 172}, "kvbudget": {"good": 274}, "kvbudget-serve": {"good": 183}}
    sim = {"vllm": {"good": 185, "good_at_pace_band": [176, 194]},
           "kvbudget": {"good": 289, "good_at_pace_band": [280, 292]},
           "kvbudget-serve": {"good": 178, "good_at_pace_band": [178, 191]}}
    assert not svr.same_order(real, sim)
    assert svr.same_order_in_pace_band(real, sim) is True
    apart = {**sim, "kvbudget-serve": {"good": 160, "good_at_pace_band": [158, 165]}}
    assert svr.same_order_in_pace_band(real, apart) is False
    # a tie in the real run asks nothing of the bands; no band: no answer
    assert svr.same_order_in_pace_band({**real, "kvbudget-serve": {"good": 175}}, apart) is True
    assert svr.same_order_in_pace_band(real, {**sim, "vllm": {"good": 185}}) is None


def test_the_pace_band_simulates_the_cell_2_percent_faster_and_slower() -> None:
    """:func:`pace_band` runs the cell with every step time PACE_BAND faster and slower, from
    the same start, and gives the fewest and most good of the three. The burst on the tiny
    profile with vLLM's policy has waves that cross the 2 s objective as the step times grow
    (24 good at the profile's, 15 at 1.6x; at 1.53x 20, and 16 a little slower): at a scale
    where one does, the band spans both sides."""
    profile = svr.EngineProfile.load("vllm-cpu-tiny")
    plan, limits = svr.context_limits(svr.plan_workload("burst", 0, TOK))
    scenario, reqs = svr.sim_requests(plan)
    client = svr.ClientView()
    calls: list[tuple[float, Any]] = []

    def run_at(scale: float, windows: Any = None) -> tuple[Any, None]:
        calls.append((scale, windows))
        engine = svr.scaled_engine(profile.engine_model(), scale)
        return svr.simulate(reqs, scenario, engine, "reserve-current", keep_requests=True), None

    def good_at(scale: float) -> int:
        result = run_at(scale)[0]
        good: int = svr.summarize_sim(result.request_records, client, limits)["good"]
        return good

    lo, hi = 1 - svr.PACE_BAND, 1 + svr.PACE_BAND
    scale = next(
        x / 100 for x in range(100, 200, 2) if good_at(x / 100 * lo) != good_at(x / 100 * hi)
    )
    good = good_at(scale)
    calls.clear()
    windows = [(0.0, 1.0, 1.1)]
    band = svr.pace_band(run_at, scale, windows, client, limits, good)
    assert calls == [(scale * lo, windows), (scale * hi, windows)]
    goods = [good, good_at(scale * lo), good_at(scale * hi)]
    assert band == [min(goods), max(goods)] and band[0] < band[1]


# -- the whole script over a --real fixture -----------------------------------------------------


def _summary(good: int, late: int, rejected: int = 0) -> dict[str, Any]:
    return {"sent": good + late + rejected, "good": good, "late": late, "rejected": rejected,
            "rejected_503": 0, "failed": 0, "goodput": 1.0, "duration_s": 3.0,
            "ttft_p50_s": 0.3, "tpot_p50_ms": 5.0, "engine_preemptions": 1}


def _last_json(out: str) -> dict[str, Any]:
    doc = json.loads(out.strip().splitlines()[-1])
    assert isinstance(doc, dict)
    return doc


def test_json_shape_from_a_serve_bench_json_file(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = tmp_path / "serve_bench.out"
    doc = {"workloads": {"burst": {"vllm": _summary(20, 10), "kvbudget": _summary(21, 0, 9),
                                   "vllm-cap16": _summary(1, 1)}}, "meta": {}}
    real.write_text("progress line\n" + json.dumps(doc) + "\n")
    assert svr.main(["--real", str(real), "--workload", "burst"]) == 0
    out = _last_json(capsys.readouterr().out)
    assert set(out) == {
        "workloads", "notes", "translation", "translation_mismatch", "speed_check", "meta"
    }
    assert list(out["workloads"]) == ["burst"]
    burst = out["workloads"]["burst"]
    # vLLM's server with its queue cap is compared too, as the same baseline with that cap
    assert list(burst) == [
        "vllm", "vllm-cap16", "kvbudget", "same_order", "same_order_in_pace_band"
    ]
    assert isinstance(burst["same_order"], bool)
    assert isinstance(burst["same_order_in_pace_band"], bool)
    for server in ("vllm", "vllm-cap16", "kvbudget"):
        assert set(burst[server]) == {"real", "sim", "error"}
        assert burst[server]["sim"]["sent"] == 30
        for key in ("good", "late", "rejected", "failed", "abandoned"):
            assert isinstance(burst[server]["sim"][key], int)
        assert set(burst[server]["error"]) >= {
            "good_rel", "good_diff", "within_target", "within_target_in_pace_band"
        }
        low, high = burst[server]["sim"]["good_at_pace_band"]
        assert low <= burst[server]["sim"]["good"] <= high
    assert burst["vllm"]["real"]["good"] == 20 and burst["kvbudget"]["real"]["rejected"] == 9
    assert burst["vllm"]["sim"]["policy"] == "reserve-current"
    assert burst["vllm-cap16"]["sim"]["policy"] == "reserve-current"
    assert burst["vllm-cap16"]["real"]["good"] == 1
    # the burst of 30 at once: the cap of 16 refuses 14 callers at once, as vLLM does
    assert burst["vllm-cap16"]["sim"]["rejected"] == 14 and not burst["vllm"]["sim"]["rejected"]
    assert burst["kvbudget"]["sim"]["policy"] == "calibrated"
    assert out["meta"]["policies"]["vllm-cap16"] == "reserve-current (max_num_queued_reqs 16)"
    assert out["meta"]["engine_profile"] == "vllm-cpu-tiny" and out["notes"]


def test_records_dir_and_translation_check(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = svr.plan_workload("burst", 0, TOK)
    for server in ("vllm", "kvbudget", "kvbudget-serve", "vllm-cap8", "vllm-cap16"):
        records = [
            {"request_id": f"sb-{server}-burst-r0-abc-{p.index}", "start": 100.0,
             "prompt_len": p.prompt_tokens + (p.index == 3), "output_len": p.output_tokens}
            for p in plan
        ]
        good = 99 if server == "kvbudget-serve" else 25  # must not be read for "kvbudget"
        (tmp_path / f"records-burst-{server}-r0.json").write_text(json.dumps(
            {"summary": _summary(good, 30 - good if good < 30 else 0), "records": records}
        ))
    real, recs = svr.load_real(tmp_path)
    # vLLM's server with each queue cap in cap order, the example, then kvbudget serve, each
    # from its own files
    assert set(real) == {"burst"}
    assert list(real["burst"]) == [
        "vllm", "vllm-cap8", "vllm-cap16", "kvbudget", "kvbudget-serve"
    ]
    assert real["burst"]["kvbudget"]["good"] == 25
    assert real["burst"]["kvbudget-serve"]["good"] == 99
    check = svr.translation_check({"burst": plan}, recs)
    assert check["burst"]["vllm"] == {
        "matched": 30, "of": 30, "prompt_len_differs": 1, "max_prompt_len_diff": 1,
        "output_len_differs": 0, "max_send_time_diff_s": 0.0,
    }
    assert svr.main(["--real", str(tmp_path), "--workload", "burst"]) == 0
    text = capsys.readouterr().out
    out = _last_json(text)
    assert out["translation"]["burst"]["kvbudget"]["matched"] == 30
    assert "burst" in text.splitlines()[2]  # the table row
    assert out["workloads"]["burst"]["kvbudget-serve"]["sim"]["policy"] == "calibrated"
    assert out["meta"]["policies"]["kvbudget-serve"] == "calibrated"


def test_real_runs_on_a_different_machine_than_their_reference_are_flagged(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """serve_bench's machine probe: a kvbudget run made on a machine 2.9x slower than its vLLM
    reference's (sb30a) is named in a warning; one within MACHINE_DRIFT, or a run made before
    the probe (no ratio), is not."""
    plan = svr.plan_workload("burst", 0, TOK)
    for server, ratio in (("vllm", None), ("kvbudget", 2.9), ("vllm-cap8", 1.1)):
        records = [
            {"request_id": f"sb-{server}-burst-r0-abc-{p.index}", "start": 100.0,
             "prompt_len": p.prompt_tokens, "output_len": p.output_tokens}
            for p in plan
        ]
        summary = _summary(25, 5)
        if ratio is not None:
            summary["machine_vs_reference"] = ratio
        (tmp_path / f"records-burst-{server}-r0.json").write_text(json.dumps(
            {"summary": summary, "records": records}
        ))
    assert svr.machine_drifts(tmp_path) == ["burst/kvbudget r0 x2.9"]
    assert svr.main(["--real", str(tmp_path), "--workload", "burst"]) == 0
    warned = [ln for ln in capsys.readouterr().out.splitlines() if "compare two machines" in ln]
    assert len(warned) == 1 and "burst/kvbudget r0 x2.9" in warned[0]


def _held_out_run(
    run: pathlib.Path, bench_args: list[str], settings: bool, engine: tuple[str, ...] = ()
) -> None:
    """A serve_bench ``--out`` directory of the burst made with ``bench_args``: its records
    follow that plan; ``settings``: the run recorded them (serve_bench's settings.json), with
    ``engine`` (serve_bench's ``--kv-blocks`` / ``--max-num-seqs``)."""
    run.mkdir()
    plan = svr.plan_workload("burst", 0, TOK, 1.0, bench_args)
    for server in ("vllm", "kvbudget"):
        records = [
            {"request_id": f"sb-{server}-burst-r0-abc-{p.index}", "start": 100.0,
             "prompt_len": p.prompt_tokens, "output_len": p.output_tokens}
            for p in plan
        ]
        (run / f"records-burst-{server}-r0.json").write_text(json.dumps(
            {"summary": _summary(20, 10), "records": records}
        ))
    if settings:
        opts = sb.parse_args(
            ["--workload", "burst", *engine, *(f"--bench-arg={a}" for a in bench_args)]
        )
        (run / sb.SETTINGS_FILE).write_text(json.dumps(sb.run_settings(opts, [])))


def test_real_runs_settings_plan_the_simulated_requests(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--real DIR`` of a held-out variant: the simulated requests are the ones that run sent,
    from the settings it recorded, without repeating its ``--bench-arg``; a setting given that
    differs from the run's is refused; a run that recorded none, compared on other requests
    than it sent, is flagged in the output and the JSON."""
    held_out = ["--random-input-len=300", "--random-output-len=90"]
    _held_out_run(tmp_path / "new", held_out, settings=True)
    assert svr.main(["--real", str(tmp_path / "new")]) == 0
    text = capsys.readouterr().out
    out = _last_json(text)
    assert list(out["workloads"]) == ["burst"]  # the run's workloads, not all of them
    assert out["meta"]["bench_args"] == held_out
    assert out["translation"]["burst"]["vllm"]["output_len_differs"] == 0
    assert out["translation_mismatch"] == [] and "WARNING" not in text
    with pytest.raises(SystemExit, match="--seed 3 differs from the real run's 0"):
        svr.main(["--real", str(tmp_path / "new"), "--seed", "3"])
    assert svr.main(["--real", str(tmp_path / "new"), "--seed", "0"]) == 0  # the same: fine
    capsys.readouterr()

    _held_out_run(tmp_path / "old", held_out, settings=False)
    assert svr.main(["--real", str(tmp_path / "old"), "--workload", "burst"]) == 0
    text = capsys.readouterr().out
    out = _last_json(text)
    assert out["translation_mismatch"] == ["burst/vllm", "burst/kvbudget"]
    assert "WARNING: the simulated requests are not the ones the real client sent" in text
    held = [f"--bench-arg={a}" for a in held_out]
    assert svr.main(["--real", str(tmp_path / "old"), "--workload", "burst", *held]) == 0
    assert _last_json(capsys.readouterr().out)["translation_mismatch"] == []


def test_the_engine_the_run_ran_is_simulated(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run made on a held-out engine (serve_bench ``--kv-blocks 80 --max-num-seqs 8``) is
    simulated on that engine, not on the profile's (the shipped one here: 256 blocks, 64
    sequences); a run that recorded no engine ran serve_bench's default one."""
    _held_out_run(tmp_path / "small", [], settings=True,
                  engine=("--kv-blocks", "80", "--max-num-seqs", "8"))
    _held_out_run(tmp_path / "default", [], settings=True)
    outs = {}
    for name in ("small", "default"):
        assert svr.main(["--real", str(tmp_path / name)]) == 0
        outs[name] = _last_json(capsys.readouterr().out)
    small, default = outs["small"], outs["default"]
    assert small["meta"]["engine"] == {"capacity_blocks": 79, "max_batch": 8}
    assert default["meta"]["engine"] == {"capacity_blocks": sb.KV_BLOCKS - 1,
                                         "max_batch": sb.MAX_NUM_SEQS}
    # 30 callers of 512 + 300 tokens: 8 at a time on the small engine, all at once on the other
    sim_small = small["workloads"]["burst"]["vllm"]["sim"]
    sim_default = default["workloads"]["burst"]["vllm"]["sim"]
    assert sim_small["ttft_p50_s"] > 2 * sim_default["ttft_p50_s"], (sim_small, sim_default)
    with pytest.raises(SystemExit, match="--kv-blocks 257 differs from the real run's 80"):
        svr.main(["--real", str(tmp_path / "small"), "--kv-blocks", "257"])
    with pytest.raises(SystemExit):
        svr.parse_args(["--sim-only", "--kv-blocks", "10"])  # not one 2,048-token sequence


def test_run_settings_come_from_a_result_line_too(tmp_path: pathlib.Path) -> None:
    real = tmp_path / "serve_bench.out"
    meta = {"workloads": ["burst"], "bench_args": ["--request-rate=9"], "seed": 2,
            "num_prompts_scale": 0.5, "policy": "calibrated"}
    real.write_text(json.dumps({"workloads": {}, "meta": meta}) + "\n")
    assert svr.run_settings_of(real) == meta
    assert svr.run_settings_of(tmp_path) is None  # a directory without settings.json
    opts = svr.parse_args(["--real", str(real), "--policy", "calibrated"])
    svr.adopt_run_settings(opts, meta)
    assert (opts.bench_arg, opts.seed, opts.num_prompts_scale) == (["--request-rate=9"], 2, 0.5)
    assert opts.workloads == ["burst"]
    opts = svr.parse_args(["--real", str(real), "--workload", "moderate"])
    svr.adopt_run_settings(opts, meta)
    assert opts.workloads == ["moderate"]  # asked for: kept (its real side is then missing)


def test_the_examples_policy_settings_are_simulated() -> None:
    """A run made with ``--example-arg=--first-token-pause-share=off`` is simulated with the
    pauses off (a fresh policy per simulated run); the run's recorded example arguments are
    adopted like its other settings; arguments that are not the policy's change nothing."""
    from kvbudget.core.policy import CalibratedPolicy

    assert svr.example_policy("calibrated", []) == "calibrated"
    assert svr.example_policy("calibrated", ["--max-queue-delay=3"]) == "calibrated"
    factory = svr.example_policy("calibrated", ["--first-token-pause-share=off"])
    first, second = factory(), factory()
    assert isinstance(first, CalibratedPolicy) and first is not second
    assert first.first_token_pause_share is None
    spaced = svr.example_policy("calibrated", ["--first-token-pause-share", "0.5"])()
    assert isinstance(spaced, CalibratedPolicy) and spaced.first_token_pause_share == 0.5
    recorded = sb.run_settings(
        sb.parse_args(["--workload", "burst", "--example-arg=--first-token-pause-share=off"]), []
    )
    assert recorded["example_args"] == ["--first-token-pause-share=off"]
    opts = svr.parse_args(["--real", "x"])
    svr.adopt_run_settings(opts, recorded)
    assert opts.example_arg == ["--first-token-pause-share=off"]
    opts = svr.parse_args(["--real", "x", "--example-arg=--first-token-pause-share=0.5"])
    with pytest.raises(SystemExit, match="--example-arg"):
        svr.adopt_run_settings(opts, {"example_args": ["--first-token-pause-share=off"]})


def test_kvbudget_serve_is_the_examples_policy_and_budget_with_its_own_settings() -> None:
    """``kvbudget serve`` is simulated where the run has it: the example's policy and budget
    (the adapter's slack, the prefill measured before the first caller, its pace from its own
    streams less their pauses), with its own pause share (``--serve-arg``, its flag
    ``--kvbudget-first-token-pause-share``), which the run recorded and the output keeps."""
    from kvbudget.core.policy import CalibratedPolicy

    serve = svr.SERVE
    assert svr.is_simulated(serve) and serve in svr.BUDGETED_SERVERS
    for rule in (svr.PROBING_SERVERS, svr.PACED_SERVERS, svr.PAUSING_SERVERS):
        assert "kvbudget" in rule and serve in rule
    assert svr.simulated_config(serve) == svr.simulated_config("kvbudget") is not None
    assert svr.servers_in_order({"vllm", serve}) == ("vllm", "kvbudget", serve)
    assert svr.servers_in_order({"vllm"}) == ("vllm", "kvbudget")
    # the example's flag is not serve's, nor the other way round
    assert svr.example_policy("calibrated", ["--first-token-pause-share=0.5"],
                              svr.SERVE_PAUSE_FLAG) == "calibrated"
    assert svr.example_policy("calibrated", [f"{svr.SERVE_PAUSE_FLAG}=0.5"]) == "calibrated"
    mine = svr.example_policy("calibrated", [f"{svr.SERVE_PAUSE_FLAG}=0.5"], svr.SERVE_PAUSE_FLAG)
    assert not isinstance(mine, str)
    made = mine()
    assert isinstance(made, CalibratedPolicy) and made.first_token_pause_share == 0.5
    assert svr.simulated_policy(serve, "calibrated", mine) is mine
    assert svr.simulated_policy(serve, "calibrated") == "calibrated"  # none: the example's
    assert svr.simulated_policy("kvbudget", "calibrated", mine) == "calibrated"
    # simulated: serve's pauses for first tokens (on here) change serve's run, not the example's
    profile = svr.load_profile(svr.DEFAULT_PROFILE, None)
    on = svr.example_policy("calibrated", [f"{svr.SERVE_PAUSE_FLAG}=0.75"], svr.SERVE_PAUSE_FLAG)
    both = svr.simulate_workloads(
        ["burst"], profile=profile, servers=("vllm", "kvbudget", serve), serve_policy=on
    )["burst"]
    alone = svr.simulate_workloads(["burst"], profile=profile)["burst"]
    assert both["kvbudget"]["good"] == alone["kvbudget"]["good"]
    assert both[serve]["budget_preemptions"] != both["kvbudget"]["budget_preemptions"]
    assert both[serve]["good"] > both["kvbudget"]["good"]  # a burst served by rounds of pauses
    recorded = sb.run_settings(sb.parse_args(
        ["--workload", "burst", f"--serve-arg={svr.SERVE_PAUSE_FLAG}=off"]), [])
    assert recorded["serve_args"] == [f"{svr.SERVE_PAUSE_FLAG}=off"]
    opts = svr.parse_args(["--real", "x"])
    svr.adopt_run_settings(opts, recorded)
    assert opts.serve_arg == [f"{svr.SERVE_PAUSE_FLAG}=off"]
    opts = svr.parse_args(["--real", "x", f"--serve-arg={svr.SERVE_PAUSE_FLAG}=0.5"])
    with pytest.raises(SystemExit, match="--serve-arg"):
        svr.adopt_run_settings(opts, recorded)


def test_freezes_real_and_simulated() -> None:
    """The longest gap of each complete stream, the one rule of serve_bench: simulated from the
    records' ``longest_gap_s`` (good and late streams only), and from a run's raw records
    where its summary predates the figures."""
    def rec(i: int, gap: float | None, first: float | None = 0.5) -> RequestRecord:
        return RequestRecord(
            request_id=f"r{i}", arrival_s=0.0, end="completed" if first else "rejected",
            prompt_tokens=10, output_tokens=20 if first else 0, expected_tokens=20,
            first_token_s=first, last_token_s=None if first is None else first + 1.5,
            finished_s=None if first is None else first + 1.5, longest_gap_s=gap,
        )

    out = svr.summarize_sim([rec(0, 0.01), rec(1, 2.5), rec(2, None, first=None)])
    assert (out["frozen_streams"], out["longest_gap_max_s"]) == (1, 2.5)
    # good_unfrozen as serve_bench counts it: good, and an interactive stream that never froze
    assert (out["good"], out["good_unfrozen"]) == (2, 1)
    frozen_batch = attrs.evolve(rec(3, 2.5), service_class="batch")
    assert svr.summarize_sim([rec(1, 2.5), frozen_batch])["good_unfrozen"] == 1
    raw = [{"outcome": "late", "itl": [0.01, 4.0]}, {"outcome": "good", "itl": [0.2]},
           {"outcome": "rejected", "itl": []}, {"outcome": "failed", "itl": [9.0]}]
    assert svr._freezes_of(raw) == {
        "frozen_streams": 1, "longest_gap_p50_s": 0.2, "longest_gap_max_s": 4.0
    }
    # a batch stream's freezes are not the interactive ones the simulator reports either
    batch = {"outcome": "good", "itl": [7.0], "service_class": "batch"}
    assert svr._freezes_of([*raw, batch]) == svr._freezes_of(raw)


def test_abandon_in_the_simulator_leaves_after_k_tokens() -> None:
    profile = svr.EngineProfile.load("vllm-cpu-tiny")
    sim = svr.simulate_workloads(["abandon"], profile=profile, scale=0.5)
    for server in ("vllm", "kvbudget"):
        s = sim["abandon"][server]
        leaving = sum(1 for p in svr.plan_workload("abandon", 0, TOK, 0.5) if p.leave_after)
        assert s["abandoned"] == leaving  # every planned leaver leaves, nobody else
        assert s["good"] + s["late"] + s["rejected"] + s["failed"] == s["sent"] - leaving
        assert s["duration_s"] > 0 and not math.isnan(s["duration_s"])


def test_the_engine_profile_is_the_runs_own_where_the_run_kept_one(tmp_path: pathlib.Path) -> None:
    """``--engine-profile run`` (the default) reads the profile the kvbudget server fitted in the
    real run; a run without one, and no run, fall back to the shipped profile; a name or file
    is taken as given."""
    from kvbudget.sim.profile import EngineProfile

    shipped = EngineProfile.load(svr.DEFAULT_PROFILE)
    own = EngineProfile.from_dict({
        **shipped.to_dict(), "name": "tiny-run", "source": "this run",
        "step": {**shipped.to_dict()["step"], "fixed_s": 0.001},
    })
    assert svr.load_profile(svr.RUN_PROFILE, tmp_path).name == shipped.name
    assert svr.load_profile(svr.RUN_PROFILE, None).name == shipped.name
    # a run without the example: kvbudget serve's own; with it: the example's
    serves = EngineProfile.from_dict({**own.to_dict(), "name": "tiny-serve"})
    (tmp_path / svr.SERVE_PROFILE_FILE).write_text(json.dumps(serves.to_dict()))
    assert svr.load_profile(svr.RUN_PROFILE, tmp_path).name == "tiny-serve"
    (tmp_path / svr.RUN_PROFILE_FILE).write_text(json.dumps(own.to_dict()))
    picked = svr.load_profile(svr.RUN_PROFILE, tmp_path)
    assert picked.name == "tiny-run" and picked.step.fixed_s == 0.001
    assert svr.load_profile("vllm-l4-qwen2.5-0.5b", tmp_path).name == "vllm-l4-qwen2.5-0.5b"
    assert svr.parse_args([]).engine_profile == svr.RUN_PROFILE
    # the intake: a run's own profile (fitted from steps, which do not tell it apart) takes the
    # shipped profile's, measured on this machine; a named one keeps its own; --intake-ms wins
    own_fit = EngineProfile.from_dict({k: v for k, v in own.to_dict().items() if k != "intake_s"})
    (tmp_path / svr.RUN_PROFILE_FILE).write_text(json.dumps(own_fit.to_dict()))
    assert own_fit.intake_s == 0.0 and shipped.intake_s > 0.0
    assert svr.load_profile(svr.RUN_PROFILE, tmp_path).intake_s == shipped.intake_s
    assert svr.load_profile(svr.RUN_PROFILE, tmp_path, 2.5).intake_s == pytest.approx(0.0025)
    assert svr.load_profile("vllm-l4-qwen2.5-0.5b", tmp_path).intake_s == 0.0
    assert svr.scaled(shipped, 2.0).intake_s == pytest.approx(2 * shipped.intake_s)
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            svr.parse_args(["--intake-ms", bad])


def test_send_times_real_replays_the_clients_bursts() -> None:
    """``--send-times real``: each server's requests arrive when the real client sent them to
    it. A client stalled for a second sends the moderate workload's first 10 requests at once;
    the replay has them arrive together, the rest as planned (records without an index keep
    their plan), and the simulated run reports its turn-aways by reason."""
    plan = svr.plan_workload("moderate", 0, TOK)
    stall = plan[9].arrival_s
    records = [
        {"request_id": f"sb-kvbudget-moderate-r0-abc-{p.index}",
         "start": 50.0 + (stall if p.index < 10 else p.arrival_s)}
        for p in plan
    ]
    sent = svr.real_send_times({"moderate": {"kvbudget": records}})
    times = sent["moderate"]["kvbudget"]
    assert [times[i] for i in range(10)] == [0.0] * 10  # relative to the first send
    assert times[20] == pytest.approx(plan[20].arrival_s - stall)
    moved = svr.with_send_times(plan, {i: t + stall for i, t in times.items()})
    assert [p.arrival_s for p in moved[:10]] == [pytest.approx(stall)] * 10
    assert [p.index for p in moved] == sorted(p.index for p in moved)  # arrival order kept
    replay = svr.Replay(
        {"moderate": {"kvbudget": {i: t + stall for i, t in times.items()}}}, {}
    )
    sim = svr.simulate_workloads(
        ["moderate"], profile=svr.EngineProfile.load("vllm-cpu-tiny"), scale=1.0, replay=replay,
    )
    summary = sim["moderate"]["kvbudget"]
    assert summary["sent"] == len(plan)
    assert sum(summary["rejections_by_reason"].values()) == summary["rejected"]


def test_each_repeat_is_replayed_with_its_own_client(tmp_path: pathlib.Path) -> None:
    """A serve_bench run of two repeats: each repeat is replayed with its own client (its send
    times and its stalls, on a clock from its first send), and the simulated counts compared as
    medians, as the real ones are."""
    plan = svr.plan_workload("burst", 0, TOK)
    for k, lag in enumerate((0.0, 0.5)):
        records = [
            {"request_id": f"sb-kvbudget-burst-r{k}-abc-{p.index}",
             "start": 10.0 + (lag if p.index % 2 else 0.0),
             "prompt_len": p.prompt_tokens, "output_len": p.output_tokens}
            for p in plan
        ]
        (tmp_path / f"records-burst-kvbudget-r{k}.json").write_text(json.dumps(
            {"summary": _summary(20 + k, 10 - k), "records": records,
             "client_stalls": [[10.2, 1.5]] if k else []}
        ))
    replays = svr.load_replays(tmp_path)
    assert len(replays) == 2
    assert set(replays[0].send_times["burst"]["kvbudget"].values()) == {0.0}
    assert set(replays[1].send_times["burst"]["kvbudget"].values()) == {0.0, 0.5}
    assert replays[0].stalls["burst"]["kvbudget"] == []
    assert replays[1].stalls["burst"]["kvbudget"] == [(pytest.approx(0.2), 1.5)]
    a = {"burst": {"kvbudget": {"good": 20, "late": 4, "rejected": 6, "failed": 0,
                                "abandoned": 0, "ttft_p50_s": 1.0}}}
    b = {"burst": {"kvbudget": {"good": 30, "late": 0, "rejected": 0, "failed": 0,
                                "abandoned": 0, "ttft_p50_s": 2.0}}}
    merged = svr.median_of_runs([a, b])["burst"]["kvbudget"]
    assert merged["good"] == 25 and merged["late"] == 2 and merged["runs"] == 2
    assert merged["ttft_p50_s"] == 1.0  # (the first run's other figures)
    assert svr.median_of_runs([a]) == a


def test_each_repeat_of_the_example_runs_on_its_own_engine_profile(
    tmp_path: pathlib.Path,
) -> None:
    """Where serve_bench kept the example's engine profile of each run (fitted from the steps
    of that run alone), ``--pace run`` replays each repeat on its own: a run whose engine was
    twice as slow is simulated twice as slow; a run without one, and ``--pace none``, use the
    run's profile; vLLM's server has none."""
    from kvbudget.sim.profile import EngineProfile

    shipped = EngineProfile.load(svr.DEFAULT_PROFILE)
    plan = svr.plan_workload("burst", 0, TOK)
    for k in range(3):
        records = [
            {"request_id": f"sb-kvbudget-burst-r{k}-abc-{p.index}", "start": 10.0,
             "prompt_len": p.prompt_tokens, "output_len": p.output_tokens}
            for p in plan
        ]
        (tmp_path / f"records-burst-kvbudget-r{k}.json").write_text(json.dumps(
            {"summary": _summary(30, 0), "records": records, "client_stalls": []}
        ))
    slow = svr.scaled(shipped, 2.0)
    (tmp_path / "engine-profile-kvbudget-burst-r0.json").write_text(json.dumps(shipped.to_dict()))
    (tmp_path / "engine-profile-kvbudget-burst-r1.json").write_text(json.dumps(slow.to_dict()))
    own = svr.stretch_profiles(tmp_path, "burst", "kvbudget")
    assert [p is not None for p in own] == [True, True, False]
    assert own[1] is not None and own[1].step.fixed_s == pytest.approx(2 * shipped.step.fixed_s)
    replays = svr.load_replays(tmp_path, stretches=True)
    assert "kvbudget" in replays[1].profiles["burst"] and replays[2].profiles == {}
    assert svr.load_replays(tmp_path)[1].profiles == {}  # (--pace none)
    runs = [
        svr.simulate_workloads(["burst"], profile=shipped, replay=r)["burst"]["kvbudget"]
        for r in replays
    ]
    assert [r["engine_profile"] for r in runs] == ["this run's", "this run's", "the run's"]
    assert runs[0]["tpot_p50_ms"] == runs[2]["tpot_p50_ms"]
    assert runs[1]["tpot_p50_ms"] > 1.6 * runs[0]["tpot_p50_ms"]


def test_the_examples_turn_away_may_start_each_workload_from_what_the_real_one_had_learned(
    tmp_path: pathlib.Path,
) -> None:
    """serve_bench records the example's wait outcomes by band before each run; sim_vs_real
    reads them, reports them beside the simulator's own at each workload's start, and with
    ``wait_outcomes="real"`` (not the default) starts the simulated turn-away from them (each
    counting for a minute from the workload's start), not from what its simulated workloads
    before taught it."""
    from kvbudget.core.forecast import MIN_WAIT_OUTCOMES, WAIT_OUTCOME_HORIZON_S
    from kvbudget.core.model import Capacity
    from kvbudget.core.scheduler import Scheduler

    pressed = [(0, 0)] * 16
    pressed[3] = (MIN_WAIT_OUTCOMES + 4, 1)  # at about its bound, nearly all timed out
    for workload in ("burst", "abandon"):
        plan = svr.plan_workload(workload, 0, TOK)
        records = [
            {"request_id": f"sb-kvbudget-{workload}-r0-abc-{p.index}", "start": 10.0,
             "prompt_len": p.prompt_tokens, "output_len": p.output_tokens}
            for p in plan
        ]
        before = [{"pressure_from": 0.0, "seen": n, "in_time": k}
                  for n, k in ([(0, 0)] * 16 if workload == "burst" else pressed)]
        (tmp_path / f"records-{workload}-kvbudget-r0.json").write_text(json.dumps(
            {"summary": _summary(30, 0), "records": records, "client_stalls": [],
             "wait_outcomes": {"before": before, "after": None},
             "release_rate": {"before": 0.0 if workload == "burst" else 116.5, "after": 9.0}}
        ))
    (replay,) = svr.load_replays(tmp_path)
    assert replay.wait_outcomes["abandon"]["kvbudget"] == pressed
    # the release rate the real one started each workload from, beside the simulated one's
    assert replay.release_rates == {"burst": {"kvbudget": 0.0}, "abandon": {"kvbudget": 116.5}}
    assert svr.real_release_rate({"release_rate": {"before": None}}) is None
    assert svr.real_release_rate({}) is None
    assert svr.format_bands(pressed) == f"1:1/{MIN_WAIT_OUTCOMES + 4}"
    assert svr.format_bands([]) == "none"
    assert svr.parse_args(["--sim-only"]).wait_outcomes == "sim"  # (the default: predicted)
    for mode in ("sim", "real"):
        out = svr.simulate_workloads(
            ["burst", "abandon"], profile=svr.load_profile(svr.DEFAULT_PROFILE, None),
            replay=replay, wait_outcomes=mode,
        )
        start = out["abandon"]["kvbudget"]["wait_outcomes_at_start"]
        assert start["real"] == pressed and start["used"] == mode
        rates = out["abandon"]["kvbudget"]["release_rate_at_start"]
        assert rates["real"] == 116.5 and rates["sim"] > 0.0  # (the simulated burst released)
        assert out["burst"]["kvbudget"]["release_rate_at_start"] == {"sim": 0.0, "real": 0.0}
        assert start["sim"] != pressed  # (the simulated burst taught it something else)
        # the first workload starts fresh either way, as the real server did
        assert out["burst"]["kvbudget"]["wait_outcomes_at_start"]["used"] == "sim"
        assert "engine_preemptions" in out["abandon"]["kvbudget"]
        assert "budget_preemptions" in out["abandon"]["kvbudget"]
        assert "budget_preemptions" not in out["abandon"]["vllm"]
    # what the seeded memory tells a scheduler that takes it over: those outcomes, for a minute
    s = Scheduler(Capacity(64, 16))
    memory = svr.with_wait_outcomes(None, pressed)
    assert svr.memory_bands(memory) == pressed
    # the simulator's own carried outcomes are shown as a forecast reads them: the last minute's
    later = attrs.evolve(memory, at=memory.at + WAIT_OUTCOME_HORIZON_S + 1.0)
    assert svr.memory_bands(later) == [(0, 0)] * 16
    s.forecast.recall(memory, 5.0)
    s.now = 5.0
    assert s.forecast.wait_outcomes_by_band() == tuple(pressed)
    assert s.forecast.unlikely_in_time(1.1, 1.0)  # only 1 in 20 served at that pressure
    s.now = 5.0 + WAIT_OUTCOME_HORIZON_S + 1.0
    assert s.forecast.wait_outcomes_by_band() == ((0, 0),) * 16


def test_the_simulated_servers_tick_as_the_real_ones_budgets_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real servers' budgets tick their schedulers every ``SHELL_TICK_INTERVAL_S`` (a
    queued caller past its bound is turned away at most that late, and may be admitted in
    between): the simulated ones tick as often, on the run's profile and on a repeat's own."""
    import inspect

    from kvbudget.budget import Budget
    from kvbudget.core.config import SHELL_TICK_INTERVAL_S
    from kvbudget.sim.engine_model import DEFAULT_TICK_S
    from kvbudget.vllm import BudgetedEngine

    for shell in (Budget.__init__, BudgetedEngine.__init__):
        assert inspect.signature(shell).parameters["tick_interval"].default \
            == SHELL_TICK_INTERVAL_S
    assert DEFAULT_TICK_S == SHELL_TICK_INTERVAL_S  # (kvbudget simulate ticks as they do too)
    ticks: list[float] = []
    real_simulate = svr.simulate

    def spy(*args: Any, **kw: Any) -> Any:
        ticks.append(args[2].tick_s)
        return real_simulate(*args, **kw)

    monkeypatch.setattr(svr, "simulate", spy)
    profile = svr.load_profile(svr.DEFAULT_PROFILE, None)
    plan = svr.plan_workload("burst", 0, TOK)
    own = svr.Replay(
        {"burst": {"kvbudget": {p.index: p.arrival_s for p in plan}}}, {},
        profiles={"burst": {"kvbudget": profile}},
    )
    for replay in (None, own):
        ticks.clear()
        svr.simulate_workloads(["burst"], profile=profile, replay=replay)
        assert ticks and set(ticks) == {SHELL_TICK_INTERVAL_S}


def test_a_stalled_client_reads_what_came_meanwhile_when_the_stall_ends() -> None:
    """A stream served in time whose tokens came while the client was stalled is timed as that
    client read it: a first token at 1.5 s read at the end of a 1.0-2.5 s stall is 2.5 s late;
    tokens outside any stall are read as they come."""
    rec = RequestRecord(
        request_id="r", arrival_s=0.0, end="completed", prompt_tokens=8, output_tokens=31,
        expected_tokens=31, first_token_s=1.5, last_token_s=3.0, finished_s=3.0,
    )
    view = svr.ClientView([(1.0, 1.5)])
    assert view.read_at(0.5) == 0.5 and view.read_at(1.2) == 2.5 and view.read_at(2.5) == 2.5
    ttft, tpot = view.timing(rec)
    assert ttft == pytest.approx(2.5) and tpot == pytest.approx((3.0 - 2.5) / 30)
    assert svr.classify_sim(rec) == "good"
    assert svr.classify_sim(rec, view) == "late"
    assert svr.summarize_sim([rec], view)["late"] == 1


def test_front_ends_are_fitted_from_the_runs_cpu_counts(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each workload run whose counters hold the front end's CPU is one stretch: (requests,
    chunks that carried tokens, wall + idle wait after, CPU); a run counted before serve_bench
    counted CPU gives none. ``--front-end run`` fits each server's and prints it; the default
    leaves the front ends out."""
    per_request, per_output = 0.002, 0.0001
    for k, name in enumerate(("moderate", "overload", "burst")):
        n = 30 + 50 * k
        recs = [{"request_id": f"sb-vllm-{name}-r0-abc-{i}", "start": 1.0, "prompt_len": 10,
                 "output_len": 5, "token_chunks": 10 + 7 * k} for i in range(n)]
        chunks = sum(r["token_chunks"] for r in recs)
        (tmp_path / f"records-{name}-vllm-r0.json").write_text(json.dumps({
            "summary": {**_summary(n, 0), "wall_s": 10.0 + k, "idle_wait": {"after_s": 0.5}},
            "counters": {"frontend_cpu_s": per_request * n + per_output * chunks},
            "records": recs,
        }))
    (tmp_path / "records-abandon-vllm-r0.json").write_text(json.dumps(
        {"summary": _summary(1, 0), "counters": {}, "records": recs[:1]}))
    stretches = svr.front_end_stretches(tmp_path)
    assert set(stretches) == {"vllm"} and len(stretches["vllm"]) == 3
    assert stretches["vllm"][0] == (30, 300, 10.5, pytest.approx(0.09))
    (fe, idle), = svr.front_ends_of(tmp_path).values()
    assert fe.per_request_s == pytest.approx(per_request, rel=1e-6)
    assert fe.per_output_s == pytest.approx(per_output, rel=1e-6)
    assert idle == pytest.approx(0.0, abs=1e-9)
    assert svr.parse_args(["--sim-only"]).front_end == "none"
    assert svr.main(["--real", str(tmp_path), "--workload", "burst", "--front-end", "run"]) == 0
    out = _last_json(capsys.readouterr().out)
    assert out["meta"]["front_ends"]["vllm"]["per_output_s"] == pytest.approx(per_output)


def test_mean_gap_weighs_every_gap_alike() -> None:
    """The mean gap between tokens over several streams: (a 3-token stream over 0.2 s and a
    5-token one over 0.2 s) = 0.4 s / 6 gaps; a one-token stream has no gap."""
    assert svr.mean_gap([(3, 0.2), (5, 0.2), (1, 0.0)]) == pytest.approx(0.4 / 6)
    assert svr.mean_gap([(1, 0.0)]) is None and svr.mean_gap([]) is None
    recs = [
        {"outcome": "good", "output_tokens": 11, "ttft": 0.5, "latency": 1.5},
        {"outcome": "late", "output_tokens": 21, "ttft": 3.0, "latency": 5.0},
        {"outcome": "failed", "output_tokens": 3, "ttft": 0.1, "latency": 9.0},  # not counted
        {"outcome": "rejected", "output_tokens": 0, "ttft": None, "latency": None},
    ]
    assert svr.real_stream_gap(recs) == pytest.approx(3.0 / 30)


def test_the_pace_is_found_from_the_streams_gap() -> None:
    """``--pace run``: the step-time scale at which the simulated streams' mean gap is the real
    run's. Planted: the gap of the burst simulated with every step 1.3x as long; the search,
    starting from the profile, finds a scale near 1.3 and returns the run made at it."""
    profile = svr.EngineProfile.load("vllm-cpu-tiny")
    scenario, reqs = svr.sim_requests(svr.plan_workload("burst", 0, TOK))
    client = svr.ClientView()

    def run_at(scale: float) -> tuple[Any, float]:
        engine = svr.scaled_engine(profile.engine_model(), scale)
        return svr.simulate(reqs, scenario, engine, "reserve-current", keep_requests=True), scale

    target = svr.sim_stream_gap(run_at(1.3)[0].request_records, client)
    assert target is not None
    (result, ran_at), scale = svr.paced_simulation(run_at, target, client)
    assert ran_at == scale and 1.2 < scale < 1.4
    gap = svr.sim_stream_gap(result.request_records, client)
    assert gap == pytest.approx(target, rel=svr.PACE_TOLERANCE)
    # a gap far outside what any scale gives stops at the bound
    (_, _), fast = svr.paced_simulation(run_at, target / 100, client)
    assert fast == svr.PACE_BOUNDS[0]
    # a server that ran at less than half the profile's step time (vLLM's server in a fast
    # spell of the machine, the profile fitted by the example's engine in a slow one: sb30a)
    # is found there, not held at half
    quick = svr.sim_stream_gap(run_at(0.4)[0].request_records, client)
    assert quick is not None
    (_, _), scale = svr.paced_simulation(run_at, quick, client)
    assert 0.35 < scale < 0.45


def test_phase_gaps_split_the_streams_by_their_middle() -> None:
    """``--pace phases``: the streams whose middle came while requests were still sent and
    those after, each phase cut into windows of about equal numbers of streams (at least 12
    each, at most 3 per phase), each window's mean gap; too few streams in a phase give none."""
    streams = [(1.0, 11, 0.5)] * 8 + [(5.0, 11, 0.2)] * 8
    got = svr.phase_gaps(streams, 4.0)
    assert got is not None and got.split_s == 4.0 and got.edges == (4.0,)
    assert got.gaps == (pytest.approx(0.05), pytest.approx(0.02))
    assert svr.phase_gaps(streams[:-1], 4.0) is None  # 7 after
    # 36 streams while requests arrive, slower in their first third; 8 after
    early = [(0.1 * i, 11, 1.0 if i < 12 else 0.5) for i in range(36)]
    got = svr.phase_gaps(early + [(5.0, 11, 0.2)] * 8, 4.0)
    assert got is not None
    assert got.edges == (pytest.approx(1.15), pytest.approx(2.35), 4.0)
    assert got.gaps == tuple(pytest.approx(g) for g in (0.1, 0.05, 0.05, 0.02))
    assert svr.window_gaps(early, got.edges) == [
        pytest.approx(0.1), pytest.approx(0.05), pytest.approx(0.05), None
    ]
    # the slower windows run as spans of the timeline at the fastest one's scale
    assert svr.phase_spans([1.5, 1.0], (4.0,)) == (1.0, [(-1.0, 5.0, pytest.approx(1 / 1.5))])
    assert svr.phase_spans([1.0, 2.0, 1.0], (4.0, 6.0)) == (1.0, [(4.0, 2.0, 0.5)])
    assert svr.phase_spans([1.0, 2.0], (4.0,)) == (1.0, [(4.0, 1e9 - 4.0, 0.5)])
    # 8 streams sent in the first second; the last send 6 s after the first; 8 streams sent
    # before it whose middle comes after it (a long wait for their first token)
    recs: list[dict[str, Any]] = [
        {"outcome": "good", "output_tokens": 11, "start": 10.0 + i / 10, "ttft": 0.1,
         "latency": 0.6}
        for i in range(8)
    ]
    recs += [{"outcome": "good", "output_tokens": 11, "start": 15.0, "ttft": 1.5,
              "latency": 1.7}] * 8
    recs += [{"outcome": "good", "output_tokens": 11, "start": 16.0, "ttft": 0.1,
              "latency": 0.3}]
    recs += [{"outcome": "rejected", "output_tokens": 0, "start": 12.0, "ttft": None,
              "latency": None}]
    real = svr.real_phase_gaps(recs)
    assert real is not None and real.split_s == pytest.approx(6.0)
    assert real.gaps == (pytest.approx(0.05), pytest.approx(0.02))


def test_a_run_paced_by_windows_keeps_its_clients_stalls() -> None:
    """A slow window and the client's stalls as the driver's speed spans: a stall inside the
    slow window runs at the stall speed of the window's speed, one past it at the stall speed;
    the spans do not overlap and keep their order (the driver refuses overlapping ones)."""
    windows = [(-1.0, 5.0, 0.5)]  # (begin, seconds, speed): slow until t = 4
    stalls = [(2.0, 1.0), (6.0, 0.5)]
    spans = svr.merged_spans(windows, stalls, 0.3)
    assert spans == [
        (-1.0, 3.0, 0.5), (2.0, 1.0, pytest.approx(0.15)), (3.0, 1.0, 0.5), (6.0, 0.5, 0.3)
    ]
    assert svr.merged_spans([], stalls, 0.3) == [(2.0, 1.0, 0.3), (6.0, 0.5, 0.3)]
    assert svr.merged_spans(windows, [], 0.3) == windows
    # (the driver takes them: sorted, not overlapping)
    profile = svr.EngineProfile.load("vllm-cpu-tiny")
    scenario, reqs = svr.sim_requests(svr.plan_workload("burst", 0, TOK))
    engine = profile.engine_model()
    plain = svr.simulate(reqs, scenario, engine, "reserve-current", stalls=windows)
    both = svr.simulate(reqs, scenario, engine, "reserve-current", stalls=spans)
    assert both.makespan_s > plain.makespan_s


def test_the_pace_of_each_window_is_found_from_its_streams() -> None:
    """``--pace phases``: planted, the overload workload simulated with every step 1.6x as
    long in the first 2 s and 1.0x after (as vLLM's server ran in real runs: slow in its first
    seconds only); the search, starting from the profile, finds the windows' scales (the
    first near 1.6, the last near 1.0) and returns a run whose windows have the planted mean
    gaps. One scale for the whole run (``--pace run``) cannot: its first streams come out
    faster than the planted run's."""
    profile = svr.EngineProfile.load("vllm-cpu-tiny")
    plan = svr.plan_workload("overload", 0, TOK)
    scenario, reqs = svr.sim_requests(plan)
    split = max(p.arrival_s for p in plan)
    client = svr.ClientView()

    def run_at(scale: float, spans: Any = None) -> tuple[Any, float]:
        engine = svr.scaled_engine(profile.engine_model(), scale)
        result = svr.simulate(reqs, scenario, engine, "reserve-current", keep_requests=True,
                              stalls=spans or ())
        return result, scale

    planted = run_at(1.0, [(-1.0, 3.0, 1 / 1.6)])[0].request_records
    target = svr.phase_gaps(svr.sim_streams(planted, client), split)
    assert target is not None and len(target.gaps) >= 3
    assert target.gaps[0] > 1.3 * target.gaps[-1]
    found = svr.phased_simulation(run_at, target, client)
    assert found is not None
    (result, _), scales = found
    assert scales[0] == pytest.approx(1.6, rel=0.15) and scales[-1] == pytest.approx(1.0, rel=0.1)
    got = svr.sim_phase_gaps(result.request_records, client, target.edges)
    for want, have in zip(target.gaps, got, strict=True):
        assert have == pytest.approx(want, rel=0.05)
    first = min(planted, key=lambda r: r.arrival_s)
    (one, _), _scale = svr.paced_simulation(run_at, svr.sim_stream_gap(planted, client) or 0.0,
                                            client)
    one_first = min(one.request_records, key=lambda r: r.arrival_s)
    assert one_first.tpot_s is not None and first.tpot_s is not None
    assert one_first.tpot_s < 0.9 * first.tpot_s


def test_both_servers_are_paced_by_their_streams_the_examples_without_its_pauses(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With the run's records, each server's cell is simulated at its streams' pace and says
    the scale it ran at. The example's pace is read without each stream's pause (its longest
    gap, where that is over ``PAUSE_GAP_S``): pauses are its policy's doing, which the
    simulator predicts, not the engine's pace. ``--pace none`` leaves both at 1."""
    plan = svr.plan_workload("burst", 0, TOK)
    for server, span, pause in (("vllm", 3.0, 0.0), ("kvbudget", 30.0, 27.0)):
        records = []
        for p in plan:
            gaps = p.output_tokens - 1
            itl = ([(span - pause) / (gaps - 1)] * (gaps - 1) + [pause] if pause
                   else [span / gaps] * gaps)
            records.append(
                {"request_id": f"sb-{server}-burst-r0-abc-{p.index}", "start": 10.0,
                 "prompt_len": p.prompt_tokens, "output_len": p.output_tokens,
                 "outcome": "good", "output_tokens": p.output_tokens, "ttft": 0.1,
                 "latency": 0.1 + span, "itl": itl}
            )
        (tmp_path / f"records-burst-{server}-r0.json").write_text(json.dumps(
            {"summary": _summary(30, 0), "records": records}
        ))
    gaps = svr.load_replays(tmp_path)[0].gaps["burst"]
    assert gaps["vllm"] == pytest.approx(3.0 / 299)
    assert gaps["kvbudget"] == pytest.approx(3.0 / 298)  # (not 30 s / 299: the pause is out)
    assert svr.parse_args([]).pace == "phases"
    for pace, scaled in (("phases", True), ("run", True), ("none", False)):
        assert svr.main(["--real", str(tmp_path), "--workload", "burst", "--pace", pace]) == 0
        out = _last_json(capsys.readouterr().out)
        burst = out["workloads"]["burst"]
        for server in ("vllm", "kvbudget"):
            assert (burst[server]["sim"]["step_scale"] != 1.0) is scaled
        assert out["meta"]["paced"] == (["vllm", "kvbudget"] if scaled else [])


def test_mixed_is_serve_benchs_own_plan_and_its_backlog_is_batch() -> None:
    plan = svr.plan_workload("mixed", 0, TOK)
    theirs = sb.mixed_plan(120, 0, "x-", TOK.vocab_size, TOK.special_ids)
    assert [(p.arrival_s, p.prompt_tokens, p.output_tokens, p.service_class) for p in plan] == [
        (at, r.prompt_len, r.output_len, r.service_class) for at, r, _ in theirs
    ]
    scenario, reqs = svr.sim_requests(plan)
    assert scenario.batch_deadline_s == sb.BATCH_DEADLINE_S
    assert [r.spec.service_class for r in reqs] == [p.service_class for p in plan]
    assert sum(r.spec.service_class == "batch" for r in reqs) == 40
    # a batch request is good when it completes within its deadline, whatever its first token
    slow = {"service_class": "batch", "first_token_s": 40.0, "last_token_s": 90.0}
    assert svr.classify_sim(_sim_rec(**slow, finished_s=90.0)) == "good"
    late = {**slow, "last_token_s": 700.0, "finished_s": 700.0}
    assert svr.classify_sim(_sim_rec(**late)) == "late"
    assert svr.classify_sim(_sim_rec(first_token_s=40.0, last_token_s=90.0)) == "late"


def test_a_mixed_variant_is_planned_as_serve_bench_sends_it() -> None:
    args = ["--mixed-batch-share=0.5", "--mixed-rate=3", "--random-input-len=64"]
    plan = svr.plan_workload("mixed", 2, TOK, 0.5, args)
    mine = sb.WORKLOADS["mixed"].with_args(args).bench_args
    theirs = sb.mixed_plan(60, 2, "x-", TOK.vocab_size, TOK.special_ids, mine)
    assert [(p.arrival_s, p.output_tokens, p.service_class) for p in plan] == [
        (at, r.output_len, r.service_class) for at, r, _ in theirs
    ]
    assert sum(p.service_class == "batch" for p in plan) == 30


def test_the_models_context_refuses_or_cuts_requests_as_the_servers_do() -> None:
    # prompts of 1,620-1,980 tokens + 1 BOS with 135-165 out: some outputs do not fit in the
    # 2,048 tokens after their prompt, no prompt is refused; at 1,710-2,090, some are refused
    fits = ["--random-input-len=1800", "--random-range-ratio=0.1", "--random-output-len=150"]
    over = ["--random-input-len=1900", "--random-range-ratio=0.1", "--random-output-len=100"]
    for args in (fits, over):
        plan = svr.plan_workload("moderate", 0, TOK, 0.25, args)
        kept, limits = svr.context_limits(plan)
        refused = [p for p in plan if p.prompt_tokens >= sb.MAX_MODEL_LEN]
        cut = [p for p in kept if p.prompt_tokens + p.output_tokens > sb.MAX_MODEL_LEN]
        assert limits.refused == len(refused) == len(plan) - len(kept)
        assert limits.cut == {f"r{p.index}": p.output_tokens for p in cut}
        sim = svr.simulate_workloads(
            ["moderate"], profile=svr.EngineProfile.load("vllm-cpu-tiny"), scale=0.25,
            bench_args=args,
        )["moderate"]
        for server in ("vllm", "kvbudget"):
            s = sim[server]
            assert s["sent"] == len(plan)
            assert s["failed"] == len(refused) + len(cut)
            assert s["good"] + s["late"] + s["rejected"] == len(plan) - s["failed"]
    assert svr.context_limits(svr.plan_workload("moderate", 0, TOK, 0.25, over))[1].refused
    only_cut = svr.context_limits(svr.plan_workload("moderate", 0, TOK, 0.25, fits))[1]
    assert only_cut.cut and not only_cut.refused
    assert svr.classify_sim(_sim_rec(output_tokens=60, expected_tokens=60), asked=80) == "failed"
    assert svr.classify_sim(_sim_rec(output_tokens=60, expected_tokens=60), asked=60) == "good"


def test_the_simulated_example_has_measured_the_prefill_before_its_first_caller() -> None:
    """The example's BudgetedEngine prefills PREFILL_PROBES prompts before any caller, so its
    calibrated policy may pause streams from the first request on; the simulated example's
    cost model starts from the same observations. Held out (sb23b, with the pauses on, as
    they were by default then): 160 callers of the shared-prefix workload all at once, whose
    cached prefix leaves too few prefill steps to measure in the burst: the real example
    paused streams and served all 160 in time; the simulated one without the probes paused
    none and turned 102 away at their deadline."""
    from kvbudget.engines.vllm.adapter import PREFILL_PROBES, prefill_probe_lengths
    from kvbudget.sim.profile import EngineProfile

    assert prefill_probe_lengths(8, 2048, 8192) == [128, 256, 384, 512, 640, 768, 896, 1024]
    assert prefill_probe_lengths(4, 300, 256) == [32, 64, 96, 128]  # half the cache
    assert prefill_probe_lengths(3, 2, 1000) == [1, 1, 1]
    prof = EngineProfile.load(svr.DEFAULT_PROFILE)
    engine = prof.engine_model()
    cost = svr.probed_cost(engine)
    assert cost.prefill_observations == PREFILL_PROBES
    assert cost.predict_prefill(1000) == pytest.approx(
        1000 * engine.step.prefill_per_token_s, rel=0.05
    )
    out = svr.simulate_workloads(
        ["shared-prefix"], profile=prof, bench_args=["--request-rate=inf"],
        servers=("kvbudget",),
        policy=svr.example_policy("calibrated", [f"--first-token-pause-share={PAUSING}"]),
    )["shared-prefix"]["kvbudget"]
    assert out["good"] == 160 and out["rejected"] == 0 and out["frozen_streams"] > 0


def test_each_simulated_server_keeps_its_forecast_from_one_workload_to_the_next() -> None:
    """A server keeps its scheduler, and with it the release rate and the calibration of its
    wait forecasts, from one workload to the next; so does its simulated twin. Held out
    (sb23c, sb23e): 160 overload callers all at once right after the moderate burst; the
    real example turned 29-46 away at arrival ("deadline", Retry-After about 8 s) on the rate
    the moderate burst had shown, where the simulated one, starting the workload with a fresh
    scheduler, had no rate, forecast the placeholder wait and turned none away. (Those runs
    had the first-token pauses on, as they were by default then: a caller they could serve is
    not turned away on a forecast with no evidence.)"""
    from kvbudget.sim.profile import EngineProfile

    prof = EngineProfile.load(svr.DEFAULT_PROFILE)
    pausing = svr.example_policy("calibrated", [f"--first-token-pause-share={PAUSING}"])
    after = svr.simulate_workloads(
        ["moderate", "overload"], profile=prof, bench_args=["--request-rate=inf"],
        servers=("kvbudget",), policy=pausing,
    )["overload"]["kvbudget"]
    alone = svr.simulate_workloads(
        ["overload"], profile=prof, bench_args=["--request-rate=inf"], servers=("kvbudget",),
        policy=pausing,
    )["overload"]["kvbudget"]
    assert alone["rejected"] == 0
    # (34 turned away with grants a block ahead; 18 with the tight grants, which serve 16 more)
    assert after["rejections_by_reason"].get("deadline", 0) >= 10
    assert after["good"] + after["rejected"] == 160 and after["late"] == 0


def test_pace_of_runs_every_server_on_one_servers_engine_as_it_was_paced(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--pace-of vllm`` (a what-if): the example runs on vLLM's server's engine as the replay
    paced it (vLLM's profile and step-time scale), not on its own engine profile and streams'
    pace: a run whose example engine was twice as slow as vLLM's is then simulated at vLLM's
    pace, and says so (``paced_as``); without it, at its own. vLLM's own cell is the same
    either way. A server the run does not have is refused."""
    from kvbudget.sim.profile import EngineProfile

    shipped = EngineProfile.load(svr.DEFAULT_PROFILE)
    plan = svr.plan_workload("burst", 0, TOK)
    for server, span in (("vllm", 3.0), ("kvbudget", 6.0)):
        records = []
        for p in plan:
            gaps = p.output_tokens - 1
            records.append(
                {"request_id": f"sb-{server}-burst-r0-abc-{p.index}", "start": 10.0,
                 "prompt_len": p.prompt_tokens, "output_len": p.output_tokens,
                 "outcome": "good", "output_tokens": p.output_tokens, "ttft": 0.1,
                 "latency": 0.1 + span, "itl": [span / gaps] * gaps}
            )
        (tmp_path / f"records-burst-{server}-r0.json").write_text(json.dumps(
            {"summary": _summary(30, 0), "records": records}
        ))
    slow = svr.scaled(shipped, 2.0)
    (tmp_path / "engine-profile-kvbudget-burst-r0.json").write_text(json.dumps(slow.to_dict()))

    def burst(*extra: str) -> dict[str, Any]:
        assert svr.main(["--real", str(tmp_path), "--workload", "burst", "--pace", "run",
                         *extra]) == 0
        out = _last_json(capsys.readouterr().out)
        assert out["meta"]["pace_of"] == (extra[-1] if extra else None)
        cells: dict[str, Any] = out["workloads"]["burst"]
        return cells

    own, what_if = burst(), burst("--pace-of", "vllm")
    assert list(what_if) == list(own)  # (the servers in serve_bench's order)
    assert what_if["vllm"]["sim"] == own["vllm"]["sim"]
    example = what_if["kvbudget"]["sim"]
    assert example["paced_as"] == "vllm" and example["engine_profile"] == "vllm's"
    assert "paced_as" not in own["kvbudget"]["sim"]
    assert own["kvbudget"]["sim"]["engine_profile"] == "this run's"
    assert example["step_scale"] == what_if["vllm"]["sim"]["step_scale"]
    # on vLLM's engine, the example's streams go at vLLM's pace, not at half of it
    assert example["tpot_p50_ms"] == pytest.approx(what_if["vllm"]["sim"]["tpot_p50_ms"], rel=0.25)
    assert own["kvbudget"]["sim"]["tpot_p50_ms"] > 1.5 * example["tpot_p50_ms"]
    with pytest.raises(SystemExit, match="not one of this run's servers"):
        svr.main(["--real", str(tmp_path), "--workload", "burst", "--pace-of", "kvbudget-serve"])
