"""kvbudget's own policy: calibrated quantile grants, bounded extensions from a headroom pool,
and, where the engine's re-prefill is cheap, the engine's own optimism (class docstring)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, ClassVar

from kvbudget.core.lifecycle import LIVE_STATES, State
from kvbudget.core.model import blocks_for
from kvbudget.core.policy.base import BasePolicy, Blocked
from kvbudget.validate import check_float, check_int

if TYPE_CHECKING:
    from kvbudget.core.lifecycle import Request
    from kvbudget.core.view import SchedulerView


#: the objective a pause's re-prefill is weighed against for a class with no first-token one
_REFERENCE_S = 2.0
#: the ``first_token_pause_share`` to turn the pauses on with
#: (:meth:`CalibratedPolicy.first_token_pause_at`); the policy's default is off (None)
FIRST_TOKEN_PAUSE_SHARE = 0.75


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
      ``protected_fraction`` of capacity is reserved for protected classes while one is live.
      A grant made the vLLM way (:meth:`cheap_to_pause`) adds no demand: it grows by pausing a
      newer stream, as vLLM's do, and blocks kept free for it would only shrink the batch;
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
      queue);
    * a grant made the vLLM way is as tight as vLLM's allocation where the engine's steps are
      short against the stream's latency floor (``tight_floor_steps``, :meth:`_tight`): to
      the end of the block its next token goes in, one block at a time, asked a pause's
      confirmation ahead (None: always a block ahead, two at a time);
    * running streams are not paused for a fresh caller's first token unless
      ``first_token_pause_share`` is set (:meth:`first_token_pause_at`): by default a wave larger
      than the cache is answered with bounded admission and an early "overloaded", and the
      streams admitted keep their pace.
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
        first_token_pause_share: float | None = None,
        tight_floor_steps: int | None = 20,
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
        self.first_token_pause_share = (
            None
            if first_token_pause_share is None
            else check_float(
                "first_token_pause_share", first_token_pause_share, open_min=True, maximum=1.0
            )
        )
        self.tight_floor_steps = (
            None
            if tight_floor_steps is None
            else check_int("tight_floor_steps", tight_floor_steps, minimum=1)
        )
        self._demand = 0.0
        self._demand_of: dict[str, float] = {}
        self._outrun: set[str] = set()
        #: class name -> the tightest first-token objective of the classes served before it,
        #: for classes with no objective of their own (batch_prefill_share applies to them)
        self._objective_above: dict[str, float] = {}

    def bind(self, scheduler: SchedulerView) -> None:
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
        by the cost model: the vLLM adapter and the simulated engine feed them, and
        :class:`~kvbudget.vllm.BudgetedEngine` measures them before it serves) and
        re-prefilling its prompt plus the p90 of its length (less the prompt blocks its twins
        keep cached) takes at most ``recompute_share`` of its first-token objective (2 s for a
        class without one).
        Such a request is granted like vLLM grants: the blocks it fills now and one more, grown
        two blocks at a time, or tighter where its steps are short against its latency floor
        (:meth:`_tight`); when the cache runs out a request admitted after it is paused
        (checkpointed; :meth:`_newer` says which), as vLLM preempts, but before the engine
        has to."""
        share = self.recompute_share
        if share is None or not req.spec.resumable:
            return False
        s = self._s
        cost = s.cost
        if cost.prefill_observations < self.min_prefill_observations:
            return False
        objective = req.cls.ttft_slo_s if req.cls.ttft_slo_s is not None else _REFERENCE_S
        # its context then (up to the p90 of its length), less the prompt blocks its twins keep
        # in the engine's cache
        more = max(0, min(req.hard_max, s.lengths.quantile(req.key, 0.9)) - req.generated)
        expected = s.ledger.reprefill_tokens(req) + more
        return cost.predict_prefill(expected) <= share * objective

    def acts_ahead(self, req: Request) -> bool:
        return self.cheap_to_pause(req)

    def _pausable_after(self, req: Request) -> Iterator[Request]:
        """Live requests admitted after ``req`` that may be paused, of any class (in no
        particular order); those that give way for ``req``'s growth are the ones of no higher
        priority than it (:meth:`_gives_way_for_growth`)."""
        return (
            r
            for r in self._s.live.values()
            if r.seq > req.seq and r.spec.resumable and r.generated < r.hard_max
        )

    @staticmethod
    def _gives_way_for_growth(victim: Request, req: Request) -> bool:
        """A stream more important than ``req`` never gives way for its growth."""
        return victim.cls.priority >= req.cls.priority

    def _newer(self, req: Request) -> list[Request]:
        """Live requests admitted after ``req`` that may be paused for it (none more important
        than it: :meth:`_gives_way_for_growth`), in the order they give way: those still waiting for
        their first token last (a pause would make it late; one that has had it loses only
        pace), then the most tokens per pause first: the length a stream is expected to reach
        (:meth:`~kvbudget.core.scheduler.Scheduler.expected_length`) over the pauses it will
        then have had. A pause is one long gap in a stream; spread over many tokens it costs the
        stream's pace little, over few it breaks it (a stream of 50 tokens paused once has 2 %
        of its gaps over the floor), and a second pause of one stream costs it twice. Equal
        ones: the newest first, as vLLM preempts."""
        s = self._s
        return sorted(
            (r for r in self._pausable_after(req) if self._gives_way_for_growth(r, req)),
            key=lambda r: (
                r.first_token_at is None,
                -s.expected_length(r) / (1 + r.preemptions),
                -r.seq,
            ),
        )

    def first_token_pause_at(self, req: Request) -> float | None:
        """``first_token_pause_share`` of the first-token objective, for a fresh caller under
        one that is cheap to pause (None: never): the queue slack at which running streams are
        paused for it. Where the objective is on the first token and the mean pace after it, a
        stall of a stream well inside its pace costs it little and an "overloaded" costs the
        caller everything; each stream gives way at most once (:meth:`gives_way`) and is
        requeued behind the callers queued then, so a burst is spread over the cache's
        turnovers rather than thrashed. Off by default (None): a paused stream waits behind
        those callers, and under sustained overload that is a freeze of seconds in an answer
        already streaming; with the pauses off the servers over the real engine froze no stream
        and still served more callers in time than vLLM's own server under overload
        (``docs/policies.md``). Turned on, :data:`FIRST_TOKEN_PAUSE_SHARE` (0.75) pauses before
        the last responsible moment: the objective is met where the caller reads the token,
        past a network and a client that take their share of it."""
        share = self.first_token_pause_share
        objective = req.cls.ttft_slo_s
        if share is None or objective is None or req.generated or not self.cheap_to_pause(req):
            return None
        return share * objective

    def gives_way(self, victim: Request, head: Request) -> bool:
        """``victim`` was never paused, is cheap to pause, is of no higher priority than
        ``head``, and is expected (its conditional median length, at the current step time)
        to hold its blocks longer than re-prefilling it takes and than a quarter of the time
        ``head`` may still wait: one about to finish returns them soon enough without a
        pause."""
        if (
            victim is head
            or victim.preemptions
            or victim.cls.priority < head.cls.priority
            or victim.state not in LIVE_STATES
            or not self.cheap_to_pause(victim)
        ):
            return False
        s = self._s
        slack = s.queue_slack(head)
        held = s.seconds_left(victim)
        return held > s.cost.predict_prefill(s.ledger.reprefill_tokens(victim)) and (
            slack is None or held > 0.25 * slack
        )

    def _tight(self, req: Request) -> bool:
        """Is ``req``, granted the vLLM way (:meth:`cheap_to_pause`: the caller asks), granted
        as tight as vLLM allocates? Where its class has a latency floor at least
        ``tight_floor_steps`` engine steps long (at the scheduler's ``step_seconds`` now): its
        grant then reaches the end of the block its next token goes in,
        grows one block at a time, and is asked to grow only as many tokens ahead as a pause of
        a newer stream takes to return its blocks (:meth:`_pause_lookahead`). Elsewhere it holds
        the next block as well, grows two at a time and asks a block ahead.

        A block held ahead by every stream is a block per stream no caller can be admitted
        into: over the 20-30 streams of a small cache, a tenth of it, and callers queued in a
        wave time out behind it while vLLM admits them. Where steps are short against the
        floor, a stream that reaches its boundary before the blocks it asked for are back loses
        a few steps of its pace, not its floor; where they are long (an A100 under load, 80 ms
        steps against a 200 ms floor), a step lost is a stall, and the block ahead is kept."""
        steps = self.tight_floor_steps
        floor = req.latency_floor
        return (
            steps is not None
            and math.isfinite(floor)
            and self._s.step_seconds() * steps <= floor
        )

    def _pause_lookahead(self) -> int:
        """Tokens before its boundary a tight grant (:meth:`_tight`) asks to grow: those its
        stream makes while a pause of a newer stream returns its blocks (the engine's
        confirmation delay as measured, ``confirm_seconds``, at the current step time), and two
        more for tokens the engine produced before its reader charged them. At most a block;
        a block until a confirmation was measured."""
        s = self._s
        confirm = s.confirm_seconds
        step = s.step_seconds()
        if confirm is None or not step > 0.0:
            return self.block_size
        return max(1, min(self.block_size, math.ceil(confirm / step) + 2))

    def initial_allowance(self, req: Request) -> int:
        if self.cheap_to_pause(req):
            if self._tight(req):
                # to the end of the block its next token goes in (less the slack the ledger
                # charges past every boundary): what vLLM allocates for it
                ledger = self._s.ledger
                blocks = blocks_for(req.context_tokens + 1 + ledger.slack_tokens, self.block_size)
                fill = ledger.covered_boundary(req, blocks) - req.generated
                return max(1, min(req.remaining, fill))
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
        if self.cheap_to_pause(req) and self._tight(req):
            return self._pause_lookahead()
        return self.lookahead_blocks * self.block_size

    def admit(self, req: Request, blocks: int) -> bool:
        # A protected head that does not fit its admission budget may take the unprotected
        # headroom (the scheduler's rule) only while the forecast behind it holds: once a
        # protected stream has outlived everything its distribution has seen, as a wave of
        # long answers does, its extensions are real demand, and the headroom is kept for them.
        if self._outrun and req.cls.protected and not self._s.ledger.fits_admission(blocks):
            return False
        if (
            not self._s.ledger.fits_admission(blocks)  # (the cheaper question first)
            and self.cheap_to_pause(req)
            and (req.generated or self._s.released_in_time(req, blocks))
        ):
            # the headroom is the next extension of every live stream granted the vLLM way: a
            # head let into it would be the first paused when they grow, so it waits for room
            # beyond it while the blocks released at the recent rate admit it in time. A fresh
            # caller they would not (a burst, before anything was released) takes the headroom
            # for its first token, as vLLM admits whatever fits, and is paused, cheaply, when
            # the streams grow; a checkpoint waiting to resume has had its first token and waits
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
        """An extension of a request granted the vLLM way: two blocks, one for a tight grant
        (:meth:`_tight`), or what remains."""
        blocks = 1 if self._tight(req) else 2
        return max(1, min(req.hard_max - req.boundary, blocks * self.block_size))

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
        if self.cheap_to_pause(req):
            # as vLLM: one admitted after it gives way, this one if it is the newest; asked
            # ahead, not while every newer one still awaits its first token (a pause would make
            # it late): at the boundary, a block of tokens later, they have had it
            # (whether one could give way, not which: choose_victims orders them); a stream more
            # important than it never gives way for its growth: where every newer one is, it
            # gives way itself, as vLLM's priority scheduling preempts the least important
            newer = list(self._pausable_after(req))
            if newer:
                may_give_way = [r for r in newer if self._gives_way_for_growth(r, req)]
                # (the streams that would give way: those, else this one for all of them)
                weighed = may_give_way or newer
                if req.state is State.EXTENDING or (
                    any(r.first_token_at is not None for r in weighed)
                    and not self._released_before_boundary(req)
                ):
                    return Blocked.PREEMPT_OTHERS if may_give_way else Blocked.PREEMPT_SELF
                return Blocked.WAIT
            if req.spec.on_exhausted == "continue":
                return Blocked.CONTINUE if req.state is State.EXTENDING else Blocked.WAIT
            s = self._s
            room = s.ledger.room()
            if req.state is State.EXTENDING and s.ledger.grant_blocks(req, req.hard_max) <= room:
                return Blocked.PREEMPT_SELF  # it resumes once there is room (it fits alone)
            return Blocked.WAIT  # (asked ahead: decide at the boundary; too large: progress)
        if req.cls.protected and any(self._eligible(req, r) for r in self._s.live.values()):
            return Blocked.PREEMPT_OTHERS
        return Blocked.CONTINUE if req.spec.on_exhausted == "continue" else Blocked.WAIT

    def _released_before_boundary(self, req: Request) -> bool:
        """Are blocks expected back before ``req``, which asked ahead, reaches its boundary? A
        stop the engine is expected to have confirmed (at the confirmation delay it has shown)
        two steps before it, so that a pause decided then would still return blocks in time, or
        a live stream expected to end (its conditional median) and be confirmed (two steps)
        before it."""
        s = self._s
        step = s.step_seconds()
        horizon = (req.boundary - req.generated) * step
        if horizon <= 2 * step:
            return False
        confirm = s.confirm_seconds
        if confirm is not None and s.stopping:
            due = s.now + horizon - 2 * step - confirm
            if any(
                r.release_started_at is not None and r.release_started_at <= due
                for r in s.stopping.values()
            ):
                return True
        return any(
            r is not req and s.seconds_left(r, step) + 2 * step <= horizon
            for r in s.live.values()
        )

    @staticmethod
    def _eligible(req: Request, victim: Request) -> bool:
        return (
            victim is not req
            and victim.cls.preemptible
            and victim.cls.priority > req.cls.priority
            and victim.state in LIVE_STATES
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
                    freed += self._s.ledger.footprint(victim)
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
            freed += self._s.ledger.footprint(victim)
        return chosen

    def on_granted(self, req: Request) -> None:
        # expected extension demand of this grant: P(extend) x the growth still expected
        outrun = False
        if req.boundary >= req.hard_max:
            demand = 0.0
        elif self.cheap_to_pause(req):
            # granted the vLLM way: it grows by pausing a newer stream, as vLLM's do, and
            # claims none of the pool beyond its floor
            demand = 0.0
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


__all__ = ["FIRST_TOKEN_PAUSE_SHARE", "CalibratedPolicy"]
