"""The pure helpers of benchmarks/serve_bench.py (no server, no vLLM import)."""

from __future__ import annotations

import json
import pathlib

import pytest

from _bench_loader import load_benchmark

sb = load_benchmark("serve_bench")


def _rec(**kw: object) -> sb.Record:
    base: dict[str, object] = {
        "request_id": "r-0", "prompt": "hi", "prompt_len": 2, "output_len": 3, "status": 200,
        "done": True, "output_tokens": 3, "ttft": 0.1, "latency": 0.3, "text_ok": True,
    }
    base.update(kw)
    return sb.Record(**base)  # type: ignore[arg-type]


def test_parse_prometheus_sums_label_sets_and_skips_comments() -> None:
    text = (
        "# HELP vllm:num_preemptions_total Preemptions\n"
        "# TYPE vllm:num_preemptions_total counter\n"
        'vllm:num_preemptions_total{engine="0",model_name="tiny"} 3.0\n'
        'vllm:num_preemptions_total{engine="1",model_name="a b}"} 2\n'
        "kvbudget_reserved_blocks 7 1700000000\n"
        "bad_line\n"
    )
    m = sb.parse_prometheus(text)
    assert m["vllm:num_preemptions_total"] == 5.0
    assert m["kvbudget_reserved_blocks"] == 7.0
    assert "bad_line" not in m


def test_sse_parser_splits_events_across_reads_and_crlf() -> None:
    p = sb.SSEParser()
    assert p.feed(b'data: {"a": 1}\n\ndata: {"b"') == ['{"a": 1}']
    assert p.feed(b': 2}\r') == []
    assert p.feed(b'\n\r\n: ping\r\n\r\ndata: [DONE]\n\n') == ['{"b": 2}', "[DONE]"]
    assert p.feed("data: é".encode()[:-1]) == []  # a split UTF-8 character waits
    assert p.feed("é".encode()[-1:] + b"\n\n") == ["é"]


def test_apply_message_timing_tokens_usage_and_error_events() -> None:
    rec = sb.Record("r", "p", 1, 2, start=10.0)
    chunk = {"choices": [{"text": "a", "token_ids": [5], "prompt_token_ids": [0, 9]}]}
    last = sb.apply_message(rec, json.dumps(chunk), 10.5, 10.0)
    chunk2 = {"choices": [{"text": "b", "token_ids": [6], "finish_reason": "length"}]}
    last = sb.apply_message(rec, json.dumps(chunk2), 10.7, last)
    sb.apply_message(rec, json.dumps({"choices": [], "usage": {"completion_tokens": 2,
                                                               "prompt_tokens": 2}}), 10.8, last)
    sb.apply_message(rec, "[DONE]", 10.9, last)
    assert rec.ttft == pytest.approx(0.5)
    assert rec.itl == [pytest.approx(0.2)]
    assert (rec.text, rec.token_ids, rec.prompt_token_ids) == ("ab", [5, 6], [0, 9])
    assert (rec.output_tokens, rec.prompt_len, rec.done, rec.finish_reason) == (2, 2, True,
                                                                                "length")
    err = sb.Record("r", "p", 1, 2)
    sb.apply_message(err, json.dumps({"error": {"message": "busy", "code": 503}}), 1.0, 0.0)
    assert err.error_code == 503 and err.error_event is not None


def test_a_bare_finish_chunk_is_not_a_token() -> None:
    rec = sb.Record("r", "p", 1, 2)
    sb.apply_message(rec, json.dumps({"choices": [{"text": "x"}]}), 1.0, 0.0)
    sb.apply_message(rec, json.dumps({"choices": [{"text": "", "finish_reason": "length"}]}),
                     1.1, 1.0)
    assert (rec.chunks, rec.token_chunks, rec.tokens_seen()) == (2, 1, 1)


@pytest.mark.parametrize(
    ("kw", "outcome"),
    [
        ({}, "good"),
        ({"ttft": 2.5, "latency": 2.7}, "late"),
        ({"latency": 0.1 + 2 * 0.2}, "late"),  # tpot 200 ms
        ({"status": 429}, "rejected"),
        ({"status": 503}, "rejected_503"),
        ({"status": 500}, "failed"),
        ({"status": None, "error": "ClientConnectorError"}, "failed"),
        ({"error_event": "{}", "error_code": 500}, "failed"),
        ({"error_event": "{}", "error_code": 503, "ttft": None}, "rejected_503"),
        ({"error_event": "{}", "error_code": 503}, "failed"),  # after tokens: a failure
        ({"error_event": "{}", "error_type": "overloaded", "ttft": None}, "rejected"),
        ({"done": False}, "failed"),
        ({"output_tokens": 2}, "failed"),
        ({"output_tokens": None}, "failed"),
        ({"token_ids": [1, 2]}, "failed"),  # 2 ids but usage says 3
        ({"text_ok": False}, "failed"),
        ({"text_ok": None}, "good"),  # no token ids: not checked, not failed
        ({"left": True, "done": False, "output_tokens": None}, "abandoned"),
    ],
)
def test_classify(kw: dict[str, object], outcome: str) -> None:
    assert sb.classify(_rec(**kw))[0] == outcome


def test_tpot_is_per_token_after_the_first() -> None:
    assert _rec(ttft=1.0, latency=3.0, output_tokens=5).tpot() == pytest.approx(0.5)
    assert _rec(output_tokens=1).tpot() == 0.0


def test_cross_check_matches_by_prompt_and_fails_mismatches() -> None:
    ref = [
        _rec(prompt="a", text="x", token_ids=[1], outcome="good"),
        _rec(prompt="b", text="y", token_ids=[2], outcome="good"),
    ]
    other = [
        _rec(prompt="b", text="y", token_ids=[2], outcome="good"),
        _rec(prompt="a", text="x", token_ids=[9], outcome="late"),  # ids differ
        _rec(prompt="c", text="z", outcome="good"),  # not in the reference
        _rec(prompt="a", text="q", token_ids=None, outcome="good"),  # text differs, no ids
        _rec(prompt="a", outcome="rejected"),  # not compared
        # the same ids, the text without vLLM's echo of the prompt's unfinished tail: its own
        # tokens' text but for U+FFFD, or exactly, is right; any other text is not
        _rec(prompt="a", text="\ufffdx", token_ids=[1], text_check="fffd", outcome="good"),
        _rec(prompt="a", text="w", token_ids=[1], text_check="exact", outcome="good"),
        _rec(prompt="a", text="w", token_ids=[1], text_check="mismatch", outcome="good"),
    ]
    counts = sb.cross_check(ref, other)
    assert counts == {"compared": 6, "mismatches": 3, "unmatched": 1}
    assert [r.outcome for r in other] == [
        "good", "failed", "good", "failed", "rejected", "good", "good", "failed"
    ]


def test_parse_servers() -> None:
    names = [s.name for s in sb.parse_servers(None, "8,32")]
    assert names == ["vllm", "vllm-cap8", "vllm-cap32", "kvbudget", "kvbudget-serve"]
    serve = sb.parse_servers("kvbudget-serve", None)[0]
    assert serve.budgeted and serve.argv(pathlib.Path("/m"), 9002, "calibrated")[2:4] == [
        "kvbudget.cli", "serve"
    ]
    specs = sb.parse_servers("kvbudget,vllm-cap4", None)
    assert [(s.name, s.kind, s.queue_cap) for s in specs] == [
        ("kvbudget", "kvbudget", None), ("vllm-cap4", "vllm", 4)
    ]
    argv = specs[1].argv(pathlib.Path("/m"), 9000, "calibrated")
    assert argv[-2:] == ["--max-num-queued-reqs", "4"] and "--num-gpu-blocks-override" in argv
    assert specs[0].argv(pathlib.Path("/m"), 9001, "greedy")[-2:] == ["--policy", "greedy"]
    with pytest.raises(ValueError):
        sb.parse_servers("sglang", None)


def test_each_kind_of_server_takes_its_own_extra_arguments() -> None:
    vllm, example, serve = sb.parse_servers("vllm,kvbudget,kvbudget-serve", None)
    extra = (["--e"], ["--v"], ["--s"])
    assert vllm.argv(pathlib.Path("/m"), 1, "p", *extra)[-1] == "--v"
    assert example.argv(pathlib.Path("/m"), 1, "p", *extra)[-1] == "--e"
    serve_argv = serve.argv(pathlib.Path("/m"), 1, "p", *extra)
    assert serve_argv[-1] == "--s" and "--e" not in serve_argv and "--v" not in serve_argv
    assert sb.parse_args(["--serve-arg=--disable-log-stats"]).serve_arg == ["--disable-log-stats"]


def test_every_server_runs_the_engine_asked_for() -> None:
    """``--kv-blocks`` / ``--max-num-seqs``: the same held-out engine on every server, recorded
    in the run's settings (sim_vs_real simulates it); a cache that cannot hold one sequence of
    the model's context is refused (a request of the whole context could never run)."""
    def flag(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    vllm, example, serve = sb.parse_servers("vllm,kvbudget,kvbudget-serve", None)
    default = vllm.argv(pathlib.Path("/m"), 1, "p")
    assert flag(default, "--num-gpu-blocks-override") == str(sb.KV_BLOCKS)
    assert flag(default, "--max-num-seqs") == str(sb.MAX_NUM_SEQS)
    opts = sb.parse_args(["--kv-blocks", "97", "--max-num-seqs", "12"])
    engine = {"kv_blocks": opts.kv_blocks, "max_num_seqs": opts.max_num_seqs}
    for spec, blocks in ((vllm, "--num-gpu-blocks-override"), (serve, "--num-gpu-blocks-override"),
                         (example, "--kv-blocks")):
        argv = spec.argv(pathlib.Path("/m"), 1, "p", **engine)
        assert (flag(argv, blocks), flag(argv, "--max-num-seqs")) == ("97", "12"), spec.name
    settings = sb.run_settings(opts, [])
    assert (settings["kv_blocks"], settings["max_num_seqs"]) == (97, 12)
    assert sb.MIN_KV_BLOCKS == 65  # 2,048 tokens in blocks of 32, and vLLM's null block
    sb.parse_args(["--kv-blocks", "65"])
    svr = load_benchmark("sim_vs_real")  # (the same engine check)
    for bad in (["--kv-blocks", "64"], ["--max-num-seqs", "0"]):
        with pytest.raises(SystemExit):
            sb.parse_args(bad)
        with pytest.raises(SystemExit):
            svr.parse_args(["--sim-only", *bad])


def test_rotated_repeats_give_every_server_every_place_in_turn() -> None:
    specs = sb.parse_servers("vllm,kvbudget,kvbudget-serve", None)
    starts = sb.server_starts(specs, 3, rotate=True)
    assert [(s.name, reps) for s, reps in starts] == [
        ("vllm", [0]), ("kvbudget", [0]), ("kvbudget-serve", [0]),
        ("kvbudget", [1]), ("kvbudget-serve", [1]), ("vllm", [1]),
        ("kvbudget-serve", [2]), ("vllm", [2]), ("kvbudget", [2]),
    ]
    # each server serves every repeat exactly once, and is first in exactly one of them
    for spec in specs:
        assert sorted(r for s, reps in starts if s is spec for r in reps) == [0, 1, 2]
    firsts = [starts[i][0].name for i in range(0, 9, 3)]
    assert sorted(firsts) == sorted(s.name for s in specs)
    # not rotated, or nothing to rotate: each server once, for all its repeats, as given
    assert [(s.name, reps) for s, reps in sb.server_starts(specs, 3, rotate=False)] == [
        ("vllm", [0, 1, 2]), ("kvbudget", [0, 1, 2]), ("kvbudget-serve", [0, 1, 2])
    ]
    assert [(s.name, reps) for s, reps in sb.server_starts(specs, 1, rotate=True)] == [
        ("vllm", [0]), ("kvbudget", [0]), ("kvbudget-serve", [0])
    ]
    one = specs[:1]
    assert [(s.name, r) for s, r in sb.server_starts(one, 2, rotate=True)] == [("vllm", [0, 1])]
    assert sb.parse_args([]).rotate and not sb.parse_args(["--no-rotate"]).rotate


def test_without_proxies() -> None:
    env = sb.without_proxies({"HTTP_PROXY": "x", "https_proxy": "y", "All_Proxy": "z", "K": "v"})
    assert env == {"K": "v", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


def test_front_end_cpu_is_also_given_per_output_token() -> None:
    recs = [_rec(output_tokens=200), _rec(output_tokens=100), _rec(output_tokens=None)]
    # 0.45 s over 300 tokens: 1,500 µs each; a record without usage adds nothing
    assert sb.cpu_us_per_token(0.45, recs) == 1500.0
    assert sb.cpu_us_per_token(None, recs) is None  # the server's process was not measured
    assert sb.cpu_us_per_token(0.45, [_rec(output_tokens=None)]) is None  # no tokens at all


def test_summarize_and_abandon_figures() -> None:
    recs = [
        _rec(outcome="good"),
        _rec(outcome="late"),
        _rec(outcome="rejected_503"),
        _rec(outcome="abandoned", leave_after=2, left=True, token_chunks=2, itl=[0.5]),
        _rec(outcome="good", itl=[0.3, 0.01], token_chunks=3),
    ]
    s = sb.summarize(recs, 2.0)
    assert (s["sent"], s["good"], s["late"], s["rejected_503"], s["goodput"]) == (5, 2, 1, 1, 1.0)
    # the longest gap of each complete stream (good or late); none of these froze
    assert (s["frozen_streams"], s["longest_gap_max_s"]) == (0, 0.3)
    frozen = sb.summarize([*recs, _rec(outcome="late", itl=[0.01, 12.5, 0.01])], 2.0)
    assert (frozen["frozen_streams"], frozen["longest_gap_max_s"]) == (1, 12.5)
    assert "frozen" in sb.table_header()
    # good by the objective, and good without a freeze: a long answer's mean TPOT forgives one
    assert s["good_unfrozen"] == 2
    good_frozen = _rec(outcome="good", itl=[0.01, 1.5, 0.01], token_chunks=4)
    assert sb.summarize([*recs, good_frozen], 2.0)["good_unfrozen"] == 2
    assert "good_unfrozen" in sb.table_header()
    # a batch stream may be checkpointed by design: its freezes are counted apart
    batch_frozen = _rec(outcome="good", itl=[0.01, 3.0, 0.01], token_chunks=4,
                        service_class="batch")
    mixed = sb.summarize([*recs, batch_frozen], 2.0)
    assert (mixed["frozen_streams"], mixed["longest_gap_max_s"]) == (0, 0.3)
    assert (mixed["frozen_batch_streams"], mixed["good_unfrozen"]) == (1, 3)
    a = sb.abandon_figures(recs, {"generation_tokens": 20.0, "budget_tokens": 99.0})
    assert (a["stayed"], a["left"], a["useful"], a["stalls"], a["stalled_requests"]) == (
        4, 1, 2, 1, 1
    )
    assert a["wasted_decoded_tokens"] == 20 - 3 and a["delivered_to_leavers"] == 2
    kvb = sb.abandon_figures(recs, {"budget_tokens": 10.0, "budget_wasted_tokens": 4.0})
    assert (kvb["wasted_decoded_tokens"], kvb["server_wasted_tokens"]) == (7, 4)
    lower = sb.abandon_figures(recs, {})
    assert lower["wasted_decoded_tokens"] == 2 and lower["wasted_source"].startswith("lower")


def test_abandon_plan_is_seeded() -> None:
    a = sb.abandon_plan(20, 7, "p-", 1024, range(5))
    b = sb.abandon_plan(20, 7, "p-", 1024, range(5))
    assert [(t, r.prompt, r.output_len, r.leave_after) for t, r, _ in a] == [
        (t, r.prompt, r.output_len, r.leave_after) for t, r, _ in b
    ]
    for _, rec, payload in a:
        assert len(rec.prompt) == 256 and min(rec.prompt) >= 5
        assert 100 <= rec.output_len <= 400 and payload["max_tokens"] == rec.output_len
        assert rec.leave_after is None or 1 <= rec.leave_after < rec.output_len


def test_text_verdict() -> None:
    assert sb.text_verdict("ab", "ab", "xx") == "exact"
    assert sb.text_verdict("ab", "pp ab", "ab") == "exact"  # a plain decode is fine too
    assert sb.text_verdict("a\ufffdb", "a\ufffd\ufffdb", "ab\ufffd") == "fffd"
    assert sb.text_verdict("ab", "a\ufffdb", "xx") == "fffd"
    assert sb.text_verdict("ac", "ab", "ab") == "mismatch"


def test_false_rejections_are_the_turned_away_that_vllm_served_in_time() -> None:
    """A 429/503 counts as a false rejection when vLLM's own server, sent the same request (the
    same index), served it good; one vLLM was late for, or failed, does not count."""
    ref = [
        _rec(request_id=f"sb-vllm-w-r0-aa-{i}", outcome=o)
        for i, o in enumerate(["good", "good", "late", "failed", "good"])
    ]
    mine = [
        _rec(request_id=f"sb-kvbudget-w-r0-bb-{i}", outcome=o)
        for i, o in enumerate(["rejected", "good", "rejected", "rejected_503", "rejected_503"])
    ]
    assert sb.false_rejections(ref, mine) == 2  # indices 0 and 4
    assert sb.false_rejections(ref, []) == 0
    assert sb.request_index("sb-kvbudget-serve-shared-prefix-r0-c4f2aa-27") == "27"


def test_bench_args_append_to_sampled_workloads_and_split_equals() -> None:
    base = sb.WORKLOADS["shared-prefix"]
    held_out = base.with_args(["--random-prefix-len=1024", "--random-input-len", "128"])
    assert held_out.bench_args[: len(base.bench_args)] == base.bench_args
    assert held_out.bench_args[len(base.bench_args):] == (
        "--random-prefix-len", "1024", "--random-input-len", "128"
    )
    assert held_out.name == base.name and held_out.dataset == "random"
    assert base.with_args([]) is base
    assert sb.WORKLOADS["abandon"].with_args(["--random-prefix-len=9"]) is sb.WORKLOADS["abandon"]
    args = sb.parse_args(["--workload", "multi-prefix", "--bench-arg=--request-rate=20"])
    assert args.workloads == ["multi-prefix"] and args.bench_arg == ["--request-rate=20"]
    assert sb.WORKLOADS["multi-prefix"].dataset == "prefix_repetition"


def test_loop_lag_counts_the_time_the_clients_loop_did_not_run() -> None:
    """The client's own stalls: a loop blocked for 0.3 s (as when this 2-core VM is not
    scheduled) is one stall of about 0.3 s; a loop that keeps running has none. The figures
    are per run: taking them starts afresh."""
    import asyncio
    import time

    lag = sb.LoopLag()

    async def run(block: float) -> None:
        lag.ensure_running()
        await asyncio.sleep(0.05)
        time.sleep(block)  # the loop runs nothing meanwhile
        await asyncio.sleep(0.05)

    t0 = time.perf_counter()
    asyncio.run(run(0.3))
    stalls = lag.take()
    got = sb.stall_figures(stalls)
    assert got["client_stalls"] == 1 and len(stalls) == 1
    assert 0.25 <= got["client_max_stall_s"] <= 0.6
    assert got["client_stall_s"] == got["client_max_stall_s"]
    begin, length = stalls[0]
    assert 0.03 <= begin - t0 <= 0.3
    # the summary rounds to 10 ms, so the raw length is within half of that
    assert length == pytest.approx(got["client_max_stall_s"], abs=0.005)
    asyncio.run(run(0.0))
    assert lag.take() == []
    assert sb.stall_figures([]) == {
        "client_stalls": 0, "client_stall_s": 0.0, "client_max_stall_s": 0.0
    }


def test_steal_watch_reports_the_share_of_cpu_time_the_host_took() -> None:
    """The machine's stolen time per run: the steal ticks' share of all ticks in each interval
    (from ``/proc/stat``'s counters), and per run the mean share and the worst second. A run
    on a machine whose host took nothing reports 0; one without the counters, nothing."""
    import time

    ticks = iter([(0, 0), (10, 100), (10, 200), (60, 300)] + [(60, 300 + 100 * k)
                                                               for k in range(1, 400)])
    watch = sb.StealWatch(interval=0.01)
    watch.counters = lambda: next(ticks)  # type: ignore[method-assign]
    t0 = time.perf_counter()
    watch.start()
    deadline = time.monotonic() + 10.0
    while len(watch._samples) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    samples = watch.take()
    assert [v for _, v in samples[:3]] == [0.1, 0.0, 0.5]
    assert all(v == 0.0 for _, v in samples[3:]) and samples[0][0] >= t0
    got = sb.steal_figures([(0.0, 0.1), (0.1, 0.0), (0.2, 0.5), (0.3, 0.0)], 0.25)
    assert got == {"machine_steal_share": 0.15, "machine_steal_max_share": 0.15}
    got = sb.steal_figures([(0.0, 0.0)] * 4 + [(0.0, 0.4)] * 4, 0.25)
    assert got == {"machine_steal_share": 0.2, "machine_steal_max_share": 0.4}
    assert sb.steal_figures([], 0.25) == {
        "machine_steal_share": None, "machine_steal_max_share": None
    }
    nothing = sb.StealWatch(interval=0.01)
    nothing.counters = lambda: None  # type: ignore[method-assign]
    nothing.start()
    assert nothing.take() == []
    real = sb.StealWatch.counters()  # this machine's own, where it has /proc/stat
    assert real is None or 0 <= real[0] <= real[1]


def test_set_autogroup_nice_nices_the_whole_session(tmp_path: pathlib.Path) -> None:
    """The server's session gets the niceness (autogroups share the CPU between sessions first,
    so the process's own niceness does not protect the load generator)."""
    import subprocess

    if not pathlib.Path("/proc/self/autogroup").exists():
        pytest.skip("this kernel has no autogroup scheduling")
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert sb.set_autogroup_nice(proc.pid, 7)
        assert pathlib.Path(f"/proc/{proc.pid}/autogroup").read_text().split()[-1] == "7"
        assert not sb.set_autogroup_nice(proc.pid, 99)  # the kernel refuses: not a niceness
    finally:
        proc.kill()
        proc.wait()
    assert not sb.set_autogroup_nice(proc.pid, 7)  # gone


def test_cpu_seconds_counts_the_front_end_and_its_children_apart(tmp_path: pathlib.Path) -> None:
    """A stand-in server: a process that burns CPU itself and starts a child that burns more
    (as vLLM's API server and its engine core); ``counters`` reports both, from the OS."""
    import subprocess
    import sys
    import time

    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 1.3: pass\\n"
        "time.sleep(30)'])\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.3: pass\n"
        "time.sleep(30)\n"
    )
    srv = sb.ServerProcess(sb.ServerSpec("stand-in", "vllm"), [], 1, tmp_path / "log")
    assert srv.cpu_seconds() == {"frontend_cpu_s": None, "engine_cpu_s": None}
    srv.proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        cpu = srv.cpu_seconds()
        while time.monotonic() < deadline and not (
            (cpu["frontend_cpu_s"] or 0) >= 0.3 and (cpu["engine_cpu_s"] or 0) >= 1.2
        ):
            time.sleep(0.1)
            cpu = srv.cpu_seconds()
        # (the front end's own count has its interpreter's start-up on top of its 0.3 s, which
        # on a busy machine can take a few tenths more: the child's 1.3 s must not be in it;
        # the OS counts in clock ticks, which read the child's 1.3 s a tick or two short, so
        # it is checked against 1.2 s)
        assert 0.3 <= (cpu["frontend_cpu_s"] or 0) < 1.0
        assert (cpu["engine_cpu_s"] or 0) >= 1.2
    finally:
        srv.stop()
    assert srv.cpu_seconds()["frontend_cpu_s"] is None


def test_requests_sent_is_what_vllms_client_sent() -> None:
    """vLLM's prefix_repetition dataset makes n // num_prefixes prompts per prefix (159 of 160
    for 3 prefixes): the strict request function must have seen what the client sent, not n."""
    assert sb.requests_sent({"completed": 150, "failed": 9}, 160) == 159
    assert sb.requests_sent({"completed": 160, "failed": 0}, 160) == 160
    assert sb.requests_sent({}, 160) == 160  # a result without counts: the number asked
    with pytest.raises(RuntimeError, match="161 requests for 160"):
        sb.requests_sent({"completed": 161, "failed": 0}, 160)


def test_mixed_plan_sends_a_batch_backlog_first_then_interactive_callers() -> None:
    plan = sb.mixed_plan(120, 3, "m-", 1024, range(5))
    again = sb.mixed_plan(120, 3, "m-", 1024, range(5))
    assert [(t, r.prompt, r.output_len, r.service_class) for t, r, _ in plan] == [
        (t, r.prompt, r.output_len, r.service_class) for t, r, _ in again
    ]
    batch = [(t, r) for t, r, _ in plan if r.service_class == "batch"]
    inter = [(t, r) for t, r, _ in plan if r.service_class == "interactive"]
    assert len(batch) == 40 and len(inter) == 80
    assert [t for t, _ in batch] == pytest.approx([0.05 * i for i in range(40)])
    assert all(r.output_len == 500 for _, r in batch)
    assert all(100 <= r.output_len <= 200 for _, r in inter)
    assert [t for t, _, _ in plan] == sorted(t for t, _, _ in plan)
    assert [r.request_id for _, r, _ in plan] == [f"m-{i}" for i in range(120)]
    for _, rec, payload in plan:
        assert len(rec.prompt) == 256 and min(rec.prompt) >= 5
        assert payload["max_tokens"] == rec.output_len and payload["prompt"] == rec.prompt


def test_a_batch_request_is_good_within_its_deadline_whatever_its_first_token() -> None:
    slow_start = {"ttft": 30.0, "latency": 60.0, "start": 0.0, "end": 60.0}
    assert sb.classify(_rec(**slow_start))[0] == "late"  # interactive: TTFT over 2 s
    assert sb.classify(_rec(service_class="batch", **slow_start))[0] == "good"
    over = {**slow_start, "end": sb.BATCH_DEADLINE_S + 1.0}
    assert sb.classify(_rec(service_class="batch", **over))[0] == "late"
    recs = [
        _rec(outcome="good", service_class="batch", start=0.0, end=50.0),
        _rec(outcome="late", service_class="batch", start=0.0, end=700.0),
        _rec(outcome="good", ttft=0.5),
        _rec(outcome="rejected", ttft=None),
    ]
    s = sb.summarize(recs, 10.0)
    assert (s["sent_batch"], s["good_batch"], s["good_interactive"]) == (2, 1, 1)
    assert s["rejected_interactive"] == 1 and s["batch_latency_max_s"] == 700.0
    assert s["interactive_ttft_p50_s"] == 0.5
    assert "sent_batch" not in sb.summarize(recs[2:], 10.0)


def test_mixed_variants_come_from_their_own_bench_args_and_others_ignore_them() -> None:
    extra = ["--mixed-batch-share=0.5", "--mixed-rate", "4", "--random-prefix-len=1024"]
    mixed = sb.WORKLOADS["mixed"].with_args(extra)
    assert mixed.bench_args == ("--mixed-batch-share", "0.5", "--mixed-rate", "4")
    shared = sb.WORKLOADS["shared-prefix"].with_args(extra)
    assert shared.bench_args[-2:] == ("--random-prefix-len", "1024")
    assert not any(a.startswith("--mixed-") for a in shared.bench_args)
    assert sb.WORKLOADS["abandon"].with_args(extra).bench_args == ()
    shape = sb.mixed_shape(mixed.bench_args)
    assert (shape.batch_share, shape.rate, shape.batch_output) == (0.5, 4.0, 500)
    plan = sb.mixed_plan(40, 1, "v-", 1024, range(5), mixed.bench_args)
    assert sum(r.service_class == "batch" for _, r, _ in plan) == 20
    assert sb.mixed_shape(()) == sb.MixedShape()
    more = sb.mixed_shape(["--mixed-batch-spacing", "0", "--mixed-output-min", "5",
                           "--mixed-output-max", "5", "--mixed-prompt-len", "64"])
    assert (more.batch_spacing_s, more.output_min, more.output_max, more.prompt_len) == (
        0.0, 5, 5, 64
    )
    for bad, what in [
        (["--mixed-colour", "1"], "unknown"),
        (["--mixed-rate"], "needs a value"),
        (["--mixed-batch-output", "1.5"], "not a int"),
        (["--mixed-batch-share", "2"], "share"),
        (["--mixed-rate", "0"], "rate"),
        (["--mixed-rate", "nan"], "rate"),
        (["--mixed-output-min", "300"], "output"),
        (["--mixed-prompt-len", "2000"], "fit"),
    ]:
        with pytest.raises(ValueError, match=what):
            sb.mixed_shape(bad)
    with pytest.raises(ValueError, match="no arguments"):
        sb.abandon_plan(4, 0, "a-", 1024, range(5), ["--mixed-rate", "4"])


def test_a_run_on_a_slower_machine_than_its_reference_is_noted() -> None:
    """The machine probe (a fixed pure-Python loop, timed in the client before each run): a
    run whose probe is more than MACHINE_DRIFT times its vLLM reference's is noted in the
    table, where it compares two machines rather than two servers (sb30a: the machine slowed
    about 3x between vLLM's turn and the kvbudget servers')."""
    probe = sb.machine_probe_ms()
    assert probe > 0.0
    assert sb.machine_ratio(30.0, 10.0) == 3.0 and sb.machine_ratio(None, 10.0) is None
    assert sb.machine_ratio(10.0, None) is None
    recs = [_rec(outcome="good", request_id=f"sb-x-r0-{k}") for k in range(3)]
    runs = []
    for server, probe_ms in (("vllm", 10.0), ("kvbudget", 31.0), ("kvbudget-serve", 11.0)):
        run = sb.Run("moderate", server, 0, records=list(recs), duration=1.0)
        run.probe_ms = probe_ms
        runs.append(run)
    sb.finish_runs(runs)
    vllm, slow, same = runs
    assert vllm.summary["machine_probe_ms"] == 10.0
    assert "machine_vs_reference" not in vllm.summary
    assert slow.summary["machine_vs_reference"] == 3.1
    assert "machine=x3.10_vs_vllm" in sb.table_line(slow)
    assert same.summary["machine_vs_reference"] == 1.1
    assert "machine=" not in sb.table_line(same)


def test_turned_away_callers_by_cause_are_the_run_s_snapshot_delta() -> None:
    """A budgeted server's summary carries the callers it turned away after they queued, by
    cause: the delta of its snapshot's ``turned_away_held_by`` over the run (causes seen only),
    and ``turned_away_behind``, how many of them never were their queue's head; vLLM's server
    (no snapshot) has neither."""
    from kvbudget.core.stats import HELD_BY

    def counters(held: dict[str, int] | None) -> dict[str, float | None]:
        return {
            sb.HELD_PREFIX + c: None if held is None else float(held.get(c, 0)) for c in HELD_BY
        }

    before, after = counters({"no-room": 2}), counters({"no-room": 5, "behind": 1})
    delta = {k: sb._delta(after[k], before[k]) for k in after}
    assert sb.turned_away_held_by(delta) == {"behind": 1, "no-room": 3}
    assert sb.turned_away_held_by({k: sb._delta(v, v) for k, v in after.items()}) == {}
    assert sb.turned_away_held_by(counters(None)) is None
    assert sb.turned_away_held_by({"engine_preemptions": 3.0}) is None
    # a run's summary: the causes, and how many of those never were their queue's head
    recs = [_rec(outcome="good", request_id=f"sb-x-r0-{k}") for k in range(2)]
    budgeted = sb.Run("moderate", "kvbudget", 0, records=list(recs), duration=1.0)
    budgeted.counters = {**delta, "turned_away_behind": 1.0}
    bare = sb.Run("moderate", "vllm", 0, records=list(recs), duration=1.0)
    bare.counters = {**counters(None), "turned_away_behind": None}
    sb.finish_runs([bare, budgeted])
    assert budgeted.summary["turned_away_held_by"] == {"behind": 1, "no-room": 3}
    assert budgeted.summary["turned_away_behind"] == 1
    assert "turned_away_held_by" not in bare.summary
    assert "turned_away_behind" not in bare.summary


def test_the_server_s_own_late_first_tokens_are_in_a_budgeted_server_s_summary() -> None:
    """A budgeted server's summary carries its own count of first tokens under an objective and
    of those it served late (its snapshot's ``totals`` delta over the run), noted in the table
    where any was late; vLLM's server (no snapshot) has neither."""
    recs = [_rec(outcome="good", request_id=f"sb-x-r0-{k}") for k in range(2)]
    budgeted = sb.Run("overload", "kvbudget", 0, records=list(recs), duration=1.0)
    before = {"server_first_tokens": 40.0, "server_first_tokens_late": 1.0}
    after = {"server_first_tokens": 74.0, "server_first_tokens_late": 12.0}
    budgeted.counters = {k: sb._delta(after[k], before[k]) for k in after}
    on_time = sb.Run("moderate", "kvbudget", 0, records=list(recs), duration=1.0)
    on_time.counters = {"server_first_tokens": 5.0, "server_first_tokens_late": 0.0}
    bare = sb.Run("overload", "vllm", 0, records=list(recs), duration=1.0)
    bare.counters = {"server_first_tokens": None, "server_first_tokens_late": None}
    sb.finish_runs([bare, budgeted, on_time])
    assert budgeted.summary["server_first_tokens"] == 34
    assert budgeted.summary["server_first_tokens_late"] == 11
    assert "srv_late_first=11/34" in sb.table_line(budgeted)
    assert on_time.summary["server_first_tokens_late"] == 0
    assert "srv_late_first" not in sb.table_line(on_time)
    assert "server_first_tokens" not in bare.summary
