"""Write five synthetic traces, unlike the conversation trace the policies were tuned on.

They check the policies on workloads they were not tuned on (docs/benchmarks-history.md, "Traces it
was not tuned on"): ``code.csv`` (long prompts, short answers: prefill-bound, 6 req/s for an hour),
``reason.csv`` (short prompts, long heavy-tailed answers, 1 req/s) and ``bursty.csv`` (gamma
arrivals with a coefficient of variation of 3, half short and half long answers); and two in the
Mooncake JSON-lines format: ``longctx.jsonl`` (long contexts) and ``sessions.jsonl`` (multi-turn
chat sessions whose ``hash_ids`` carry shared system prompts and re-sent contexts). Seeded.

    python benchmarks/synthetic_traces.py OUT_DIR
    kvbudget simulate --trace OUT_DIR/code.csv --sweep-rate 0.7,1.0,1.3
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from kvbudget.sim.prefix import MOONCAKE_HASH_BLOCK_TOKENS


def write_azure_csv(
    path: Path, ts: Iterable[float], prompt: Iterable[float], out: Iterable[float]
) -> None:
    """A trace in the Azure CSV format: arrival seconds, prompt and answer tokens per request."""
    t0 = dt.datetime(2024, 1, 1)
    with path.open("w") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for t, p, o in zip(ts, prompt, out, strict=True):
            stamp = (t0 + dt.timedelta(seconds=float(t))).strftime("%Y-%m-%d %H:%M:%S.%f")
            f.write(f"{stamp}0,{int(p)},{int(o)}\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    out_dir = ap.parse_args(argv).out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    n = 21_600
    ts = np.cumsum(rng.exponential(1 / 6, n))
    p = np.clip(rng.lognormal(np.log(1500), 0.8, n), 20, 7800)
    o = np.where(
        rng.random(n) < 0.05,
        rng.integers(200, 600, n),
        np.clip(rng.lognormal(np.log(15), 0.9, n), 1, 200),
    )
    write_azure_csv(out_dir / "code.csv", ts, p, o)
    n = 3_600
    ts = np.cumsum(rng.exponential(1.0, n))
    p = np.clip(rng.lognormal(np.log(300), 0.7, n), 10, 4000)
    o = np.clip(rng.lognormal(np.log(600), 1.0, n), 5, 4000)
    write_azure_csv(out_dir / "reason.csv", ts, p, o)
    n = 12_000
    ts = np.cumsum(rng.gamma(1 / 9, 9 / 4.0, n))
    p = np.clip(rng.lognormal(np.log(800), 0.8, n), 10, 6000)
    o = np.where(
        rng.random(n) < 0.5,
        np.clip(rng.lognormal(np.log(40), 0.5, n), 1, 300),
        np.clip(rng.lognormal(np.log(800), 0.4, n), 100, 2000),
    )
    write_azure_csv(out_dir / "bursty.csv", ts, p, o)
    n = 4_300
    ts = np.cumsum(rng.exponential(1 / 1.2, n))
    p = np.clip(rng.lognormal(np.log(8000), 0.7, n), 500, 30_000)
    o = np.clip(rng.lognormal(np.log(250), 0.8, n), 1, 2000)
    with (out_dir / "longctx.jsonl").open("w") as f:
        for t, pi, oi in zip(ts, p, o, strict=True):
            f.write(json.dumps({"timestamp": int(t * 1000), "input_length": int(pi),
                                "output_length": int(oi)}) + "\n")
    _write_sessions(out_dir / "sessions.jsonl", np.random.default_rng(11))
    print(f"wrote code.csv, reason.csv, bursty.csv, longctx.jsonl, sessions.jsonl to {out_dir}")


#: tokens per Mooncake ``hash_ids`` entry (the simulator's, which expands them)
HASH_BLOCK = MOONCAKE_HASH_BLOCK_TOKENS


def _write_sessions(path: Path, rng: np.random.Generator) -> None:
    """Multi-turn chat sessions in the Mooncake format, with the prefix structure it carries:
    each session opens on one of four shared system prompts (512-2,048 tokens) and every turn
    re-sends the session's whole context (system prompt, earlier questions and answers) plus a
    new question. A full 512-token block keeps its id from one turn to the next (the context
    only grows at its end); the last, partial block of a turn gets an id of its own."""
    system = [list(range(k * 10, k * 10 + n)) for k, n in enumerate((1, 2, 3, 4))]
    next_id = 1000
    rows: list[tuple[float, int, int, list[int]]] = []
    starts = np.cumsum(rng.exponential(1 / 0.4, 700))  # sessions at 0.4/s
    for start in starts:
        sys_ids = system[int(rng.integers(0, len(system)))]
        context = len(sys_ids) * HASH_BLOCK
        ids = list(sys_ids)
        t = float(start)
        for _turn in range(int(rng.integers(1, 7))):
            question = int(np.clip(rng.lognormal(np.log(250), 0.7), 10, 2000))
            answer = int(np.clip(rng.lognormal(np.log(300), 0.8), 5, 2000))
            length = context + question
            if length + answer > 16_000:
                break
            full = length // HASH_BLOCK
            while len(ids) < full:
                ids.append(next_id)
                next_id += 1
            hashes = ids[:full] + ([next_id] if length % HASH_BLOCK else [])
            next_id += 1
            rows.append((t, length, answer, hashes))
            context = length + answer
            t += float(rng.uniform(5.0, 40.0))  # the user reads and types
    rows.sort(key=lambda r: r[0])
    with path.open("w") as f:
        for t, length, answer, hashes in rows:
            f.write(json.dumps({"timestamp": int(t * 1000), "input_length": length,
                                "output_length": answer, "hash_ids": hashes}) + "\n")


if __name__ == "__main__":
    main()
