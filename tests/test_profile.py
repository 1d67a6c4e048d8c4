"""Engine profiles: the step-time fit recovers a known engine, profiles round-trip through JSON,
bad files get typed errors, and ``kvbudget simulate --engine-profile`` runs on one."""

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
    engine = json.loads(out.read_text())["engine"]
    assert engine["capacity_blocks"] == 300 and engine["max_batch"] == 32
    assert engine["step_fixed_s"] == pytest.approx(prof.step.fixed_s)
    # a flag overrides the profile's figure
    main([
        "simulate", "--engine-profile", str(path), "--capacity-blocks", "500", "--policy",
        "calibrated", "--limit", "60", "--quiet", "--json", str(out),
    ])
    assert json.loads(out.read_text())["engine"]["capacity_blocks"] == 500
