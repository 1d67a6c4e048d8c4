"""The simulator's prefix cache (issue 12, part 3): the cache itself, hashes from Mooncake
``hash_ids`` and from a scenario's system prompts, the driver's use of them, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from kvbudget import block_hashes
from kvbudget.cli import main
from kvbudget.core.cost import StepTimeModel
from kvbudget.core.model import Capacity
from kvbudget.errors import InvalidInput
from kvbudget.sim.driver import simulate
from kvbudget.sim.engine_model import EngineModel
from kvbudget.sim.prefix import PrefixCache, system_prompt_blocks, trace_prefix_blocks
from kvbudget.sim.scenario import Scenario, apply_scenario, scenario_from_dict
from kvbudget.sim.workload import TraceRequest, Workload, read_trace, synthetic_workload

#: one interactive class, nobody leaves: the runs below are hand-checkable
PLAIN = Scenario(interactive_share=1.0, abandon_share=0.0, ttft_slo_s=10.0, itl_floor_s=1.0)
#: prefill 0.1 ms per token, 10 ms per step
STEP = StepTimeModel(fixed_s=0.01, per_seq_s=0.0, per_context_token_s=0.0,
                     prefill_per_token_s=1e-4)


def _engine(blocks: int, *, on: bool = True, block_size: int = 16) -> EngineModel:
    return EngineModel(capacity=Capacity(blocks, block_size), step=STEP, prefix_caching=on)


def _workload(*rows: tuple[float, int, int, list[int]]) -> Workload:
    return Workload(
        name="hand",
        requests=[TraceRequest(arrival_s=t, prompt_tokens=p, output_tokens=o, hash_ids=h)
                  for t, p, o, h in rows],
    )


# -- the cache ------------------------------------------------------------------------------


def test_twins_share_and_freed_blocks_stay_cached_tail_first() -> None:
    cache = PrefixCache()
    assert cache.allocate((1, 2, 3)) == 0  # registered at allocation...
    assert cache.allocate((1, 2, 3)) == 3  # ...so a twin of the same step finds all three
    assert cache.held == {1: 2, 2: 2, 3: 2}
    cache.free((1, 2, 3))
    assert cache.held == {1: 1, 2: 1, 3: 1} and not cache.cached
    cache.free((1, 2, 3))
    assert not cache.held
    assert list(cache.cached) == [3, 2, 1]  # the tail is the least recently used
    assert cache.trim(1) == 2  # room for one: the leading block survives
    assert list(cache.cached) == [1]
    # a newcomer finds the leading block only: its prefill skips one block
    assert cache.allocate((1, 2, 4)) == 1
    assert not cache.cached and cache.held == {1: 1, 2: 1, 4: 1}
    assert cache.evictions == 2


def test_a_hit_stops_at_the_first_missing_block() -> None:
    cache = PrefixCache()
    cache.allocate((1, 2, 3))
    cache.free((1, 2, 3))
    cache.cached.pop(2)  # evicted from the middle
    assert cache.allocate((1, 2, 3)) == 1
    # the stale copy of 3 is taken over: one block, held once
    assert cache.held == {1: 1, 2: 1, 3: 1} and not cache.cached
    assert cache.trim(-5) == 0


# -- hashes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [32, 16])
def test_hash_ids_expand_to_the_engines_blocks(block_size: int) -> None:
    per_id = 512 // block_size  # blocks per 512-token hash id
    a = trace_prefix_blocks([7, 8, 9], 1500, block_size)
    # the prompt's full blocks among its first 1499 tokens, as block_hashes counts them
    assert len(a) == 1499 // block_size == len(block_hashes(list(range(1500)), block_size))
    assert len(set(a)) == len(a)
    same_two = trace_prefix_blocks([7, 8, 5], 1500, block_size)
    assert a[: 2 * per_id] == same_two[: 2 * per_id]
    assert not set(a[2 * per_id :]) & set(same_two)
    same_one = trace_prefix_blocks([7, 6, 9], 1500, block_size)
    assert a[:per_id] == same_one[:per_id]
    assert not set(a[per_id:]) & set(same_one)  # chained: differs from the first id on
    assert not set(a) & set(trace_prefix_blocks([3, 8, 9], 1500, block_size))
    # a shorter prompt with the same ids: a prefix of the same hashes
    assert trace_prefix_blocks([7, 8], 700, block_size) == a[: 699 // block_size]
    # ids cover 512 tokens each: nothing past what they cover is shared
    assert trace_prefix_blocks([7], 1500, block_size) == a[:per_id]
    assert trace_prefix_blocks([], 1500, block_size) == ()
    # the last prompt token is never cached: 1024 tokens are 1023 cacheable ones
    assert len(trace_prefix_blocks([7, 8], 1024, block_size)) == 2 * per_id - 1


def test_hash_ids_at_a_block_size_that_does_not_divide_512() -> None:
    a = trace_prefix_blocks([1, 2], 1000, 48)
    b = trace_prefix_blocks([1, 3], 1000, 48)
    # block 10 covers tokens 480..527: it touches the second id, so it differs already
    assert len(a) == 999 // 48 and a[:10] == b[:10] and a[10] != b[10]


def test_system_prompt_blocks() -> None:
    a = system_prompt_blocks(0, 100, 500, 16)
    assert len(a) == 6  # 96 of the 100 shared tokens fill whole blocks
    assert a == system_prompt_blocks(0, 100, 120, 16)
    assert not set(a) & set(system_prompt_blocks(1, 100, 500, 16))
    assert system_prompt_blocks(0, 100, 50, 16) == a[:3]  # (49 cacheable tokens)


# -- the scenario option --------------------------------------------------------------------


def test_the_scenario_prepends_system_prompts_to_a_share_of_requests() -> None:
    wl = synthetic_workload(seed=3, n_requests=400)
    base = apply_scenario(wl, Scenario())
    sc = Scenario(system_prompts=3, system_prompt_tokens=200, system_prompt_share=0.5)
    reqs = apply_scenario(wl, sc)
    carriers = [r for r in reqs if r.system_prompt is not None]
    assert 150 < len(carriers) < 250
    assert {r.system_prompt for r in carriers} == {0, 1, 2}
    for b, r in zip(base, reqs, strict=True):
        # the system prompt's own stream: nothing else of a request changes
        assert (b.spec.tenant, b.spec.service_class, b.abandon_after_s) == (
            r.spec.tenant, r.spec.service_class, r.abandon_after_s)
        if r.system_prompt is None:
            assert r.prompt_tokens == b.prompt_tokens and r.system_prompt_tokens == 0
        else:
            assert r.system_prompt_tokens == 200
            assert r.unclamped_prompt_tokens == b.unclamped_prompt_tokens + 200
    assert scenario_from_dict(sc.to_dict()) == sc
    # requests that carry prefix data of their own get no system prompt
    traced = apply_scenario(_workload((0.0, 100, 5, [1]), (0.0, 100, 5, [])), sc.__class__(
        system_prompts=1, system_prompt_tokens=50))
    assert [r.system_prompt for r in traced] == [None, 0]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"system_prompts": -1}, "system_prompts"),
        ({"system_prompts": 2}, "system_prompt_tokens"),  # a length is needed
        ({"system_prompts": 2, "system_prompt_tokens": 8191}, "system_prompt_tokens"),
        ({"system_prompt_share": 1.5}, "system_prompt_share"),
        ({"system_prompt_tokens": True}, "system_prompt_tokens"),
    ],
)
def test_system_prompt_options_are_validated(changes: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidInput) as info:
        Scenario(**changes)  # type: ignore[arg-type]
    assert info.value.field == field


# -- the driver -----------------------------------------------------------------------------


def test_twins_in_one_step_share_and_skip_the_cached_prefill() -> None:
    # two 80-token prompts with the same 512-token id: 4 full cacheable blocks of 16 shared
    reqs = apply_scenario(_workload((0.0, 80, 3, [5]), (0.0, 80, 3, [5])), PLAIN)
    on = simulate(reqs, PLAIN, _engine(100), "oracle", check_invariants=True)
    off = simulate(reqs, PLAIN, _engine(100, on=False), "oracle", check_invariants=True)
    assert on.completed == off.completed == 2
    assert on.prefix_cached_tokens == 64 and on.prefix_hit_rate == pytest.approx(64 / 160)
    assert off.prefix_cached_tokens == 0 and off.prefix_hit_rate == 0.0
    # both prefill in one step: 80 + 16 tokens instead of 80 + 80
    assert on.ttft_p50_s == pytest.approx(0.01 + 96e-4)
    assert off.ttft_p50_s == pytest.approx(0.01 + 160e-4)


def test_an_unreferenced_prefix_is_evicted_lru_under_pressure() -> None:
    a = (0.0, 80, 1, [5])  # 4 hashed blocks, cached unreferenced once it is done
    c = (2.0, 80, 1, [5])  # the same prefix, later
    big = (1.0, 290, 5, [])  # 19 blocks of a 20-block engine: room for one cached block
    quiet = simulate(apply_scenario(_workload(a, c), PLAIN), PLAIN, _engine(20), "oracle",
                     check_invariants=True)
    assert quiet.prefix_cached_tokens == 64  # the whole prefix was still cached
    pressed = simulate(apply_scenario(_workload(a, big, c), PLAIN), PLAIN, _engine(20),
                       "oracle", check_invariants=True)
    assert pressed.completed == 3
    # the tail blocks were evicted first: only the leading block survived
    assert pressed.prefix_cached_tokens == 16


def _shared_prefix_workload(n: int = 48) -> Workload:
    # the case: n requests sharing a 640-token prefix plus a few tokens each
    return _workload(*((0.001 * i, 640 + 8, 40, [1, 2]) for i in range(n)))


@pytest.mark.parametrize("policy", ["calibrated", "reserve-max", "reserve-current"])
def test_a_shared_prefix_admits_more_at_once_with_the_cache(policy: str) -> None:
    sc = attrs.evolve(PLAIN, interactive_max_tokens=64)  # reserve-max: 23 blocks a request
    reqs = apply_scenario(_shared_prefix_workload(), sc)
    on = simulate(reqs, sc, _engine(128, block_size=32), policy, check_invariants=True)
    off = simulate(reqs, sc, _engine(128, on=False, block_size=32), policy,
                   check_invariants=True)
    assert on.completed == off.completed == 48
    assert on.peak_resident >= 2 * off.peak_resident, (on.peak_resident, off.peak_resident)
    assert on.makespan_s < off.makespan_s
    assert on.prefix_hit_rate > 0.9


def test_a_system_prompt_scenario_runs_every_policy_with_the_invariants() -> None:
    wl = synthetic_workload(seed=2, n_requests=150, rate_rps=8.0)
    sc = Scenario(system_prompts=2, system_prompt_tokens=512, system_prompt_share=0.8)
    reqs = apply_scenario(wl, sc)
    for policy in ("calibrated", "segmented", "new-token-ratio", "past-future"):
        r = simulate(reqs, sc, EngineModel(capacity=Capacity(1500, 16)), policy,
                     check_invariants=True)
        assert r.prefix_hit_rate > 0.1, policy
        assert r.hard_max_violations == r.silent_truncations == 0


# -- the CLI --------------------------------------------------------------------------------


def test_cli_system_prompts_and_no_prefix_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["simulate", "--limit", "80", "--capacity-blocks", "1500", "--quiet",
            "--policy", "calibrated", "--system-prompts", "2", "--system-prompt-tokens", "400",
            "--system-prompt-share", "0.9"]
    on, off = tmp_path / "on.json", tmp_path / "off.json"
    assert main([*args, "--json", str(on)]) == 0
    assert "prefix hit %" in capsys.readouterr().out
    assert main([*args, "--no-prefix-cache", "--json", str(off)]) == 0
    d_on, d_off = json.loads(on.read_text()), json.loads(off.read_text())
    assert d_on["engine"]["prefix_caching"] is True
    assert d_off["engine"]["prefix_caching"] is False
    assert d_on["scenario"]["system_prompts"] == 2
    assert d_on["scenario"]["system_prompt_tokens"] == 400
    assert d_on["workload"]["overlay"]["system_prompt"] > 50
    assert d_on["policies"]["calibrated"]["prefix_hit_rate"] > 0.1
    assert d_on["policies"]["calibrated"]["prefix_cached_tokens"] > 0
    assert d_off["policies"]["calibrated"]["prefix_hit_rate"] == 0.0


def test_cli_refuses_bad_system_prompt_options(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["simulate", "--limit", "10", "--quiet", "--policy", "calibrated"]
    assert main([*base, "--system-prompts", "2"]) == 2  # no length given
    assert "system_prompt_tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--system-prompt-share", "2"])
    with pytest.raises(SystemExit):
        main([*base, "--system-prompts", "-1"])


def test_cli_reads_prefixes_from_a_mooncake_trace(tmp_path: Path) -> None:
    trace = tmp_path / "tiny_mooncake.jsonl"
    rows = [{"timestamp": 50 * i, "input_length": 1100 + i, "output_length": 20,
             "hash_ids": [0, 1 + i % 3, 100 + i]} for i in range(30)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(read_trace(trace)) == 30
    out = tmp_path / "out.json"
    assert main(["simulate", "--trace", str(trace), "--capacity-blocks", "2000", "--quiet",
                 "--policy", "calibrated", "--policy", "reserve-max", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    for figures in doc["policies"].values():
        # id 0 (32 blocks) is shared by all, ids 1..3 by a third each: most of 1024 tokens
        assert 0.5 < figures["prefix_hit_rate"] < 1.0
        assert figures["completed"] == 30


def test_without_prefix_data_the_cache_changes_nothing() -> None:
    # nothing shared and nobody preempted (reserve-max): the cache finds nothing to skip
    wl = synthetic_workload(seed=4, n_requests=120, rate_rps=10.0)
    reqs = apply_scenario(wl, Scenario())
    on = simulate(reqs, Scenario(), EngineModel(capacity=Capacity(1200, 16)), "reserve-max")
    off = simulate(reqs, Scenario(), EngineModel(capacity=Capacity(1200, 16),
                                                 prefix_caching=False), "reserve-max")
    assert attrs.evolve(on, wall_s=0.0) == attrs.evolve(off, wall_s=0.0)
    assert on.prefix_cached_tokens == 0 and on.resume_cached_tokens == 0
    assert on.preemptions == 0


def test_a_resumed_request_finds_its_own_blocks_cached() -> None:
    # vLLM keeps a preempted request's full blocks (prompt and output) in its prefix cache:
    # admitted again, it recomputes only what was evicted meanwhile. No prompt is shared here.
    wl = synthetic_workload(seed=4, n_requests=120, rate_rps=10.0)
    reqs = apply_scenario(wl, Scenario())
    on = simulate(reqs, Scenario(), EngineModel(capacity=Capacity(1200, 16)),
                  "reserve-current", check_invariants=True)
    off = simulate(reqs, Scenario(), EngineModel(capacity=Capacity(1200, 16),
                                                 prefix_caching=False), "reserve-current")
    assert on.preemptions > 0 and off.preemptions > 0
    assert on.prefix_cached_tokens == 0  # first admissions: nothing shared to find
    assert 0 < on.resume_cached_tokens <= on.recompute_tokens
    assert off.resume_cached_tokens == 0


def test_park_caches_unregistered_blocks_tail_first() -> None:
    cache = PrefixCache()
    cache.allocate((1, 2))
    cache.park((3, 4))  # blocks that filled up while the request ran
    cache.free((1, 2))
    assert list(cache.cached) == [4, 3, 2, 1]  # evicted in this order
    cache.allocate((9,))
    cache.park((9,))  # a block someone holds stays held, not cached
    assert 9 not in cache.cached
    assert cache.allocate((1, 2, 3, 4)) == 4
    cache.trim(0)
    assert not cache.cached
