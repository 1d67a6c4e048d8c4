"""Tests for kvbudget.core.lengths: histogram, Kaplan–Meier, decay, back-off, underestimation."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbudget.core.lengths import (
    BUCKET_EDGES,
    MAX_TOKENS,
    LengthHistogram,
    LengthModel,
    UnderestimationReport,
    bucket_index,
)
from kvbudget.core.model import CalibrationKey
from kvbudget.errors import InvalidInput

lengths = st.integers(min_value=0, max_value=200_000)
qs = st.floats(min_value=0.01, max_value=0.99)


def empirical_quantile(sorted_xs: list[int], q: float) -> int:
    """Smallest x with ECDF(x) >= q."""
    n = len(sorted_xs)
    k = math.ceil(q * n - 1e-9)
    return sorted_xs[max(0, k - 1)]


def same_bucket(a: int, b: int) -> bool:
    return bucket_index(max(a, 1)) == bucket_index(max(b, 1))


# -- layout ----------------------------------------------------------------------------------


def test_layout_is_log_spaced_and_exact_below_16() -> None:
    assert BUCKET_EDGES[:17] == tuple(range(17))
    assert BUCKET_EDGES[-1] == MAX_TOKENS == 1 << 20
    assert 100 <= len(BUCKET_EDGES) <= 130
    for lo, hi in itertools.pairwise(BUCKET_EDGES[16:]):
        assert 1.0 < hi / lo <= (1.13 if lo >= 100 else 1.17)


@given(st.integers(min_value=0, max_value=MAX_TOKENS))
def test_bucket_index_brackets_length(x: int) -> None:
    j = bucket_index(x)
    assert x <= BUCKET_EDGES[j]
    assert j == 0 or x > BUCKET_EDGES[j - 1]


# -- quantiles without censoring -------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(lengths, min_size=1, max_size=300), qs)
def test_quantile_matches_empirical_within_bucket(xs: list[int], q: float) -> None:
    h = LengthHistogram()
    for x in xs:
        h.observe(x)
    xs.sort()
    expected = empirical_quantile(xs, q)
    got = h.quantile(q)
    assert got >= 1
    assert same_bucket(got, expected), (got, expected)


def test_quantile_exact_for_small_lengths() -> None:
    h = LengthHistogram()
    for x in range(1, 11):
        h.observe(x)
    assert h.quantile(0.5) == 5
    assert h.quantile(0.51) == 6
    assert h.quantile(0.9) == 9
    assert h.quantile(0.95) == 10
    assert h.survival(3) == pytest.approx(0.7)


def test_quantile_on_lognormal_close_to_truth() -> None:
    rng = random.Random(7)
    xs = sorted(int(rng.lognormvariate(5.0, 1.0)) + 1 for _ in range(20_000))
    h = LengthHistogram()
    for x in xs:
        h.observe(x)
    for q in (0.1, 0.5, 0.9, 0.99):
        exact = empirical_quantile(xs, q)
        assert abs(h.quantile(q) - exact) <= 0.12 * exact + 1, q


def test_empty_histogram_is_unbounded() -> None:
    h = LengthHistogram()
    assert h.total_weight == 0.0
    assert h.quantile(0.5) == MAX_TOKENS
    assert h.survival(100) == 1.0


# -- censoring -------------------------------------------------------------------------------


def test_kaplan_meier_hand_example() -> None:
    # Events at 2, 4, 6; censored at 3 and 5.
    # t=2: 5 at risk, 1 event -> S=4/5. t=4: 3 at risk -> S=4/5*2/3=8/15. t=6: 1 at risk -> 0.
    h = LengthHistogram()
    for x in (2, 4, 6):
        h.observe(x)
    for x in (3, 5):
        h.observe(x, censored=True)
    assert h.survival(1) == pytest.approx(1.0)
    assert h.survival(2) == pytest.approx(0.8)
    assert h.survival(3) == pytest.approx(0.8)
    assert h.survival(4) == pytest.approx(8 / 15)
    assert h.survival(5) == pytest.approx(8 / 15)
    assert h.survival(6) == pytest.approx(0.0)
    # Naively dropping the censored points would give S(4) = 1/3; ignoring censoring (treating
    # them as stops) would give S(4) = 1/5.
    assert h.quantile(0.2) == 2
    assert h.quantile(0.3) == 4
    assert h.quantile(0.5) == 6
    assert h.event_weight == pytest.approx(3.0)
    assert h.total_weight == pytest.approx(5.0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 50_000), min_size=1, max_size=200),
    st.lists(st.floats(1.0, 10.0), min_size=1, max_size=100),
    qs,
)
def test_censored_above_quantile_never_lowers_it(
    events: list[int], factors: list[float], q: float
) -> None:
    h = LengthHistogram()
    for x in events:
        h.observe(x)
    before = h.quantile(q)
    for f in factors:
        h.observe(int(before * f), censored=True)
    assert h.quantile(q) >= before


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 50_000), min_size=1, max_size=200), st.integers(0, 60_000))
def test_censoring_raises_survival(events: list[int], c: int) -> None:
    h = LengthHistogram()
    for x in events:
        h.observe(x)
    before = [h.survival(x) for x in (1, 10, 100, 1000, 10_000)]
    h.observe(c, censored=True)
    after = [h.survival(x) for x in (1, 10, 100, 1000, 10_000)]
    for b, a in zip(before, after, strict=True):
        assert a >= b - 1e-12


def test_all_censored_tail_is_unbounded() -> None:
    h = LengthHistogram()
    for _ in range(10):
        h.observe(100)
    for _ in range(90):
        h.observe(500, censored=True)
    assert same_bucket(h.quantile(0.05), 100)
    assert h.quantile(0.5) == MAX_TOKENS  # only L > 500 is known for 90 %


# -- conditional quantiles -------------------------------------------------------------------


def test_conditional_quantile_small_exact() -> None:
    h = LengthHistogram()
    for x in range(1, 11):
        h.observe(x)
    # Given L > 5: uniform on 6..10.
    assert h.conditional_quantile(0.5, 5) == 8  # P(L<=8 | L>5) = 3/5 >= .5; P(L<=7|.)=2/5
    assert h.conditional_quantile(0.2, 5) == 6
    assert h.conditional_quantile(0.99, 5) == 10
    assert h.conditional_quantile(0.5, 0) == h.quantile(0.5)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 100_000), min_size=1, max_size=200),
    qs,
    st.one_of(st.integers(0, 120_000), st.sampled_from(BUCKET_EDGES[:95])),
)
def test_conditional_quantile_properties(xs: list[int], q: float, g: int) -> None:
    h = LengthHistogram()
    for x in xs:
        h.observe(x)
    ans = h.conditional_quantile(q, g)
    assert ans >= g + 1
    top = BUCKET_EDGES[bucket_index(max(xs))]
    if g >= top:  # outlived everything seen, even at bucket resolution: doubling
        assert ans == max(g + 1, min(MAX_TOKENS, 2 * g))
        return
    assert ans <= max(top, g + 1)
    survivors = sorted(x for x in xs if x > g)
    if survivors and g == BUCKET_EDGES[bucket_index(g)]:
        # g on a bucket edge: S(g) is exact, so the answer is in the exact answer's bucket.
        expected = empirical_quantile(survivors, q)
        assert same_bucket(ans, expected), (ans, expected)
    # Monotone in q.
    assert h.conditional_quantile(min(0.999, q + 0.2), g) >= ans


# -- decay -----------------------------------------------------------------------------------


def test_decay_moves_quantiles_to_new_distribution() -> None:
    rng = random.Random(3)
    h = LengthHistogram(half_life=500.0)
    for _ in range(5000):
        h.observe(rng.randint(100, 200))
    assert 100 <= h.quantile(0.5) <= 200
    for _ in range(100):  # 0.2 half-lives: the old distribution still dominates
        h.observe(rng.randint(1000, 2000))
    assert h.quantile(0.5) <= 200
    for _ in range(2400):  # ~5 half-lives in total
        h.observe(rng.randint(1000, 2000))
    assert 1000 <= h.quantile(0.1) <= 2000
    assert 1000 <= h.quantile(0.5) <= 2000


def test_no_decay_never_forgets() -> None:
    h = LengthHistogram()
    for _ in range(1000):
        h.observe(100)
    for _ in range(999):
        h.observe(1000)
    assert same_bucket(h.quantile(0.5), 100)


def test_decay_weights_and_renormalisation() -> None:
    h = LengthHistogram(half_life=1.0)
    for i in range(5000):  # forces many renormalisations (scale passes 2**200 every 200 obs)
        h.observe(10 if i % 2 else 20)
    # Geometric series: sum 2**-k for k >= 0 = 2.
    assert h.total_weight == pytest.approx(2.0)
    assert all(math.isfinite(h.survival(x)) for x in (5, 10, 15, 20))
    # The last observation (i = 4999, odd -> 10) weighs 1, the one before 1/2, ...
    assert h.survival(10) == pytest.approx(1 / 3)


# -- merge -----------------------------------------------------------------------------------


obs = st.tuples(lengths, st.booleans())


@settings(max_examples=150, deadline=None)
@given(st.lists(obs, max_size=150), st.lists(obs, max_size=150))
def test_merge_equals_observing_the_union(
    a: list[tuple[int, bool]], b: list[tuple[int, bool]]
) -> None:
    ha, hb, hu = LengthHistogram(), LengthHistogram(), LengthHistogram()
    for x, c in a:
        ha.observe(x, censored=c)
        hu.observe(x, censored=c)
    for x, c in b:
        hb.observe(x, censored=c)
        hu.observe(x, censored=c)
    ha.merge(hb)
    assert ha.total_weight == pytest.approx(hu.total_weight)
    assert ha.event_weight == pytest.approx(hu.event_weight)
    for x in (0, 1, 5, 17, 100, 1000, 50_000, 200_000):
        assert ha.survival(x) == pytest.approx(hu.survival(x), abs=1e-9)
    for q in (0.1, 0.5, 0.9, 0.99):
        assert ha.quantile(q) == hu.quantile(q)


def test_merge_with_decay_uses_current_weights() -> None:
    ha = LengthHistogram(half_life=1.0)
    hb = LengthHistogram(half_life=1.0)
    ha.observe(10)
    hb.observe(20)
    hb.observe(20)  # effective weights 1 + 1/2
    ha.merge(hb)
    assert ha.total_weight == pytest.approx(2.5)
    assert ha.survival(10) == pytest.approx(1.5 / 2.5)


def test_merge_self_doubles() -> None:
    h = LengthHistogram()
    h.observe(5)
    h.observe(7, censored=True)
    h.merge(h)
    assert h.total_weight == pytest.approx(4.0)
    assert h.event_weight == pytest.approx(2.0)


# -- the model: prior and back-off -----------------------------------------------------------

KEY = CalibrationKey(model="m", task="chat", service_class="interactive", tenant="acme")


def test_prior_without_data() -> None:
    m = LengthModel(prior_tokens=256)
    assert m.level(KEY) == "prior"
    assert m.quantile(KEY, 0.5) == math.ceil(256 * math.log(2))
    assert m.quantile(KEY, 0.9) == math.ceil(-256 * math.log(0.1))
    assert m.conditional_quantile(KEY, 0.9, 1000) == 1000 + m.quantile(KEY, 0.9)
    assert m.survival(KEY, 256) == pytest.approx(math.exp(-1))


def test_global_below_min_samples_still_uses_prior() -> None:
    m = LengthModel(min_samples=10, prior_tokens=100)
    for _ in range(9):
        m.observe(KEY, 5000)
    assert m.level(KEY) == "prior"
    m.observe(KEY, 5000)
    assert m.level(KEY) == "full"
    assert m.quantile(KEY, 0.5) == 5000 or same_bucket(m.quantile(KEY, 0.5), 5000)


def test_backoff_sparse_tenant_uses_parent_then_its_own() -> None:
    rng = random.Random(11)
    m = LengthModel(min_samples=32, half_life=1e9)
    big = CalibrationKey(model="m", task="chat", service_class="interactive", tenant="big")
    small = CalibrationKey(model="m", task="chat", service_class="interactive", tenant="small")
    unseen = CalibrationKey(model="m", task="chat", service_class="interactive", tenant="new")
    for _ in range(500):
        m.observe(big, rng.randint(50, 150))
    for _ in range(5):
        m.observe(small, 5000)
    assert m.level(small) == "service_class"
    assert m.level(unseen) == "service_class"
    assert m.quantile(small, 0.5) == m.quantile(unseen, 0.5)
    assert m.quantile(small, 0.5) <= 150
    for _ in range(27):
        m.observe(small, 5000)
    assert m.level(small) == "full"
    assert same_bucket(m.quantile(small, 0.5), 5000)
    # The parent level moved too: every observation updates every level.
    assert m.quantile(unseen, 0.99) > 150


def test_backoff_order_through_levels() -> None:
    m = LengthModel(min_samples=3, half_life=1e9)
    k = CalibrationKey(model="m", task="t", service_class="batch", tenant="x", sampling="s")
    sib = [
        ("full", CalibrationKey(model="m", task="t", service_class="batch", tenant="x")),
        ("tenant", CalibrationKey(model="m", task="t", service_class="batch", tenant="y")),
        ("service_class", CalibrationKey(model="m", task="t", service_class="int")),
        ("task", CalibrationKey(model="m", task="u")),
        ("model", CalibrationKey(model="n")),
    ]
    for _ in range(3):
        m.observe(k, 100)
    # k itself has its own full key; each sibling shares a longer or shorter prefix with k.
    assert m.level(k) == "full"
    expected = ["tenant", "service_class", "task", "model", "global"]
    for (_, other), level in zip(sib, expected, strict=True):
        assert m.level(other) == level


def test_decayed_event_weight_can_disqualify_a_level() -> None:
    m = LengthModel(min_samples=3, half_life=2.0)
    for _ in range(10):
        m.observe(KEY, 100)
    assert m.level(KEY) == "full"
    for _ in range(20):
        m.observe(KEY, 100, censored=True)
    assert m.level(KEY) == "prior"  # event weight decayed below 3 everywhere


_TENANTS = st.sampled_from(["a", "b", "c", "d"])
_KEYS = st.builds(
    CalibrationKey,
    model=st.sampled_from(["m1", "m2"]),
    task=st.sampled_from(["t1", "t2"]),
    tenant=_TENANTS,
    sampling=st.sampled_from(["s1", "s2"]),
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(_KEYS, st.integers(1, 5000), st.booleans()), max_size=120),
    st.lists(_KEYS, min_size=1, max_size=8),
    st.integers(6, 30),
)
def test_cached_resolution_matches_brute_force(
    ops: list[tuple[CalibrationKey, int, bool]], probes: list[CalibrationKey], max_keys: int
) -> None:
    m = LengthModel(min_samples=3, half_life=1e12, max_keys=max_keys)
    for i, (k, x, c) in enumerate(ops):
        m.observe(k, x, censored=c)
        if i % 7 == 0:  # interleave queries so that stale cache entries would be caught
            for p in probes:
                m.quantile(p, 0.5)
        assert m.histogram_count <= max_keys
    for p in probes:
        expected = "prior"
        for name in ("full", "tenant", "service_class", "task", "model", "global"):
            h = m.histogram(p, name)
            if h is not None and h.event_weight >= 3 - 1e-6:
                expected = name
                break
        assert m.level(p) == expected
        for q in (0.5, 0.9):
            if expected == "prior":
                assert m.quantile(p, q) == max(1, math.ceil(-256 * math.log1p(-q) - 1e-9))
            else:
                h = m.histogram(p, expected)
                assert h is not None
                assert m.quantile(p, q) == h.quantile(q)
                assert m.conditional_quantile(p, q, 100) == h.conditional_quantile(q, 100)
                assert m.survival(p, 100) == h.survival(100)


def test_resolution_cache_is_by_identity_and_never_serves_another_key() -> None:
    # (resolutions are cached by the key object's id: an equal key of its own is resolved
    # alike, and an entry left under an id that another key now has is not served to it)
    m = LengthModel(min_samples=1, half_life=1e12)
    busy, quiet = CalibrationKey(tenant="busy"), CalibrationKey(tenant="quiet")
    for x in (10, 20, 30):
        m.observe(busy, x)
    m.observe(quiet, 900)
    assert m.quantile(busy, 0.5) == 20
    assert m.quantile(CalibrationKey(tenant="busy"), 0.5) == 20  # equal, not identical
    stale = m._resolved[id(busy)]
    m._resolved[id(quiet)] = stale  # as if busy were gone and quiet had its id
    assert same_bucket(m.quantile(quiet, 0.5), 900)


def test_equal_specs_share_one_calibration_key() -> None:
    from kvbudget.core.model import RequestSpec

    a = RequestSpec(10, 20, 100, tenant="t1", task="chat")
    b = RequestSpec(30, 40, 100, tenant="t1", task="chat")
    assert a.calibration_key is b.calibration_key
    assert a.calibration_key == CalibrationKey(task="chat", tenant="t1")
    assert RequestSpec(10, 20, 100, tenant="t2").calibration_key.tenant == "t2"


# -- bounded memory ----------------------------------------------------------------------------


def test_lru_key_cap_holds() -> None:
    m = LengthModel(max_keys=20, min_samples=1)
    keys = [CalibrationKey(model="m", task="t", tenant=f"t{i}") for i in range(200)]
    for i, k in enumerate(keys):
        m.observe(k, 10 + i)
        assert m.histogram_count <= 20
    assert m.histogram_count == 20
    assert m.level(keys[-1]) == "full"
    assert m.level(keys[0]) == "service_class"  # its own histograms were evicted
    assert m.histogram(keys[0], "tenant") is None
    assert m.histogram(keys[-1], "tenant") is not None
    g = m.histogram(keys[0], "global")
    assert g is not None and g.observations == 200


def test_lru_keeps_recently_observed_keys() -> None:
    m = LengthModel(max_keys=12, min_samples=1)
    hot = CalibrationKey(tenant="hot")
    for i in range(100):
        m.observe(CalibrationKey(tenant=f"cold{i}"), 10)
        m.observe(hot, 20)
    assert m.level(hot) == "full"
    assert m.quantile(hot, 0.5) == 20


# -- caching ---------------------------------------------------------------------------------


def test_quantile_cache_invalidated_on_observe() -> None:
    m = LengthModel(min_samples=1, half_life=1e9)
    m.observe(KEY, 10)
    assert m.quantile(KEY, 0.5) == 10
    assert m.quantile(KEY, 0.5) == 10
    for _ in range(10):
        m.observe(KEY, 1000)
    assert same_bucket(m.quantile(KEY, 0.5), 1000)


def test_warm_quantile_is_served_from_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    # speed is measured in benchmarks; here we only check that a warm call does no bucket walk
    m = LengthModel()
    rng = random.Random(0)
    for _ in range(2000):
        m.observe(KEY, int(rng.lognormvariate(5, 1)))
    first = m.quantile(KEY, 0.9)
    calls = 0
    original = LengthHistogram._curve

    def counting(self: LengthHistogram) -> list[float]:
        nonlocal calls
        calls += 1
        return original(self)

    monkeypatch.setattr(LengthHistogram, "_curve", counting)
    for _ in range(100):
        assert m.quantile(KEY, 0.9) == first
    assert calls == 0


# -- underestimation ---------------------------------------------------------------------------


@pytest.mark.parametrize("q", [0.5, 0.9])
def test_underestimation_coverage_matches_quantile(q: float) -> None:
    rng = random.Random(42)
    m = LengthModel(half_life=1e9)
    for _ in range(3000):
        m.observe(KEY, int(rng.lognormvariate(5.0, 0.8)) + 1)
    for _ in range(6000):
        allowance = m.quantile(KEY, q)
        length = int(rng.lognormvariate(5.0, 0.8)) + 1
        m.record_outcome(KEY, allowance, length, q)
        m.observe(KEY, length)
    rep = m.underestimation()
    assert isinstance(rep, UnderestimationReport)
    assert rep.overall.count == 6000
    assert rep.overall.target == pytest.approx(q)
    assert abs(rep.overall.coverage - q) < 0.025
    assert rep.overall.coverage + rep.overall.rate == pytest.approx(1.0)
    tenant = rep.get("tenant", "acme")
    assert tenant is not None and tenant.count == 6000
    assert tenant.coverage == pytest.approx(rep.overall.coverage)
    assert 0 < tenant.shortfall_p50 <= tenant.shortfall_p90 <= tenant.shortfall_p99


def test_underestimation_detects_miscalibration() -> None:
    rng = random.Random(5)
    m = LengthModel(half_life=1e9)
    for _ in range(3000):
        m.observe(KEY, int(rng.lognormvariate(5.0, 0.8)) + 1)
    for _ in range(3000):
        # Claim p90 but grant the median: coverage must come out near 0.5, not 0.9.
        m.record_outcome(KEY, m.quantile(KEY, 0.5), int(rng.lognormvariate(5.0, 0.8)) + 1, 0.9)
    rep = m.underestimation()
    assert rep.overall.target == pytest.approx(0.9)
    assert abs(rep.overall.coverage - 0.5) < 0.04


def test_underestimation_shortfall_percentiles() -> None:
    m = LengthModel()
    # Allowance 100; lengths 101..200 -> shortfalls 1..100; 100 more requests fit.
    for s in range(1, 101):
        m.record_outcome(KEY, 100, 100 + s, 0.9)
    for _ in range(100):
        m.record_outcome(KEY, 100, 50, 0.9)
    st_ = m.underestimation().overall
    assert st_.count == 200 and st_.underestimated == 100
    assert st_.rate == pytest.approx(0.5) and st_.coverage == pytest.approx(0.5)
    assert same_bucket(st_.shortfall_p50, 50)
    assert same_bucket(st_.shortfall_p90, 90)
    assert same_bucket(st_.shortfall_p99, 99)


def test_underestimation_per_dimension_and_cap() -> None:
    m = LengthModel(max_dimension_values=3)
    for i in range(10):
        m.record_outcome(CalibrationKey(tenant=f"t{i}"), 10, 20 if i % 2 else 5, 0.9)
    rep = m.underestimation()
    assert set(rep.dimensions["tenant"]) == {"t7", "t8", "t9"}
    t9 = rep.get("tenant", "t9")
    assert t9 is not None and t9.rate == 1.0 and t9.shortfall_p50 == 10
    t8 = rep.get("tenant", "t8")
    assert t8 is not None and t8.rate == 0.0 and t8.shortfall_p99 == 0
    model_stats = rep.get("model", "default")
    assert model_stats is not None and model_stats.count == 10
    assert model_stats.rate == pytest.approx(0.5)
    assert rep.overall.count == 10
    m.reset_underestimation()
    assert m.underestimation().overall.count == 0


def test_empty_report() -> None:
    rep = LengthModel().underestimation()
    assert rep.overall.count == 0 and rep.overall.rate == 0.0 and rep.overall.shortfall_p50 == 0
    assert rep.get("tenant", "x") is None


# -- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda m: m.quantile(KEY, 1.0), "q"),
        (lambda m: m.quantile(KEY, 0.0), "q"),
        (lambda m: m.quantile(KEY, float("nan")), "q"),
        (lambda m: m.quantile(KEY, True), "q"),
        (lambda m: m.conditional_quantile(KEY, 0.5, -1), "given"),
        (lambda m: m.survival(KEY, -1), "at"),
        (lambda m: m.observe(KEY, -1), "length"),
        (lambda m: m.observe(KEY, 1.5), "length"),
        (lambda m: m.observe(KEY, 3, censored=1), "censored"),
        (lambda m: m.observe("acme", 3), "key"),
        (lambda m: m.quantile("acme", 0.5), "key"),
        (lambda m: m.record_outcome(KEY, -1, 3, 0.9), "allowance"),
        (lambda m: m.record_outcome(KEY, 1, -3, 0.9), "length"),
        (lambda m: m.record_outcome(KEY, 1, 3, 1.5), "quantile"),
        (lambda m: m.histogram(KEY, "nope"), "level"),
    ],
)
def test_model_invalid_inputs(call: object, field: str) -> None:
    m = LengthModel()
    with pytest.raises(InvalidInput) as exc:
        call(m)  # type: ignore[operator]
    assert exc.value.field == field


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"half_life": 0.0}, "half_life"),
        ({"half_life": -1.0}, "half_life"),
        ({"half_life": float("inf")}, "half_life"),
        ({"max_keys": 5}, "max_keys"),
        ({"min_samples": 0}, "min_samples"),
        ({"prior_tokens": 0}, "prior_tokens"),
        ({"max_dimension_values": 0}, "max_dimension_values"),
    ],
)
def test_model_invalid_config(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(InvalidInput) as exc:
        LengthModel(**kwargs)  # type: ignore[arg-type]
    assert exc.value.field == field


def test_histogram_invalid_inputs() -> None:
    h = LengthHistogram()
    with pytest.raises(InvalidInput, match="half_life"):
        LengthHistogram(half_life=0)
    with pytest.raises(InvalidInput, match="length"):
        h.observe(-2)
    with pytest.raises(InvalidInput, match="q="):
        h.quantile(1.2)
    with pytest.raises(InvalidInput, match="given"):
        h.conditional_quantile(0.5, -1)
    with pytest.raises(InvalidInput, match="x="):
        h.survival(-1)
    with pytest.raises(InvalidInput, match="other"):
        h.merge("nope")  # type: ignore[arg-type]
    h.observe(0, censored=True)  # a censored length may be 0
    assert h.censored_weight == 1.0


def test_evicting_a_qualified_histogram_invalidates_resolution() -> None:
    m = LengthModel(max_keys=6, min_samples=3, half_life=1e12)
    a = CalibrationKey(model="a", tenant="x")
    b = CalibrationKey(model="b", tenant="y")
    for _ in range(3):
        m.observe(a, 1000)
    assert m.level(a) == "full"
    assert same_bucket(m.quantile(a, 0.5), 1000)
    m.observe(b, 10)  # b's five new histograms push all of a's out; none qualifies yet
    assert m.histogram(a, "model") is None
    assert m.level(a) == "global"
    assert m.quantile(a, 0.5) == m.histogram(a, "global").quantile(0.5)  # type: ignore[union-attr]


def test_allowance_equal_to_length_is_not_an_underestimate() -> None:
    m = LengthModel()
    m.record_outcome(KEY, 100, 100, 0.9)
    assert m.underestimation().overall.underestimated == 0
    m.record_outcome(KEY, 100, 101, 0.9)
    rep = m.underestimation().overall
    assert rep.underestimated == 1 and rep.shortfall_p50 == 1 and rep.shortfall_p99 == 1


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 5000), min_size=1, max_size=400),
    st.lists(st.tuples(st.sampled_from([0.5, 0.9, 0.99]), st.integers(0, 6000)), max_size=30),
)
def test_conditional_quantiles_cached_per_version_match_a_fresh_answer(
    lengths: list[int], asks: list[tuple[float, int]]
) -> None:
    """The model caches conditional answers per histogram version: after every observation an
    answer equals the histogram's own, computed afresh (a stale cache would answer from an
    older distribution)."""
    model = LengthModel(prior_tokens=64, min_samples=1)
    for i, length in enumerate(lengths):
        model.observe(KEY, length)
        for q, g in asks[i % max(1, len(asks)) :][:3]:
            node = model._node_for(KEY)
            fresh = g + model._prior_quantile(q) if node is None else node.hist._conditional(q, g)
            assert model.conditional_quantile(KEY, q, g) == fresh
            assert model.conditional_quantile(KEY, q, g) == fresh  # (the cached answer)
