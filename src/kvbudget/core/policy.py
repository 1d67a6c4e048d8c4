"""Policies: the decisions a scheduler delegates (how much to grant, when to grow, whom to stop).

A policy answers a handful of questions through the :class:`Policy` protocol; the scheduler owns
the mechanism (the ledger, the queue, the pool rules, the invariants) and checks every answer, so a
policy cannot break an invariant: an answer that would is refused with
:class:`~kvbudget.errors.PolicyViolation`. All policies run over the same ledger, which is what
makes the comparison in ``kvbudget simulate`` fair.

Shipped policies (DESIGN §5): ``calibrated`` (the default), and the baselines ``reserve-max``
(TensorRT-LLM GUARANTEED_NO_EVICT / TGI before segments), ``segmented`` (TGI v3 router),
``reserve-current`` (vLLM v1 FCFS), ``new-token-ratio`` (SGLang), ``past-future`` (LightLLM,
ASPLOS 2025) and ``oracle`` (knows each true length; simulation only).
"""

from __future__ import annotations

import enum
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from kvbudget.core.model import blocks_for, check_float, check_int
from kvbudget.errors import InvalidInput, UnknownPolicy

if TYPE_CHECKING:
    from kvbudget.core.ledger import Request
    from kvbudget.core.scheduler import Scheduler


#: the objective a pause's re-prefill is weighed against for a class with no first-token one
_REFERENCE_S = 2.0


class Blocked(enum.Enum):
    """What to do with a request stopped at its boundary whose grant cannot grow now."""

    WAIT = "wait"  # hold the grant and wait for blocks to come back
    PREEMPT_OTHERS = "preempt-others"  # checkpoint victims chosen by ``choose_victims``
    PREEMPT_SELF = "preempt-self"  # checkpoint this request; it resumes by re-prefill
    CONTINUE = "continue"  # end with an explicit continuation (only if the request allows it)


@runtime_checkable
class Policy(Protocol):
    """The decisions of a budget policy. See :class:`BasePolicy` for the defaults."""

    @property
    def name(self) -> str: ...  # read-only: shipped policies set it as a ClassVar

    requeue_front: bool
    preempt_for_admission: bool

    def bind(self, scheduler: Scheduler) -> None: ...
    def headroom_target(self) -> int: ...
    def protected_blocks(self) -> int: ...
    def initial_allowance(self, req: Request) -> int: ...
    def lookahead_tokens(self, req: Request) -> int: ...
    def extension_tokens(self, req: Request) -> int | None: ...
    def admit(self, req: Request, blocks: int) -> bool: ...
    def on_blocked(self, req: Request) -> Blocked: ...
    def choose_victims(
        self, req: Request, need_blocks: int, candidates: Sequence[Request]
    ) -> list[Request]: ...
    def on_granted(self, req: Request) -> None: ...
    def on_leave(self, req: Request) -> None: ...
    def on_finished(self, req: Request, length: int) -> None: ...
    def on_step(self) -> None: ...


class BasePolicy:
    """Defaults for every hook: no headroom, grant the hard max, never preempt."""

    name: ClassVar[str] = "base"
    requeue_front: bool = True
    preempt_for_admission: bool = False
    _s: Scheduler

    def bind(self, scheduler: Scheduler) -> None:
        self._s = scheduler

    @property
    def scheduler(self) -> Scheduler:
        return self._s

    @property
    def block_size(self) -> int:
        return self._s.capacity.block_size

    def headroom_target(self) -> int:
        return 0

    def protected_blocks(self) -> int:
        return 0

    def initial_allowance(self, req: Request) -> int:
        return req.remaining

    def lookahead_tokens(self, req: Request) -> int:
        return 0

    def extension_tokens(self, req: Request) -> int | None:
        return None

    def admit(self, req: Request, blocks: int) -> bool:
        return True

    def on_blocked(self, req: Request) -> Blocked:
        return Blocked.CONTINUE if req.spec.on_exhausted == "continue" else Blocked.WAIT

    def choose_victims(
        self, req: Request, need_blocks: int, candidates: Sequence[Request]
    ) -> list[Request]:
        return []

    def on_granted(self, req: Request) -> None:
        pass

    def on_leave(self, req: Request) -> None:
        pass

    def on_finished(self, req: Request, length: int) -> None:
        pass

    def on_step(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _most_recent(req: Request, candidates: Sequence[Request]) -> list[Request]:
    """vLLM/LightLLM victim: the most recently admitted running request (maybe ``req`` itself)."""
    pool = list(candidates)
    if req not in pool:
        pool.append(req)
    return [max(pool, key=lambda r: r.seq)]


class CalibratedPolicy(BasePolicy):
    """kvbudget's policy: calibrated quantile grants, bounded extensions from a headroom pool.

    * admission grants prompt + the class's ``initial_quantile`` of the output-length
      distribution for the request's calibration key (resumed requests: the conditional quantile
      given what they already generated), capped at the hard max;
    * an extension is asked ``lookahead_blocks`` ahead of the boundary and sized from the
      conditional distribution P(L > g + x | L > g) at the class's ``extension_quantile``, at least
      one block and at most the class's ``max_extension_tokens``;
    * the grant of unprotected (batch) work grows in bounded steps: its initial allowance reaches
      at most ``grant_step_tokens`` past the context's last block, and an extension adds at most
      ``grant_step_tokens`` (None: no such bound). Blocks granted far ahead of the tokens that
      fill them are blocks nobody else can be admitted into; the quantiles still decide how far
      it is expected to grow. Protected streams keep whole quantile grants: a wait at their
      boundary is a stall;
    * the headroom target follows the predicted extension demand of in-flight grants (sum of
      P(extend) x the growth still expected: the next increment, or with bounded steps the way to
      the conditional quantile; for a protected stream P(extend) is conditioned on the length it
      has already outlived), clamped to ``[headroom_min, headroom_max]`` of capacity;
      ``protected_fraction`` of capacity is reserved for protected classes;
    * a protected head that does not fit the admission budget may take the headroom beyond its
      protected part (the scheduler's rule: at once while no extension waits) unless a protected
      stream's grant has outrun everything its distribution has seen (:meth:`admit`): then the
      forecast is real demand and the headroom is kept for it;
    * a protected request stopped at its boundary preempts preemptible work of lower priority
      (lowest recompute cost first, most deadline slack first); others wait or, when they allow
      it, end with a continuation;
    * a head of a class with no first-token objective, below a class with one (batch under
      interactive), waits while the engine's prefill queue is busy and the prefill it would
      join is predicted to take more than ``batch_prefill_share`` of that objective: the
      prefill already queued, its own, and the prefill the callers under the objective are
      expected to bring within one objective at their recent rate
      (:meth:`~kvbudget.core.scheduler.Scheduler.first_token_prefill_rate`). The engine
      prefills first come first served, so a batch prompt admitted ahead of them delays their
      first tokens; waiting in kvbudget's queue, which serves them first, it does not. With
      nothing queued for prefill it is admitted (None: batch never waits for the prefill
      queue).
    """

    name: ClassVar[str] = "calibrated"
    requeue_front = True
    preempt_for_admission = True

    def __init__(
        self,
        *,
        headroom_min: float = 0.03,
        headroom_max: float = 0.5,
        protected_fraction: float = 0.02,
        demand_safety: float = 1.0,
        lookahead_blocks: int = 1,
        grant_step_tokens: int | None = 128,
        batch_prefill_share: float | None = 0.5,
        recompute_share: float | None = 0.1,
        min_prefill_observations: int = 8,
    ) -> None:
        self.headroom_min = check_float("headroom_min", headroom_min, maximum=1.0)
        self.headroom_max = check_float(
            "headroom_max", headroom_max, minimum=self.headroom_min, maximum=1.0
        )
        self.protected_fraction = check_float(
            "protected_fraction", protected_fraction, maximum=self.headroom_min
        )
        self.demand_safety = check_float("demand_safety", demand_safety, maximum=100.0)
        self.lookahead_blocks = check_int("lookahead_blocks", lookahead_blocks, minimum=0)
        self.grant_step_tokens = (
            None
            if grant_step_tokens is None
            else check_int("grant_step_tokens", grant_step_tokens, minimum=1)
        )
        self.batch_prefill_share = (
            None
            if batch_prefill_share is None
            else check_float("batch_prefill_share", batch_prefill_share, open_min=True)
        )
        self.recompute_share = (
            None
            if recompute_share is None
            else check_float("recompute_share", recompute_share, open_min=True, maximum=1.0)
        )
        self.min_prefill_observations = check_int(
            "min_prefill_observations", min_prefill_observations, minimum=1
        )
        self._demand = 0.0
        self._demand_of: dict[str, float] = {}
        self._outrun: set[str] = set()
        #: class name -> the tightest first-token objective of the classes served before it,
        #: for classes with no objective of their own (batch_prefill_share applies to them)
        self._objective_above: dict[str, float] = {}

    def bind(self, scheduler: Scheduler) -> None:
        super().bind(scheduler)
        classes = scheduler.classes.values()
        self._objective_above = {}
        for cls in classes:
            if cls.ttft_slo_s is not None:
                continue
            above = [
                c.ttft_slo_s
                for c in classes
                if c.ttft_slo_s is not None and c.priority < cls.priority
            ]
            if above:
                self._objective_above[cls.name] = min(above)

    def headroom_target(self) -> int:
        cap = self._s.capacity.blocks
        lo = math.ceil(self.headroom_min * cap)
        hi = math.floor(self.headroom_max * cap)
        return max(lo, min(hi, math.ceil(self._demand * self.demand_safety)))

    def protected_blocks(self) -> int:
        return math.ceil(self.protected_fraction * self._s.capacity.blocks)

    # -- the engine's economics: where a pause is cheap, be as optimistic as the engine ----------

    def cheap_to_pause(self, req: Request) -> bool:
        """Is re-prefilling ``req`` after a pause cheap against its objective? True when the
        engine's own prefill cost has been measured (``min_prefill_observations`` prefills seen
        by the cost model: an adapter that reads the engine's step details feeds them; the
        simulator does not) and re-prefilling its prompt plus the p90 of its length takes at
        most ``recompute_share`` of its first-token objective (2 s for a class without one).
        Such a request is granted like vLLM grants: the blocks it fills now and one more, grown
        two blocks at a time; when the cache runs out the most recently admitted request is
        paused (checkpointed), as vLLM preempts, but before the engine has to."""
        share = self.recompute_share
        if share is None or not req.spec.resumable:
            return False
        s = self._s
        cost = s.cost
        if cost.prefill_observations < self.min_prefill_observations:
            return False
        objective = req.cls.ttft_slo_s if req.cls.ttft_slo_s is not None else _REFERENCE_S
        expected = req.prompt + max(req.generated, s.lengths.quantile(req.key, 0.9))
        return cost.predict_prefill(min(expected, req.prompt + req.hard_max)) <= share * objective

    def acts_ahead(self, req: Request) -> bool:
        return self.cheap_to_pause(req)

    def _newer(self, req: Request) -> list[Request]:
        """Live requests admitted after ``req`` that may be paused, newest first."""
        return sorted(
            (
                r
                for r in self._s.live.values()
                if r.seq > req.seq and r.spec.resumable and r.generated < r.hard_max
            ),
            key=lambda r: -r.seq,
        )

    def initial_allowance(self, req: Request) -> int:
        if self.cheap_to_pause(req):
            fill = -req.context_tokens % self.block_size + self.block_size
            return max(1, min(req.remaining, fill))
        lengths = self._s.lengths
        if req.generated:
            target = lengths.conditional_quantile(
                req.key, req.cls.extension_quantile, req.generated
            )
        else:
            target = lengths.quantile(req.key, req.cls.initial_quantile)
        allowance = min(req.remaining, target - req.generated)
        step = self._step(req)
        if step is not None:
            # fill the context's last block, then at most one step beyond it
            allowance = min(allowance, -req.context_tokens % self.block_size + step)
        return max(1, allowance)

    def lookahead_tokens(self, req: Request) -> int:
        return self.lookahead_blocks * self.block_size

    def admit(self, req: Request, blocks: int) -> bool:
        # A protected head that does not fit its admission budget may take the unprotected
        # headroom (the scheduler's rule) only while the forecast behind it holds: once a
        # protected stream has outlived everything its distribution has seen, as a wave of
        # long answers does, its extensions are real demand, and the headroom is kept for them.
        if self._outrun and req.cls.protected and not self._s.ledger.fits_admission(blocks):
            return False
        if self.cheap_to_pause(req) and not self._s.ledger.fits_admission(blocks):
            # the headroom is the next extension of every live stream granted the vLLM way: a
            # head let into it would be the first paused when they grow (a re-prefill for
            # nothing), so it waits for room beyond it
            return False
        share = self.batch_prefill_share
        if share is not None and self._s.prefill_backlog:
            objective = self._objective_above.get(req.cls.name)
            if objective is not None and self._prefill_crowds(req, objective, share):
                return False
        return True

    def _prefill_crowds(self, req: Request, objective: float, share: float) -> bool:
        """Would admitting ``req`` now leave the callers under ``objective`` less than the rest
        of it for their first tokens? (Class docstring: ``batch_prefill_share``.)"""
        s = self._s
        coming = int(s.first_token_prefill_rate() * objective)
        return s.first_token_delay(req, coming) > share * objective

    def extension_tokens(self, req: Request) -> int | None:
        if req.boundary >= req.hard_max:
            return None
        if self.cheap_to_pause(req):
            return self._cheap_step(req)
        return self._extension(req, self._target(req))

    def _cheap_step(self, req: Request) -> int:
        """An extension of a request granted the vLLM way: two blocks (or what remains)."""
        return max(1, min(req.hard_max - req.boundary, 2 * self.block_size))

    def _target(self, req: Request) -> int:
        """The length an extension of ``req`` aims to cover: its conditional quantile."""
        return self._s.lengths.conditional_quantile(
            req.key, req.cls.extension_quantile, req.boundary
        )

    def _extension(self, req: Request, target: int) -> int:
        want = max(self.block_size, min(req.cls.max_extension_tokens, target - req.boundary))
        step = self._step(req)
        if step is not None:
            want = min(want, step)
        return min(req.hard_max - req.boundary, want)

    def _step(self, req: Request) -> int | None:
        """How far one grant of ``req`` may reach ahead (None: as far as its quantile)."""
        return None if req.cls.protected else self.grant_step_tokens

    def on_blocked(self, req: Request) -> Blocked:
        from kvbudget.core.ledger import State

        if self.cheap_to_pause(req):
            # as vLLM: the most recently admitted gives way, this one if it is the newest
            if self._newer(req):
                return Blocked.PREEMPT_OTHERS
            if req.spec.on_exhausted == "continue":
                return Blocked.CONTINUE if req.state is State.EXTENDING else Blocked.WAIT
            s = self._s
            room = s.ledger.room(req.cls.protected)
            if req.state is State.EXTENDING and s.ledger.grant_blocks(req, req.hard_max) <= room:
                return Blocked.PREEMPT_SELF  # it resumes once there is room (it fits alone)
            return Blocked.WAIT  # (asked ahead: decide at the boundary; too large: progress)
        if req.cls.protected and any(self._eligible(req, r) for r in self._s.live.values()):
            return Blocked.PREEMPT_OTHERS
        return Blocked.CONTINUE if req.spec.on_exhausted == "continue" else Blocked.WAIT

    @staticmethod
    def _eligible(req: Request, victim: Request) -> bool:
        from kvbudget.core.ledger import State

        return (
            victim is not req
            and victim.cls.preemptible
            and victim.cls.priority > req.cls.priority
            and victim.state in (State.ADMITTED, State.RUNNING, State.EXTENDING)
        )

    def choose_victims(
        self, req: Request, need_blocks: int, candidates: Sequence[Request]
    ) -> list[Request]:
        if self.cheap_to_pause(req):
            allowed = {r.request_id for r in candidates}
            chosen: list[Request] = []
            freed = 0
            for victim in self._newer(req):
                if freed >= need_blocks:
                    break
                if victim.request_id in allowed:
                    chosen.append(victim)
                    freed += victim.blocks
            return chosen
        now = self._s.now
        eligible = [r for r in candidates if self._eligible(req, r)]
        # cheapest to recompute first; among equals, the one with the most deadline slack
        eligible.sort(
            key=lambda r: (
                r.prompt + r.generated,
                -(r.deadline_at - now if r.deadline_at is not None else math.inf),
            )
        )
        chosen = []
        freed = 0
        for victim in eligible:
            if freed >= need_blocks:
                break
            chosen.append(victim)
            freed += victim.blocks
        return chosen

    def on_granted(self, req: Request) -> None:
        # expected extension demand of this grant: P(extend) x the growth still expected
        outrun = False
        if req.boundary >= req.hard_max:
            demand = 0.0
        elif self.cheap_to_pause(req):
            # granted the vLLM way: it will want its next extension soon
            demand = float(blocks_for(self._cheap_step(req), self.block_size))
        else:
            target = self._target(req)
            step = self._extension(req, target)
            if self._step(req) is not None:
                # a stepped grant still expects to grow to its calibrated target
                step = max(step, min(req.hard_max, target) - req.boundary)
            p_extend, outrun = self._p_extend(req)
            demand = p_extend * blocks_for(step, self.block_size)
        self._demand += demand - self._demand_of.get(req.request_id, 0.0)
        self._demand_of[req.request_id] = demand
        if outrun:
            self._outrun.add(req.request_id)
        else:
            self._outrun.discard(req.request_id)

    def _p_extend(self, req: Request) -> tuple[float, bool]:
        """How likely ``req`` outgrows its grant, as the headroom forecast counts it, and
        whether it is a protected stream that has outlived everything its distribution has seen.

        A protected stream is judged by what it has already outlived, P(L > boundary | L >
        generated): under a heavy tail one that ran long is likely to run longer (one that
        outlived everything seen is taken to go on), and its extension is what the headroom
        protects. Other work counts with P(L > boundary): it can wait at its boundary or be
        checkpointed, so its claim on the pool is the weaker one.
        """
        lengths = self._s.lengths
        beyond = lengths.survival(req.key, req.boundary)
        if not req.cls.protected:
            return beyond, False
        if not req.generated:
            return beyond, beyond <= 1e-9
        alive = lengths.survival(req.key, req.generated)
        if alive <= 1e-9:
            return 1.0, True
        return min(1.0, beyond / alive), beyond <= 1e-9

    def on_leave(self, req: Request) -> None:
        self._outrun.discard(req.request_id)
        self._demand -= self._demand_of.pop(req.request_id, 0.0)
        if not self._demand_of:
            self._demand = 0.0  # shed float drift when idle


class ReserveMaxPolicy(BasePolicy):
    """Reserve prompt + hard max at admission; never extend, never preempt.

    TensorRT-LLM's ``GUARANTEED_NO_EVICT`` capacity scheduler; TGI's router before grant segments.
    """

    name: ClassVar[str] = "reserve-max"
    preempt_for_admission = False


class SegmentedPolicy(BasePolicy):
    """Reserve prompt + min(hard max, ``segment``); at the boundary, re-queue with the output
    appended and re-prefill (TGI v3 router's segmented reservations)."""

    name: ClassVar[str] = "segmented"
    requeue_front = False

    def __init__(self, *, segment: int = 1024) -> None:
        self.segment = check_int("segment", segment, minimum=1)

    def initial_allowance(self, req: Request) -> int:
        return min(req.remaining, self.segment)

    def on_blocked(self, req: Request) -> Blocked:
        return Blocked.PREEMPT_SELF


class ReserveCurrentPolicy(BasePolicy):
    """vLLM v1 FCFS: admit while the prompt fits; grow block by block; when a step cannot
    allocate, preempt the most recently admitted request by recompute and put it at the head of
    the queue."""

    name: ClassVar[str] = "reserve-current"
    requeue_front = True

    def initial_allowance(self, req: Request) -> int:
        return 1

    def extension_tokens(self, req: Request) -> int | None:
        room = req.hard_max - req.boundary
        return min(room, self.block_size) if room > 0 else None

    def on_blocked(self, req: Request) -> Blocked:
        return Blocked.PREEMPT_OTHERS

    def choose_victims(
        self, req: Request, need_blocks: int, candidates: Sequence[Request]
    ) -> list[Request]:
        return _most_recent(req, candidates)


class NewTokenRatioPolicy(ReserveCurrentPolicy):
    """SGLang: admit while free tokens cover running requests' remaining x ratio plus the new
    request's prompt + min(max_new, 4096); the ratio starts at 0.7 and decays linearly to 0.098
    over 600 steps; when a step cannot allocate, retract the request with the fewest output
    tokens and reset the ratio.

    The running term uses the ledger's O(1) aggregate ``sum(hard_max) - sum(generated)`` rather
    than SGLang's per-request clip at 4096 (identical whenever max_new <= 4096).
    """

    name: ClassVar[str] = "new-token-ratio"
    clip = 4096

    def __init__(
        self, *, init_ratio: float = 0.7, min_ratio: float = 0.098, decay_steps: int = 600
    ) -> None:
        self.init_ratio = check_float("init_ratio", init_ratio, maximum=1.0, open_min=True)
        self.min_ratio = check_float("min_ratio", min_ratio, maximum=self.init_ratio)
        self.decay = (self.init_ratio - self.min_ratio) / check_int(
            "decay_steps", decay_steps, minimum=1
        )
        self.ratio = self.init_ratio

    def admit(self, req: Request, blocks: int) -> bool:
        led = self._s.ledger
        running_rest = (led.active_hard_max - led.active_generated) * self.ratio
        needed = req.prompt + req.generated + min(req.remaining, self.clip)
        return led.free * self.block_size - running_rest - needed >= 0

    def on_blocked(self, req: Request) -> Blocked:
        self.ratio = self.init_ratio
        return Blocked.PREEMPT_OTHERS

    def choose_victims(
        self, req: Request, need_blocks: int, candidates: Sequence[Request]
    ) -> list[Request]:
        pool = list(candidates)
        if req not in pool:
            pool.append(req)
        return [min(pool, key=lambda r: (r.generated, -r.seq))]

    def on_step(self) -> None:
        self.ratio = max(self.min_ratio, self.ratio - self.decay)


class PastFuturePolicy(ReserveCurrentPolicy):
    """LightLLM's Past-Future scheduler (ASPLOS 2025).

    A window of the last ``window`` finished lengths; each running request's final length is
    sampled from the window's lengths above what it already generated (its hard max when none);
    the peak KV over the finish points must stay under ``threshold`` of capacity in the worst of
    K = min(5, window/n + 1) samples; on overflow the most recently admitted request is paused.
    As in LightLLM, the test is drawn once per scheduling step: a refused head is drawn for again
    only when the clock or the set of running requests has moved.
    """

    name: ClassVar[str] = "past-future"

    def __init__(self, *, window: int = 200, threshold: float = 0.95, seed: int = 0) -> None:
        self.window: deque[int] = deque(maxlen=check_int("window", window, minimum=1))
        self.threshold = check_float("threshold", threshold, maximum=1.0, open_min=True)
        self._rng = random.Random(seed)
        self._sorted: list[int] = []
        self._dirty = False
        self._refused: tuple[str, float, int] | None = None

    def on_finished(self, req: Request, length: int) -> None:
        self.window.append(length)
        self._dirty = True

    def _sample(self, generated: int, hard_max: int) -> int:
        import bisect

        if self._dirty:
            self._sorted = sorted(self.window)
            self._dirty = False
        lengths = self._sorted
        i = bisect.bisect_right(lengths, generated)
        if i >= len(lengths):
            return hard_max
        return min(hard_max, lengths[self._rng.randrange(i, len(lengths))])

    def admit(self, req: Request, blocks: int) -> bool:
        # LightLLM draws once per scheduling step: a head refused at this instant, with the same
        # requests running, is not drawn for again until the clock or the running set moves
        attempt = (req.request_id, self._s.now, len(self._s.live))
        if attempt == self._refused:
            return False
        ok = self._fits_future(req)
        self._refused = None if ok else attempt
        return ok

    def _fits_future(self, req: Request) -> bool:
        from kvbudget.core.lifecycle import STOPPING_STATES

        live = list(self._s.live.values())
        live.append(req)
        n = len(live)
        k = min(5, self.window.maxlen // n + 1 if self.window.maxlen else 1)
        limit = self.threshold * self._s.capacity.tokens
        held_elsewhere = (
            sum(r.blocks for r in self._s.requests.values() if r.state in STOPPING_STATES)
            * self.block_size
        )
        for _ in range(k):
            futures = sorted(
                (self._sample(r.generated, r.hard_max) - r.generated, r.prompt + r.generated)
                for r in live
            )
            # at the moment the i-th shortest finishes, every request still running holds its
            # context plus that many more tokens
            total_ctx = sum(c for _, c in futures)
            peak = 0.0
            remaining_ctx = total_ctx
            for i, (rest, ctx) in enumerate(futures):
                usage = remaining_ctx + rest * (n - i)
                peak = max(peak, usage)
                remaining_ctx -= ctx
            if peak + held_elsewhere > limit:
                return False
        return True

    def choose_victims(
        self, req: Request, need_blocks: int, candidates: Sequence[Request]
    ) -> list[Request]:
        return _most_recent(req, candidates)


class OraclePolicy(BasePolicy):
    """Knows every request's true output length and reserves exactly that (simulation only).

    ``true_length(request_id)`` returns the length, or None when unknown (then the hard max is
    reserved, as ``reserve-max`` would).
    """

    name: ClassVar[str] = "oracle"

    def __init__(self, true_length: Callable[[str], int | None] | None = None) -> None:
        self.true_length = true_length

    def initial_allowance(self, req: Request) -> int:
        known = self.true_length(req.request_id) if self.true_length is not None else None
        if known is None or known <= req.generated:
            return req.remaining
        return max(1, min(req.remaining, known - req.generated))

    def extension_tokens(self, req: Request) -> int | None:
        room = req.hard_max - req.boundary
        return room if room > 0 else None


POLICIES: dict[str, type[BasePolicy]] = {
    cls.name: cls
    for cls in (
        CalibratedPolicy,
        ReserveMaxPolicy,
        SegmentedPolicy,
        ReserveCurrentPolicy,
        NewTokenRatioPolicy,
        PastFuturePolicy,
        OraclePolicy,
    )
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def make_policy(name: str, **kwargs: object) -> Policy:
    """Build a shipped policy by name (``calibrated``, ``reserve-max``, ...)."""
    if not isinstance(name, str):
        raise InvalidInput("policy", name, f"a policy name, one of {', '.join(POLICY_NAMES)}")
    try:
        cls = POLICIES[name]
    except KeyError:
        raise UnknownPolicy(name, POLICY_NAMES) from None
    policy: Policy = cls(**kwargs)
    return policy


def resolve_policy(policy: Policy | str | None) -> Policy:
    if policy is None:
        return CalibratedPolicy()
    if isinstance(policy, str):
        return make_policy(policy)
    for attr in ("name", "initial_allowance", "on_blocked", "bind"):
        if not hasattr(policy, attr):
            raise InvalidInput("policy", policy, f"a Policy (missing {attr!r}) or a policy name")
    return policy
