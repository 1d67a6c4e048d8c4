"""benchmarks/synthetic_traces.py's Mooncake-format session trace: it reads as a trace, and its
``hash_ids`` carry the prefix structure it claims (shared system prompts, contexts re-sent)."""

from __future__ import annotations

import json
import pathlib

import numpy as np

from _bench_loader import load_benchmark
from kvbudget.sim.prefix import trace_prefix_blocks
from kvbudget.sim.workload import read_mooncake_jsonl

st = load_benchmark("synthetic_traces")


def test_sessions_share_system_prompts_and_resend_their_context(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "sessions.jsonl"
    st._write_sessions(path, np.random.default_rng(11))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    workload = read_mooncake_jsonl(path)
    assert len(workload.requests) == len(rows) > 1000
    for r in rows:
        assert len(r["hash_ids"]) == -(-r["input_length"] // st.HASH_BLOCK)  # one per block
    # the four system prompts open most sessions: their ids recur across many requests
    firsts = {r["hash_ids"][0] for r in rows}
    assert firsts <= {0, 10, 20, 30}
    # a later turn starts with every full block of the turn before it in the same session
    by_tail: dict[int, dict[str, object]] = {}
    continued = 0
    for r in rows:
        ids = r["hash_ids"]
        full = r["input_length"] // st.HASH_BLOCK
        for k in range(full - 1, -1, -1):
            prev = by_tail.get(ids[k])
            if prev is not None and ids[k] >= 1000:
                prev_ids = prev["hash_ids"]
                assert isinstance(prev_ids, list)
                prev_full = int(prev["input_length"]) // st.HASH_BLOCK  # type: ignore[call-overload]
                assert ids[:prev_full] == prev_ids[:prev_full]
                continued += 1
                break
        if full:
            by_tail[ids[full - 1]] = r
    assert continued > 500
    # at the engine's 32-token blocks, twins of a system prompt get equal leading block hashes
    a, b = [r for r in rows if r["hash_ids"][:4] == [30, 31, 32, 33]][:2]
    ha = trace_prefix_blocks(a["hash_ids"], a["input_length"], 32)
    hb = trace_prefix_blocks(b["hash_ids"], b["input_length"], 32)
    assert ha[: 4 * 16] == hb[: 4 * 16]
