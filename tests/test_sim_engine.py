"""SimEngine: pull-based generation, truthful KV ledger, frees only when processed, faults."""

from __future__ import annotations

import anyio
import pytest

from _kvb_helpers import quiet_structlog  # noqa: F401 (autouse fixture)
from kvbudget import Capacity, Checkpoint, EngineDead, EngineError, InvalidInput
from kvbudget.core.model import blocks_for
from kvbudget.engines.base import (
    Engine,
    EngineStep,
    engine_request_id,
    split_engine_request_id,
)
from kvbudget.engines.sim import Faults, SimEngine

pytestmark = pytest.mark.anyio


async def drain(engine: SimEngine, rid: str, prompt: int = 10, max_tokens: int = 100,
                resume: Checkpoint | None = None) -> list[EngineStep]:
    steps = []
    async for step in engine.generate(rid, prompt, max_tokens, resume=resume):
        steps.append(step)
    return steps


def test_engine_ids_round_trip() -> None:
    assert engine_request_id("a", 0) == "a"
    assert split_engine_request_id(engine_request_id("a#b", 3)) == ("a#b", 3)
    assert split_engine_request_id("plain") == ("plain", 0)


async def test_default_engine_is_usable_and_an_engine() -> None:
    engine = SimEngine()
    assert isinstance(engine, Engine)
    assert engine.capacity.blocks > 0
    steps = await drain(engine, "x", max_tokens=10_000)
    assert steps[-1].finished and steps[-1].finish_reason == "stop"
    assert sum(s.new_tokens for s in steps) == engine.true_length("x")
    assert engine.kv_used_blocks() == 0


async def test_given_lengths_and_length_reason() -> None:
    engine = SimEngine(lengths={"a": 7, "b": 50})
    a = await drain(engine, "a")
    assert sum(s.new_tokens for s in a) == 7 and a[-1].finish_reason == "stop"
    b = await drain(engine, "b", max_tokens=20)
    assert sum(s.new_tokens for s in b) == 20 and b[-1].finish_reason == "length"
    c = SimEngine(lengths=lambda rid: 3)
    assert sum(s.new_tokens for s in await drain(c, "q")) == 3


async def test_seeded_lengths_are_reproducible() -> None:
    one = [SimEngine(seed=5).true_length(f"r{i}") for i in range(20)]
    two = [SimEngine(seed=5).true_length(f"r{i}") for i in range(20)]
    assert one == two and len(set(one)) > 5
    others = {SimEngine(seed=s).true_length("r0") for s in (6, 7, 8)}
    assert others != {one[0]}


async def test_pull_based_and_truthful_usage() -> None:
    engine = SimEngine(lengths={"a": 100}, capacity=Capacity(100, 16))
    stream = engine.generate("a", 20, 100, resume=None)
    for _ in range(13):
        await stream.__anext__()
    assert engine.held_blocks("a") == blocks_for(20 + 13, 16)
    assert engine.kv_used_blocks() == blocks_for(33, 16)
    await anyio.sleep(0.02)  # nobody pulls: nothing is generated
    assert engine.held_blocks("a") == blocks_for(33, 16)
    await engine.abort("a")
    step = await stream.__anext__()
    assert step.finished and step.finish_reason == "abort"
    assert engine.kv_used_blocks() == 0
    assert await engine.wait_released("a", 0.1)


async def test_resume_continues_from_checkpoint() -> None:
    engine = SimEngine(lengths={"a": 30})
    steps = await drain(engine, engine_request_id("a", 1), resume=Checkpoint("a", 10, 12))
    assert sum(s.new_tokens for s in steps) == 18


async def test_delayed_release_frees_only_when_processed() -> None:
    engine = SimEngine(lengths={"a": 100}, faults=Faults(release_delay_p=1.0, release_delay_s=0.1))
    stream = engine.generate("a", 16, 100, resume=None)
    await stream.__anext__()
    await engine.abort("a")
    assert engine.kv_used_blocks() == 2
    assert not await engine.wait_released("a", 0.03)
    assert engine.kv_used_blocks() == 2
    assert await engine.wait_released("a", 0.5)
    assert engine.kv_used_blocks() == 0
    await stream.aclose()


async def test_lost_confirmation_frees_but_never_confirms() -> None:
    engine = SimEngine(lengths={"a": 5}, faults=Faults(lost_confirm_p=1.0))
    await drain(engine, "a")
    assert engine.kv_used_blocks() == 0
    assert not await engine.wait_released("a", 0.05)


async def test_duplicate_confirmations_call_the_hook_twice() -> None:
    seen: list[str] = []
    engine = SimEngine(
        lengths={"a": 3},
        faults=Faults(duplicate_confirm_p=1.0, duplicate_delay_s=0.01),
        on_released=seen.append,
    )
    await drain(engine, "a")
    assert seen == ["a"]
    await anyio.sleep(0.03)
    engine.kv_used_blocks()
    assert seen == ["a", "a"]


async def test_consumer_gone_counts_as_abort() -> None:
    engine = SimEngine(lengths={"a": 100})
    stream = engine.generate("a", 16, 100, resume=None)
    await stream.__anext__()
    await stream.aclose()
    assert engine.kv_used_blocks() == 0
    assert await engine.wait_released("a", 0.1)


async def test_error_mid_stream() -> None:
    engine = SimEngine(lengths={"a": 100}, faults=Faults(error_p=1.0))
    with pytest.raises(EngineError) as info:
        await drain(engine, "a")
    assert info.value.request_id == "a" and "mid-stream" in info.value.detail
    assert not isinstance(info.value, EngineDead)


async def test_death_is_for_everyone_and_frees_nothing() -> None:
    engine = SimEngine(lengths={"a": 100, "b": 100}, faults=Faults(die_after_steps=5))
    held = engine.generate("b", 16, 100, resume=None)
    await held.__anext__()
    with pytest.raises(EngineDead):
        await drain(engine, "a")
    assert engine.dead
    with pytest.raises(EngineDead):
        await held.__anext__()
    with pytest.raises(EngineDead):
        await drain(engine, "c")
    with pytest.raises(EngineDead):
        await engine.abort("b")
    assert engine.kv_used_blocks() is None
    assert not await engine.wait_released("b", 0.02)


async def test_stall() -> None:
    engine = SimEngine(lengths={"a": 3}, faults=Faults(stall_p=1.0, stall_s=0.2))
    stream = engine.generate("a", 16, 100, resume=None)
    with anyio.move_on_after(0.05) as scope:
        await stream.__anext__()
    assert scope.cancelled_caught
    assert engine.stalls == 1
    assert engine.kv_used_blocks() == 0  # the consumer left: aborted and freed


async def test_batch_scaling_slows_steps() -> None:
    engine = SimEngine(lengths=lambda rid: 20)
    t0 = anyio.current_time()
    await drain(engine, "solo")
    solo = anyio.current_time() - t0
    t0 = anyio.current_time()
    async with anyio.create_task_group() as tg:
        for i in range(200):
            tg.start_soon(drain, engine, f"b{i}")
    assert anyio.current_time() - t0 > solo
    assert engine.kv_used_blocks() == 0 and engine.overflows == 0


def test_faults_validate() -> None:
    with pytest.raises(InvalidInput):
        Faults(error_p=2.0)
    with pytest.raises(InvalidInput):
        Faults(stall_s=-1.0)
