"""A simulated engine for tests and demos: :class:`SimEngine` and its faults, :class:`Faults`.

``SimEngine`` implements :class:`kvbudget.engines.base.Engine` in real (anyio) time:

* each request's true output length comes from ``lengths`` (a ``{request_id: n}`` mapping or a
  callable) or else from a seeded lognormal; a resumed attempt keeps its request's length;
* a step sleeps ``step_time.decode_time(active, 0)`` seconds (``active``: the requests being
  pulled right now, so steps slow down with the batch), plus ``prefill_time`` of what the first
  step of an attempt prefills; it generates one token and only while the consumer pulls;
* it keeps its own KV ledger in blocks (``blocks_for(prompt + generated)`` per request, allocated
  at prefill and as tokens are generated) so :meth:`SimEngine.kv_used_blocks` is truthful, and it
  frees a request's blocks only when its finish or abort is *processed*, which :class:`Faults`
  may delay. A consumer that stops pulling without finishing counts as an abort.

Fault injection (:class:`Faults`): delayed processing of finishes/aborts, lost confirmations
(the KV is freed but :meth:`SimEngine.wait_released` never says so), duplicated confirmations
(the optional ``on_released`` hook is called twice, the second time late), a stream that raises
:class:`~kvbudget.errors.EngineError` mid-stream, an engine that dies
(:class:`~kvbudget.errors.EngineDead` for everyone after, KV never freed, usage unknown) and
steps that stall for ``stall_s`` seconds.

Frees are processed lazily, whenever anything calls into the engine (a step, ``abort``,
``wait_released``, ``kv_used_blocks``), so the engine needs no background task of its own.
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

import anyio
import attrs

from kvbudget.core.cost import StepTimeModel
from kvbudget.core.model import Capacity, blocks_for
from kvbudget.core.resume import Checkpoint
from kvbudget.engines.base import EngineStep, split_engine_request_id
from kvbudget.errors import EngineDead, EngineError, InvalidInput
from kvbudget.validate import check_float, check_int, fraction, nonnegative

#: ~1 ms per decode step, +1 µs per running sequence, no context or prefill cost
DEFAULT_SIM_STEP = StepTimeModel(
    fixed_s=1e-3, per_seq_s=1e-6, per_context_token_s=0.0, prefill_per_token_s=0.0
)


def _optional_steps(_inst: object, _attr: object, value: Any) -> None:
    if value is not None:
        check_int("die_after_steps", value, minimum=0)


@attrs.frozen(slots=True)
class Faults:
    """Faults a :class:`SimEngine` injects. Probabilities are per request unless said otherwise.

    ``release_delay_p``/``release_delay_s``: with this probability a finish or abort is processed
    (its KV freed) only ``release_delay_s`` seconds later. ``lost_confirm_p``: the KV is freed but
    :meth:`SimEngine.wait_released` never confirms it (and ``on_released`` is not called).
    ``duplicate_confirm_p``/``duplicate_delay_s``: ``on_released`` is called a second time,
    ``duplicate_delay_s`` later. ``error_p``: per step, the stream raises ``EngineError``.
    ``die_after_steps``: after this many steps in total the engine dies. ``stall_p``/``stall_s``:
    per step, the step takes ``stall_s`` seconds instead.
    """

    release_delay_p: float = attrs.field(default=0.0, validator=fraction())
    release_delay_s: float = attrs.field(default=0.0, validator=nonnegative())
    lost_confirm_p: float = attrs.field(default=0.0, validator=fraction())
    duplicate_confirm_p: float = attrs.field(default=0.0, validator=fraction())
    duplicate_delay_s: float = attrs.field(default=0.005, validator=nonnegative())
    error_p: float = attrs.field(default=0.0, validator=fraction())
    die_after_steps: int | None = attrs.field(default=None, validator=_optional_steps)
    stall_p: float = attrs.field(default=0.0, validator=fraction())
    stall_s: float = attrs.field(default=1.0, validator=nonnegative())


NO_FAULTS = Faults()


class _SimRequest:
    __slots__ = (
        "aborted",
        "blocks",
        "engine_id",
        "free_at",
        "freed",
        "generated",
        "lost",
        "max_tokens",
        "prompt",
        "scheduled",
        "target",
    )

    def __init__(self, engine_id: str, prompt: int, generated: int, target: int, max_tokens: int):
        self.engine_id = engine_id
        self.prompt = prompt
        self.generated = generated
        self.target = target
        self.max_tokens = max_tokens
        self.blocks = 0
        self.aborted = False
        self.free_at: float | None = None
        self.freed = anyio.Event()
        self.scheduled = anyio.Event()
        self.lost = False


class SimEngine:
    """A simulated, pull-based engine with a truthful KV ledger and fault injection.

    ``capacity``: what :attr:`capacity` reports (the sim never refuses KV; it counts in
    :attr:`overflows` every step that found its usage above capacity). ``lengths``: true output
    length per budget request id (a mapping, or a callable returning an int or None);
    otherwise ``round(lognormal(log(median_length), sigma))`` clipped to >= 1, drawn from
    ``(seed, request_id)`` so it does not depend on arrival order.
    ``step_time``: the step-time model. ``on_released``: called with the engine request id
    whenever the engine frees a request's KV (a push-style confirmation).
    """

    def __init__(
        self,
        *,
        capacity: Capacity | None = None,
        lengths: Mapping[str, int] | Callable[[str], int | None] | None = None,
        median_length: float = 64.0,
        sigma: float = 1.0,
        step_time: StepTimeModel | None = None,
        faults: Faults | None = None,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
        on_released: Callable[[str], object] | None = None,
        remember: int = 100_000,
    ) -> None:
        self._capacity = capacity if capacity is not None else Capacity(blocks=4096, block_size=16)
        if not isinstance(self._capacity, Capacity):
            raise InvalidInput("capacity", capacity, "a kvbudget.Capacity or None")
        self._lengths = lengths
        self._median = check_float("median_length", median_length, minimum=1.0)
        self._sigma = check_float("sigma", sigma, minimum=0.0)
        self.step_time = step_time if step_time is not None else DEFAULT_SIM_STEP
        self.faults = faults if faults is not None else NO_FAULTS
        self._seed = seed
        self._rng = random.Random(seed)
        self._clock = clock
        self.on_released = on_released
        self._remember = check_int("remember", remember, minimum=1)
        self._requests: dict[str, _SimRequest] = {}
        self._pending: list[_SimRequest] = []  # scheduled to be freed, not yet freed
        self._dups: list[tuple[float, str]] = []  # duplicate on_released calls still due
        self._done: OrderedDict[str, bool] = OrderedDict()  # freed engine ids -> lost?
        self._true: OrderedDict[str, int] = OrderedDict()  # budget request id -> true length
        self._used = 0
        self._active = 0
        self._steps = 0
        self._dead = False
        #: steps that found the engine's KV usage above its capacity (should stay 0)
        self.overflows = 0
        #: the most KV blocks ever in use
        self.peak_used = 0
        #: counters of what happened, for tests and reports
        self.started = 0
        self.finished = 0
        self.aborted = 0
        self.errors = 0
        self.stalls = 0

    # -- the Engine protocol -------------------------------------------------------------------

    @property
    def capacity(self) -> Capacity:
        return self._capacity

    @property
    def dead(self) -> bool:
        return self._dead

    def kill(self) -> None:
        """Kill the engine now: every stream raises EngineDead; nothing is ever freed again."""
        self._dead = True

    def kv_used_blocks(self) -> int | None:
        if self._dead:
            return None
        self._collect(self._clock())
        return self._used

    def held_blocks(self, engine_id: str) -> int:
        """Blocks the engine holds for ``engine_id`` right now (0 when freed or unknown)."""
        self._collect(self._clock())
        r = self._requests.get(engine_id)
        return r.blocks if r is not None else 0

    def generate(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        *,
        resume: Checkpoint | None = None,
    ) -> AsyncGenerator[EngineStep, None]:
        check_int("prompt_tokens", prompt_tokens, minimum=1)
        check_int("max_tokens", max_tokens, minimum=1)
        return self._run(request_id, prompt_tokens, max_tokens, resume)

    async def abort(self, request_id: str) -> None:
        if self._dead:
            raise EngineDead(request_id, "the engine is dead")
        r = self._requests.get(request_id)
        if r is not None and not r.aborted:
            r.aborted = True
            self.aborted += 1
            self._schedule_free(r)
        await anyio.lowlevel.checkpoint()

    async def wait_released(self, request_id: str, timeout: float) -> bool:
        with anyio.move_on_after(timeout):
            while True:
                if self._dead:
                    await anyio.sleep_forever()
                now = self._clock()
                self._collect(now)
                lost = self._done.get(request_id)
                if lost is not None:
                    if lost:
                        await anyio.sleep_forever()
                    return True
                r = self._requests.get(request_id)
                if r is None:
                    return False  # never known (or long forgotten): nothing to confirm
                if r.free_at is None:
                    await r.scheduled.wait()
                else:
                    await anyio.sleep(max(0.0, r.free_at - now))
        return False

    # -- internals -----------------------------------------------------------------------------

    def true_length(self, request_id: str) -> int:
        """The output length request ``request_id`` (a budget id) will reach if unhindered."""
        n = self._true.get(request_id)
        if n is not None:
            return n
        given: int | None = None
        if callable(self._lengths):
            given = self._lengths(request_id)
        elif self._lengths is not None:
            given = self._lengths.get(request_id)
        if given is None:
            # drawn from (seed, request id): the same request gets the same length in any order
            draw = random.Random(f"{self._seed}:{request_id}")
            given = max(1, round(draw.lognormvariate(math.log(self._median), self._sigma)))
        n = check_int(f"lengths[{request_id!r}]", given, minimum=1)
        self._true[request_id] = n
        if len(self._true) > self._remember:
            self._true.popitem(last=False)
        return n

    async def _run(
        self, engine_id: str, prompt: int, max_tokens: int, resume: Checkpoint | None
    ) -> AsyncGenerator[EngineStep, None]:
        if self._dead:
            raise EngineDead(engine_id, "the engine is dead")
        if engine_id in self._requests or engine_id in self._done:
            raise EngineError(engine_id, "duplicate engine request id")
        base, _attempt = split_engine_request_id(engine_id)
        generated = resume.generated_tokens if resume is not None else 0
        r = _SimRequest(engine_id, prompt, generated, self.true_length(base), max_tokens)
        self._requests[engine_id] = r
        self.started += 1
        faults = self.faults
        rng = self._rng
        bs = self._capacity.block_size
        first = True
        self._active += 1
        try:
            while True:
                if r.aborted:
                    yield EngineStep(0, True, "abort")
                    return
                if r.generated >= min(r.target, r.max_tokens):
                    # a resumed request that had already reached its end: nothing to generate
                    self._schedule_free(r)
                    self.finished += 1
                    reason = "stop" if r.generated >= r.target else "length"
                    yield EngineStep(0, True, reason)  # type: ignore[arg-type]
                    return
                now = self._clock()
                self._collect(now)
                delay = self.step_time.decode_time(self._active, 0)
                if first:
                    # prefill: the prompt (plus what a checkpoint re-computes) takes its KV now
                    self._hold(r, blocks_for(prompt + r.generated, bs))
                    delay += self.step_time.prefill_time(prompt + r.generated)
                    first = False
                if faults.stall_p and rng.random() < faults.stall_p:
                    self.stalls += 1
                    delay = faults.stall_s
                await anyio.sleep(delay)
                if self._dead:
                    raise EngineDead(engine_id, "the engine died")
                self._steps += 1
                if faults.die_after_steps is not None and self._steps >= faults.die_after_steps:
                    self._dead = True
                    raise EngineDead(engine_id, "the engine died")
                if faults.error_p and rng.random() < faults.error_p:
                    self.errors += 1
                    raise EngineError(engine_id, "injected failure mid-stream")
                if r.aborted:
                    yield EngineStep(0, True, "abort")
                    return
                r.generated += 1
                self._hold(r, blocks_for(prompt + r.generated, bs))
                if r.generated >= r.target or r.generated >= r.max_tokens:
                    self.finished += 1
                    self._schedule_free(r)
                    reason = "stop" if r.generated >= r.target else "length"
                    yield EngineStep(1, True, reason)  # type: ignore[arg-type]
                    return
                yield EngineStep(1)
        finally:
            self._active -= 1
            if r.free_at is None and not self._dead:
                # the consumer went away (or the stream failed): the engine aborts the request
                r.aborted = True
                self.aborted += 1
                self._schedule_free(r)

    def _hold(self, r: _SimRequest, blocks: int) -> None:
        if blocks != r.blocks:
            self._used += blocks - r.blocks
            r.blocks = blocks
            if self._used > self.peak_used:
                self.peak_used = self._used
            if self._used > self._capacity.blocks:
                self.overflows += 1

    def _schedule_free(self, r: _SimRequest) -> None:
        if r.free_at is not None:
            return
        faults = self.faults
        rng = self._rng
        now = self._clock()
        delay = 0.0
        if faults.release_delay_p and rng.random() < faults.release_delay_p:
            delay = faults.release_delay_s
        r.lost = bool(faults.lost_confirm_p) and rng.random() < faults.lost_confirm_p
        r.free_at = now + delay
        r.scheduled.set()
        self._pending.append(r)
        if delay == 0.0:
            self._collect(now)

    def _collect(self, now: float) -> None:
        if self._dead:
            return
        if self._pending:
            keep: list[_SimRequest] = []
            due: list[_SimRequest] = []
            for r in self._pending:
                (due if r.free_at is not None and r.free_at <= now else keep).append(r)
            self._pending = keep
            for r in due:
                self._free(r, now)
        if self._dups:
            ready = [d for d in self._dups if d[0] <= now]
            if ready:
                self._dups = [d for d in self._dups if d[0] > now]
                for _at, engine_id in ready:
                    self._notify(engine_id)

    def _free(self, r: _SimRequest, now: float) -> None:
        self._used -= r.blocks
        r.blocks = 0
        self._requests.pop(r.engine_id, None)
        self._done[r.engine_id] = r.lost
        if len(self._done) > self._remember:
            self._done.popitem(last=False)
        r.freed.set()
        if r.lost:
            return
        self._notify(r.engine_id)
        faults = self.faults
        if faults.duplicate_confirm_p and self._rng.random() < faults.duplicate_confirm_p:
            self._dups.append((now + faults.duplicate_delay_s, r.engine_id))

    def _notify(self, engine_id: str) -> None:
        if self.on_released is not None:
            self.on_released(engine_id)


__all__ = ["DEFAULT_SIM_STEP", "NO_FAULTS", "Faults", "SimEngine"]
