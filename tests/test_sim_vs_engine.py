"""benchmarks/sim_vs_engine.py without an engine: the prompts it builds for a plan, its SLO
rule, and its simulated side on a workload (no vLLM import)."""

from __future__ import annotations

from _bench_loader import load_benchmark

sve = load_benchmark("sim_vs_engine")
svr = sve.svr


def test_prompts_share_their_system_prompt_and_have_the_planned_length() -> None:
    plan = svr.plan_workload("multi-prefix", 0, svr.TINY_TOKENIZER)
    prompts = sve.prompt_ids(plan, seed=3)
    assert [len(ids) for ids in prompts] == [p.prompt_tokens for p in plan]
    heads: dict[int, list[int]] = {}
    for p, ids in zip(plan, prompts, strict=True):
        assert p.system_prompt is not None and p.shared_prefix_tokens > 0
        head = ids[: p.shared_prefix_tokens]
        assert heads.setdefault(p.system_prompt, head) == head
        assert all(100 <= t < 1000 for t in ids)
    assert len(heads) > 1 and len({tuple(h) for h in heads.values()}) == len(heads)
    # a workload without shared prefixes: no two prompts start alike
    plain = svr.plan_workload("burst", 0, svr.TINY_TOKENIZER)
    firsts = {tuple(ids[:32]) for ids in sve.prompt_ids(plain, seed=3)}
    assert len(firsts) == len(plain)


def test_summary_applies_serve_benchs_rule() -> None:
    slo_ttft, slo_tpot = sve.sb.SLO_TTFT_S, sve.sb.SLO_TPOT_S
    timings = [
        (0.1, 0.01, 10, 10),  # good
        (slo_ttft + 0.1, 0.01, 10, 10),  # late: first token
        (0.1, slo_tpot + 0.01, 10, 10),  # late: pace
        (0.1, 0.01, 9, 10),  # failed: a token short
        (None, None, 0, 10),  # failed: nothing
    ]
    s = sve.summarize(timings, preemptions=3)
    assert (s["sent"], s["good"], s["late"], s["failed"]) == (5, 1, 2, 2)
    assert s["engine_preemptions"] == 3
    assert s["ttft_p50_s"] is not None


def test_simulated_side_replays_every_request() -> None:
    from kvbudget.sim.profile import EngineProfile

    out = sve.run_sim(["burst"], 0, EngineProfile.load("vllm-cpu-tiny"))
    s = out["burst"]
    assert s["sent"] == 30 and s["good"] + s["late"] + s["failed"] == 30
    assert s["engine_preemptions"] > 0
