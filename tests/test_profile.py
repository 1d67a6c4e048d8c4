"""Engine profiles: the step-time fit recovers a known engine, profiles round-trip through JSON,
bad files get typed errors, ``kvbudget simulate --engine-profile`` runs on one, and the shipped GPU
profile reproduces the public measurement it was fitted from."""

from __future__ import annotations

import json
import pathlib
import random

import pytest

from kvbudget.core.cost import StepTimeModel
from kvbudget.errors import InvalidInput
from kvbudget.sim.profile import (
    EngineProfile,
    StepRecorder,
    fit_profile,
    fit_step_time,
    shipped_profiles,
)

TRUE = StepTimeModel(
    fixed_s=0.012, per_seq_s=0.0004, per_context_token_s=2e-7, prefill_per_token_s=5e-5
)


def _steps(n: int, noise: float, seed: int = 0) -> list[tuple[int, int, int, float]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        batch = rng.randint(1, 64)
        context = batch * rng.randint(100, 2000)
        prefill = rng.choice([0, 0, 0, rng.randint(32, 2048)])
        seconds = TRUE.decode_time(batch, context) + TRUE.prefill_time(prefill)
        out.append((batch, context, prefill, seconds * (1.0 + rng.gauss(0.0, noise))))
    return out


def test_the_fit_recovers_a_known_engine_exactly_without_noise() -> None:
    fit = fit_step_time(_steps(400, 0.0))
    assert fit.fixed_s == pytest.approx(TRUE.fixed_s, rel=1e-6)
    assert fit.per_seq_s == pytest.approx(TRUE.per_seq_s, rel=1e-6)
    assert fit.per_context_token_s == pytest.approx(TRUE.per_context_token_s, rel=1e-6)
    assert fit.prefill_per_token_s == pytest.approx(TRUE.prefill_per_token_s, rel=1e-6)


def test_the_fit_is_close_under_noise() -> None:
    fit = fit_step_time(_steps(4000, 0.05, seed=3))
    for b, c in ((1, 500), (16, 16 * 800), (64, 64 * 1500)):
        assert fit.decode_time(b, c) == pytest.approx(TRUE.decode_time(b, c), rel=0.03)
    assert fit.prefill_per_token_s == pytest.approx(TRUE.prefill_per_token_s, rel=0.1)


def test_coefficients_stay_non_negative() -> None:
    # time falls with batch size in this data: the per-sequence term is held at 0, not negative
    steps = [(b, 0, 0, 0.02 - 0.0001 * b) for b in range(1, 50)]
    fit = fit_step_time(steps)
    assert fit.per_seq_s == 0.0 and fit.per_context_token_s == 0.0
    assert fit.fixed_s == pytest.approx(sum(s for *_, s in steps) / len(steps))


def test_steps_at_one_batch_size_give_the_mean_as_the_fixed_cost() -> None:
    fit = fit_step_time([(4, 400, 0, 0.010), (4, 400, 0, 0.012)])
    assert fit.decode_time(4, 400) == pytest.approx(0.011)


def test_no_decode_step_is_a_typed_error() -> None:
    with pytest.raises(InvalidInput, match="decode step"):
        fit_step_time([(0, 0, 512, 0.03)])


def test_the_recorder_is_bounded_and_drops_non_finite_steps() -> None:
    rec = StepRecorder(limit=3)
    for i in range(5):
        rec.record(1, 10, 0, 0.01 * (i + 1))
    rec.record(1, 10, 0, float("nan"))
    assert len(rec) == 3 and [s for *_, s in rec.steps] == pytest.approx([0.03, 0.04, 0.05])


def test_the_recorder_keeps_when_each_whole_step_ended() -> None:
    """Steps timed whole carry when they ended: a stretch of time picks those that ended in it
    (both ends included; steps recorded without a time are in none), stalls are left out, and
    the times roll with the steps past the limit."""
    rec = StepRecorder(limit=4)
    for i in range(6):
        rec.record_wall(2, 100, 0, 0.01, at=10.0 + i)
    rec.record_wall(2, 100, 0, 5.0, at=20.0)  # a stall, not a step
    rec.record_wall(2, 100, 0, 0.02)  # no time given
    assert len(rec.wall) == 4 and list(rec.wall_at)[:3] == [13.0, 14.0, 15.0]
    assert len(rec.wall_between(14.0, 15.0)) == 2
    assert rec.wall_between(16.0, 100.0) == []
    assert len(rec.wall_between(-float("inf"), float("inf"))) == 3


def test_a_profile_round_trips_and_builds_the_engine_model(tmp_path: pathlib.Path) -> None:
    prof = fit_profile(
        _steps(200, 0.0), name="t", source="synthetic", capacity_blocks=100, block_size=16,
        max_batch=32, prefill_chunk_tokens=512,
    )
    assert prof.observed_steps == 200 and prof.abort_latency_s > 0.0
    path = tmp_path / "p.json"
    prof.save(path)
    again = EngineProfile.load(path)
    assert again == prof
    engine = again.engine_model()
    assert engine.capacity.blocks == 100 and engine.capacity.block_size == 16
    assert engine.max_batch == 32 and engine.prefill_chunk_tokens == 512
    assert engine.step == prof.step


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{", "valid JSON"),
        ("[]", "JSON object"),
        ('{"name": "x"}', "fields"),
        ('{"name": "x", "nope": 1}', "only the fields"),
    ],
)
def test_bad_profile_files_are_typed_errors(tmp_path: pathlib.Path, text: str, match: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(InvalidInput, match=match):
        EngineProfile.load(path)


def test_a_profile_with_a_negative_cost_is_refused() -> None:
    data = {
        "name": "x", "source": "y", "capacity_blocks": 10, "block_size": 16, "max_batch": 4,
        "prefill_chunk_tokens": 64, "abort_latency_s": 0.0,
        "step": {"fixed_s": -1.0, "per_seq_s": 0.0, "per_context_token_s": 0.0,
                 "prefill_per_token_s": 0.0},
    }
    with pytest.raises(InvalidInput, match="fixed_s"):
        EngineProfile.from_dict(data)


def test_a_missing_profile_names_the_shipped_ones() -> None:
    with pytest.raises(InvalidInput, match="profile file"):
        EngineProfile.load("/nonexistent/profile.json")


def test_every_shipped_profile_loads_and_says_where_it_comes_from() -> None:
    names = shipped_profiles()
    assert names, "kvbudget ships at least the profile of the engine it is tested on"
    for name in names:
        prof = EngineProfile.load(name)
        assert prof.name == name and len(prof.source) > 40
        prof.engine_model()


def test_simulate_reads_an_engine_profile(tmp_path: pathlib.Path) -> None:
    from kvbudget.cli import main

    prof = fit_profile(
        _steps(200, 0.0), name="t", source="synthetic", capacity_blocks=300, block_size=16,
        max_batch=32, prefill_chunk_tokens=512,
    )
    path = tmp_path / "p.json"
    prof.save(path)
    out = tmp_path / "r.json"
    main([
        "simulate", "--engine-profile", str(path), "--policy", "calibrated", "--limit", "60",
        "--quiet", "--json", str(out),
    ])
    plain_ttft = json.loads(out.read_text())["policies"]["calibrated"]["ttft_p50_s"]
    engine = json.loads(out.read_text())["engine"]
    assert engine["capacity_blocks"] == 300 and engine["max_batch"] == 32
    assert engine["step_fixed_s"] == pytest.approx(prof.step.fixed_s)
    # a flag overrides the profile's figure
    main([
        "simulate", "--engine-profile", str(path), "--capacity-blocks", "500", "--policy",
        "calibrated", "--limit", "60", "--quiet", "--json", str(out),
    ])
    assert json.loads(out.read_text())["engine"]["capacity_blocks"] == 500
    assert json.loads(out.read_text())["engine"]["front_end"] is None
    # a profile's front end reaches the simulated engine (and its first tokens come later)
    from kvbudget.sim.engine_model import FrontEndModel

    fe = FrontEndModel(per_request_s=0.05, per_output_s=0.001)
    with_fe = EngineProfile.from_dict({**prof.to_dict(), "front_end": fe.to_dict()})
    with_fe.save(path)
    fronted = tmp_path / "f.json"
    main([
        "simulate", "--engine-profile", str(path), "--policy", "calibrated", "--limit", "60",
        "--quiet", "--json", str(fronted),
    ])
    assert json.loads(fronted.read_text())["engine"]["front_end"] == fe.to_dict()
    assert json.loads(fronted.read_text())["policies"]["calibrated"]["ttft_p50_s"] > (
        plain_ttft + fe.per_request_s
    )


# The GPU profile, vllm-l4-qwen2.5-0.5b, against the measurement it was fitted from: vLLM 0.23.0
# (V1) on one NVIDIA L4, Qwen/Qwen2.5-0.5B-Instruct BF16, `vllm bench serve` in a closed loop at
# fixed max-concurrency, 256 prompt and 128 output tokens (--ignore-eos), published at
# https://ai.wmx.dev/benchmarks. Per concurrency, as published: (C, req/s, output tok/s,
# TTFT p50 ms, ITL p50 ms, E2E p50 ms).
L4_PROFILE = "vllm-l4-qwen2.5-0.5b"
L4_SWEEP = [
    (1, 1.3, 168, 27.0, 5.1, 679),
    (2, 2.9, 367, 37.8, 5.2, 698),
    (4, 5.4, 698, 50.1, 5.3, 722),
    (8, 10.2, 1312, 60.9, 5.5, 772),
    (16, 17.8, 2277, 103.8, 6.0, 880),
    (32, 29.5, 3773, 135.3, 7.1, 1082),
]
L4_PROMPT, L4_OUTPUT = 256, 128
#: context a sequence holds at the median decode step of a closed loop: prompt + output / 2
L4_CONTEXT = L4_PROMPT + L4_OUTPUT // 2
#: K and V bytes per token (2 x 24 layers x 2 KV heads x 64 dims x 2 bytes) and the L4's bandwidth
L4_KV_BYTES, L4_BANDWIDTH = 2 * 24 * 2 * 64 * 2, 300e9


def _l4_decode_phase(c: int, rps: float, e2e_ms: float, ttft_ms: float) -> tuple[float, float]:
    """(seconds from first to last token, prompt tokens prefilled meanwhile) at concurrency c,
    read off the published p50s."""
    seconds = (e2e_ms - ttft_ms) / 1e3
    return seconds, rps * seconds * L4_PROMPT


def test_the_l4_profile_reproduces_the_published_decode_step() -> None:
    # ITL p50 is a decode step without a prefill in it: within 5 % at every concurrency
    step = EngineProfile.load(L4_PROFILE).step
    for c, _, _, _, itl_ms, _ in L4_SWEEP:
        assert step.decode_time(c, c * L4_CONTEXT) == pytest.approx(itl_ms / 1e3, rel=0.05), c


def test_the_l4_profile_reproduces_the_published_tpot_with_prefill_interference() -> None:
    # the mean gap between tokens, (E2E - TTFT) / 127, is the decode step stretched by the
    # prefills of the requests that arrive meanwhile (each shares a step): within 5 %
    step = EngineProfile.load(L4_PROFILE).step
    for c, rps, _, ttft_ms, _, e2e_ms in L4_SWEEP:
        seconds, _ = _l4_decode_phase(c, rps, e2e_ms, ttft_ms)
        interference = rps * L4_PROMPT * step.prefill_per_token_s  # prefill s per second
        predicted = (L4_OUTPUT - 1) * step.decode_time(c, c * L4_CONTEXT) / (1.0 - interference)
        assert predicted / (L4_OUTPUT - 1) == pytest.approx(
            seconds / (L4_OUTPUT - 1), rel=0.05
        ), c


def test_the_l4_profile_fits_the_published_throughput_in_the_engines_time() -> None:
    # at each concurrency the engine's work per second (output tokens / C decode steps, plus the
    # prefills) fits in one second; the prefill cost TTFT at C=1 alone would give does not
    step = EngineProfile.load(L4_PROFILE).step

    def busy(prefill_per_token_s: float, c: int, rps: float, tokens_per_s: float) -> float:
        steps = tokens_per_s / c
        return steps * step.decode_time(c, c * L4_CONTEXT) + rps * L4_PROMPT * prefill_per_token_s

    ttft_c1 = L4_SWEEP[0][3] / 1e3
    from_ttft = (ttft_c1 - step.fixed_s) / L4_PROMPT
    for c, rps, tokens_per_s, *_ in L4_SWEEP:
        assert busy(step.prefill_per_token_s, c, rps, tokens_per_s) <= 1.0, c
        if c >= 2:
            assert busy(from_ttft, c, rps, tokens_per_s) > 1.0, c


def test_the_l4_profiles_first_token_at_concurrency_1() -> None:
    # one prefill step of the 256-token prompt: 6.5 ms of the published 27.0 ms TTFT p50; the
    # other 20.5 ms are per-request work outside the engine's steps (HTTP, tokenizing,
    # detokenizing, streaming, the client), which a step-time model has no term for
    step = EngineProfile.load(L4_PROFILE).engine_model().step
    engine_s = step.fixed_s + step.prefill_time(L4_PROMPT)
    ttft_c1 = L4_SWEEP[0][3] / 1e3
    assert engine_s == pytest.approx(0.0065, abs=0.0005)
    assert ttft_c1 - engine_s == pytest.approx(0.0205, abs=0.0005)


def test_the_l4_profile_is_what_the_documented_fit_gives() -> None:
    prof = EngineProfile.load(L4_PROFILE)
    per_ctx = L4_KV_BYTES / L4_BANDWIDTH
    # decode: least squares of ITL p50 less the KV-traffic term on fixed + per_seq * C
    xs = [float(c) for c, *_ in L4_SWEEP]
    ys = [itl / 1e3 - per_ctx * c * L4_CONTEXT for c, _, _, _, itl, _ in L4_SWEEP]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    per_seq = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    fixed = my - per_seq * mx
    # prefill: through the origin, decode-phase time left by 127 decode steps per prompt token
    num = den = 0.0
    for c, rps, _, ttft_ms, _, e2e_ms in L4_SWEEP:
        seconds, tokens = _l4_decode_phase(c, rps, e2e_ms, ttft_ms)
        rest = seconds - (L4_OUTPUT - 1) * (fixed + per_seq * c + per_ctx * c * L4_CONTEXT)
        num += tokens * rest
        den += tokens * tokens
    assert prof.step.per_context_token_s == pytest.approx(per_ctx, rel=1e-3)
    assert prof.step.fixed_s == pytest.approx(fixed, rel=1e-3)
    assert prof.step.per_seq_s == pytest.approx(per_seq, rel=1e-3)
    assert prof.step.prefill_per_token_s == pytest.approx(num / den, rel=1e-2)
    # KV blocks: 0.6 of the card's 22.5 GiB less 0.92 GiB of weights (494,032,768 BF16
    # parameters) and 0.5 GiB of activations, in 16-token blocks
    kv_bytes = 0.6 * 22.5 * 2**30 - 494_032_768 * 2 - 0.5 * 2**30
    assert prof.capacity_blocks == int(kv_bytes // (16 * L4_KV_BYTES))
    assert prof.block_size == 16 and prof.max_batch == 256 and prof.prefill_chunk_tokens == 2048
    # the source's KV-cache peak, 1.1 %: 32 requests of at most 384 tokens hold at most 768
    # blocks, 1.2 % of the profile's
    assert 32 * ((L4_PROMPT + L4_OUTPUT) // 16) / prof.capacity_blocks < 0.012


def test_simulate_runs_the_l4_profile_by_name(tmp_path: pathlib.Path) -> None:
    from kvbudget.cli import main

    prof = EngineProfile.load(L4_PROFILE)
    out = tmp_path / "r.json"
    main([
        "simulate", "--engine-profile", L4_PROFILE, "--policy", "calibrated", "--limit", "60",
        "--quiet", "--json", str(out),
    ])
    report = json.loads(out.read_text())
    engine = report["engine"]
    assert engine["capacity_blocks"] == prof.capacity_blocks and engine["block_size"] == 16
    assert engine["max_batch"] == 256 and engine["prefill_chunk_tokens"] == 2048
    assert engine["step_fixed_s"] == pytest.approx(prof.step.fixed_s)
    assert engine["prefill_per_token_s"] == pytest.approx(prof.step.prefill_per_token_s)
    run = report["policies"]["calibrated"]
    assert run["completed"] + run["abandoned"] + run["rejected"] == run["requests"] == 60
    # a small model's engine: its decode steps are a few milliseconds
    assert prof.step.fixed_s < run["itl_p50_s"] < 0.02


def test_the_front_end_fit_recovers_known_costs_and_sets_idle_aside() -> None:
    from kvbudget.sim.profile import fit_front_end

    per_request, per_output, idle = 0.0015, 0.00004, 0.02
    stretches = [
        (n, tokens, seconds, per_request * n + per_output * tokens + idle * seconds)
        for n, tokens, seconds in ((120, 30_000, 17.0), (160, 22_000, 11.0), (30, 9_000, 3.0),
                                   (160, 40_000, 25.0), (80, 6_000, 16.0))
    ]
    fe, idle_fit = fit_front_end(stretches)
    assert fe.per_request_s == pytest.approx(per_request, rel=1e-6)
    assert fe.per_output_s == pytest.approx(per_output, rel=1e-6)
    assert idle_fit == pytest.approx(idle, rel=1e-6)
    # a cost that comes out negative is held at 0 and the others refitted
    flat = [(n, t, s, 0.00005 * t) for n, t, s, _ in stretches]
    fe, idle_fit = fit_front_end(flat)
    assert fe.per_request_s >= 0.0 and idle_fit >= 0.0
    assert fe.per_output_s == pytest.approx(0.00005, rel=1e-6)
    with pytest.raises(InvalidInput):
        fit_front_end(stretches[:1])
    with pytest.raises(InvalidInput):
        fit_front_end([*stretches, (10, 100, float("nan"), 1.0)])
    with pytest.raises(InvalidInput):
        fit_front_end([*stretches, (10, -1, 1.0, 1.0)])
    with pytest.raises(InvalidInput):
        fit_front_end([*stretches, (10, 100, 1.0)])
    with pytest.raises(InvalidInput):
        fit_front_end([*stretches, (10, True, 1.0, 1.0)])


def test_a_profiles_intake_reaches_the_engine_and_old_files_still_load(
    tmp_path: pathlib.Path,
) -> None:
    prof = EngineProfile.load("vllm-cpu-tiny")
    assert 0.0 < prof.intake_s < 0.01 and prof.engine_model().intake_s == prof.intake_s
    old = {k: v for k, v in prof.to_dict().items() if k != "intake_s"}
    without = EngineProfile.from_dict(old)
    assert without.intake_s == 0.0 and "intake_s" not in without.to_dict()
    path = tmp_path / "p.json"
    prof.save(path)
    assert EngineProfile.load(path) == prof
    for bad in (-1.0, float("nan"), float("inf"), "fast"):
        with pytest.raises(InvalidInput):
            EngineProfile.from_dict({**old, "intake_s": bad})


def test_a_profile_with_a_front_end_round_trips_and_old_files_still_load(
    tmp_path: pathlib.Path,
) -> None:
    from kvbudget.sim.engine_model import FrontEndModel

    prof = EngineProfile.load("vllm-cpu-tiny")
    assert prof.front_end is None and "front_end" not in prof.to_dict()
    fe = FrontEndModel(per_request_s=0.001, per_output_s=2e-5)
    with_fe = EngineProfile.from_dict({**prof.to_dict(), "front_end": fe.to_dict()})
    assert with_fe.front_end == fe and with_fe.engine_model().front_end == fe
    path = tmp_path / "p.json"
    with_fe.save(path)
    assert EngineProfile.load(path) == with_fe
    for bad in ({"per_request_s": -1.0}, {"per_output": 1.0}, "fast"):
        with pytest.raises(InvalidInput):
            EngineProfile.from_dict({**prof.to_dict(), "front_end": bad})
