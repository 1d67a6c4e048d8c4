"""benchmarks/adapter_hot_path.py: every mode streams every token and the budget releases every
request; the figures are reported (timings are read in benchmarks, not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from _bench_loader import BENCHMARKS

pytest.importorskip("vllm")


def test_every_mode_streams_every_token_and_reports_its_figures() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "adapter_hot_path.py"), "--rounds", "2",
         "--requests", "12", "--concurrency", "5", "--output-len", "70"],
        capture_output=True, text=True, check=True, timeout=300,
    ).stdout.strip().splitlines()
    result = json.loads(out[-1])
    for mode in ("vllm", "adapter", "serve"):
        assert result[f"{mode}_us_per_token_median"] > 0
        low, high = result[f"{mode}_us_per_token_range"]
        assert 0 < low <= result[f"{mode}_us_per_token_median"] <= high
    for mode in ("adapter", "serve"):
        assert result[f"{mode}_vs_vllm_median"] > 0
        assert f"{mode}_added_us_per_token_median" in result
    assert sum(line.startswith("round ") for line in out) == 2


def test_a_stream_cut_short_is_caught() -> None:
    # the run checks what it measures: a stand-in engine that stops a token early fails it
    from _bench_loader import load_benchmark

    bench = load_benchmark("adapter_hot_path")
    step = bench.StubLLM.step

    def short_step(self: Any) -> None:
        for entry in self.live.values():
            entry[1] = min(entry[1], 2)  # every request ends after at most two more tokens
        step(self)

    args = bench.argparse.Namespace(requests=3, concurrency=3, output_len=20, kv_blocks=4097)
    bench.StubLLM.step = short_step
    try:
        with pytest.raises(SystemExit, match="tokens streamed"):
            bench.asyncio.run(bench.run_mode("vllm", args))
    finally:
        bench.StubLLM.step = step
