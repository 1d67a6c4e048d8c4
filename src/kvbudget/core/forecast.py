"""The forecast: when blocks come back, how long a caller would wait, when a queued request is
turned away, what it is told to retry after, and whether its first token would be late.

It learns from four streams the scheduler feeds it (blocks released, the prompt tokens of
callers under a first-token objective, whether each first token met its objective, and how long
queued callers really waited against the wait forecast for them); it is handed
the scheduler's queues and configuration, and reads the rest of the scheduler through
:class:`~kvbudget.core.view.SchedulerView`. It decides nothing: the scheduler turns callers away
on its answers.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

from kvbudget.core.lifecycle import Request, State

if TYPE_CHECKING:
    from kvbudget.core.config import SchedulerConfig
    from kvbudget.core.queue import Queues
    from kvbudget.core.view import SchedulerView

# turn_away_late_first_tokens=None engages while more than this share of recent first tokens
# (an exponential average with this weight per first token, ~100 of them) missed the objective
LATE_SHARE_ON = 0.05
LATE_ALPHA = 0.01
#: ratios of real to forecast waits needed before the turn-away at arrival reads them
MIN_WAIT_RATIOS = 16
#: what a forecast wait is scaled by before that (SchedulerConfig.turn_away_wait_quantile):
#: over vLLM at 40 req/s the forecasts of a regime not seen before were 4-5x long (the release
#: rate lags a surge), and 0.5 turned away 20-35 callers of 160 that 0.25 served in time
UNCALIBRATED_WAIT_RATIO = 0.25
#: the ratios are kept by the size of the forecast they judge, in bands of a factor of 2 from
#: this many seconds (the first band holds everything shorter, the last everything longer):
#: how a forecast errs depends on the regime it is made in (measured over vLLM: forecasts of
#: 0.5 s in a shared-prefix run were 1.8x short, forecasts of 5 s at 40 req/s 5x long), and a
#: forecast is judged by the ratios of forecasts of its own size
WAIT_RATIO_BAND_S = 0.25
WAIT_RATIO_BANDS = 8


def wait_ratio_band(forecast: float) -> int:
    """The band (0 .. ``WAIT_RATIO_BANDS`` - 1) of a forecast wait of ``forecast`` seconds."""
    if forecast < 2.0 * WAIT_RATIO_BAND_S:
        return 0
    return min(WAIT_RATIO_BANDS - 1, int(math.log2(forecast / WAIT_RATIO_BAND_S)))


class DecayingRate:
    """Amounts added over time, exponentially forgotten over ``window_s``, read as a rate.

    ``warm_up``: until one window has passed since the first amount, divide by the time since
    then rather than by the window (a rate from the first few events is not diluted).
    """

    __slots__ = ("_at", "_first_at", "_sum", "warm_up", "window_s")

    def __init__(self, window_s: float, warm_up: bool) -> None:
        self.window_s = window_s
        self.warm_up = warm_up
        self._sum = 0.0
        self._at: float | None = None
        self._first_at: float | None = None

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


class Forecast:
    """Rates, waits, expiries and first-token lateness (module docstring)."""

    __slots__ = (
        "_config",
        "_ft_prompts",
        "_judged_band",
        "_queues",
        "_ratio_at",
        "_releases",
        "_s",
        "_wait_ratios",
        "late_first_token_share",
    )

    def __init__(self, view: SchedulerView, queues: Queues, config: SchedulerConfig) -> None:
        self._s = view
        self._queues = queues
        self._config = config
        self._releases = DecayingRate(config.release_rate_window_s, warm_up=True)
        # prompt tokens of callers under a first-token objective (first_token_prefill_rate)
        self._ft_prompts = DecayingRate(config.arrival_rate_window_s, warm_up=False)
        #: exponential average of how many recent first tokens missed their objective
        self.late_first_token_share = 0.0
        # real / forecast waits of recent queued callers, by the band of their forecast
        # (WAIT_RATIO_BAND_S), and the ratio and sample count read for each band (dropped when
        # a ratio comes in that it reads: a sort of at most 3 x ``wait_ratio_window`` floats, at
        # arrivals only)
        self._wait_ratios: list[deque[float]] = [
            deque(maxlen=config.wait_ratio_window) for _ in range(WAIT_RATIO_BANDS)
        ]
        self._ratio_at: dict[int, tuple[float, int]] = {}
        #: the band of the forecast last judged (what the snapshot reports)
        self._judged_band = 0

    # -- what it learns from -------------------------------------------------------------------

    def note_arrival(self, req: Request, now: float) -> None:
        if req.cls.ttft_slo_s is not None:
            self._ft_prompts.add(req.prompt, now)

    def note_first_token(self, req: Request, now: float) -> None:
        """``req``'s first token came at ``now`` (only a caller's own first token counts, not a
        resumed checkpoint's)."""
        ttft = req.cls.ttft_slo_s
        if ttft is not None and req.preemptions == 0:
            late = 1.0 if now - req.arrival > ttft else 0.0
            self.late_first_token_share += LATE_ALPHA * (late - self.late_first_token_share)

    def note_release(self, blocks: int, now: float) -> None:
        self._releases.add(blocks, now)

    def note_waited(self, forecast: float, waited: float) -> None:
        """A queued caller forecast to wait ``forecast`` seconds was admitted, or turned away at
        its bound, after ``waited`` (then a lower bound of its wait)."""
        if forecast > 0.0:
            band = wait_ratio_band(forecast)
            self._wait_ratios[band].append(max(0.0, waited) / forecast)
            for read in (band - 1, band, band + 1):
                self._ratio_at.pop(read, None)

    # -- what it answers -----------------------------------------------------------------------

    def release_rate(self, now: float) -> float:
        """Blocks per second returned recently (0 when nothing was released yet)."""
        return self._releases.rate(now)

    def first_token_prefill_rate(self) -> float:
        """Prompt tokens per second that callers under a first-token objective brought recently
        (every arrival counts, admitted or not; an exponential average over
        ``arrival_rate_window_s``). 0 before the first such caller."""
        return self._ft_prompts.rate(self._s.now)

    def queue_expiry(self, req: Request, service: bool = True) -> float:
        """When a queued request is turned away (a checkpoint: only its deadline bounds it).

        A caller with a time-to-first-token objective is turned away once admitting it could no
        longer give it a first token in time (the objective less its predicted prefill); one with
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
            prefill = self._s.ledger.prefill_tokens(req)
            last = req.arrival + cls.ttft_slo_s - self._s.cost.predict_prefill(prefill)
            expiry = min(expiry, last)
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

    def first_token_delay(self, req: Request, extra_tokens: int = 0) -> float:
        """Predicted seconds from admitting ``req`` now to its first token, behind the prefill
        queued in the engine (and ``extra_tokens`` more of it ahead)."""
        s = self._s
        return s.cost.predict_first_token(
            s.prefill_backlog + s.ledger.prefill_tokens(req) + extra_tokens
        )

    def first_token_late(self, req: Request, now: float) -> bool:
        """Would the prefill queued in the engine make ``req``'s first token late if it were
        admitted now? (Not if its own prefill alone already exceeds its objective: it can never
        be met, and now is as early as that caller can be served.)"""
        ttft = self.first_token_objective(req)
        return (
            ttft is not None
            and self._s.cost.predict_first_token(self._s.ledger.prefill_tokens(req)) <= ttft
            and now + self.first_token_delay(req) > req.arrival + ttft
        )

    def deficit(self, req: Request) -> int:
        """Blocks that the queued ``req`` and everything queued ahead of it want beyond what
        is free for admission now."""
        return self._queues.blocks_ahead(req.cls) + req.want_blocks - self._s.ledger.admission_free

    def estimated_wait(self, req: Request) -> float:
        """Seconds until ``req`` could be admitted, from the queue ahead and the release rate."""
        return self.wait_estimate(req)[0]

    def wait_estimate(self, req: Request) -> tuple[float, bool]:
        """:meth:`estimated_wait`, and whether it was measured: False where no release was seen
        yet (the wait is then ``min_retry_after_s``, a placeholder, not a forecast to learn the
        error of)."""
        s = self._s
        deficit = self.deficit(req)
        if deficit <= 0 and (self._config.max_active is None or s.active < self._config.max_active):
            return 0.0, True
        deficit = max(deficit, 1)
        rate = self.release_rate(s.now)
        if rate <= 0.0:
            return (0.0 if s.active + s.releasing == 0 else self._config.min_retry_after_s), False
        return deficit / rate, True

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
        s = self._s
        ledger = s.ledger
        step = s.step_seconds()
        releases: list[tuple[float, int]] = [
            (step, ledger.footprint(r)) for r in s.stopping.values()
        ]
        for r in s.live.values():
            final = s.expected_length(r)
            grows = max(0, ledger.grant_blocks(r, final) - r.blocks)
            deficit += grows
            releases.append(((final - r.generated) * step, ledger.footprint(r) + grows))
        held = sum(blocks for _, blocks in releases)
        if held <= 0:
            return None
        cycles, rest = divmod(deficit, held)
        if rest == 0:
            cycles, rest = cycles - 1, held
        releases.sort()
        for at, blocks in releases:
            rest -= blocks
            if rest <= 0:
                return cycles * max(turnover, at) + at
        raise AssertionError("unreachable: the releases add up to what is held")  # pragma: no cover

    @property
    def wait_ratio_samples(self) -> int:
        """How many real / forecast wait ratios the turn-away at arrival read for the forecast
        it judged last (:meth:`wait_ratio`)."""
        return self._band_ratio(self._judged_band)[1]

    def wait_ratio(self, forecast: float | None = None) -> float:
        """What a forecast wait of ``forecast`` seconds is scaled by before a caller is turned
        away on it (None: the forecast judged last): the ``turn_away_wait_quantile`` of the
        recent real / forecast wait ratios of forecasts of its size (its band, or with too few
        there, its band and the two beside it); ``UNCALIBRATED_WAIT_RATIO`` with fewer than
        ``MIN_WAIT_RATIOS`` ratios even so; 1.0 with the quantile off."""
        if forecast is not None:
            self._judged_band = wait_ratio_band(forecast)
        return self._band_ratio(self._judged_band)[0]

    def _band_ratio(self, band: int) -> tuple[float, int]:
        q = self._config.turn_away_wait_quantile
        cached = self._ratio_at.get(band)
        if cached is not None:
            return cached
        bands = self._wait_ratios
        ratios = list(bands[band])
        if len(ratios) < MIN_WAIT_RATIOS:
            for near in (band - 1, band + 1):
                if 0 <= near < WAIT_RATIO_BANDS:
                    ratios.extend(bands[near])
        if q is None:
            read = (1.0, len(ratios))
        elif len(ratios) < MIN_WAIT_RATIOS:
            read = (UNCALIBRATED_WAIT_RATIO, len(ratios))
        else:
            ratios.sort()
            read = (ratios[min(len(ratios) - 1, int(q * len(ratios)))], len(ratios))
        self._ratio_at[band] = read
        return read

    def turns_away(self, req: Request, wait: float, bound: float | None) -> bool:
        """Is a caller forecast to wait ``wait`` seconds, who may wait ``bound``, turned away at
        arrival? Only when even at the calibrated ratio its wait exceeds the bound
        (``turn_away_wait_quantile``), and the drain of what the engine holds now would not
        admit it within the bound either (:meth:`drain_wait`)."""
        if not (wait > 0.0 and bound is not None and wait * self.wait_ratio(wait) > bound):
            return False
        drain = self.drain_wait(max(1, self.deficit(req)), self.predicted_service(req, 0.5))
        return drain is None or drain > bound

    def clamp_retry(self, wait: float) -> float:
        """``wait`` as callers are told it: within ``[min_retry_after_s, max_retry_after_s]``."""
        return min(max(wait, self._config.min_retry_after_s), self._config.max_retry_after_s)

    def retry_after(self, req: Request) -> float:
        return self.clamp_retry(self.estimated_wait(req))


__all__ = [
    "LATE_ALPHA",
    "LATE_SHARE_ON",
    "MIN_WAIT_RATIOS",
    "UNCALIBRATED_WAIT_RATIO",
    "WAIT_RATIO_BANDS",
    "WAIT_RATIO_BAND_S",
    "DecayingRate",
    "Forecast",
    "wait_ratio_band",
]
