"""The scheduler's configuration: the knobs of the mechanism (the policy holds those of the
decisions), validated on construction."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import attrs

from kvbudget.errors import InvalidInput
from kvbudget.validate import check_float, integer, number, one_of, optional, quantile, seconds

#: seconds between the ticks a shell sends its scheduler by default (``Budget``'s and
#: ``BudgetedEngine``'s ``tick_interval``): a queued caller past its bound is turned away at most
#: this late, and may be admitted in between (the simulator of a real server ticks as often)
SHELL_TICK_INTERVAL_S: Final = 0.05


def _weights(_inst: Any, _attr: Any, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise InvalidInput("tenant_weights", value, "a mapping of tenant name to weight")
    for tenant, weight in value.items():
        check_float(f"tenant_weights[{tenant!r}]", weight, open_min=True)


@attrs.frozen(slots=True)
class SchedulerConfig:
    """Knobs of the mechanism (the policy holds the knobs of the decisions).

    ``slack_tokens``: tokens each grant reserves beyond its boundary for engines that overshoot.
    ``max_active``: cap on admitted requests (vLLM's ``max_num_seqs``). ``max_queued``: bound on
    waiting callers per class. ``confirm_timeout_s``: after this an unconfirmed stop is counted.
    ``release_rate_window_s``: time constant of the block release-rate estimate used for
    ``retry_after`` and the wait forecast (on a clock that stops while the engine holds no
    blocks: an idle spell does not read as a slow cache). ``min_retry_after_s`` /
    ``max_retry_after_s`` clamp what callers are told.
    ``remember_released``: how many finished request ids are kept to recognise late events.
    ``tenant_weights``: weighted fairness across tenants inside a class (default weight 1).
    ``prefill_chunk_tokens``: the most prompt tokens the engine prefills in one step (vLLM's
    ``max_num_batched_tokens`` under chunked prefill; 2,048 is its long-standing default; None:
    a prompt is prefilled in one step). An admission's prefill, up to this many tokens, counts
    in the step time that the latency floor of active streams is checked against.
    ``turn_away_late_first_tokens``: turn away a caller under a first-token objective whose first
    token the prefill already queued in the engine would make late (at admission, and at
    arrival when its expected wait leaves no time for that prefill), by the cost model's learned
    time to a first token. None (the default): only while more than 5 % of the recent first
    tokens (an exponential average over ~100) missed their objective, i.e. while the engine's
    prefill queue is what makes callers late; True: always; False: never. The forecast is only
    as good as the shell's first-token reports: the first ``charge`` after admission must be the
    first token, as in ``BudgetedEngine`` and the simulator.
    ``deadline_service_quantile``: a queued request with a deadline is turned away once admitting
    it could no longer finish it by the deadline: the deadline less its predicted prefill and
    decode, at this quantile of its output-length distribution and the current step time
    (None: it is turned away at the deadline itself).
    ``turn_away_wait_quantile``: a caller whose forecast wait for admission exceeds what it may
    wait is turned away at arrival ("deadline") only if it is at least this unlikely to be
    admitted in time: fewer than this share of the recent queued callers whose forecasts were
    at about its pressure (forecast / the wait they might have, in bands of a factor of
    sqrt(2)) were admitted in time (the last ``wait_outcome_window`` of each band, from the last
    minute), so a forecast that runs pessimistic on the live workload stops turning away
    callers it could serve, and one that runs optimistic turns away callers that would time
    out. An outcome is counted as the caller's own: admitted (in time: its bound holds its
    first token's prefill) or not (timed out at its bound, or its first token would have been
    late). With fewer than ``MIN_WAIT_OUTCOMES`` outcomes at its pressure (and the bands beside
    it, then the next one down, so the pressure callers are queued at climbs a band at a time
    past the highest seen served), a forecast with no evidence is taken as it is
    (``UNCALIBRATED_WAIT_RATIO``, 1: a cold server turns away at once callers forecast to wait
    past their bound whom the drain of what the engine holds would not admit in time either),
    and quartered for a caller whose first token may have running streams paused for it
    (``UNCALIBRATED_WAIT_RATIO_PAUSES``: later rounds of pauses serve such callers). Until the
    sixteenth session every forecast was quartered, which with the pauses off queued most of a
    synchronized wave only to time it out at its bound, two seconds later. None: whenever the
    forecast exceeds the bound. (Until 2026-12-03 the forecast was scaled by this quantile of
    real / forecast waits instead; a policy that admits callers at their last responsible
    moment makes every wait about its bound, and that ratio then turned away the most pressed
    fifth of the callers it had served in time, run after run.)
    ``first_token_quantile``: the quantile of the time from admission to a first token that a
    first-token objective is judged against (when a queued caller is turned away, whether its
    first token would be late, whether a prefill crowds callers under an objective): the cost
    model's fitted line plus this quantile of how far recent first tokens came after it
    (:meth:`~kvbudget.core.cost.CostModel.first_token_margin`). None: the line itself, a mean,
    which leaves callers admitted at their last moment late about half the time.
    ``arrival_rate_window_s``: time constant of the estimate of the prompt tokens per second
    that callers under a first-token objective bring (:meth:`Scheduler.first_token_prefill_rate`),
    which a policy may keep room for in the engine's prefill queue.
    """

    slack_tokens: int = attrs.field(default=0, validator=integer(0, 1 << 20))
    max_active: int | None = attrs.field(default=None, validator=optional(integer(1)))
    max_queued: int = attrs.field(default=100_000, validator=integer(0))
    confirm_timeout_s: float = attrs.field(default=5.0, validator=seconds())
    release_rate_window_s: float = attrs.field(default=10.0, validator=seconds())
    min_retry_after_s: float = attrs.field(default=0.05, validator=number(0.0))
    max_retry_after_s: float = attrs.field(default=60.0, validator=number(0.0))
    remember_released: int = attrs.field(default=10_000, validator=integer(0))
    tenant_weights: Mapping[str, float] = attrs.field(factory=dict, validator=_weights)
    prefill_chunk_tokens: int | None = attrs.field(default=2048, validator=optional(integer(1)))
    turn_away_late_first_tokens: bool | None = attrs.field(
        default=None,
        validator=one_of(None, True, False, expected="None (automatic), True or False"),
    )
    arrival_rate_window_s: float = attrs.field(default=10.0, validator=seconds())
    turn_away_wait_quantile: float | None = attrs.field(
        default=0.2, validator=optional(quantile())
    )
    wait_outcome_window: int = attrs.field(default=256, validator=integer(1, 1 << 20))
    deadline_service_quantile: float | None = attrs.field(
        default=0.5, validator=optional(quantile())
    )
    first_token_quantile: float | None = attrs.field(
        default=0.9, validator=optional(quantile())
    )

    def __attrs_post_init__(self) -> None:
        check_float("max_retry_after_s", self.max_retry_after_s, minimum=self.min_retry_after_s)


__all__ = ["SHELL_TICK_INTERVAL_S", "SchedulerConfig"]
