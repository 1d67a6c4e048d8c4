"""The forecast: when blocks come back, how long a caller would wait, when a queued request is
turned away, what it is told to retry after, and whether its first token would be late.

It learns from five streams the scheduler feeds it (blocks released, streams stopped (the
sequence slots freed under a batch cap), the prompt tokens of callers under a first-token
objective, whether each first token met its objective, and whether each caller queued on a wait
forecast was admitted in time); it is handed
the scheduler's queues and configuration, and reads the rest of the scheduler through
:class:`~kvbudget.core.view.SchedulerView`. It decides nothing: the scheduler turns callers away
on its answers.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from itertools import accumulate
from typing import TYPE_CHECKING

import attrs

from kvbudget.core.lifecycle import Request, State

if TYPE_CHECKING:
    from kvbudget.core.config import SchedulerConfig
    from kvbudget.core.queue import Queues
    from kvbudget.core.view import SchedulerView

# turn_away_late_first_tokens=None engages while more than this share of recent first tokens
# (an exponential average with this weight per first token, ~100 of them) missed the objective
LATE_SHARE_ON = 0.05
LATE_ALPHA = 0.01
#: outcomes of queued callers needed (at a forecast's pressure, else with the bands beside it
#: and the next one down) before the turn-away at arrival reads them
MIN_WAIT_OUTCOMES = 16
#: what a forecast wait is scaled by before that (SchedulerConfig.turn_away_wait_quantile), for
#: a caller that no pause for a first token can serve: over vLLM, with the pauses off, under a
#: synchronized wave, a quartered forecast queued 55 of the 75 callers turned away only to time
#: them out two seconds later, and the forecast as it is turned 55 of 76 away at once, serving
#: as many in time (the drain of what the engine holds must agree: turns_away)
UNCALIBRATED_WAIT_RATIO = 1.0
#: ... and for a caller whose first token may have running streams paused for it
#: (Policy.first_token_pause_at): later rounds of pauses serve callers whose forecasts ran 4-5x
#: long (over vLLM at 40 req/s, 0.5 turned away 20-35 callers of 160 that 0.25 served in time;
#: with the forecast as it is, `kvbudget serve` turned away 46 of 160 under overload where it
#: had turned away 0-4)
UNCALIBRATED_WAIT_RATIO_PAUSES = 0.25
#: the outcomes are kept by the pressure of the forecast they judge (forecast wait / the wait
#: the caller may have), in bands of a factor of sqrt(2) from this pressure (the first band
#: holds everything lower, the last everything higher)
WAIT_PRESSURE_FROM = 0.5
WAIT_PRESSURE_BANDS = 16
#: outcomes older than this many seconds are forgotten: a pressure that callers were turned
#: away at is judged afresh (at the uncalibrated margin) once the regime may have changed
WAIT_OUTCOME_HORIZON_S = 60.0


#: the blocks and the callers queued ahead of a queued caller (:meth:`Forecast.deficit`)
Ahead = tuple[int, int]


def wait_pressure_band(pressure: float) -> int:
    """The band (0 .. ``WAIT_PRESSURE_BANDS`` - 1) of a forecast wait ``pressure`` times what
    the caller may wait."""
    if pressure < WAIT_PRESSURE_FROM:
        return 0
    if pressure == math.inf:
        return WAIT_PRESSURE_BANDS - 1
    return min(WAIT_PRESSURE_BANDS - 1, 1 + int(2.0 * math.log2(pressure / WAIT_PRESSURE_FROM)))


def wait_pressure_band_from(band: int) -> float:
    """The lowest pressure of ``band`` (:func:`wait_pressure_band`; 0 for band 0)."""
    if band <= 0:
        return 0.0
    return float(WAIT_PRESSURE_FROM * 2.0 ** ((band - 1) / 2.0))


def _turned_over(
    times: Sequence[float], returned: Sequence[int], need: int, turnover: float
) -> float:
    """When ``need`` units (blocks, sequence slots) have come back, where ``returned[i]`` of
    them (a running total) are back ``times[i]`` seconds from now, and past all of them the
    same releases come again every ``max(turnover, that time)`` seconds, cycle after cycle."""
    held = returned[-1]
    cycles, rest = divmod(need, held)
    if rest == 0:
        cycles, rest = cycles - 1, held
    at = times[bisect_left(returned, rest)]
    return cycles * max(turnover, at) + at


def _busy_time(now: float, idle_since: float | None, idle_total: float) -> float:
    """The busy clock at ``now``: seconds the engine held blocks (plus a constant), given the
    idle seconds before its last busy spell and when its current idle spell began (None: busy)."""
    return (now if idle_since is None else min(now, idle_since)) - idle_total


class DecayingRate:
    """Amounts added over time, exponentially forgotten over ``window_s``, read as a rate.

    ``warm_up``: until one window has passed since the first amount (or since :meth:`begin`,
    if that came first), divide by the time since then rather than by the window (a rate from
    the first few events is not diluted).
    """

    __slots__ = ("_at", "_first_at", "_sum", "warm_up", "window_s")

    def __init__(self, window_s: float, warm_up: bool) -> None:
        self.window_s = window_s
        self.warm_up = warm_up
        self._sum = 0.0
        self._at: float | None = None
        self._first_at: float | None = None

    def begin(self, now: float) -> None:
        """What it counts could happen from ``now`` on: the warm-up divides by the time since
        then (where it counts blocks released, a first release a moment after the engine took
        its first blocks is then not a rate of thousands a second). No effect once begun."""
        if self._first_at is None:
            self._first_at = now

    def add(self, amount: float, now: float) -> None:
        if self._first_at is None:
            self._first_at = now
        if self._at is not None:
            self._sum *= math.exp(-(now - self._at) / self.window_s)
        self._sum += amount
        self._at = now

    def rate(self, now: float) -> float:
        """Amount per second recently (0 before the first amount)."""
        at, first = self._at, self._first_at
        if at is None or first is None:
            return 0.0
        tau = self.window_s
        span = min(tau, max(now - first, 1e-3)) if self.warm_up else tau
        return self._sum * math.exp(-(now - at) / tau) / span

    def state(self) -> tuple[float, float | None, float | None]:
        """What it holds: the decayed sum, when it was last added to, when first."""
        return self._sum, self._at, self._first_at

    def restore(self, state: tuple[float, float | None, float | None], shift: float) -> None:
        """Hold ``state`` (:meth:`state`) with its times ``shift`` seconds later."""
        total, at, first = state
        self._sum = total
        self._at = None if at is None else at + shift
        self._first_at = None if first is None else first + shift


@attrs.frozen(slots=True)
class ForecastMemory:
    """What a :class:`Forecast` learned, on its scheduler's clock up to ``at``: for a scheduler
    that takes over its work (:meth:`Forecast.recall`), as a server that runs on keeps it. A
    simulator that replays a server's workloads one after another carries it between them."""

    at: float
    releases: tuple[float, float | None, float | None]
    idle_total: float
    idle_since: float | None
    ft_prompts: tuple[float, float | None, float | None]
    late_first_token_share: float
    outcomes: tuple[tuple[tuple[float, bool], ...], ...]
    ends: tuple[float, float | None, float | None] = (0.0, None, None)

    def wait_outcomes_by_band(self) -> tuple[tuple[int, int], ...]:
        """:meth:`Forecast.wait_outcomes_by_band` of a forecast that takes this memory over:
        ``(seen, in time)`` per band of the outcomes of the last minute before ``at``."""
        since = self.at - WAIT_OUTCOME_HORIZON_S
        return tuple(
            (
                sum(1 for when, _ in band if when >= since),
                sum(1 for when, ok in band if ok and when >= since),
            )
            for band in self.outcomes
        )

    def release_rate(self, window_s: float) -> float:
        """:meth:`Forecast.release_rate` of a forecast that takes this memory over, at ``at``
        (``window_s``: its ``SchedulerConfig.release_rate_window_s``)."""
        rate = DecayingRate(window_s, warm_up=True)
        rate.restore(self.releases, 0.0)
        return rate.rate(_busy_time(self.at, self.idle_since, self.idle_total))


class Forecast:
    """Rates, waits, expiries and first-token lateness (module docstring)."""

    __slots__ = (
        "_config",
        "_ends",
        "_ft_prompts",
        "_idle_since",
        "_idle_total",
        "_in_time",
        "_judged_band",
        "_outcomes",
        "_queues",
        "_releases",
        "_s",
        "_share_at",
        "late_first_token_share",
    )

    def __init__(self, view: SchedulerView, queues: Queues, config: SchedulerConfig) -> None:
        self._s = view
        self._queues = queues
        self._config = config
        # blocks can only be released while the engine holds some: the release rate runs on a
        # clock that stops while it holds none (_busy_clock), so an idle spell between two
        # busy ones does not read as a slow cache (which turned away most of the next surge)
        self._releases = DecayingRate(config.release_rate_window_s, warm_up=True)
        # streams that left the engine's batch (each stop frees a sequence slot: the wait of a
        # caller the batch cap holds back, SchedulerConfig.max_active), on the same clock
        self._ends = DecayingRate(config.release_rate_window_s, warm_up=True)
        self._idle_total = 0.0
        self._idle_since: float | None = None
        # prompt tokens of callers under a first-token objective (first_token_prefill_rate)
        self._ft_prompts = DecayingRate(config.arrival_rate_window_s, warm_up=False)
        #: exponential average of how many recent first tokens missed their objective
        self.late_first_token_share = 0.0
        # whether recent queued callers were admitted in time ((when, in time) by the band of
        # the pressure of their forecast, oldest first; the in-time count of each band), and
        # the share and sample count read for each band (dropped when an outcome comes in or
        # leaves that it reads)
        self._outcomes: list[deque[tuple[float, bool]]] = [
            deque() for _ in range(WAIT_PRESSURE_BANDS)
        ]
        self._in_time = [0] * WAIT_PRESSURE_BANDS
        self._share_at: dict[int, tuple[float, int]] = {}
        #: the band of the forecast last judged (what the snapshot reports)
        self._judged_band = 0

    # -- what it learns from -------------------------------------------------------------------

    def memory(self) -> ForecastMemory:
        """What it has learned so far (:class:`ForecastMemory`), as of the scheduler's now."""
        return ForecastMemory(
            at=self._s.now,
            releases=self._releases.state(),
            ends=self._ends.state(),
            idle_total=self._idle_total,
            idle_since=self._idle_since,
            ft_prompts=self._ft_prompts.state(),
            late_first_token_share=self.late_first_token_share,
            outcomes=tuple(tuple(band) for band in self._outcomes),
        )

    def recall(self, memory: ForecastMemory, resumed_at: float) -> None:
        """Take over what another forecast had learned (``memory``), its times moved so that
        ``memory.at`` falls at ``resumed_at`` on this one's clock: the time between them counts
        as none (an idle engine, whose release rate runs on a clock that stops, learns nothing
        then either)."""
        shift = resumed_at - memory.at
        self._releases.restore(memory.releases, shift)
        self._ends.restore(memory.ends, shift)
        self._ft_prompts.restore(memory.ft_prompts, shift)
        self._idle_total = memory.idle_total
        self._idle_since = None if memory.idle_since is None else memory.idle_since + shift
        self.late_first_token_share = memory.late_first_token_share
        window = self._config.wait_outcome_window
        self._outcomes = [
            deque((when + shift, ok) for when, ok in band[-window:]) for band in memory.outcomes
        ]
        self._in_time = [sum(ok for _, ok in band) for band in self._outcomes]
        self._share_at.clear()

    def note_arrival(self, req: Request, now: float) -> None:
        if req.cls.ttft_slo_s is not None:
            self._ft_prompts.add(req.prompt, now)

    def note_first_token(self, req: Request, late: bool) -> None:
        """``req``'s first token came, ``late`` against its class's first-token objective
        (:meth:`Request.first_token_past_objective`; only a caller never preempted counts, not a
        resumed checkpoint)."""
        if req.preemptions == 0:
            self.late_first_token_share += LATE_ALPHA * (late - self.late_first_token_share)

    def note_release(self, blocks: int, now: float) -> None:
        self._releases.add(blocks, self._busy_clock(now))

    def note_end(self, now: float) -> None:
        """A stream left the engine's batch at ``now`` (stopped: its sequence slot is free)."""
        self._ends.add(1.0, self._busy_clock(now))

    def note_idle(self, now: float, idle: bool) -> None:
        """From ``now`` the engine holds no blocks (``idle``), or holds some again."""
        if idle:
            if self._idle_since is None:
                self._idle_since = now
            return
        if self._idle_since is not None:
            self._idle_total += max(0.0, now - self._idle_since)
            self._idle_since = None
        # (the release and end rates' warm-up runs from when the engine first held blocks)
        busy = self._busy_clock(now)
        self._releases.begin(busy)
        self._ends.begin(busy)

    def _busy_clock(self, now: float) -> float:
        """Seconds during which the engine held blocks, up to ``now`` (plus a constant)."""
        return _busy_time(now, self._idle_since, self._idle_total)

    def note_waited(self, forecast: float, bound: float, in_time: bool, now: float) -> None:
        """A caller forecast, when it was queued, to wait ``forecast`` seconds where it might
        wait ``bound`` was, at ``now``, admitted in time (``in_time``) or not (turned away at
        its bound, or its first token would have been late)."""
        if forecast <= 0.0:
            return
        band = wait_pressure_band(forecast / bound if bound > 0.0 else math.inf)
        outcomes = self._outcomes[band]
        if len(outcomes) >= self._config.wait_outcome_window:
            self._in_time[band] -= outcomes.popleft()[1]
        outcomes.append((now, in_time))
        self._in_time[band] += in_time
        for read in range(band - 1, band + 3):
            self._share_at.pop(read, None)

    # -- what it answers -----------------------------------------------------------------------

    def release_rate(self, now: float) -> float:
        """Blocks per second returned recently while the engine held blocks (0 when nothing
        was released yet)."""
        return self._releases.rate(self._busy_clock(now))

    def first_token_prefill_rate(self) -> float:
        """Prompt tokens per second that callers under a first-token objective brought recently
        (every arrival counts, admitted or not; an exponential average over
        ``arrival_rate_window_s``). 0 before the first such caller."""
        return self._ft_prompts.rate(self._s.now)

    def queue_expiry(self, req: Request, service: bool = True) -> float:
        """When a queued request is turned away (a checkpoint: only its deadline bounds it).

        A caller with a time-to-first-token objective is turned away once admitting it could no
        longer give it a first token in time (the objective less the time to a first token of
        its own prefill, :meth:`first_token_time`); one with
        a deadline once admitting it could no longer finish it in time (the deadline less its
        predicted service, ``deadline_service_quantile``): admitted later it would miss anyway,
        and the KV and engine time it took would be lost to others. (``service=False``: without
        that forecast, for a caller about to be admitted at once.)
        """
        expiry = req.deadline_at if req.deadline_at is not None else math.inf
        if req.state is State.CHECKPOINTED:
            return expiry
        q = self._config.deadline_service_quantile
        if service and req.deadline_at is not None and q is not None:
            expiry -= self.predicted_service(req, q)
        cls = req.cls
        if cls.max_queue_delay_s is not None:
            expiry = min(expiry, req.arrival + cls.max_queue_delay_s)
        if cls.ttft_slo_s is not None and req.generated == 0:
            own = self.first_token_time(self._s.ledger.prefill_tokens(req))
            expiry = min(expiry, req.arrival + cls.ttft_slo_s - own)
        return expiry

    def predicted_service(self, req: Request, q: float) -> float:
        """Seconds from admission to the last token of ``req`` if its output runs to the
        ``q``-quantile of its length distribution: its prefill, then that many steps at the
        current step time (one more sequence and its context in the batch)."""
        s = self._s
        if req.generated:
            target = s.lengths.conditional_quantile(req.key, q, req.generated)
        else:
            target = s.lengths.quantile(req.key, q)
        tokens = max(1, min(req.remaining, target - req.generated))
        context = req.prompt + req.generated
        step = s.cost.predict_decode(s.active + 1, s.active_context + context)
        return s.cost.predict_prefill(context) + tokens * step

    def wait_bound(self, req: Request, now: float) -> float | None:
        """Seconds from ``now`` that ``req`` may still wait for admission (None: unbounded).

        ``req.expiry`` (fixed when it was queued: the scheduler's tick turns the caller away
        there), and with ``turn_away_late_first_tokens``, for a first token under an objective,
        less the time to it that the prefill queued in the engine now predicts
        (:meth:`first_token_late` turns the caller away there at admission).
        """
        bound = None if req.expiry == math.inf else req.expiry - now
        ttft = self.first_token_objective(req)
        if ttft is not None:
            late = req.arrival + ttft - self.first_token_delay(req) - now
            bound = late if bound is None else min(bound, late)
        return bound

    def first_token_objective(self, req: Request) -> float | None:
        """The first-token objective that the late-first-token turn-away judges ``req`` by now
        (None: it does not apply: no objective, not a fresh queued caller, or not engaged)."""
        ttft = req.cls.ttft_slo_s
        if ttft is None or req.generated or req.state is not State.QUEUED:
            return None
        setting = self._config.turn_away_late_first_tokens
        engaged = self.late_first_token_share > LATE_SHARE_ON if setting is None else setting
        return ttft if engaged else None

    def first_token_time(self, tokens_ahead: int) -> float:
        """Seconds from an admission to its first token with ``tokens_ahead`` prompt tokens
        queued for prefill (its own included), at ``first_token_quantile``: every first-token
        objective is judged against this."""
        cost = self._s.cost
        q = self._config.first_token_quantile
        predicted = cost.predict_first_token(tokens_ahead)
        return predicted if q is None else predicted + cost.first_token_margin(q)

    def first_token_delay(self, req: Request, extra_tokens: int = 0) -> float:
        """Predicted seconds from admitting ``req`` now to its first token, behind the prefill
        queued in the engine (and ``extra_tokens`` more of it ahead)."""
        s = self._s
        return self.first_token_time(
            self.queued_prefill() + s.ledger.prefill_tokens(req) + extra_tokens
        )

    def queued_prefill(self) -> int:
        """Prompt tokens still to prefill ahead of an admission now: the backlog (prompts
        admitted whose first token has not come), less what the engine has prefilled of it
        since the newest of them was admitted.

        The backlog leaves only as first tokens come, so a long prompt counts in full until its
        last chunk is done: a caller arriving near the end of it would be forecast to wait all
        of it again (over Mooncake's synthetic trace at 5 % of its load, 26 callers with
        prompts of 26-700 tokens turned away as late behind a 35,000-token prefill nearly
        done, who got their first tokens in 0.1-1.5 s under every baseline). The newest
        admission's share still to do is read off its own first-token forecast (at
        ``first_token_quantile``, so a prefill late against the mean line is not taken as
        done): that forecast counted everything queued ahead of it, its own prompt included.
        """
        s = self._s
        backlog = s.prefill_backlog
        if not backlog:
            return 0
        admitted_at, ahead = s.newest_prefill
        due = self.first_token_time(ahead)
        if due <= 0.0:
            return backlog
        left = ahead * (1.0 - (s.now - admitted_at) / due)
        return min(backlog, max(0, math.ceil(left)))

    def first_token_late(self, req: Request, now: float) -> bool:
        """Would the prefill queued in the engine make ``req``'s first token late if it were
        admitted now? (Not if its own prefill alone already exceeds its objective: it can never
        be met, and now is as early as that caller can be served.)"""
        ttft = self.first_token_objective(req)
        return (
            ttft is not None
            and self.first_token_time(self._s.ledger.prefill_tokens(req)) <= ttft
            and now + self.first_token_delay(req) > req.arrival + ttft
        )

    def deficit(self, req: Request, ahead: Ahead | None = None) -> int:
        """Blocks that the queued ``req`` and everything queued ahead of it want beyond what
        is free for admission now (``ahead``: the blocks and callers queued ahead of a caller
        already queued; else everything queued in its class and before it, as for a newcomer)."""
        blocks = self._queues.blocks_ahead(req.cls) if ahead is None else ahead[0]
        return blocks + req.want_blocks - self._s.ledger.admission_free

    def slot_deficit(self, req: Request, ahead: Ahead | None = None) -> int:
        """Sequence slots that ``req`` and everything queued ahead of it want, where the batch
        cap (``SchedulerConfig.max_active``) is what holds the queue back: the batch is full.
        0 below the cap, or without one: the queue then waits for blocks, and the stream whose
        end returns them frees its slot too (counting the callers queued for blocks against
        the free slots as well turned away, over the real engine with twice the cache, callers
        the blocks would have served in time: 11 of 160 under overload)."""
        cap = self._config.max_active
        if cap is None or self._s.active < cap:
            return 0
        count = self._queues.count_ahead(req.cls) if ahead is None else ahead[1]
        return count + 1 - (cap - self._s.active)

    def estimated_wait(self, req: Request) -> float:
        """Seconds until ``req`` could be admitted, from the queue ahead and the release rate
        (and, where the batch cap holds it back, the rate streams stop)."""
        return self.wait_estimate(req)[0]

    def wait_estimate(self, req: Request, ahead: Ahead | None = None) -> tuple[float, bool]:
        """:meth:`estimated_wait`, and whether it was measured: False where no release was seen
        yet (the wait is then ``min_retry_after_s``, a placeholder, not a forecast to learn the
        error of). ``ahead``: as :meth:`deficit`."""
        s = self._s
        deficit = self.deficit(req, ahead)
        slots = self.slot_deficit(req, ahead)
        if deficit <= 0 and slots <= 0:
            return 0.0, True
        unmeasured = (0.0 if s.active + s.releasing == 0 else self._config.min_retry_after_s), False
        wait = 0.0
        if deficit > 0:
            rate = self.release_rate(s.now)
            if rate <= 0.0:
                return unmeasured
            wait = deficit / rate
        if slots > 0:
            # the batch is full: a slot frees as a stream stops, at the rate streams have
            ends = self._ends.rate(self._busy_clock(s.now))
            if ends <= 0.0:
                return unmeasured
            wait = max(wait, slots / ends)
        return wait, True

    def drain_wait(self, deficit: int, turnover: float) -> float | None:
        """Seconds until ``deficit`` blocks beyond what is free come back as the work in the
        engine ends (None: nothing holds blocks to drain).

        A stopped request's blocks return within a step; each live stream's at its expected
        length (its conditional median, capped at its hard max, at the current pace), with the
        blocks it grows by until then, which come out of what is free first. Past everything held
        now, the cache turns over: the callers queued ahead take what is released and hold it
        about ``turnover`` seconds (a caller's predicted service), so the same releases come
        again that much later, cycle after cycle.
        """
        return self.drain_waits((deficit,), turnover)[0]

    def drain_waits(self, deficits: Sequence[int], turnover: float) -> list[float | None]:
        """:meth:`drain_wait` of each of ``deficits``, the engine's releases gathered once."""
        s = self._s
        ledger = s.ledger
        step = s.step_seconds()
        releases: list[tuple[float, int]] = [
            (step, ledger.footprint(r)) for r in s.stopping.values()
        ]
        grown = 0
        for r in s.live.values():
            final = s.expected_length(r)
            grows = max(0, ledger.grant_blocks(r, final) - r.blocks)
            grown += grows
            releases.append(((final - r.generated) * step, ledger.footprint(r) + grows))
        releases.sort()
        times = [at for at, _ in releases]
        returned = list(accumulate(blocks for _, blocks in releases))
        held = returned[-1] if returned else 0
        if held <= 0:
            return [None] * len(deficits)
        return [_turned_over(times, returned, deficit + grown, turnover) for deficit in deficits]

    @property
    def wait_outcome_samples(self) -> int:
        """How many outcomes of queued callers the turn-away at arrival read for the forecast
        it judged last (:meth:`in_time_share`)."""
        return self._band_share(self._judged_band)[1]

    def in_time_share(self, pressure: float | None = None) -> float:
        """The share of recent queued callers admitted in time, of those whose forecast wait
        was about ``pressure`` times what they might wait (None: the forecast judged last): of
        its band, or with too few there, of its band and the two beside it, and with too few
        still, the next one down too: so the pressure callers are admitted at climbs a band
        at a time past the highest one they were seen served in time at (1.0 with none)."""
        if pressure is not None:
            self._judged_band = wait_pressure_band(pressure)
        return self._band_share(self._judged_band)[0]

    def _band_share(self, band: int) -> tuple[float, int]:
        self._forget_old()
        cached = self._share_at.get(band)
        if cached is not None:
            return cached
        seen, in_time = len(self._outcomes[band]), self._in_time[band]
        for near in (band + 1, band - 1, band - 2):
            if seen >= MIN_WAIT_OUTCOMES:
                break
            if 0 <= near < WAIT_PRESSURE_BANDS:
                seen += len(self._outcomes[near])
                in_time += self._in_time[near]
        read = (in_time / seen if seen else 1.0, seen)
        self._share_at[band] = read
        return read

    def _forget_old(self) -> None:
        horizon = self._s.now - WAIT_OUTCOME_HORIZON_S
        for band, outcomes in enumerate(self._outcomes):
            forgot = False
            while outcomes and outcomes[0][0] < horizon:
                self._in_time[band] -= outcomes.popleft()[1]
                forgot = True
            if forgot:
                for read in range(band - 1, band + 3):
                    self._share_at.pop(read, None)

    def wait_outcomes_by_band(self) -> tuple[tuple[int, int], ...]:
        """What the turn-away at arrival reads, band by band of pressure
        (:func:`wait_pressure_band`): ``(seen, in time)`` of the recent queued callers'
        outcomes (the last ``wait_outcome_window`` of each band, from the last minute)."""
        self._forget_old()
        return tuple(
            (len(outcomes), self._in_time[band]) for band, outcomes in enumerate(self._outcomes)
        )

    def unlikely_in_time(self, wait: float, bound: float, pauses: bool = False) -> bool:
        """Is a caller forecast to wait ``wait`` seconds, who may wait ``bound``, unlikely to be
        admitted in time (``SchedulerConfig.turn_away_wait_quantile``)? Where at least
        ``MIN_WAIT_OUTCOMES`` recent queued callers' forecasts were of about its pressure
        (``wait / bound``): fewer than that share of them were admitted in time. Before that,
        its forecast exceeds the bound (times ``UNCALIBRATED_WAIT_RATIO``, or where running
        streams may be paused for the caller's first token, ``pauses``, quartered:
        ``UNCALIBRATED_WAIT_RATIO_PAUSES``). With the
        quantile off: the forecast exceeds the bound."""
        if bound <= 0.0:
            return True
        pressure = wait / bound
        q = self._config.turn_away_wait_quantile
        if q is None:
            return pressure > 1.0
        share = self.in_time_share(pressure)
        if self.wait_outcome_samples < MIN_WAIT_OUTCOMES:
            ratio = UNCALIBRATED_WAIT_RATIO_PAUSES if pauses else UNCALIBRATED_WAIT_RATIO
            return pressure * ratio > 1.0
        return share < q

    def turns_away(
        self,
        req: Request,
        wait: float,
        bound: float | None,
        pauses: bool = False,
        ahead: Ahead | None = None,
    ) -> bool:
        """Is a caller forecast to wait ``wait`` seconds, who may wait ``bound``, turned away at
        arrival? Only when it is unlikely to be admitted in time (:meth:`unlikely_in_time`)
        and the drain of what the engine holds now would not admit it within the bound either
        (:meth:`drain_wait`). ``ahead``: as :meth:`deficit`."""
        if not (wait > 0.0 and bound is not None and self.unlikely_in_time(wait, bound, pauses)):
            return False
        service = self.predicted_service(req, 0.5)
        drain = self.drain_wait(max(1, self.deficit(req, ahead)), service)
        if drain is None or drain > bound:
            return True
        slots = self.slot_deficit(req, ahead)
        if slots <= 0:
            return False
        ends = self.slot_drain_wait(slots, service)
        return ends is None or ends > bound

    def slot_drain_wait(self, slots: int, turnover: float) -> float | None:
        """Seconds until ``slots`` sequence slots free up under the batch cap as the live
        streams end, each at its expected length at the current pace (None: none is live);
        past them, the batch turns over every ``turnover`` seconds, as the cache does in
        :meth:`drain_waits`."""
        s = self._s
        step = s.step_seconds()
        ends = sorted((s.expected_length(r) - r.generated) * step for r in s.live.values())
        if not ends:
            return None
        return _turned_over(ends, range(1, len(ends) + 1), slots, turnover)

    def clamp_retry(self, wait: float) -> float:
        """``wait`` as callers are told it: within ``[min_retry_after_s, max_retry_after_s]``."""
        return min(max(wait, self._config.min_retry_after_s), self._config.max_retry_after_s)

    def retry_after(self, req: Request) -> float:
        return self.clamp_retry(self.estimated_wait(req))


__all__ = [
    "LATE_ALPHA",
    "LATE_SHARE_ON",
    "MIN_WAIT_OUTCOMES",
    "UNCALIBRATED_WAIT_RATIO",
    "UNCALIBRATED_WAIT_RATIO_PAUSES",
    "WAIT_OUTCOME_HORIZON_S",
    "WAIT_PRESSURE_BANDS",
    "WAIT_PRESSURE_FROM",
    "Ahead",
    "DecayingRate",
    "Forecast",
    "ForecastMemory",
    "wait_pressure_band",
    "wait_pressure_band_from",
]
