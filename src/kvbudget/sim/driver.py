"""The discrete-event driver: replays a workload through the real core in virtual time.

This module owns :func:`simulate` (one policy over one list of
:class:`~kvbudget.sim.scenario.SimRequest`) and :func:`run_policies` (several policies over the
same requests, with the ``goodput_vs_oracle`` ratio filled in). It drives
:class:`kvbudget.core.scheduler.Scheduler` exactly as a production shell does -- events in,
actions out -- against the engine of :mod:`kvbudget.sim.engine`, and measures the outcome from its
*own* records (not from the core's counters): what was decoded, when, and how each request ended.

Theory of operation
-------------------
Time is virtual. The engine runs back-to-back iterations while it has work; when it is idle the
clock jumps to the next timed event. Timed events are arrivals (``Scheduler.arrive``), client
disconnects at ``abandon_after_s`` after arrival (``Scheduler.cancel``; durable requests never
disconnect), release confirmations (``Scheduler.confirm_release``) and a ``Tick`` every
``engine.tick_s``. Each iteration:

1. the engine composes its step from what it holds *now*: the decode batch (every running
   request that is not stopped at its grant boundary, plus aborted requests whose abort is not
   confirmed yet) and up to ``prefill_chunk_tokens`` of pending prefill, first come first served;
   the step lasts ``step.decode_time(batch, context) + step.prefill_time(prefill)``;
2. timed events that fall inside the step are applied at their own times, in time order (an
   admission made mid-step joins the next step; a request preempted or aborted mid-step is
   handled when its token would come out);
3. at the end of the step every request in the batch gains one token and the driver calls
   ``charge``; a request whose prefill completed emits its first token. After its token a request
   that reached its true length calls ``finish("stop")`` (``finish("length")`` at the hard max);
   one that reached its grant boundary while it still has tokens to generate calls
   ``boundary_reached`` and *stops* -- it generates nothing until an ``Extend`` comes back, and the
   wait shows in its inter-token gaps. ``observe_step`` reports the decode part of the step.

Actions are carried out as an engine would: ``Admit`` allocates the request's blocks and queues
the prefill (prompt, plus the generated tokens of a resumed checkpoint: the recompute cost, less
the leading prompt blocks found in the prefix cache); ``Extend`` moves the boundary and
un-stops the request; ``Deny`` is counted; ``Preempt`` stops the request at once, its blocks
confirmed as the engine confirms an abort (at once, at the same instant, for a policy whose
engine preempts inside its own step: ``preempts_in_engine``); ``Abort`` (a cancelled or failed
request) keeps decoding -- wasted tokens -- until its abort is confirmed; ``Continue`` ends the
request explicitly (counted as continued), confirmed likewise. An abort is confirmed with the
second engine step that ends after it (the adapter's two step records), or, where the engine
has no step to run, ``abort_latency_s`` after it; ``Reject`` ends a request that was never
admitted as overloaded (a checkpoint that expired as failed); ``Released`` ends it for good,
or puts a preempted request back in the queue to resume. A request that finished by itself is
confirmed at the start of the next iteration.

Prefix caching (``EngineModel.prefix_caching``, :mod:`kvbudget.sim.prefix`). Each request's
spec gets ``prefix_blocks`` at the engine's block size when it arrives (from the trace's
``hash_ids`` or the scenario's system prompt), so the ledger charges shared blocks once. The
engine registers a request's prompt blocks in its :class:`~kvbudget.sim.prefix.PrefixCache` at
``Admit`` and frees them when the stop is confirmed; its prefill skips the leading cached
blocks, and at the first token it tells the scheduler how many tokens it found cached
(``Scheduler.note_cached``, as vLLM's ``num_cached_tokens``). As vLLM's, the cache keeps every
full block of a request, its output and its unshared prompt blocks included, under hashes of its
own: a preempted request that is admitted again skips the leading blocks of its prompt and
output that were not evicted meanwhile (a recompute costs only what the cache lost). The
engine counts its own blocks (each request's own, plus each held hash once); after every step it
evicts unreferenced cached blocks that no longer fit beside them. With ``check_invariants``
that count is checked against the ledger's ``used`` at every tick and passed to
``Scheduler.reconcile`` (which must then find no drift); otherwise the driver does not
reconcile: it confirms every stop itself.

The front end (``EngineModel.front_end``, off by default). The server process in front of the
engine is one queue of work, first come first served: an arriving request costs it
``per_request_s`` and reaches the scheduler when that is done (timed event kind 2); each step's
outputs (one per stream in the batch and per completed prefill) cost it ``per_output_s`` each,
queued at the step's end, and the step's tokens reach their clients when that is done. Those
delivery times are the records' first and last token times, so TTFT, TPOT and the goodput's
TTFT rule see them; the engine's steps, the scheduler's charges and the inter-token gaps keep
the engine's own times.

The intake (``EngineModel.intake_s``, 0 by default): each arriving request adds that much to the
engine's next step (the arrivals since the last step began are counted, and their intake paid at
once), so a burst of arrivals delays the steps that follow it.

What is measured (all from the driver's own records)
----------------------------------------------------
* Each request ends exactly once: completed, rejected (overloaded), abandoned, continued or
  failed; :func:`simulate` checks that the counts add up.
* **Goodput**: requests completed within their class SLO, per second of the *replayed arrival
  span* (first to last arrival; the same denominator for every policy). Interactive: completed,
  time to first token <= the class's ``ttft_slo_s``, and its p99 inter-token gap within the
  latency floor, i.e. at most 1 % of its gaps exceed ``latency_floor_s``. Batch: completed within
  its deadline after arrival.
* TTFT p50/p99 over interactive requests that got a first token; inter-token latency p50/p99
  over every gap between consecutive tokens of an interactive request (gaps across a preemption
  included), from a 0.1 ms histogram; ``stalls``: interactive gaps above the latency floor.
* Hard-max violations: tokens generated beyond a request's hard max. Silent truncations: requests
  that ended as completed (not cancelled, continued or failed) with fewer tokens than
  min(true length, hard max), or that the core released as completed without the engine having
  finished them.
* ``peak_resident``: the most requests whose blocks the engine held at once (admitted, not
  yet freed).
* ``prefix_cached_tokens``: prompt tokens found in the prefix cache at first admissions;
  ``prefix_hit_rate``: those over the prompt tokens of first admissions (cached or prefilled).
  ``resume_cached_tokens``: tokens that requests admitted again (after a preemption) found
  cached, i.e. did not recompute.
* Mean reserved and used KV: time-weighted over the makespan (first arrival to last release), as
  percent of capacity. Wasted decoded tokens: tokens decoded for requests that did not complete.

Performance: the per-token work is one ``charge`` call plus a few slot updates; the decode batch
is walked once per step, and gaps equal to the step length are counted in bulk.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import attrs

from kvbudget.core import events as ev
from kvbudget.core.config import SchedulerConfig
from kvbudget.core.cost import CostModel
from kvbudget.core.forecast import ForecastMemory
from kvbudget.core.lengths import LengthModel
from kvbudget.core.model import RequestSpec
from kvbudget.core.policy import OraclePolicy, Policy, make_policy
from kvbudget.core.scheduler import Scheduler
from kvbudget.errors import HardLimitExceeded, InvalidInput
from kvbudget.errors import SimulationError as SimulationError
from kvbudget.sim.engine_model import EngineModel
from kvbudget.sim.prefix import PrefixCache, system_prompt_blocks, trace_prefix_blocks
from kvbudget.sim.report import PolicyResult, RequestRecord, with_oracle_ratio
from kvbudget.sim.scenario import Scenario, SimRequest
from kvbudget.validate import check_float

__all__ = ["SimulationError", "run_policies", "simulate"]

# request phases in the engine (ints: compared on the hot path)
_QUEUED = 0  # waiting for admission (first time or to resume), holds nothing in the engine
_PREFILL = 1  # admitted, prefilling
_DECODE = 2  # decoding
_BLOCKED = 3  # stopped at its grant boundary, waiting for an extension
_ABORTING = 4  # cancelled/failed, decoding until the abort is confirmed
_HELD = 5  # stopped (finished / preempted / continued / aborted and idle), awaiting confirmation
_DONE = 6

_ENDS = ("completed", "rejected", "abandoned", "continued", "failed")
_MAX_SERIES = 2000
_ITL_RES = 10000.0  # histogram resolution: 0.1 ms
_NEVER = 1 << 62  # a token count no request reaches
_OWN_SEED = 0x6B76622D6F77  # "kvb-ow": hashes of a request's own blocks (integers only)


class _Req:
    __slots__ = (
        "abandon_at",
        "admitted_at",
        "arrival",
        "boundary",
        "cached_tokens",
        "chain",
        "ctx_in",
        "deadline",
        "end",
        "engine_held",
        "finished_at",
        "first_token_at",
        "floor",
        "gaps",
        "generated",
        "hard_max",
        "interactive",
        "last_seen",
        "last_token_at",
        "leave_at",
        "longest_gap",
        "phase",
        "prefill_left",
        "prefix",
        "prompt",
        "rid",
        "sim",
        "stalls",
        "stop_at",
        "ttft_slo",
        "uid",
    )

    def __init__(self, sim: SimRequest, floor: float, ttft_slo: float, deadline: float) -> None:
        self.sim = sim
        self.rid = sim.request_id
        self.arrival = sim.arrival_s
        self.prompt = sim.prompt_tokens
        self.hard_max = sim.spec.hard_max
        # the engine stops a request at its true stop point, or at max_tokens ("length")
        self.stop_at = sim.unclamped_output_tokens
        self.interactive = sim.spec.service_class == "interactive"
        self.floor = floor
        self.ttft_slo = ttft_slo
        self.deadline = deadline
        self.generated = 0
        self.boundary = 0
        self.phase = _QUEUED
        self.end: str | None = None
        self.admitted_at = -1.0
        self.first_token_at = -1.0
        self.last_token_at = -1.0
        self.last_seen = -1.0  # when its client got its latest token (the front end's delay)
        self.finished_at = -1.0
        self.gaps = 0
        self.longest_gap = 0.0  # (interactive: its longest gap between two tokens)
        self.stalls = 0
        self.prefill_left = 0
        self.ctx_in = False  # counted in the decode batch's context
        self.prefix: tuple[int, ...] = ()  # prompt block hashes (set at arrival)
        self.engine_held = False  # the engine holds blocks for it (admitted, not yet freed)
        self.cached_tokens = 0  # prompt tokens found cached at its latest admission
        # the engine's hashes of the blocks it allocated at the latest admission: the shared
        # prompt blocks, then the request's own full blocks (prompt and output)
        self.chain: tuple[int, ...] = ()
        self.uid = 0  # the request's index, for hashes of its own blocks
        self.abandon_at = (
            None
            if sim.abandon_after_s is None or sim.spec.durable
            else sim.arrival_s + sim.abandon_after_s
        )
        # a caller that leaves once it has received this many tokens (never: above any count)
        leave = sim.abandon_after_tokens
        self.leave_at = leave if leave is not None and not sim.spec.durable else _NEVER


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    n = len(sorted_values)
    if n == 0:
        return 0.0
    return float(sorted_values[min(n, max(1, math.ceil(q * n))) - 1])


def _hist_percentile(hist: dict[int, int], q: float) -> float:
    total = sum(hist.values())
    if total == 0:
        return 0.0
    rank = max(1, math.ceil(q * total))
    acc = 0
    for key in sorted(hist):
        acc += hist[key]
        if acc >= rank:
            return key / _ITL_RES
    return max(hist) / _ITL_RES


def _hist_cdf(hist: dict[int, int], points: int = 400) -> tuple[tuple[float, float], ...]:
    total = sum(hist.values())
    if total == 0:
        return ()
    keys = sorted(hist)
    out: list[tuple[float, float]] = []
    acc = 0
    stride = max(1, len(keys) // points)
    for i, key in enumerate(keys):
        acc += hist[key]
        if i % stride == 0 or i == len(keys) - 1:
            out.append((max(key, 1) / _ITL_RES, acc / total))
    return tuple(out)


def build_policy(name: str, truth: dict[str, int], seed: int = 0) -> Policy:
    """A fresh policy by name; ``oracle`` reads the true lengths from ``truth``."""
    if name == "oracle":
        return OraclePolicy(truth.get)
    if name == "past-future":
        return make_policy(name, seed=seed)
    return make_policy(name)


class _Sim:
    """One run: the engine state, the scheduler and the driver's records."""

    def __init__(
        self,
        requests: Sequence[SimRequest],
        scenario: Scenario,
        engine: EngineModel,
        policy: str | Policy,
        seed: int,
        progress: Callable[[float], None] | None,
        check_invariants: bool,
        config: SchedulerConfig | None = None,
        keep_requests: bool = False,
        lengths: LengthModel | None = None,
        cost: CostModel | None = None,
        stalls: Sequence[tuple[float, float] | tuple[float, float, float]] = (),
        stall_speed: float = 0.0,
    ) -> None:
        self.keep_requests = keep_requests
        self.stall_speed = check_float("stall_speed", stall_speed, maximum=1.0)
        #: (begin, seconds, speed) spans, sorted, in which the machine ran at that speed
        self.machine_stalls = _speed_spans(stalls, self.stall_speed)
        #: the first of them not over at the last step's start (steps start in time order)
        self._stall_at = 0
        self.engine = engine
        fe = engine.front_end
        self.fe_request_s = fe.per_request_s if fe is not None else 0.0
        self.fe_output_s = fe.per_output_s if fe is not None else 0.0
        #: when the front end's one thread is through with the work queued so far
        self.fe_free = -math.inf
        #: when the clients get the tokens of the step being handed out
        self.seen = 0.0
        self.scenario = scenario
        interactive, batch = scenario.service_classes()
        self.classes = {interactive.name: interactive, batch.name: batch}
        self.truth = {r.request_id: r.true_output_tokens for r in requests}
        pol = build_policy(policy, self.truth, seed) if isinstance(policy, str) else policy
        self.policy_name = pol.name
        # an engine that preempts inside its own step frees the victim's blocks at once (vLLM's
        # _preempt_request, SGLang's retract_decode); kvbudget's own policies preempt by an
        # abort through the engine's API, confirmed as any abort is (_confirm_later)
        self.preempts_in_engine: bool = getattr(pol, "preempts_in_engine", False)
        self.sched = Scheduler(
            engine.capacity,
            classes=(interactive, batch),
            policy=pol,
            # a caller may carry what the budget learned over from an earlier run, as a
            # server process that serves one workload after another does
            lengths=lengths if lengths is not None else LengthModel(),
            cost=cost if cost is not None else CostModel(),
            # the engine's own limits, whatever else the config sets
            config=attrs.evolve(
                config or SchedulerConfig(),
                max_active=engine.max_batch,
                prefill_chunk_tokens=engine.prefill_chunk_tokens,
            ),
        )
        self.progress = progress
        self.check_invariants = check_invariants
        self.reqs: dict[str, _Req] = {}
        self.order: list[_Req] = []
        for sim in requests:
            cls = self.classes[sim.spec.service_class]
            floor = cls.latency_floor_s if cls.latency_floor_s is not None else math.inf
            ttft = cls.ttft_slo_s if cls.ttft_slo_s is not None else math.inf
            dl = sim.spec.deadline if sim.spec.deadline is not None else cls.default_deadline_s
            r = _Req(sim, floor, ttft, dl if dl is not None else math.inf)
            r.uid = len(self.order)
            if r.rid in self.reqs:
                raise InvalidInput("requests", r.rid, "unique request ids")
            self.reqs[r.rid] = r
            self.order.append(r)
        self.order.sort(key=lambda r: r.arrival)
        # engine state
        self.decoding: dict[str, _Req] = {}
        self.prefill_q: deque[_Req] = deque()
        self.ctx_total = 0
        self.block_size = engine.capacity.block_size
        self.cache: PrefixCache | None = PrefixCache() if engine.prefix_caching else None
        # blocks the engine holds for requests beyond their hashed prompt blocks (those are
        # counted once each, in the cache's ``held``)
        self.own_blocks = 0
        self.prefix_prompt_tokens = 0
        self.prefix_cached_tokens = 0
        self.resume_cached_tokens = 0  # tokens resumed requests found cached (not recomputed)
        self.resident = 0  # requests whose blocks the engine holds
        self.peak_resident = 0
        # timed events: (time, seq, kind, rid); kinds: 0 confirm, 1 abandon, 2 the front end
        # hands an arrived request to the scheduler
        self.timed: list[tuple[float, int, int, str]] = []
        #: stops sent through the engine's API, awaiting the step record that confirms them:
        #: (engine steps done when it is confirmed, when it was sent, request id), in order
        self.step_confirms: deque[tuple[int, float, str]] = deque()
        #: engine steps completed so far
        self.steps_done = 0
        self.tseq = 0
        # records
        self.done = 0
        self.preemptions = 0
        self.recompute_tokens = 0
        self.last_release = 0.0
        self.denies = 0
        self.preempt_reasons: dict[str, int] = {}
        self.violations = 0
        self.silent = 0
        self.stalls = 0
        self.itl_hist: dict[int, int] = {}
        self.errors: list[str] = []

    # -- timed events -------------------------------------------------------------------------

    def _at(self, t: float, kind: int, rid: str) -> None:
        self.tseq += 1
        heapq.heappush(self.timed, (t, self.tseq, kind, rid))

    # -- the engine's blocks and prefix cache ---------------------------------------------

    def _spec(self, r: _Req) -> RequestSpec:
        """The spec the application would send: with the prompt's block hashes at the engine's
        block size where the engine caches prefixes (none where it does not)."""
        sim = r.sim
        spec = sim.spec
        if self.cache is None:
            return attrs.evolve(spec, prefix_blocks=()) if spec.prefix_blocks else spec
        if spec.prefix_blocks:
            return spec  # the caller's own hashes
        if sim.hash_ids:
            blocks = trace_prefix_blocks(sim.hash_ids, sim.prompt_tokens, self.block_size)
        elif sim.system_prompt is not None:
            blocks = system_prompt_blocks(
                sim.system_prompt, sim.system_prompt_tokens, sim.prompt_tokens, self.block_size
            )
        else:
            return spec
        return attrs.evolve(spec, prefix_blocks=blocks) if blocks else spec

    @property
    def engine_used_blocks(self) -> int:
        """The blocks the engine holds: each request's own, each shared prompt block once."""
        return self.own_blocks + (len(self.cache.held) if self.cache is not None else 0)

    def _chain(self, r: _Req, tokens: int) -> tuple[int, ...]:
        """The engine's hashes of ``r``'s full blocks among its first ``tokens - 1`` tokens:
        its shared prompt blocks, then blocks of its own. vLLM hashes every full block of a
        request, output included, and keeps the hashes of freed blocks until they are reused,
        so a preempted request that is admitted again finds its own blocks still cached."""
        if self.cache is None:
            return ()
        full = max(0, tokens - 1) // self.block_size
        prefix = r.prefix
        if full <= len(prefix):
            return prefix[:full]
        uid = r.uid
        return prefix + tuple(hash((_OWN_SEED, uid, k)) for k in range(len(prefix), full))

    def _allocate(self, r: _Req, tokens: int) -> int:
        """The engine takes blocks for ``r``'s ``tokens`` of context; returns the tokens it
        found cached (the leading blocks its prefill skips: shared prompt blocks, and on a
        resume the request's own blocks not evicted since)."""
        bs = self.block_size
        cache = self.cache
        chain = self._chain(r, tokens)
        r.chain = chain
        self.own_blocks += -(-tokens // bs) - len(chain)
        r.engine_held = True
        self.resident += 1
        if self.resident > self.peak_resident:
            self.peak_resident = self.resident
        hits = cache.allocate(chain) if cache is not None else 0
        if cache is not None and cache.cached:
            cache.trim(self.engine.capacity.blocks - self.engine_used_blocks)
        return hits * bs

    def _free(self, r: _Req) -> None:
        """The engine frees ``r``'s blocks (its stop is processed); its full blocks stay
        cached, unreferenced, until the space is needed."""
        if not r.engine_held:
            return
        r.engine_held = False
        self.resident -= 1
        tokens = r.prompt + r.generated
        chain = r.chain
        self.own_blocks -= -(-tokens // self.block_size) - len(chain)
        if self.cache is not None:
            # blocks that filled up since the admission join the cache too; the tail goes in
            # first, so it is evicted first, as vLLM frees a request's blocks tail first
            self.cache.park(self._chain(r, tokens)[len(chain) :])
            self.cache.free(chain)
        r.chain = ()

    def _check_engine(self) -> None:
        """The engine's own count of its blocks agrees with the ledger's ``used`` (a shared
        prompt block counted once on both sides), and its cache fits beside them."""
        used = self.engine_used_blocks
        booked = self.sched.ledger.used
        if used != booked:
            raise SimulationError(f"the engine holds {used} blocks, the ledger books {booked}")
        cached = len(self.cache.cached) if self.cache is not None else 0
        if used + cached > self.engine.capacity.blocks:
            raise SimulationError(f"{used} held + {cached} cached blocks exceed the capacity")

    def _reconcile(self, t: float) -> None:
        """Reconcile the ledger with the engine's own usage, as a production shell does from the
        engine's KV gauge (every stop is confirmed here, so it must find no drift)."""
        self.apply(self.sched.reconcile(self.engine_used_blocks, t), t)
        if self.sched.drift:
            raise SimulationError(f"reconciliation found a drift of {self.sched.drift} blocks")

    # -- engine membership ----------------------------------------------------------------

    def _enter_decode(self, r: _Req) -> None:
        r.phase = _DECODE
        self.decoding[r.rid] = r
        if not r.ctx_in:
            r.ctx_in = True
            self.ctx_total += r.prompt + r.generated

    def _leave_decode(self, r: _Req) -> None:
        if self.decoding.pop(r.rid, None) is not None and r.ctx_in:
            r.ctx_in = False
            self.ctx_total -= r.prompt + r.generated

    def _stop_engine(self, r: _Req) -> None:
        """Take the request out of the engine's work (decode batch or prefill queue)."""
        if r.phase == _PREFILL:
            with contextlib.suppress(ValueError):
                self.prefill_q.remove(r)
        self._leave_decode(r)

    def _finalise(self, r: _Req, end: str) -> None:
        if r.phase == _DONE:
            raise SimulationError(f"request {r.rid} ended twice ({r.end}, then {end})")
        if r.end is None:
            r.end = end
        self._stop_engine(r)
        self._free(r)
        r.prefix = ()  # (the hashes are needed only while the engine may hold the blocks)
        r.phase = _DONE
        self.done += 1

    # -- actions ------------------------------------------------------------------------------

    def apply(self, actions: Iterable[ev.Action], t: float) -> None:
        for a in actions:
            kind = a.__class__
            r = self.reqs[a.request_id]
            if kind is ev.Admit:
                assert isinstance(a, ev.Admit)
                if r.phase != _QUEUED:
                    raise SimulationError(f"Admit for {r.rid} in phase {r.phase}")
                first = r.admitted_at < 0
                if first:
                    r.admitted_at = t
                if a.resume is not None:
                    if a.resume.generated_tokens != r.generated:
                        raise SimulationError(
                            f"checkpoint of {r.rid} has {a.resume.generated_tokens} tokens, "
                            f"the engine generated {r.generated}"
                        )
                    r.prefill_left = r.prompt + r.generated
                else:
                    r.prefill_left = r.prompt
                if r.engine_held:
                    raise SimulationError(f"Admit for {r.rid} whose blocks the engine holds")
                cached = self._allocate(r, r.prefill_left)
                r.cached_tokens = cached
                r.prefill_left -= cached  # (hashes cover at most all but the last prompt token)
                if first:
                    self.prefix_prompt_tokens += r.prompt
                    self.prefix_cached_tokens += cached
                else:
                    self.resume_cached_tokens += cached
                r.boundary = a.boundary
                r.phase = _PREFILL
                self.prefill_q.append(r)
            elif kind is ev.Extend:
                assert isinstance(a, ev.Extend)
                r.boundary = a.boundary
                if r.phase == _BLOCKED:
                    self._enter_decode(r)
            elif kind is ev.Deny:
                self.denies += 1
            elif kind is ev.Preempt:
                assert isinstance(a, ev.Preempt)
                self.preemptions += 1
                self.recompute_tokens += a.recompute_tokens
                why = a.reason.split(":", 1)[0]
                self.preempt_reasons[why] = self.preempt_reasons.get(why, 0) + 1
                self._stop_engine(r)
                r.phase = _HELD
                if not self.preempts_in_engine:
                    self._confirm_later(r.rid, t)
                else:
                    # freed inside the engine's step, before the next running request asks for
                    # a block (vLLM's schedule loop): a victim's blocks serve the rest of this
                    # step's growth, rather than each one short of a block preempting another
                    self._free(r)
                    self.apply(self.sched.confirm_release(r.rid, t), t)
            elif kind is ev.Abort:
                assert isinstance(a, ev.Abort)
                if r.end is None:
                    r.end = "abandoned" if a.reason == "cancelled" else "failed"
                if r.phase == _DECODE and r.generated < r.boundary:
                    r.phase = _ABORTING  # keeps decoding until the abort is confirmed
                else:
                    self._stop_engine(r)
                    r.phase = _HELD
                self._confirm_later(r.rid, t)
            elif kind is ev.Continue:
                r.end = "continued"
                self._stop_engine(r)
                r.phase = _HELD
                self._confirm_later(r.rid, t)
            elif kind is ev.Reject:
                self._finalise(r, "failed" if r.admitted_at >= 0 else "rejected")
                r.finished_at = t
            elif kind is ev.Released:
                assert isinstance(a, ev.Released)
                if a.resumable:
                    r.phase = _QUEUED
                else:
                    if a.outcome == "completed" and r.end != "completed":
                        self.silent += 1  # the core ended it as complete; the engine did not
                        self.errors.append(f"{r.rid}: released as completed, engine said {r.end}")
                    if r.end is None:
                        r.end = {"cancelled": "abandoned", "continued": "continued"}.get(
                            a.outcome, "failed"
                        )
                    if r.finished_at < 0:
                        r.finished_at = t
                    self._finalise(r, r.end)
                    self.last_release = t
            # Reject of a request never admitted comes back from arrive/tick directly

    def _confirm_later(self, rid: str, t: float) -> None:
        """A stop sent through the engine's API at ``t``: the engine core takes it in before its
        next step and the adapter confirms it with the second step record after it (the first
        may be of the step in flight), as :class:`kvbudget.vllm.BudgetedEngine` does; an idle
        engine, which records no steps, confirms it ``abort_latency_s`` later (the adapter's
        round trip to the engine core)."""
        self.step_confirms.append((self.steps_done + 2, t, rid))

    def _confirm_idle(self, now: float) -> None:
        """The engine has nothing to step: its pending stops are confirmed by round trip."""
        latency = self.engine.abort_latency_s
        for _steps, sent, rid in self.step_confirms:
            self._at(max(now, sent + latency), 0, rid)
        self.step_confirms.clear()

    # -- the engine's per-token work ------------------------------------------------------------

    def _after_token(self, r: _Req, t: float) -> None:
        """Stop conditions after a token of a decoding request (phase may have changed)."""
        g = r.generated
        ph = r.phase
        if g >= r.leave_at and r.end is None and ph == _DECODE and g < min(r.stop_at, r.hard_max):
            # the caller has the tokens it waited for and disconnects now (the same path as a
            # timed disconnect; a request that just finished has nobody left to disconnect)
            self._at(t, 1, r.rid)
        if ph == _DECODE:
            if g >= r.stop_at:
                self._finish(r, "stop", t)
            elif g >= r.hard_max:
                self._finish(r, "length", t)
            elif g >= r.boundary:
                self._leave_decode(r)
                r.phase = _BLOCKED
                self.apply(self.sched.boundary_reached(r.rid, t), t)
        elif ph == _ABORTING and (g >= r.stop_at or g >= r.hard_max or g >= r.boundary):
            self._leave_decode(r)
            r.phase = _HELD  # idle until the abort is confirmed

    def _finish(self, r: _Req, reason: str, t: float) -> None:
        self._leave_decode(r)
        r.phase = _HELD
        r.end = "completed"
        r.finished_at = t
        self._at(t, 0, r.rid)  # confirmed at the start of the next iteration
        self.apply(self.sched.finish(r.rid, reason, t), t)

    def _enter(self, r: _Req, t: float) -> None:
        """``r`` reaches the scheduler (at its arrival, or once the front end took it in)."""
        spec = self._spec(r)
        r.prefix = spec.prefix_blocks
        self.apply(self.sched.arrive(r.rid, spec, t), t)
        if r.end is None and r.abandon_at is not None:
            self._at(max(r.abandon_at, t), 1, r.rid)

    def _token(self, r: _Req, t: float, step_start: float) -> None:
        """One token for ``r`` at ``t`` (slow path: first tokens, resumes, violations)."""
        g = r.generated + 1
        if g > r.hard_max:
            self.violations += 1
        r.generated = g
        if (r.prompt + g - 1) % self.block_size == 0:
            self.own_blocks += 1  # the token opens a new block
        if r.ctx_in:
            self.ctx_total += 1
        try:
            acts = self.sched.charge(r.rid, 1, t)
        except HardLimitExceeded as exc:
            self.errors.append(str(exc))
            self._leave_decode(r)
            r.phase = _HELD
            self.apply(self.sched.fail(r.rid, "hard-max", t), t)
            return
        last = r.last_token_at
        if last >= 0.0 and r.interactive:
            gap = t - last
            r.gaps += 1
            if gap > r.longest_gap:
                r.longest_gap = gap
            key = int(gap * _ITL_RES)
            self.itl_hist[key] = self.itl_hist.get(key, 0) + 1
            if gap > r.floor:
                r.stalls += 1
                self.stalls += 1
        if r.first_token_at < 0.0:
            r.first_token_at = self.seen
        r.last_seen = self.seen
        r.last_token_at = t
        if acts:
            self.apply(acts, t)

    # -- the loop -----------------------------------------------------------------------------

    def _stalled(self, start: float, work: float) -> float:
        """How long a step of ``work`` seconds that starts at ``start`` lasts when, during the
        machine's stalls, it runs at each one's speed (0: not at all)."""
        t = start
        stalls = self.machine_stalls
        at = self._stall_at
        while at < len(stalls) and stalls[at][0] + stalls[at][1] <= start:
            at += 1  # over before this step: over before every later one
        self._stall_at = at
        for i in range(at, len(stalls)):
            begin, length, speed = stalls[i]
            stop = begin + length
            if stop <= t:
                continue
            if t + work <= begin:
                break
            if begin > t:
                work -= begin - t
                t = begin
            if speed > 0.0 and t + work / speed <= stop:
                return t + work / speed - start
            work -= (stop - t) * speed
            t = stop
        return t + work - start

    def run(self) -> PolicyResult:
        wall0 = time.perf_counter()
        sched = self.sched
        engine = self.engine
        st = engine.step
        fixed, per_seq, per_ctx, per_pre = (
            st.fixed_s,
            st.per_seq_s,
            st.per_context_token_s,
            st.prefill_per_token_s,
        )
        chunk = engine.prefill_chunk_tokens
        machine_stalls = self.machine_stalls
        tick_s = engine.tick_s
        cap_blocks = engine.capacity.blocks
        bs = self.block_size
        cache = self.cache
        note_cached = sched.note_cached
        ledger = sched.ledger
        order = self.order
        n = len(order)
        timed = self.timed
        charge = sched.charge
        itl = self.itl_hist
        decoding = self.decoding
        prefill_q = self.prefill_q
        inf = math.inf

        first_arrival = order[0].arrival if order else 0.0
        last_arrival = order[-1].arrival if order else 0.0
        now = first_arrival
        next_tick = first_arrival + tick_s
        ai = 0
        steps = 0
        area_res = 0.0
        area_used = 0.0
        series: list[tuple[float, float, float]] = []
        self.last_release = first_arrival
        guard = last_arrival + 1e6

        fe_request_s, fe_output_s = self.fe_request_s, self.fe_output_s
        intake_s = engine.intake_s
        #: arrivals since the last step began, whose intake the next step pays
        arrived = 0

        def drain(until: float) -> None:
            nonlocal ai, next_tick, arrived
            while True:
                ta = order[ai].arrival if ai < n else inf
                te = timed[0][0] if timed else inf
                t = min(ta, te, next_tick)
                if t > until:
                    return
                if t == ta:
                    r = order[ai]
                    ai += 1
                    arrived += 1
                    if fe_request_s > 0.0:  # the front end takes it in first
                        free = self.fe_free
                        self.fe_free = (free if free > t else t) + fe_request_s
                        self._at(self.fe_free, 2, r.rid)
                    else:
                        self._enter(r, t)
                elif t == te:
                    _t, _s, kind, rid = heapq.heappop(timed)
                    r = self.reqs[rid]
                    if kind == 2:
                        self._enter(r, t)
                    elif kind == 0:
                        if r.phase != _DONE and r.phase != _QUEUED:
                            if r.phase == _ABORTING:
                                self._leave_decode(r)
                                r.phase = _HELD
                            self._free(r)  # the engine processed the stop: blocks are free
                            self.apply(sched.confirm_release(rid, t), t)
                    elif r.end is None and r.phase != _DONE:
                        # the caller disconnects
                        r.end = "abandoned"
                        was_queued = r.phase == _QUEUED
                        self.apply(sched.cancel(rid, t), t)
                        if was_queued and r.phase != _DONE:
                            r.finished_at = t
                            self._finalise(r, "abandoned")
                else:
                    self.apply(sched.tick(t), t)
                    series.append(
                        (t, 100.0 * ledger.reserved / cap_blocks, 100.0 * ledger.used / cap_blocks)
                    )
                    if self.check_invariants:
                        sched.check_invariants()
                        self._check_engine()
                        self._reconcile(t)
                    next_tick = t + tick_s

        while self.done < n:
            if (
                (ai < n and order[ai].arrival <= now)
                or (timed and timed[0][0] <= now)
                or (next_tick <= now)
            ):
                drain(now)
            if self.done >= n:
                break
            # 1. compose the step
            batch = list(decoding.values())
            nb = len(batch)
            plan: list[tuple[_Req, int]] = []
            budget = chunk
            pre_tokens = 0
            for r in prefill_q:
                if budget <= 0:
                    break
                take = r.prefill_left if r.prefill_left < budget else budget
                plan.append((r, take))
                budget -= take
                pre_tokens += take
            if nb == 0 and pre_tokens == 0:
                # idle: jump to the next timed event
                if self.step_confirms:
                    self._confirm_idle(now)
                ta = order[ai].arrival if ai < n else inf
                te = timed[0][0] if timed else inf
                if not sched.requests and ta < inf:
                    # nothing held or queued: ticks have nothing to do until the next event
                    nxt = min(ta, te)
                    if next_tick < nxt:
                        next_tick = first_arrival + tick_s * math.ceil(
                            (nxt - first_arrival) / tick_s
                        )
                t_next = min(ta, te, next_tick)
                if t_next == inf or t_next > guard:
                    stuck = [r.rid for r in order if r.phase != _DONE][:10]
                    raise SimulationError(
                        f"{self.policy_name}: no event left but {n - self.done} requests never "
                        f"ended (e.g. {stuck})"
                    )
                area_res += ledger.reserved * (t_next - now)
                area_used += ledger.used * (t_next - now)
                now = t_next
                continue
            ctx = self.ctx_total
            decode_s = fixed + per_seq * nb + per_ctx * ctx if nb else 0.0
            dt = decode_s + per_pre * pre_tokens + (fixed if nb == 0 else 0.0)
            if arrived:
                dt += intake_s * arrived
                arrived = 0
            if machine_stalls:
                dt = self._stalled(now, dt)
            t_end = now + dt
            area_res += ledger.reserved * dt
            area_used += ledger.used * dt
            # 2. what happens during the step
            if (
                (ai < n and order[ai].arrival <= t_end)
                or (timed and timed[0][0] <= t_end)
                or (next_tick <= t_end)
            ):
                drain(t_end)
            # 3. tokens at the end of the step
            step_start = now
            now = t_end
            steps += 1
            self.steps_done = steps
            if fe_output_s > 0.0:
                # the front end hands this step's outputs out after what it has queued: one
                # per stream in the batch and per prefill that completes
                outputs = nb
                for r, take in plan:
                    if r.prefill_left <= take:
                        outputs += 1
                free = self.fe_free
                self.fe_free = (free if free > now else now) + outputs * fe_output_s
                self.seen = seen = self.fe_free
            else:
                self.seen = seen = now
            contiguous = 0
            for r in batch:
                ph = r.phase
                if ph != _DECODE and ph != _ABORTING:
                    continue
                g = r.generated
                if g >= r.boundary or g >= r.hard_max or r.last_token_at != step_start:
                    if g >= r.boundary:
                        continue  # the engine cannot write past the grant
                    self._token(r, now, step_start)
                    if r.phase == _DECODE or r.phase == _ABORTING:
                        self._after_token(r, now)
                    continue
                # fast path: an ordinary decode token, previous token one step ago
                g += 1
                r.generated = g
                self.ctx_total += 1
                if (r.prompt + g - 1) % bs == 0:
                    self.own_blocks += 1  # the token opens a new block
                acts = charge(r.rid, 1, now)
                r.last_token_at = now
                r.last_seen = seen
                if r.interactive:
                    contiguous += 1
                    r.gaps += 1
                    if dt > r.longest_gap:
                        r.longest_gap = dt
                    if dt > r.floor:
                        r.stalls += 1
                        self.stalls += 1
                if acts:
                    self.apply(acts, now)
                if (
                    g >= r.boundary
                    or g >= r.stop_at
                    or g >= r.hard_max
                    or g >= r.leave_at
                    or r.phase != ph
                ):
                    self._after_token(r, now)
            if contiguous:
                key = int(dt * _ITL_RES)
                itl[key] = itl.get(key, 0) + contiguous
            for r, take in plan:
                if r.phase != _PREFILL:
                    continue
                r.prefill_left -= take
                if r.prefill_left > 0:
                    continue
                prefill_q.remove(r)
                if cache is not None and r.prefix:
                    note_cached(r.rid, r.cached_tokens)  # as vLLM's num_cached_tokens
                if r.generated >= r.stop_at or r.generated >= r.hard_max:
                    # resumed after its last token: nothing left to generate
                    self._enter_decode(r)
                    self._finish(r, "stop" if r.generated >= r.stop_at else "length", now)
                    continue
                self._enter_decode(r)
                self._token(r, now, step_start)
                if r.phase == _DECODE:
                    self._after_token(r, now)
            confirms = self.step_confirms
            while confirms and confirms[0][0] <= steps:
                self._at(now, 0, confirms.popleft()[2])  # this step's record confirms it
            if cache is not None and cache.cached:
                # the step's new blocks may need the room of unreferenced cached ones
                cache.trim(cap_blocks - self.engine_used_blocks)
            if nb:
                sched.observe_step(nb, ctx, decode_s, now)
            if pre_tokens:
                # as the vLLM adapter feeds it from the engine's step details: the cost model
                # learns the engine's prefill cost (the step's time beyond its decode part)
                sched.cost.observe_prefill(pre_tokens, per_pre * pre_tokens)
            if self.progress is not None and steps % 512 == 0:
                self.progress(ai / n if n else 1.0)
        if self.progress is not None:
            self.progress(1.0)
        return self._result(
            first_arrival,
            last_arrival,
            max(now, self.last_release),
            steps,
            area_res,
            area_used,
            series,
            time.perf_counter() - wall0,
        )

    # -- results ------------------------------------------------------------------------------

    def _result(
        self,
        first_arrival: float,
        last_arrival: float,
        end: float,
        steps: int,
        area_res: float,
        area_used: float,
        series: list[tuple[float, float, float]],
        wall: float,
    ) -> PolicyResult:
        if self.sched.policy_faults:
            # (the core went on after them, a server would too; a comparison must not)
            fault = self.sched.policy_fault_log[0]
            raise SimulationError(
                f"the policy faulted {self.sched.policy_faults} time(s), first: {fault}"
            ) from fault
        counts = dict.fromkeys(_ENDS, 0)
        good_i = good_b = 0
        ttfts: list[float] = []
        decoded_fast = 0
        for r in self.order:
            if r.phase != _DONE or r.end not in counts:
                raise SimulationError(f"request {r.rid} did not end (phase {r.phase}, {r.end})")
            counts[r.end] += 1
            decoded_fast += r.generated
            if r.end == "completed":
                expected = min(r.stop_at, r.hard_max)
                if r.generated < expected:
                    self.silent += 1
                    self.errors.append(f"{r.rid}: completed with {r.generated} < {expected}")
            if r.interactive and r.first_token_at >= 0:
                ttfts.append(r.first_token_at - r.arrival)
            if r.end != "completed":
                continue
            if r.interactive:
                if r.first_token_at - r.arrival <= r.ttft_slo and r.stalls <= 0.01 * r.gaps:
                    good_i += 1
            elif r.finished_at - r.arrival <= r.deadline:
                good_b += 1
        total = sum(counts.values())
        if total != len(self.order):
            raise SimulationError(f"{total} outcomes for {len(self.order)} requests")
        wasted_tokens = sum(r.generated for r in self.order if r.end in ("abandoned", "failed"))
        window = last_arrival - first_arrival
        makespan = max(end - first_arrival, 1e-9)
        if window <= 0:
            window = makespan
        ttfts.sort()
        snap = self.sched.snapshot()
        under = snap.underestimation
        if len(series) > _MAX_SERIES:
            stride = math.ceil(len(series) / _MAX_SERIES)
            series = series[::stride]
        cap = self.engine.capacity.blocks
        good = good_i + good_b
        return PolicyResult(
            policy=self.policy_name,
            requests=total,
            good=good,
            good_interactive=good_i,
            good_batch=good_b,
            goodput_rps=good / window,
            completed=counts["completed"],
            rejected=counts["rejected"],
            abandoned=counts["abandoned"],
            continued=counts["continued"],
            failed=counts["failed"],
            preemptions=self.preemptions,
            recompute_tokens=self.recompute_tokens,
            wasted_decoded_tokens=wasted_tokens,
            decoded_tokens=decoded_fast,
            ttft_p50_s=_percentile(ttfts, 0.5),
            ttft_p99_s=_percentile(ttfts, 0.99),
            itl_p50_s=_hist_percentile(self.itl_hist, 0.5),
            itl_p99_s=_hist_percentile(self.itl_hist, 0.99),
            stalls=self.stalls,
            core_stalls=snap.stalls,
            kv_reserved_mean=100.0 * area_res / makespan / cap,
            kv_used_mean=100.0 * area_used / makespan / cap,
            hard_max_violations=self.violations,
            silent_truncations=self.silent,
            extensions=snap.extensions_granted,
            extensions_denied=snap.extensions_denied,
            under_p50=under.overall.shortfall_p50 if under else 0,
            under_p90=under.overall.shortfall_p90 if under else 0,
            under_p99=under.overall.shortfall_p99 if under else 0,
            coverage=under.overall.coverage if under else 0.0,
            window_s=window,
            makespan_s=makespan,
            steps=steps,
            wall_s=wall,
            peak_resident=self.peak_resident,
            rejections_by_reason=dict(sorted(snap.rejections_by_reason.items())),
            turned_away_held_by=dict(sorted(snap.turned_away_held_by.items())),
            turned_away_behind=snap.turned_away_behind,
            prefix_cached_tokens=self.prefix_cached_tokens,
            resume_cached_tokens=self.resume_cached_tokens,
            prefix_hit_rate=(
                self.prefix_cached_tokens / self.prefix_prompt_tokens
                if self.prefix_prompt_tokens
                else 0.0
            ),
            itl_cdf=_hist_cdf(self.itl_hist),
            kv_series=tuple(series),
            request_records=self._records() if self.keep_requests else (),
            forecast_memory=self.sched.forecast.memory(),
        )

    def _records(self) -> tuple[RequestRecord, ...]:
        """Each request as a client saw it, in arrival order (times on the replayed timeline)."""
        return tuple(
            RequestRecord(
                request_id=r.rid,
                arrival_s=r.arrival,
                end=r.end or "failed",
                prompt_tokens=r.prompt,
                output_tokens=r.generated,
                expected_tokens=min(r.stop_at, r.hard_max),
                first_token_s=r.first_token_at if r.first_token_at >= 0 else None,
                last_token_s=r.last_seen if r.last_seen >= 0 else None,
                finished_s=r.finished_at if r.finished_at >= 0 else None,
                longest_gap_s=r.longest_gap if r.interactive and r.gaps else None,
                service_class=r.sim.spec.service_class,
            )
            for r in self.order
        )


def _speed_spans(
    stalls: Sequence[tuple[float, float] | tuple[float, float, float]], default_speed: float
) -> list[tuple[float, float, float]]:
    """``stalls`` as sorted ``(begin, seconds, speed)`` spans (a pair runs at
    ``default_speed``); empty ones dropped, typed errors for the rest. Spans must not
    overlap."""
    spans: list[tuple[float, float, float]] = []
    for i, span in enumerate(stalls):
        if len(span) not in (2, 3):
            raise InvalidInput(f"stalls[{i}]", span, "(begin, seconds) or (begin, seconds, speed)")
        begin = check_float(f"stalls[{i}] begin", span[0], minimum=-math.inf)
        length = check_float(f"stalls[{i}] seconds", span[1])
        speed = (
            default_speed if len(span) == 2
            else check_float(f"stalls[{i}] speed", span[2], maximum=1.0)
        )
        if length > 0:
            spans.append((begin, length, speed))
    spans.sort()
    for (a, d, _), (b, _, _) in itertools.pairwise(spans):
        if b < a + d:
            raise InvalidInput("stalls", (a, d, b), "spans that do not overlap")
    return spans


def simulate(
    requests: Sequence[SimRequest],
    scenario: Scenario,
    engine: EngineModel | None = None,
    policy: str | Policy = "calibrated",
    *,
    seed: int = 0,
    progress: Callable[[float], None] | None = None,
    check_invariants: bool = False,
    config: SchedulerConfig | None = None,
    keep_requests: bool = False,
    lengths: LengthModel | None = None,
    cost: CostModel | None = None,
    stalls: Sequence[tuple[float, float] | tuple[float, float, float]] = (),
    stall_speed: float = 0.0,
    forecast: ForecastMemory | None = None,
) -> PolicyResult:
    """Replay ``requests`` (from :func:`~kvbudget.sim.scenario.apply_scenario`) through one policy.

    ``scenario`` supplies the service classes (objectives); ``engine`` the engine model (defaults:
    :class:`~kvbudget.sim.engine.EngineModel`). ``policy``: a shipped policy name (``oracle``
    is built with the requests' true lengths) or a Policy instance. ``progress`` is called with
    the share of arrivals replayed. ``check_invariants`` asserts the ledger invariants at every
    tick (slow; for tests). ``config``: the scheduler's knobs (its ``max_active`` and
    ``prefill_chunk_tokens`` are the engine model's). ``keep_requests``: also return every
    request's own record (``PolicyResult.request_records``: arrival, end, tokens, first and last
    token times), for a caller that classifies requests by its own SLO. ``lengths``/``cost``:
    the scheduler's length and step-cost models (default: fresh ones); pass the ones of an
    earlier run to start from what it learned (they are updated in place). ``stalls``:
    ``(begin, seconds)`` spans on the replayed timeline in which the machine ran at
    ``stall_speed`` of its speed (0: nothing at all; a step that meets one lasts longer, while
    the clock, arrivals and ticks go on), as a busy 2-core VM is sometimes barely scheduled; a
    span ``(begin, seconds, speed)`` runs at its own speed (0-1); spans must not overlap.
    ``forecast``: what an earlier run's forecast had learned (its result's
    ``forecast_memory``), taken over at the first arrival as a server that goes on serving
    keeps it (its release rate, the calibration of its wait forecasts). Deterministic for
    given inputs.
    """
    sim = _Sim(
        requests,
        scenario,
        engine or EngineModel(),
        policy,
        seed,
        progress,
        check_invariants,
        config,
        keep_requests,
        lengths,
        cost,
        stalls,
        stall_speed,
    )
    if forecast is not None:
        sim.sched.forecast.recall(forecast, min((r.arrival_s for r in requests), default=0.0))
    return sim.run()


def run_policies(
    requests: Sequence[SimRequest],
    scenario: Scenario,
    engine: EngineModel | None = None,
    policies: Sequence[str] = (),
    *,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
    config: SchedulerConfig | None = None,
) -> dict[str, PolicyResult]:
    """:func:`simulate` each policy over the same requests; fills ``goodput_vs_oracle``.

    ``progress(i, share)`` reports policy ``i``'s share of arrivals replayed.
    """
    from kvbudget.core.policy import POLICY_NAMES

    names = list(policies) or list(POLICY_NAMES)
    results: dict[str, PolicyResult] = {}
    for i, name in enumerate(names):
        cb: Callable[[float], None] | None = None
        if progress is not None:

            def cb(share: float, _i: int = i) -> None:
                progress(_i, share)

        results[name] = simulate(
            requests, scenario, engine, name, seed=seed, progress=cb, config=config
        )
    return with_oracle_ratio(results)
