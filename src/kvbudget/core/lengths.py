"""The online, calibrated output-length model and underestimation tracking (DESIGN §6).

This module owns:

* the shared log-spaced bucket layout (:data:`BUCKET_EDGES`), so every histogram merges with
  every other by adding counts;
* :class:`LengthHistogram`: a decaying, mergeable histogram of output lengths that keeps stop
  events and censored observations (cancelled or preempted requests: only ``L > observed`` is
  known) apart and answers from a Kaplan–Meier survival estimate over its buckets;
* :class:`LengthModel`: one histogram per calibration level with back-off from sparse keys to
  their parents, a bounded (LRU) number of histograms, cached quantiles, and the
  underestimation tracker behind :class:`UnderestimationReport`.

Theory of operation
-------------------
Bucket ``j`` holds the integer lengths in ``(BUCKET_EDGES[j-1], BUCKET_EDGES[j]]`` (bucket 0 holds
length 0 alone). Lengths 0..16 have a bucket each; above that an edge is ~12 % above the one
before, up to :data:`MAX_TOKENS` (= 1 << 20): 113 buckets in all. A length above
:data:`MAX_TOKENS` is counted in the last bucket, so no answer ever exceeds :data:`MAX_TOKENS`.

Survival is estimated per bucket with Kaplan–Meier: a censored observation in bucket ``j`` is at
risk for the stop events of bucket ``j`` and leaves the risk set after it (the usual convention
that censoring follows events at the same time; at bucket resolution it can only raise the
estimated survival, i.e. err towards larger allowances). Adding censored observations therefore
never lowers a quantile. Between bucket edges survival is interpolated log-linearly and answers
are rounded *up* to whole tokens.

Forgetting is by observation count: the observation made ``k`` observations ago weighs
``2 ** (-k / half_life)``. It is implemented lazily: each new observation is added with a
weight ``scale`` that grows by ``2 ** (1 / half_life)`` per observation, effective weights are
``stored / scale``, and the stored counts are divided down (O(buckets)) only when ``scale``
passes 2**200, so :meth:`LengthHistogram.observe` is O(1) amortised.

Everything here is pure and deterministic: no clock, no I/O, no logging.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

import attrs

from kvbudget.core.model import CalibrationKey
from kvbudget.errors import InvalidInput
from kvbudget.validate import check_float, check_int

__all__ = [
    "BUCKET_EDGES",
    "KEY_FIELDS",
    "LEVELS",
    "MAX_TOKENS",
    "LengthHistogram",
    "LengthModel",
    "UnderestimationReport",
    "UnderestimationStats",
    "bucket_index",
]

MAX_TOKENS: Final = 1 << 20
"""The largest length the bucket layout resolves; longer lengths count in the last bucket."""

_EXACT_MAX: Final = 16
_GROWTH: Final = 1.12


def _build_edges() -> tuple[int, ...]:
    edges = list(range(_EXACT_MAX + 1))
    x = _EXACT_MAX
    while x < MAX_TOKENS:
        x = min(MAX_TOKENS, max(x + 1, math.ceil(x * _GROWTH)))
        edges.append(x)
    return tuple(edges)


BUCKET_EDGES: Final[tuple[int, ...]] = _build_edges()
"""Upper edges (inclusive) of the shared buckets: 0, 1, ..., 16, 18, 21, 24, ..., 1 << 20."""

_NB: Final = len(BUCKET_EDGES)
_LOG_RATIO: Final[tuple[float, ...]] = tuple(
    0.0
    if j == 0 or BUCKET_EDGES[j] - BUCKET_EDGES[j - 1] == 1
    else math.log(BUCKET_EDGES[j] / BUCKET_EDGES[j - 1])
    for j in range(_NB)
)
_RENORM_AT: Final = 2.0**200
_TOL: Final = 1e-12


def bucket_index(length: int) -> int:
    """The bucket holding ``length`` (lengths above :data:`MAX_TOKENS` share the last one)."""
    if length <= _EXACT_MAX:
        return length if length > 0 else 0
    if length >= MAX_TOKENS:
        return _NB - 1
    return bisect_left(BUCKET_EDGES, length)


def _check_q(q: Any) -> float:
    if type(q) is float and 0.0 < q < 1.0:
        return q
    return check_float("q", q, minimum=0.0, maximum=1.0, open_min=True, open_max=True)


def _check_bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidInput(field, value, "a bool")
    return value


class LengthHistogram:
    """A decaying, mergeable histogram of output lengths with censoring.

    ``half_life`` is in observations (None: no forgetting). Stop events and censored
    observations are counted separately; :meth:`survival`, :meth:`quantile` and
    :meth:`conditional_quantile` use the Kaplan–Meier estimate over the shared buckets.

    With no data at all, or when censoring leaves the survival above ``1 - q`` everywhere, the
    data cannot bound the quantile and :data:`MAX_TOKENS` is returned (callers cap at the hard
    maximum). ``version`` changes when the answers may change, for callers that cache them: on
    every merge, and at least every 1/128 of the observations (exact below 128 observations), so
    answers lag the newest data by under 1 %.
    """

    __slots__ = (
        "_censored",
        "_censored_total",
        "_events",
        "_events_total",
        "_gain",
        "_half_life",
        "_neg_surv",
        "_observations",
        "_pending",
        "_scale",
        "_surv",
        "_surv_version",
        "_version",
    )

    def __init__(self, half_life: float | None = None) -> None:
        if half_life is None:
            self._gain = 1.0
        else:
            half_life = check_float("half_life", half_life, minimum=0.0, open_min=True)
            self._gain = 2.0 ** (1.0 / half_life)
        self._half_life = half_life
        self._events: list[float] = [0.0] * _NB
        self._censored: list[float] = [0.0] * _NB
        self._events_total = 0.0
        self._censored_total = 0.0
        self._scale = 1.0
        self._observations = 0
        self._pending = 0
        self._version = 0
        self._surv: list[float] = []
        self._neg_surv: list[float] = []
        self._surv_version = -1

    # -- state -----------------------------------------------------------------------------

    @property
    def half_life(self) -> float | None:
        return self._half_life

    @property
    def version(self) -> int:
        """Changes whenever the histogram changes."""
        return self._version

    @property
    def observations(self) -> int:
        """How many observations were made (undecayed, merges included)."""
        return self._observations

    @property
    def total_weight(self) -> float:
        """Decayed weight of all observations, events and censored."""
        return (self._events_total + self._censored_total) / self._scale

    @property
    def event_weight(self) -> float:
        """Decayed weight of the stop events."""
        return self._events_total / self._scale

    @property
    def censored_weight(self) -> float:
        """Decayed weight of the censored observations."""
        return self._censored_total / self._scale

    def __repr__(self) -> str:
        return (
            f"LengthHistogram(half_life={self._half_life!r}, events={self.event_weight:.3g}, "
            f"censored={self.censored_weight:.3g})"
        )

    # -- updates ---------------------------------------------------------------------------

    def observe(self, length: int, *, censored: bool = False) -> None:
        """Count one output length: a stop at ``length``, or (``censored``) ``L > length``."""
        check_int("length", length, minimum=0)
        _check_bool("censored", censored)
        self._add(length, censored)

    def _add(self, length: int, censored: bool) -> None:
        scale = self._scale * self._gain
        if scale > _RENORM_AT:
            self._renormalise(scale)
            scale = 1.0
        self._scale = scale
        j = bucket_index(length)
        if censored:
            self._censored[j] += scale
            self._censored_total += scale
        else:
            self._events[j] += scale
            self._events_total += scale
        self._observations += 1
        # publish a new version at least every 1/128 of the observations: answers (and every
        # cache keyed on the version) may lag the newest <1% of the data, which keeps an
        # admission after each finish from rebuilding the survival curve
        self._pending += 1
        if self._pending > self._observations >> 7:
            self._pending = 0
            self._version += 1

    def _renormalise(self, divisor: float) -> None:
        inv = 1.0 / divisor
        self._events = [c * inv for c in self._events]
        self._censored = [c * inv for c in self._censored]
        self._events_total = math.fsum(self._events)
        self._censored_total = math.fsum(self._censored)
        self._scale = 1.0

    def merge(self, other: LengthHistogram) -> None:
        """Add ``other``'s (decayed) counts to this histogram, in place.

        Equivalent to having observed ``other``'s data here with the weights it has now; this
        histogram keeps its own half-life.
        """
        if not isinstance(other, LengthHistogram):
            raise InvalidInput("other", other, "a LengthHistogram")
        factor = self._scale / other._scale
        ev = list(other._events)
        ce = list(other._censored)
        for j in range(_NB):
            self._events[j] += ev[j] * factor
            self._censored[j] += ce[j] * factor
        self._events_total = math.fsum(self._events)
        self._censored_total = math.fsum(self._censored)
        self._observations += other._observations
        self._pending = 0
        self._version += 1

    def copy(self) -> LengthHistogram:
        """An independent copy."""
        new = LengthHistogram(self._half_life)
        new._events = list(self._events)
        new._censored = list(self._censored)
        new._events_total = self._events_total
        new._censored_total = self._censored_total
        new._scale = self._scale
        new._observations = self._observations
        return new

    # -- the Kaplan–Meier curve ------------------------------------------------------------

    def _curve(self) -> list[float]:
        """``surv[j]`` = P(L > upper edge of bucket j-1); ``surv[0]`` = 1. Cached per version."""
        if self._surv_version == self._version:
            return self._surv
        ev = self._events
        ce = self._censored
        at_risk = [0.0] * _NB
        acc = 0.0
        for j in range(_NB - 1, -1, -1):
            acc += ev[j] + ce[j]
            at_risk[j] = acc
        surv = [1.0] * (_NB + 1)
        s = 1.0
        for j in range(_NB):
            e = ev[j]
            if e > 0.0 and s > 0.0:
                n = at_risk[j]
                s = 0.0 if e >= n else s * (1.0 - e / n)
            surv[j + 1] = s
        self._surv = surv
        self._neg_surv = [-v for v in surv[1:]]
        self._surv_version = self._version
        return surv

    def _survival(self, x: int) -> float:
        # (the cache's check first: this is asked at every grant)
        surv = self._surv if self._surv_version == self._version else self._curve()
        j = bucket_index(x)
        before, after = surv[j], surv[j + 1]
        log_ratio = _LOG_RATIO[j]
        if log_ratio == 0.0 or x >= BUCKET_EDGES[j]:
            return after
        frac = math.log(x / BUCKET_EDGES[j - 1]) / log_ratio
        return before - (before - after) * frac

    def _solve(self, target: float, first_bucket: int, at_least: int) -> int:
        """Smallest integer x >= at_least whose interpolated survival is <= target."""
        surv = self._curve()
        j = bisect_left(self._neg_surv, -(target + _TOL), first_bucket)
        if j >= _NB:
            return max(MAX_TOKENS, at_least)
        hi = BUCKET_EDGES[j]
        log_ratio = _LOG_RATIO[j]
        if log_ratio == 0.0:
            x = hi
        else:
            lo = BUCKET_EDGES[j - 1]
            before, after = surv[j], surv[j + 1]
            drop = before - after
            frac = 0.0 if drop <= 0.0 else min(1.0, max(0.0, (before - target) / drop))
            x = min(hi, max(lo + 1, math.ceil(lo * math.exp(frac * log_ratio) - 1e-9)))
        return max(x, at_least)

    # -- queries ---------------------------------------------------------------------------

    def survival(self, x: int) -> float:
        """P(L > x), interpolated log-linearly within a bucket."""
        check_int("x", x, minimum=0)
        return self._survival(x)

    def quantile(self, q: float) -> int:
        """Smallest whole x >= 1 with P(L <= x) >= q (:data:`MAX_TOKENS` if unbounded)."""
        return self._quantile(_check_q(q))

    def _quantile(self, q: float) -> int:
        return self._solve(1.0 - q, 0, 1)

    def conditional_quantile(self, q: float, given: int) -> int:
        """Smallest whole x >= given + 1 with P(L <= x | L > given) >= q.

        When no observed mass lies beyond ``given`` (the request has outlived everything seen),
        the answer doubles the length so far: ``max(given + 1, 2 * given)``, at most
        :data:`MAX_TOKENS` unless ``given`` is already past it.
        """
        q = _check_q(q)
        check_int("given", given, minimum=0)
        return self._conditional(q, given)

    def _conditional(self, q: float, given: int) -> int:
        if given >= MAX_TOKENS:
            return given + 1
        s_given = self._survival(given)
        if s_given <= _TOL:
            return max(given + 1, min(MAX_TOKENS, 2 * given))
        return self._solve((1.0 - q) * s_given, bucket_index(given + 1), given + 1)


# -- the model ---------------------------------------------------------------------------

KEY_FIELDS: Final[tuple[str, ...]] = (
    "model",
    "task",
    "service_class",
    "tenant",
    "sampling",
    "stops",
)
"""The CalibrationKey fields, in back-off order (a level keeps a prefix of them)."""

LEVELS: Final[tuple[tuple[str, int], ...]] = (
    ("full", 6),
    ("tenant", 4),
    ("service_class", 3),
    ("task", 2),
    ("model", 1),
    ("global", 0),
)
"""Back-off levels, most specific first: (name, number of leading key fields kept)."""

_LevelKey = tuple[str, ...]


def _fields(key: CalibrationKey) -> tuple[str, ...]:
    return (key.model, key.task, key.service_class, key.tenant, key.sampling, key.stops)


#: conditional answers a node keeps per histogram version (then it starts over)
_CONDITIONAL_CACHE_MAX: Final = 4096


class _Node:
    __slots__ = ("ccache", "hist", "qcache", "qualified", "qversion")

    def __init__(self, hist: LengthHistogram) -> None:
        self.hist = hist
        self.qcache: dict[float, int] = {}
        # (q, given) -> conditional quantile: the scheduler asks it of every live stream in its
        # passes (drain forecasts, who gives way), streams of one key at the same length alike
        self.ccache: dict[tuple[float, int], int] = {}
        self.qversion = -1
        self.qualified = False

    def current(self) -> None:
        """Drop the cached answers if the histogram has changed since they were cached."""
        version = self.hist._version
        if self.qversion != version:
            self.qcache.clear()
            self.ccache.clear()
            self.qversion = version


@attrs.frozen(slots=True)
class UnderestimationStats:
    """How often, and by how much, initial allowances fell short of the true length.

    ``rate`` = underestimated / count (0 when count is 0) and ``coverage`` = 1 - rate; a
    calibrated model has ``coverage`` close to ``target`` (the mean quantile the allowances
    were asked at). ``shortfall_p50/p90/p99``: percentiles of ``length - allowance`` in tokens
    over the underestimated requests only (0 when there were none), at bucket resolution and
    rounded up.
    """

    count: int
    underestimated: int
    rate: float
    coverage: float
    target: float
    shortfall_p50: int
    shortfall_p90: int
    shortfall_p99: int


@attrs.frozen(slots=True)
class UnderestimationReport:
    """Underestimation overall and per key dimension value.

    ``dimensions`` maps a CalibrationKey field name (see :data:`KEY_FIELDS`) to a read-only
    mapping from each tracked value of that field to its stats.
    """

    overall: UnderestimationStats
    dimensions: Mapping[str, Mapping[str, UnderestimationStats]]

    def get(self, field: str, value: str) -> UnderestimationStats | None:
        """Stats for one dimension value, or None if it is not tracked."""
        return self.dimensions.get(field, {}).get(value)


class _Outcomes:
    __slots__ = ("count", "shortfall", "target_sum", "under")

    def __init__(self) -> None:
        self.count = 0
        self.under = 0
        self.target_sum = 0.0
        self.shortfall = LengthHistogram(None)

    def add(self, allowance: int, length: int, quantile: float) -> None:
        self.count += 1
        self.target_sum += quantile
        if length > allowance:
            self.under += 1
            self.shortfall._add(length - allowance, False)

    def stats(self) -> UnderestimationStats:
        n = self.count
        rate = self.under / n if n else 0.0
        if self.under:
            s = self.shortfall
            p50, p90, p99 = s._quantile(0.5), s._quantile(0.9), s._quantile(0.99)
        else:
            p50 = p90 = p99 = 0
        return UnderestimationStats(
            count=n,
            underestimated=self.under,
            rate=rate,
            coverage=1.0 - rate,
            target=self.target_sum / n if n else 0.0,
            shortfall_p50=p50,
            shortfall_p90=p90,
            shortfall_p99=p99,
        )


class LengthModel:
    """Calibrated output-length quantiles per :class:`CalibrationKey`, with back-off.

    Every observation updates one histogram per level (see :data:`LEVELS`): the full key,
    (model, task, service_class, tenant), (model, task, service_class), (model, task),
    (model,) and the global one. A query answers from the most specific level whose decayed
    stop-event weight is at least ``min_samples``; if no level qualifies (including the global
    one), the *prior* answers: an exponential length distribution with mean ``prior_tokens``,
    so ``quantile(q) = ceil(-prior_tokens * ln(1 - q))`` (p50 = 178, p90 = 590 for 256),
    ``conditional_quantile(q, given) = given + quantile(q)`` (memoryless) and
    ``survival(at) = exp(-at / prior_tokens)``.

    At most ``max_keys`` histograms exist across all levels (the global one included and never
    evicted); past that the least recently *observed* one is dropped. Quantile answers are
    cached per (histogram, q) and invalidated by the histogram's version, and the level a key
    resolves to is cached until some histogram starts or stops qualifying, so a warm
    :meth:`quantile` is a few dict look-ups.

    :meth:`record_outcome` feeds the underestimation tracker read by :meth:`underestimation`,
    which keeps at most ``max_dimension_values`` values per key field (LRU).
    """

    __slots__ = (
        "_epoch",
        "_global",
        "_half_life",
        "_max_dim_values",
        "_max_keys",
        "_min_samples",
        "_nodes",
        "_outcomes",
        "_overall",
        "_prior",
        "_resolved",
        "_threshold",
    )

    def __init__(
        self,
        *,
        max_keys: int = 1024,
        min_samples: int = 32,
        half_life: float = 5000.0,
        prior_tokens: int = 256,
        max_dimension_values: int = 256,
    ) -> None:
        self._max_keys = check_int("max_keys", max_keys, minimum=len(LEVELS))
        self._min_samples = check_int("min_samples", min_samples, minimum=1)
        self._half_life = check_float("half_life", half_life, minimum=0.0, open_min=True)
        self._prior = check_int("prior_tokens", prior_tokens, minimum=1)
        self._max_dim_values = check_int("max_dimension_values", max_dimension_values, minimum=1)
        # Decayed weight of min_samples consecutive events, less a rounding margin.
        rate = math.log(2.0) / self._half_life
        fresh = math.expm1(-rate * self._min_samples) / math.expm1(-rate)
        self._threshold = min(float(self._min_samples), fresh) * (1.0 - 1e-9)
        self._global = _Node(LengthHistogram(self._half_life))
        self._nodes: OrderedDict[_LevelKey, _Node] = OrderedDict()
        self._epoch = 0
        #: id(key) -> (key, epoch, node): found by identity, without calling the key's hash and
        #: equality in Python (the key is kept, so its id is not reused while cached)
        self._resolved: dict[int, tuple[CalibrationKey, int, _Node | None]] = {}
        self._overall = _Outcomes()
        self._outcomes: dict[str, OrderedDict[str, _Outcomes]] = {
            f: OrderedDict() for f in KEY_FIELDS
        }

    # -- configuration / introspection -----------------------------------------------------

    @property
    def max_keys(self) -> int:
        return self._max_keys

    @property
    def min_samples(self) -> int:
        return self._min_samples

    @property
    def half_life(self) -> float:
        return self._half_life

    @property
    def prior_tokens(self) -> int:
        return self._prior

    @property
    def histogram_count(self) -> int:
        """Histograms held across all levels, the global one included (<= ``max_keys``)."""
        return len(self._nodes) + 1

    def level(self, key: CalibrationKey) -> str:
        """The level ``key``'s answers come from: a name in :data:`LEVELS`, or ``"prior"``."""
        node = self._node_for(key)
        if node is None:
            return "prior"
        if node is self._global:
            return "global"
        fields = _fields(key)
        for name, n in LEVELS[:-1]:
            if self._nodes.get(fields[:n]) is node:
                return name
        raise AssertionError("resolved node is not on the key's chain")  # pragma: no cover

    def histogram(self, key: CalibrationKey, level: str = "full") -> LengthHistogram | None:
        """A copy of the histogram ``key`` has at ``level`` (None if it has none)."""
        if not isinstance(key, CalibrationKey):
            raise InvalidInput("key", key, "a CalibrationKey")
        for name, n in LEVELS:
            if name == level:
                if n == 0:
                    return self._global.hist.copy()
                node = self._nodes.get(_fields(key)[:n])
                return None if node is None else node.hist.copy()
        raise InvalidInput("level", level, f"one of {', '.join(n for n, _ in LEVELS)}")

    # -- observations ----------------------------------------------------------------------

    def observe(self, key: CalibrationKey, length: int, *, censored: bool = False) -> None:
        """Count a finished request's output length at every level of ``key``.

        ``censored=True`` for a request that ended without stopping (cancelled, preempted
        without resume, truncated): its true length is only known to exceed ``length``.
        """
        if not isinstance(key, CalibrationKey):
            raise InvalidInput("key", key, "a CalibrationKey")
        check_int("length", length, minimum=0)
        _check_bool("censored", censored)
        self._update(self._global, length, censored)
        fields = _fields(key)
        nodes = self._nodes
        for _name, n in reversed(LEVELS[:-1]):
            lk = fields[:n]
            node = nodes.get(lk)
            if node is None:
                node = _Node(LengthHistogram(self._half_life))
                nodes[lk] = node
                if len(nodes) >= self._max_keys:
                    self._evict()
            else:
                nodes.move_to_end(lk)
            self._update(node, length, censored)

    def _update(self, node: _Node, length: int, censored: bool) -> None:
        node.hist._add(length, censored)
        qualified = node.hist.event_weight >= self._threshold
        if qualified != node.qualified:
            node.qualified = qualified
            self._epoch += 1

    def _evict(self) -> None:
        _lk, victim = self._nodes.popitem(last=False)
        if victim.qualified:
            self._epoch += 1

    # -- resolution ------------------------------------------------------------------------

    def _node_for(self, key: CalibrationKey) -> _Node | None:
        cached = self._resolved.get(id(key))
        if cached is not None and cached[0] is key and cached[1] == self._epoch:
            return cached[2]
        if not isinstance(key, CalibrationKey):
            raise InvalidInput("key", key, "a CalibrationKey")
        found: _Node | None = None
        fields = _fields(key)
        for _name, n in LEVELS[:-1]:
            node = self._nodes.get(fields[:n])
            if node is not None and node.qualified:
                found = node
                break
        else:
            if self._global.qualified:
                found = self._global
        if len(self._resolved) >= 4 * self._max_keys:
            self._resolved.clear()
        self._resolved[id(key)] = (key, self._epoch, found)
        return found

    def _prior_quantile(self, q: float) -> int:
        return max(1, math.ceil(-self._prior * math.log1p(-q) - 1e-9))

    # -- queries ---------------------------------------------------------------------------

    def quantile(self, key: CalibrationKey, q: float) -> int:
        """The q-quantile of ``key``'s output length, in whole tokens (>= 1)."""
        if type(q) is not float or not 0.0 < q < 1.0:
            q = _check_q(q)
        node = self._node_for(key)
        if node is None:
            return self._prior_quantile(q)
        if node.qversion != node.hist._version:
            node.current()
        cache = node.qcache
        ans = cache.get(q)
        if ans is None:
            ans = node.hist._quantile(q)
            cache[q] = ans
        return ans

    def conditional_quantile(self, key: CalibrationKey, q: float, given: int) -> int:
        """Smallest x >= given + 1 with P(L <= x | L > given) >= q for ``key``.

        See :meth:`LengthHistogram.conditional_quantile` for a request that outlived all the
        data, and the class docstring for the prior.
        """
        if type(q) is not float or not 0.0 < q < 1.0:
            q = _check_q(q)
        if type(given) is not int or given < 0:
            check_int("given", given, minimum=0)
        node = self._node_for(key)
        if node is None:
            return given + self._prior_quantile(q)
        if node.qversion != node.hist._version:
            node.current()
        cache = node.ccache
        ans = cache.get((q, given))
        if ans is None:
            if len(cache) >= _CONDITIONAL_CACHE_MAX:
                cache.clear()
            ans = node.hist._conditional(q, given)
            cache[q, given] = ans
        return ans

    def survival(self, key: CalibrationKey, at: int) -> float:
        """P(L > at) for ``key``."""
        if type(at) is not int or at < 0:
            check_int("at", at, minimum=0)
        node = self._node_for(key)
        if node is None:
            return math.exp(-at / self._prior)
        return node.hist._survival(at)

    # -- underestimation -------------------------------------------------------------------

    def record_outcome(
        self, key: CalibrationKey, allowance: int, length: int, quantile: float
    ) -> None:
        """Record how a stopped request's initial allowance compared with its true length.

        ``allowance``: the output tokens granted at admission; ``length``: the true output
        length; ``quantile``: the quantile the allowance was asked at. Only requests that
        stopped by themselves belong here (a censored length says nothing about coverage).
        """
        if not isinstance(key, CalibrationKey):
            raise InvalidInput("key", key, "a CalibrationKey")
        check_int("allowance", allowance, minimum=0)
        check_int("length", length, minimum=0)
        quantile = check_float(
            "quantile", quantile, minimum=0.0, maximum=1.0, open_min=True, open_max=True
        )
        self._overall.add(allowance, length, quantile)
        for field, value in zip(KEY_FIELDS, _fields(key), strict=True):
            table = self._outcomes[field]
            entry = table.get(value)
            if entry is None:
                entry = _Outcomes()
                table[value] = entry
                if len(table) > self._max_dim_values:
                    table.popitem(last=False)
            else:
                table.move_to_end(value)
            entry.add(allowance, length, quantile)

    def underestimation(self) -> UnderestimationReport:
        """A snapshot of underestimation overall and per key dimension value."""
        dims = {
            field: MappingProxyType({v: o.stats() for v, o in table.items()})
            for field, table in self._outcomes.items()
        }
        return UnderestimationReport(
            overall=self._overall.stats(), dimensions=MappingProxyType(dims)
        )

    def reset_underestimation(self) -> None:
        """Forget every recorded outcome (the length histograms are kept)."""
        self._overall = _Outcomes()
        self._outcomes = {f: OrderedDict() for f in KEY_FIELDS}
