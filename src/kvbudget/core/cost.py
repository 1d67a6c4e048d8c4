"""The decode-step cost model behind the latency floor (DESIGN §5, §10).

This module owns :class:`StepTimeModel` (a linear step-time model: a fixed cost per decode step,
a cost per running sequence, a cost per token of context held by the batch, and a prefill cost
per prompt token), its default :data:`DEFAULT_STEP_TIME`, and :class:`CostModel`, which starts
from such a prior and refits it online from the engine's observed steps by recursive least
squares with exponential forgetting. :class:`CostModel` also learns how long a first token takes
after admission as a function of the prefill tokens queued in the engine ahead of it (the
request's own included), which is what a time-to-first-token objective is judged against. Pure
and deterministic: no clock, no I/O, no numpy.

Where the defaults come from
----------------------------
InternLM's LMDeploy benchmark "Benchmark on A100 (FP16)"
(https://github.com/InternLM/lmdeploy/blob/main/docs/en/benchmark/a100_fp16.md; lmdeploy
v0.1.0a1, TurboMind engine, A100-80G, CUDA 11.8), static-inference table for **llama2-7b**,
tp=1. Its per-token latency percentiles are decode-step times; we fitted
``p50 = fixed + per_seq * batch + per_ctx * batch * (prompt + output / 2)`` by least squares to
the 16 rows whose KV cache fits in the card (``batch * (prompt + output) * 0.5 MiB <= 60 GB``;
the other four rows queued, as their first-token latencies of 4-116 s show). The rows range
from batch 1 (prompt 1, output 128: 100.02 out tok/s, p50 9 ms) to batch 64 (prompt 128,
output 2048: p50 30 ms). The fit gives

* ``fixed_s`` = 9.57 ms (batch 1: 9-11 ms per token in every row),
* ``per_seq_s`` = 15.0 µs per running sequence,
* ``per_context_token_s`` = 0.306 µs per token of context (batch 32, prompt 2048, output 128:
  p50 31 ms, fit 30.7 ms; batch 16, prompt 2048, output 2048: p50 25 ms, fit 24.9 ms).

Prefill: the batch-1 first-token latency is 22 ms for a 128-token prompt and 139 ms for 2048
tokens, so ``prefill_per_token_s`` = (0.139 - 0.022) / 1920 = 61 µs per prompt token
(~16,400 prompt tokens/s); with the fixed step cost this reproduces 0.0096 + 2048 * 61e-6 =
135 ms vs. 139 ms measured. These are TurboMind numbers, not vLLM's; :class:`CostModel`
replaces them with the engine's own as steps are observed.

A step that decodes ``batch_size`` sequences holding ``context_tokens`` tokens in total and
also prefills ``p`` prompt tokens is modelled as ``decode_time(batch_size, context_tokens) +
prefill_time(p)``.
"""

from __future__ import annotations

import math
from typing import Any, Final

import attrs

from kvbudget.errors import InvalidInput
from kvbudget.validate import check_float, check_int, nonnegative

__all__ = ["DEFAULT_STEP_TIME", "CostModel", "StepTimeModel"]


def _to_float(value: Any) -> Any:
    """Store numbers as floats; leave bools and non-numbers for the validator to refuse."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    return float(value)


@attrs.frozen(slots=True)
class StepTimeModel:
    """Linear engine step time, in seconds.

    ``decode_time(b, c) = fixed_s + per_seq_s * b + per_context_token_s * c`` for a decode step
    of ``b`` sequences holding ``c`` context tokens in total (0 when ``b`` is 0: no step runs);
    ``prefill_time(t) = prefill_per_token_s * t``. All coefficients are finite and >= 0.
    """

    fixed_s: float = attrs.field(converter=_to_float, validator=nonnegative())
    per_seq_s: float = attrs.field(converter=_to_float, validator=nonnegative())
    per_context_token_s: float = attrs.field(
        converter=_to_float, validator=nonnegative(name="per_context_token_s")
    )
    prefill_per_token_s: float = attrs.field(
        converter=_to_float, validator=nonnegative(name="prefill_per_token_s")
    )

    def decode_time(self, batch_size: int, context_tokens: int) -> float:
        """Seconds for one decode step of ``batch_size`` sequences and ``context_tokens`` KV."""
        # (the checks' common case inline: every admission and extension asks this)
        if batch_size.__class__ is not int or batch_size < 0:
            check_int("batch_size", batch_size, minimum=0)
        if context_tokens.__class__ is not int or context_tokens < 0:
            check_int("context_tokens", context_tokens, minimum=0)
        if batch_size == 0:
            return 0.0
        return (
            self.fixed_s + self.per_seq_s * batch_size + self.per_context_token_s * context_tokens
        )

    def prefill_time(self, tokens: int) -> float:
        """Seconds a prefill of ``tokens`` prompt tokens adds to its step."""
        if tokens.__class__ is not int or tokens < 0:
            check_int("tokens", tokens, minimum=0)
        return self.prefill_per_token_s * tokens


DEFAULT_STEP_TIME: Final = StepTimeModel(
    fixed_s=9.57e-3,
    per_seq_s=15.0e-6,
    per_context_token_s=0.306e-6,
    prefill_per_token_s=61.0e-6,
)
"""Llama-2-7B FP16 on one A100-80G (LMDeploy/TurboMind benchmark); see the module docstring."""


# Internal units: features and targets are scaled by powers of two so conversions are exact.
_Y: Final = 1024.0  # seconds -> ~milliseconds
_B: Final = 64.0  # batch size scale
_C: Final = 65536.0  # context token scale
_T: Final = 1024.0  # prefill token scale
_P0: Final = 100.0  # prior variance of each scaled coefficient (prior std ~10 ms)
_FT_MIN: Final = 20  # first-token observations before the fit replaces the prior
#: first tokens whose distance from the fitted line is kept (the newest), for its quantiles
_FT_RESIDUALS: Final = 64
#: of those, how many before a quantile is read from them (0 until then)
_FT_RESIDUALS_MIN: Final = 8
_TRACE_MAX: Final = 3.0 * _P0  # bound on trace(P): no covariance wind-up without excitation


def _nearest_nonnegative(theta: list[float], p: list[list[float]]) -> list[float]:
    """The non-negative coefficients nearest ``theta`` in the metric of its covariance ``p``:
    ``theta`` itself where none is negative, else, of the ways to hold some coefficients at 0
    and condition the others on that (``theta_F - p_FS p_SS^-1 theta_S``), the one that leaves
    none negative at the least distance ``theta_S' p_SS^-1 theta_S``.

    Why not each negative coefficient read as 0 on its own: a real engine's batch size and
    context move together, and the recursion often explains a step with a negative cost per
    sequence offset by a steeper cost per context token. Reading only the negative one as 0
    keeps the steep slope: over vLLM on this machine, a fit from steps of 1-5 sequences then
    predicted 9-14 ms for a step of 15 that took 3 ms (docs/benchmarks-history.md, twenty-second
    session). Conditioning keeps what the steps observed determine (here the slope along
    sequences and context together) and refits the rest without the negative one.
    """
    if theta[0] >= 0.0 and theta[1] >= 0.0 and theta[2] >= 0.0:
        return theta
    best: list[float] | None = None
    best_distance = math.inf
    for held in _HELD_AT_ZERO:
        free = [i for i in range(3) if i not in held]
        inverse = _inverse([[p[i][j] for j in held] for i in held])
        if inverse is None:
            continue
        at = [theta[i] for i in held]
        weights = [sum(inverse[a][b] * at[b] for b in range(len(held))) for a in range(len(held))]
        distance = sum(at[a] * weights[a] for a in range(len(held)))
        if distance >= best_distance:
            continue
        candidate = [0.0, 0.0, 0.0]
        for i in free:
            candidate[i] = theta[i] - sum(p[i][held[a]] * weights[a] for a in range(len(held)))
        if all(candidate[i] >= 0.0 for i in free):
            best, best_distance = candidate, distance
    return best if best is not None else [0.0, 0.0, 0.0]


#: the coefficients a read may hold at 0, every non-empty subset of the three
_HELD_AT_ZERO: Final = ((0,), (1,), (2,), (0, 1), (0, 2), (1, 2), (0, 1, 2))


def _inverse(m: list[list[float]]) -> list[list[float]] | None:
    """The inverse of the 1x1, 2x2 or 3x3 covariance ``m`` (None where it is singular)."""
    n = len(m)
    if n == 1:
        return [[1.0 / m[0][0]]] if m[0][0] > 0.0 else None
    if n == 2:
        det = m[0][0] * m[1][1] - m[0][1] * m[1][0]
        if not det > 1e-12 * m[0][0] * m[1][1]:  # (a covariance's: det >= 0)
            return None
        return [[m[1][1] / det, -m[0][1] / det], [-m[1][0] / det, m[0][0] / det]]
    (a, b, c), (d, e, f), (g, h, k) = m
    co = [
        [e * k - f * h, c * h - b * k, b * f - c * e],
        [f * g - d * k, a * k - c * g, c * d - a * f],
        [d * h - e * g, b * g - a * h, a * e - b * d],
    ]
    det = a * co[0][0] + b * co[1][0] + c * co[2][0]
    if not det > 1e-12 * a * e * k:
        return None
    return [[x / det for x in row] for row in co]


class CostModel:
    """Online step-time model: a prior refitted by recursive least squares with forgetting.

    With no observations every prediction equals ``prior``'s. Each :meth:`observe_decode`
    updates (fixed, per_seq, per_context_token) by one RLS step with forgetting factor
    ``forgetting`` (an observation ``k`` steps old weighs ``forgetting ** k``); each
    :meth:`observe_prefill` updates ``prefill_per_token_s`` the same way. Coefficients are
    read non-negative (:meth:`current`), and the covariance trace is bounded so that
    unexcited directions (e.g. every step at the same batch size) cannot wind up: the fit then
    stays exact for what was observed and near the prior elsewhere. O(1) per call. (The
    recursion itself is unconstrained; only the coefficients read are held non-negative.)
    """

    __slots__ = (
        "_current",
        "_forgetting",
        "_ft",
        "_ft_line",
        "_ft_margins",
        "_ft_n",
        "_ft_next",
        "_ft_residuals",
        "_ft_sorted",
        "_p",
        "_pp",
        "_prefills",
        "_prior",
        "_steps",
        "_theta",
        "_theta_p",
    )

    def __init__(self, prior: StepTimeModel = DEFAULT_STEP_TIME, *, forgetting: float = 0.99):
        if not isinstance(prior, StepTimeModel):
            raise InvalidInput("prior", prior, "a StepTimeModel")
        self._forgetting = check_float(
            "forgetting", forgetting, minimum=0.0, maximum=1.0, open_min=True
        )
        self._prior = prior
        self._theta = [
            prior.fixed_s * _Y,
            prior.per_seq_s * _Y * _B,
            prior.per_context_token_s * _Y * _C,
        ]
        self._p = [[_P0, 0.0, 0.0], [0.0, _P0, 0.0], [0.0, 0.0, _P0]]
        self._theta_p = prior.prefill_per_token_s * _Y * _T
        self._pp = _P0
        self._steps = 0
        self._prefills = 0
        self._current: StepTimeModel | None = prior
        # first-token fit: forgetting-weighted sums of 1, x, y, x*x, x*y (x in 1,024 tokens)
        self._ft = [0.0, 0.0, 0.0, 0.0, 0.0]
        self._ft_n = 0
        # the fitted line (intercept, slope per 1,024 tokens) and the margins read off the
        # residuals (by quantile), kept until the next first token: several first-token
        # forecasts are read per admission, and the fit only moves when one is observed
        self._ft_line: tuple[float, float | None] | None = None
        self._ft_margins: dict[float, float] = {}
        # how far each recent first token came after the line's prediction (ring buffer), and
        # the same sorted, rebuilt on the first read after a change
        self._ft_residuals: list[float] = []
        self._ft_next = 0
        self._ft_sorted: list[float] | None = None

    @property
    def prior(self) -> StepTimeModel:
        return self._prior

    @property
    def forgetting(self) -> float:
        return self._forgetting

    @property
    def decode_observations(self) -> int:
        return self._steps

    @property
    def prefill_observations(self) -> int:
        return self._prefills

    def current(self) -> StepTimeModel:
        """The fitted model (``prior`` itself until something is observed): the recursion's
        estimate where its coefficients are all >= 0, else the nearest non-negative one in the
        metric of its covariance (:func:`_nearest_nonnegative`)."""
        cur = self._current
        if cur is None:
            t = _nearest_nonnegative(self._theta, self._p)
            cur = StepTimeModel(
                fixed_s=max(0.0, t[0]) / _Y,
                per_seq_s=max(0.0, t[1]) / (_Y * _B),
                per_context_token_s=max(0.0, t[2]) / (_Y * _C),
                prefill_per_token_s=self._theta_p / (_Y * _T),
            )
            self._current = cur
        return cur

    def predict_decode(self, batch_size: int, context_tokens: int) -> float:
        """Predicted seconds for one decode step (0 for an empty batch)."""
        return self.current().decode_time(batch_size, context_tokens)

    def predict_prefill(self, tokens: int) -> float:
        """Predicted seconds a prefill of ``tokens`` prompt tokens adds to its step."""
        return self.current().prefill_time(tokens)

    @property
    def first_token_observations(self) -> int:
        return self._ft_n

    def predict_first_token(self, tokens_ahead: int) -> float:
        """Predicted seconds from admission to first token with ``tokens_ahead`` prompt tokens
        queued for prefill in the engine, the request's own included.

        Until enough first tokens were observed: one step plus the prefill of everything ahead
        (the prior, which leaves out the decode steps that chunked prefill interleaves). Then
        the forgetting-weighted least-squares line through the observations (slope >= 0).
        """
        if self._ft_n < _FT_MIN:
            prior = self.current()
            return prior.fixed_s + prior.prefill_time(tokens_ahead)
        line = self._ft_line
        if line is None:
            line = self._ft_line = self._first_token_line()
        intercept, slope = line
        if slope is None:
            return max(0.0, intercept)
        return max(0.0, intercept + slope * (tokens_ahead / _T))

    def _first_token_line(self) -> tuple[float, float | None]:
        """The fitted first-token line: its intercept and slope (per 1,024 tokens; None where
        the observations do not fix one, and the line is their weighted mean)."""
        w, sx, sy, sxx, sxy = self._ft
        det = w * sxx - sx * sx
        if det <= 1e-12 * max(1.0, w * sxx):
            return sy / w, None
        slope = max(0.0, (w * sxy - sx * sy) / det)
        return (sy - slope * sx) / w, slope

    def first_token_margin(self, q: float) -> float:
        """Seconds to add to :meth:`predict_first_token` for its ``q``-quantile: the
        ``q``-quantile of how much later than the fitted line the last 64 first tokens came
        (>= 0; 0 until 8 of them were judged against a fitted line).

        The line is a mean: a caller admitted at the last moment the mean allows gets its first
        token late about half the time. (Over vLLM on this machine the 0.9-quantile margin was
        0-65 ms, beside a line of 17-50 ms for a prompt alone; see docs/benchmarks-history.md.)
        """
        margin = self._ft_margins.get(q)
        if margin is not None:
            return margin
        ordered = self._ft_sorted
        if ordered is None:
            ordered = self._ft_sorted = sorted(self._ft_residuals)
        n = len(ordered)
        if n < _FT_RESIDUALS_MIN:
            margin = 0.0
        else:
            margin = max(0.0, ordered[min(n - 1, max(0, math.ceil(q * n) - 1))])
        self._ft_margins[q] = margin
        return margin

    def observe_first_token(self, tokens_ahead: int, seconds: float) -> None:
        """A first token came ``seconds`` after admission, ``tokens_ahead`` tokens queued for
        prefill in the engine at that admission (its own included). O(1)."""
        if not (
            tokens_ahead.__class__ is int
            and seconds.__class__ is float
            and tokens_ahead >= 0
            and 0.0 <= seconds < math.inf
        ):
            check_int("tokens_ahead", tokens_ahead, minimum=0)
            check_float("seconds", seconds, minimum=0.0)
        x = tokens_ahead / _T
        y = float(seconds)
        if self._ft_n >= _FT_MIN:  # judged against the line fitted before it
            residual = y - self.predict_first_token(tokens_ahead)
            kept = self._ft_residuals
            if len(kept) < _FT_RESIDUALS:
                kept.append(residual)
            else:
                kept[self._ft_next] = residual
                self._ft_next = (self._ft_next + 1) % _FT_RESIDUALS
            self._ft_sorted = None
            self._ft_margins.clear()
        self._ft_line = None
        lam = self._forgetting
        ft = self._ft
        ft[0] = ft[0] * lam + 1.0
        ft[1] = ft[1] * lam + x
        ft[2] = ft[2] * lam + y
        ft[3] = ft[3] * lam + x * x
        ft[4] = ft[4] * lam + x * y
        self._ft_n += 1

    def observe_decode(self, batch_size: int, context_tokens: int, step_s: float) -> None:
        """Fit one observed decode step: ``batch_size`` >= 1 sequences took ``step_s`` seconds."""
        if not (
            batch_size.__class__ is int
            and context_tokens.__class__ is int
            and step_s.__class__ is float
            and batch_size >= 1
            and context_tokens >= 0
            and 0.0 <= step_s < math.inf
        ):  # the checks, skipped on the common path (this runs once per engine step)
            check_int("batch_size", batch_size, minimum=1)
            check_int("context_tokens", context_tokens, minimum=0)
            check_float("step_s", step_s, minimum=0.0)
        y = float(step_s) * _Y
        x1 = batch_size / _B
        x2 = context_tokens / _C
        lam = self._forgetting
        p = self._p
        p0, p1, p2 = p
        th = self._theta
        # unrolled 3x3 RLS step (x0 = 1); same operations, in the same order, as the loop form
        px0 = p0[0] * 1.0 + p0[1] * x1 + p0[2] * x2
        px1 = p1[0] * 1.0 + p1[1] * x1 + p1[2] * x2
        px2 = p2[0] * 1.0 + p2[1] * x1 + p2[2] * x2
        denom = lam + 1.0 * px0 + x1 * px1 + x2 * px2
        k0 = px0 / denom
        k1 = px1 / denom
        k2 = px2 / denom
        err = y - (th[0] * 1.0 + th[1] * x1 + th[2] * x2)
        # the recursion runs on the unconstrained estimate; only what is read (current()) is
        # held >= 0: feeding that back makes RLS diverge on the narrow, collinear data of a
        # real engine (batch and context moving together)
        th[0] += k0 * err
        th[1] += k1 * err
        th[2] += k2 * err
        # P <- (P - k (P x)^T) / lam, kept symmetric.
        v = (p0[0] - k0 * px0) / lam
        p0[0] = v
        v = (p0[1] - k0 * px1) / lam
        p0[1] = p1[0] = v
        v = (p0[2] - k0 * px2) / lam
        p0[2] = p2[0] = v
        v = (p1[1] - k1 * px1) / lam
        p1[1] = v
        v = (p1[2] - k1 * px2) / lam
        p1[2] = p2[1] = v
        p2[2] = (p2[2] - k2 * px2) / lam
        trace = p0[0] + p1[1] + p2[2]
        if trace > _TRACE_MAX:
            f = _TRACE_MAX / trace
            for i in range(3):
                for j in range(3):
                    p[i][j] *= f
        self._steps += 1
        self._current = None

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Fit one observed prefill: ``tokens`` >= 1 prompt tokens added ``seconds`` seconds."""
        check_int("tokens", tokens, minimum=1)
        y = check_float("seconds", seconds, minimum=0.0) * _Y
        x = tokens / _T
        lam = self._forgetting
        px = self._pp * x
        k = px / (lam + x * px)
        self._theta_p = max(0.0, self._theta_p + k * (y - self._theta_p * x))
        self._pp = min(_P0, (self._pp - k * px) / lam)
        self._prefills += 1
        self._current = None
