"""The simulated engine: how much KV it holds and how long each iteration takes (DESIGN §10).

This module owns :class:`EngineModel`, the value the discrete-event driver
(:mod:`kvbudget.sim.driver`) replays a workload against, and its defaults.

What the engine is
------------------
An iteration-level batching engine in the style of vLLM v1:

* **KV capacity** ``capacity`` (whole blocks of ``block_size`` tokens). The budget's ledger divides
  exactly this capacity; the engine holds a request's blocks until the budget confirms them free.
* **Step time** ``step`` (:class:`kvbudget.core.cost.StepTimeModel`): one iteration that decodes
  ``b`` running sequences holding ``c`` context tokens and also prefills ``p`` prompt tokens takes
  ``step.decode_time(b, c) + step.prefill_time(p)`` seconds (a step with no decode and only
  prefill costs ``step.fixed_s + step.prefill_time(p)``).
* **Chunked prefill**: at most ``prefill_chunk_tokens`` prompt tokens are prefilled per iteration
  (vLLM's ``max_num_batched_tokens``), first come first served; a request whose prefill completes
  in an iteration emits its first token at the end of that iteration. A request resumed after a
  preemption re-prefills its prompt *and* the tokens it had generated: that is the recompute cost.
* **Batch cap** ``max_batch`` running sequences (vLLM's ``max_num_seqs``), passed to the
  scheduler as ``SchedulerConfig.max_active``.
* **Aborts and preemptions** through the engine's API are confirmed as
  :class:`kvbudget.vllm.BudgetedEngine` confirms them: the engine core takes an abort in before
  its next step, and the confirmation is the second step record after the abort (the first may
  be of the step in flight) -- so under a wave of prefills, whose steps are long, a stop takes
  long to come back; an idle engine, which records no steps, confirms after ``abort_latency_s``
  (the adapter's round trip to the engine core). An aborted (abandoned) request keeps decoding
  until then, and those tokens are wasted; a preempted request stops at once but its blocks come
  back only then -- unless the policy is an engine's own that preempts inside its scheduler step
  (``preempts_in_engine``: vLLM, SGLang, LightLLM), whose victim's blocks come back at once. A
  request that finished by itself is confirmed by the next iteration.
* **Prefix caching** ``prefix_caching`` (on by default, as in vLLM): a prompt block that several
  live requests share (same chained hash) is stored once; when its last holder is freed it stays
  cached, unreferenced, until the space is needed (least recently used first); a newcomer's
  prefill skips its leading cached blocks. The cache itself is
  :class:`kvbudget.sim.prefix.PrefixCache`; off, every prompt is prefilled and held in full.
* **Front end** ``front_end`` (:class:`FrontEndModel`, off by default): the server process in
  front of the engine (its HTTP handling, tokenization, output processing and streaming), one
  thread that does one thing at a time, first come first served. Each arriving request costs it
  ``per_request_s`` before the scheduler sees it; each step's outputs cost it ``per_output_s``
  per stream that got a token, and the clients get that step's tokens when it is done. While it
  keeps up it adds little; when its work outgrows it (many streams, a burst of arrivals) a
  backlog builds and first tokens come later than the engine made them: what a client measures.
  The engine itself runs on (vLLM's engine core is its own process) and the scheduler counts
  tokens as the engine makes them.
* **Intake** ``intake_s`` (0 by default): engine time each arriving request costs, taken from
  the engine's next step. On a machine whose few cores the server's front end, the load
  generator and the engine core share, a burst of arrivals (each parsed, tokenized and handed
  to the engine core) slows the engine while it is taken in: measured here, a burst of 160
  requests delayed every first token of the first wave by about 0.15 s over the fitted step
  times, a burst of 30 by about 0.03 s, where one request alone costs about 1 ms. The front
  end's own queue (above) does not capture that: it delays when the scheduler sees a request,
  not the engine's steps.
* ``tick_s``: how often the driver sends the scheduler a ``Tick`` (queue time-outs, unconfirmed
  stops) and samples reserved/used KV; by default as often as the real shells tick theirs.

Where the defaults come from
----------------------------
The step-time defaults are :data:`kvbudget.core.cost.DEFAULT_STEP_TIME`: Llama-2-7B FP16 on one
A100-80GB, fitted to InternLM's LMDeploy benchmark (see :mod:`kvbudget.core.cost` for the rows and
the fit). The KV capacity is the same setting: that fit treats 60 GB of the card as KV cache at
0.5 MiB per token (Llama-2-7B: 2 (K, V) x 32 layers x 4096 hidden x 2 bytes = 524,288 bytes per
token), i.e. 60e9 / 524,288 = 114,440 tokens = :data:`DEFAULT_CAPACITY_BLOCKS` = 7,152 blocks of
:data:`DEFAULT_BLOCK_SIZE` = 16 tokens (vLLM's default block size on GPUs).
``max_batch`` = 256 and ``prefill_chunk_tokens`` = 2048 are vLLM's ``max_num_seqs`` default and
its long-standing chunked-prefill ``max_num_batched_tokens`` default; ``abort_latency_s`` = 50 ms
(used only where the engine is idle: a busy one confirms with its step records) is the round
trip from the API server to the engine core and back.
"""

from __future__ import annotations

from typing import Any, Final

import attrs

from kvbudget.core.config import SHELL_TICK_INTERVAL_S
from kvbudget.core.cost import DEFAULT_STEP_TIME, StepTimeModel
from kvbudget.core.model import Capacity
from kvbudget.errors import InvalidInput
from kvbudget.validate import boolean, integer, nonnegative, positive

__all__ = [
    "DEFAULT_ABORT_LATENCY_S",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CAPACITY_BLOCKS",
    "DEFAULT_MAX_BATCH",
    "DEFAULT_PREFILL_CHUNK_TOKENS",
    "DEFAULT_TICK_S",
    "KV_BYTES_PER_TOKEN",
    "KV_CACHE_BYTES",
    "EngineModel",
    "FrontEndModel",
]

KV_BYTES_PER_TOKEN: Final = 2 * 32 * 4096 * 2
"""Llama-2-7B FP16: K and V, 32 layers, hidden size 4096, 2 bytes each = 0.5 MiB per token."""
KV_CACHE_BYTES: Final = 60_000_000_000
"""KV cache of one A100-80GB after weights and activations, as in the step-time fit."""
DEFAULT_BLOCK_SIZE: Final = 16
DEFAULT_CAPACITY_BLOCKS: Final = KV_CACHE_BYTES // KV_BYTES_PER_TOKEN // DEFAULT_BLOCK_SIZE
DEFAULT_MAX_BATCH: Final = 256
DEFAULT_PREFILL_CHUNK_TOKENS: Final = 2048
DEFAULT_ABORT_LATENCY_S: Final = 0.05
DEFAULT_TICK_S: Final = SHELL_TICK_INTERVAL_S
"""The simulated shell ticks its scheduler as often as a real one (``Budget``,
``BudgetedEngine``): a queued caller past its bound is turned away, and may be admitted until
then, on the same clock. (Before the thirty-eighth session it was 100 ms; the figures of
docs/benchmarks-history.md dated before it were made at that tick.)"""


def _check_capacity(_inst: object, _attr: object, value: Any) -> None:
    if not isinstance(value, Capacity):
        raise InvalidInput("capacity", value, "a kvbudget.Capacity")


def _check_step(_inst: object, _attr: object, value: Any) -> None:
    if not isinstance(value, StepTimeModel):
        raise InvalidInput("step", value, "a kvbudget.core.cost.StepTimeModel")


@attrs.frozen(slots=True, kw_only=True)
class FrontEndModel:
    """The server's front-end process in front of the engine (module docstring): seconds of
    its one thread per arriving request and per stream output (one token to one client)."""

    per_request_s: float = attrs.field(default=0.0, validator=nonnegative(name="per_request_s"))
    per_output_s: float = attrs.field(default=0.0, validator=nonnegative(name="per_output_s"))

    def to_dict(self) -> dict[str, float]:
        return {"per_request_s": self.per_request_s, "per_output_s": self.per_output_s}


def _check_front_end(_inst: object, _attr: object, value: Any) -> None:
    if value is not None and not isinstance(value, FrontEndModel):
        raise InvalidInput("front_end", value, "a kvbudget.sim.engine_model.FrontEndModel or None")


@attrs.frozen(slots=True, kw_only=True)
class EngineModel:
    """The simulated engine's KV capacity, step time and limits (module docstring)."""

    capacity: Capacity = attrs.field(
        factory=lambda: Capacity(DEFAULT_CAPACITY_BLOCKS, DEFAULT_BLOCK_SIZE),
        validator=_check_capacity,
    )
    step: StepTimeModel = attrs.field(default=DEFAULT_STEP_TIME, validator=_check_step)
    abort_latency_s: float = attrs.field(
        default=DEFAULT_ABORT_LATENCY_S, validator=nonnegative(name="abort_latency_s")
    )
    max_batch: int = attrs.field(default=DEFAULT_MAX_BATCH, validator=integer(1))
    prefill_chunk_tokens: int = attrs.field(
        default=DEFAULT_PREFILL_CHUNK_TOKENS, validator=integer(1)
    )
    tick_s: float = attrs.field(default=DEFAULT_TICK_S, validator=positive())
    prefix_caching: bool = attrs.field(default=True, validator=boolean(name="prefix_caching"))
    #: the server process in front of the engine (None: tokens reach clients as they are made)
    front_end: FrontEndModel | None = attrs.field(default=None, validator=_check_front_end)
    #: engine seconds each arriving request costs, taken from the next step (module docstring)
    intake_s: float = attrs.field(default=0.0, validator=nonnegative(name="intake_s"))

    def step_time(self, batch_size: int, context_tokens: int, prefill_tokens: int) -> float:
        """Seconds of one iteration: a decode step plus ``prefill_tokens`` of prefill."""
        s = self.step
        if batch_size == 0:
            if prefill_tokens == 0:
                return 0.0
            return s.fixed_s + s.prefill_per_token_s * prefill_tokens
        return (
            s.fixed_s
            + s.per_seq_s * batch_size
            + s.per_context_token_s * context_tokens
            + s.prefill_per_token_s * prefill_tokens
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (for reports)."""
        return {
            "capacity_blocks": self.capacity.blocks,
            "block_size": self.capacity.block_size,
            "capacity_tokens": self.capacity.tokens,
            "step_fixed_s": self.step.fixed_s,
            "step_per_seq_s": self.step.per_seq_s,
            "step_per_context_token_s": self.step.per_context_token_s,
            "prefill_per_token_s": self.step.prefill_per_token_s,
            "abort_latency_s": self.abort_latency_s,
            "max_batch": self.max_batch,
            "prefill_chunk_tokens": self.prefill_chunk_tokens,
            "tick_s": self.tick_s,
            "prefix_caching": self.prefix_caching,
            "front_end": None if self.front_end is None else self.front_end.to_dict(),
            "intake_s": self.intake_s,
        }
