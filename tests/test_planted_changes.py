"""Planted changes to the core's rules that the fast suite must notice (issue 11).

The property harness (``test_harness_catches_bugs.py``) shows that the *safety* invariants cannot
break unnoticed. The rules pinned here are not safety rules: break one and every invariant
still holds, every request still completes, and until this module the whole fast suite
(``-m "not vllm"``) still passed. What breaks is what the rule is for: grants sized to the
class's objective, extensions sized from what a request has outlived, victims chosen to spare
deadlines, a length model that is not fooled by cancellations, a latency floor that follows the
engine's real step time, and counters that report stalls and waste.

For each rule there is

* a behaviour test: a small hand-worked scenario through the core's public API
  (:class:`~kvbudget.core.scheduler.Scheduler` with :class:`~kvbudget.core.policy.CalibratedPolicy`,
  :class:`~kvbudget.core.lengths.LengthModel`, :class:`~kvbudget.core.cost.CostModel`,
  :class:`~kvbudget.core.model.ServiceClass`, :class:`~kvbudget.core.model.RequestSpec`),
  deterministic, with no clock and no sleeps: ``now`` is passed in;
* an entry in :data:`PLANTED`, the table of planted changes this module catches: the method,
  the source text the change replaces and what it is replaced with;
* a meta-test (``test_planted_change_is_caught``) that plants the change by monkeypatching the
  method with a copy of its own source carrying the change, and asserts that the behaviour test
  then fails.

A planted change is applied to the method's current source, so the table keeps working while
the rest of the method evolves; if the text it replaces is no longer in the method, the
meta-test says so, and the entry (and probably its behaviour test) must follow the code.
"""

from __future__ import annotations

import inspect
import re
import sys
import textwrap
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import pytest

from kvbudget.core import events as ev
from kvbudget.core import lifecycle
from kvbudget.core.cost import CostModel, StepTimeModel
from kvbudget.core.ledger import State
from kvbudget.core.lengths import LengthModel
from kvbudget.core.model import Capacity, RequestSpec, ServiceClass
from kvbudget.core.policy import CalibratedPolicy
from kvbudget.core.scheduler import Scheduler

# == helpers =====================================================================================


def of(actions: Iterable[ev.Action], kind: type[Any], rid: str | None = None) -> list[Any]:
    return [a for a in actions if isinstance(a, kind) and (rid is None or a.request_id == rid)]


def spec(cls: str, prompt: int = 4, max_tokens: int = 64, **kw: Any) -> RequestSpec:
    return RequestSpec(prompt, max_tokens, 4096, service_class=cls, **kw)


def learned(answers: dict[str, list[int]]) -> LengthModel:
    """A length model (defaults: 32 stops make a key's own answers count) that has seen four
    rounds of each class's answer lengths."""
    lengths = LengthModel()
    for _ in range(4):
        for cls, seen in answers.items():
            for n in seen:
                lengths.observe(spec(cls).calibration_key, n)
    return lengths


# -- 1. the class's initial quantile ------------------------------------------------------------

#: 30 % of answers end at 4 tokens, 40 % at 8, 30 % at 16 (all in exact one-token buckets)
_THREE_LENGTHS = [4, 4, 4, 8, 8, 8, 8, 16, 16, 16]


def test_initial_grant_is_the_class_initial_quantile() -> None:
    """Two classes, the same learned distribution: the p90 class is granted the length that
    covers 90 % of answers (16 tokens), the p50 class the median (8). That difference is what
    ``ServiceClass.initial_quantile`` is for: how many requests must extend (and may wait for
    it) against how many blocks are held ahead of the tokens that fill them."""
    classes = (
        ServiceClass("p50", initial_quantile=0.5),
        ServiceClass("p90", initial_quantile=0.9),
    )
    lengths = learned({"p50": _THREE_LENGTHS, "p90": _THREE_LENGTHS})
    for cls, q, want in (("p50", 0.5, 8), ("p90", 0.9, 16)):
        assert lengths.quantile(spec(cls).calibration_key, q) == want
    s = Scheduler(Capacity(64, 4), classes=classes, policy=CalibratedPolicy(), lengths=lengths)
    (median,) = of(s.arrive("median", spec("p50"), 0.0), ev.Admit)
    (p90,) = of(s.arrive("p90", spec("p90"), 0.0), ev.Admit)
    assert median.boundary == 8 and median.blocks == 3  # 4 prompt + 8 tokens, 4-token blocks
    assert p90.boundary == 16 and p90.blocks == 5


# -- 2. extensions from the conditional quantile ------------------------------------------------


def test_extension_is_sized_from_the_length_already_outlived() -> None:
    """70 % of answers end at 4 tokens, the rest at 16. A request granted the median (4) that
    runs on has outlived the short answers: the answers still going at 4 all run to 16, so its
    extension reaches 16 at once (the conditional quantile given 4), not one block past the
    unconditional median, which it has already passed (that would be an extension per block
    for every long answer)."""
    cls = ServiceClass("c", initial_quantile=0.5, extension_quantile=0.5)
    lengths = learned({"c": [4] * 7 + [16] * 3})
    key = spec("c").calibration_key
    assert lengths.quantile(key, 0.5) == 4
    assert lengths.conditional_quantile(key, 0.5, 4) == 16
    s = Scheduler(Capacity(64, 4), classes=(cls,), policy=CalibratedPolicy(), lengths=lengths)
    (admit,) = of(s.arrive("r", spec("c"), 0.0), ev.Admit)
    assert admit.boundary == 4
    (ext,) = of(s.charge("r", 4, 0.1), ev.Extend, "r")
    assert ext.boundary == 16 and ext.blocks == 5
    assert s.requests["r"].stats.extensions == 1


# -- 3. the deadline-slack tiebreak among victims ------------------------------------------------


def _preemption_victim(first_deadline: float, second_deadline: float) -> ev.Preempt:
    """Two batch requests of equal recompute cost (4 prompt + 2 generated tokens), admitted in
    this order with these deadlines, and an interactive stream that fills the cache and stops at
    its boundary: the one Preempt it causes."""
    classes = (
        ServiceClass(
            "interactive",
            priority=0,
            initial_quantile=0.5,
            extension_quantile=0.5,
            protected=True,
            preemptible=False,
        ),
        ServiceClass("batch", priority=1, initial_quantile=0.5, extension_quantile=0.5),
    )
    lengths = learned({"interactive": [8] * 10, "batch": [8] * 10})
    policy = CalibratedPolicy(headroom_min=0.0, headroom_max=0.0, protected_fraction=0.0)
    # 9 blocks of 4 tokens: three grants of 4 prompt + 8 output tokens (3 blocks each) fill it
    s = Scheduler(Capacity(9, 4), classes=classes, policy=policy, lengths=lengths)
    for rid, deadline in (("first", first_deadline), ("second", second_deadline)):
        assert of(s.arrive(rid, spec("batch", deadline=deadline), 0.0), ev.Admit, rid)
        s.charge(rid, 2, 0.5)
    assert of(s.arrive("i", spec("interactive"), 0.0), ev.Admit, "i")
    assert s.ledger.free == 0
    # the stream outlives every answer seen (8): its extension (to 16) needs 2 more blocks
    assert of(s.charge("i", 8, 1.0), ev.Deny, "i")
    preempts = of(s.boundary_reached("i", 1.0), ev.Preempt)
    assert len(preempts) == 1, preempts  # one victim's 3 blocks cover the 2 needed
    victim: ev.Preempt = preempts[0]
    assert victim.reason == "for:i" and victim.recompute_tokens == 4 + 2
    return victim


def test_equal_cost_victims_the_one_with_more_deadline_slack_gives_way() -> None:
    """Among victims that cost the same to recompute, the one whose deadline is furthest off is
    checkpointed: it can best afford the wait and the re-prefill. Both admission orders, so the
    choice is the deadline's and not the order's."""
    for first, second in ((10.0, 100.0), (100.0, 10.0)):
        victim = _preemption_victim(first, second)
        assert victim.deadline == pytest.approx(100.0), (first, second)
        assert victim.request_id == ("second" if second > first else "first")


# -- 4. cancellations are censored ---------------------------------------------------------------


def test_a_cancelled_request_does_not_pull_the_length_quantiles_down() -> None:
    """Forty answers seen, every one 16 tokens long. Then sixty callers go away after 2 tokens
    each: their lengths are unknown, only known to exceed 2. The model must not learn that
    answers stop at 2 (survival past 2 stays 1, the median stays 16), and every caller,
    the last as the first, is still granted the 16 tokens answers take, not cut to 2 and made
    to extend (as it would be if the cancellations counted as sixty stops at 2)."""
    cls = ServiceClass("c", initial_quantile=0.5)
    lengths = learned({"c": [16] * 10})  # 40 stops
    key = spec("c").calibration_key
    s = Scheduler(Capacity(64, 4), classes=(cls,), policy=CalibratedPolicy(), lengths=lengths)
    for i in range(60):
        rid = f"gone-{i}"
        (admit,) = of(s.arrive(rid, spec("c"), float(i)), ev.Admit, rid)
        assert admit.boundary == 16, i
        s.charge(rid, 2, i + 0.1)
        assert of(s.cancel(rid, i + 0.2), ev.Abort, rid)
        s.confirm_release(rid, i + 0.3)
    assert s.snapshot().cancelled == 60
    assert lengths.level(key) == "full"  # still answered from the key's own 40 stops
    assert lengths.survival(key, 2) == 1.0
    assert lengths.quantile(key, 0.5) == 16
    (admit,) = of(s.arrive("next", spec("c"), 70.0), ev.Admit, "next")
    assert admit.boundary == 16


# -- 5. the online decode-cost fit ---------------------------------------------------------------

_FLOORED = ServiceClass("s", latency_floor_s=0.1)
#: a prior that believes every decode step takes 10 ms, whatever the batch (and prefill is free)
_FAST_PRIOR = StepTimeModel(
    fixed_s=0.01, per_seq_s=0.0, per_context_token_s=0.0, prefill_per_token_s=0.0
)


def _second_stream_admitted(observed_step_s: float | None) -> tuple[Scheduler, bool]:
    """One stream under a 100 ms latency floor runs ten steps (reported at ``observed_step_s``
    each, or not reported at all); then a second stream arrives. Is it admitted?"""
    s = Scheduler(
        Capacity(1000, 16),
        classes=(_FLOORED,),
        policy=CalibratedPolicy(),
        cost=CostModel(_FAST_PRIOR),
    )
    assert of(s.arrive("a", spec("s", prompt=16, max_tokens=100), 0.0), ev.Admit, "a")
    for k in range(1, 11):
        s.charge("a", 1, 0.2 * k)
        if observed_step_s is not None:
            s.observe_step(1, s.active_context, observed_step_s, 0.2 * k)
    out = s.arrive("b", spec("s", prompt=16, max_tokens=100), 2.1)
    return s, bool(of(out, ev.Admit, "b"))


def test_observed_steps_refit_the_cost_model_and_the_latency_floor_admission() -> None:
    """The prior says a step takes 10 ms; the engine reports 200 ms. Once the reports are in,
    the cost model predicts ~200 ms, a second stream would keep the first above its 100 ms
    floor, and it waits; it comes in once the first stream is gone. Without the reports the
    same arrival is admitted on the prior's word."""
    s, admitted = _second_stream_admitted(0.2)
    assert not admitted and s.requests["b"].state is State.QUEUED
    assert s.cost.decode_observations == 10
    assert s.cost.predict_decode(1, 26) == pytest.approx(0.2, rel=0.01)
    assert s.cost.predict_decode(2, 2 * 26) > 0.1  # two streams: over the floor
    s.charge("a", 90, 2.2)
    out = s.finish("a", "length", 2.2) + s.confirm_release("a", 2.3)
    assert of(out, ev.Admit, "b")
    unreported, admitted = _second_stream_admitted(None)
    assert unreported.cost.predict_decode(2, 2 * 26) == pytest.approx(0.01)
    assert admitted


# -- 6. the stall counter ------------------------------------------------------------------------


def test_an_inter_token_gap_over_the_floor_counts_a_stall() -> None:
    """Under a 100 ms floor: the wait for the first token is not a stall, gaps of 50 ms are
    none, a gap of 250 ms is one. A class with no floor never stalls."""
    classes = (ServiceClass("floored", latency_floor_s=0.1), ServiceClass("free"))
    s = Scheduler(Capacity(64, 4), classes=classes, policy=CalibratedPolicy())
    for cls in ("floored", "free"):
        assert of(s.arrive(cls, spec(cls), 0.0), ev.Admit, cls)
        for t in (0.5, 0.55, 0.8, 0.85):  # first token, then gaps of 50, 250 and 50 ms
            s.charge(cls, 1, t)
    by_class = s.snapshot().by_class
    assert by_class["floored"].stalls == 1
    assert by_class["free"].stalls == 0


# -- 7. wasted tokens on cancel ------------------------------------------------------------------


def test_cancelling_a_running_request_counts_its_generated_tokens_as_wasted() -> None:
    """A running request cancelled after 5 tokens wasted those 5 tokens of engine work (the
    caller never sees them); a request that completes after 5 tokens wasted none."""
    cls = ServiceClass("c")
    s = Scheduler(Capacity(64, 4), classes=(cls,), policy=CalibratedPolicy())
    for rid in ("cancelled", "completed"):
        assert of(s.arrive(rid, spec("c", max_tokens=8), 0.0), ev.Admit, rid)
        s.charge(rid, 5, 0.5)
    assert of(s.cancel("cancelled", 1.0), ev.Abort, "cancelled")
    s.finish("completed", "stop", 1.0)
    snap = s.snapshot()
    assert snap.cancelled == 1 and snap.completed == 0  # (completed once confirmed)
    assert snap.wasted_tokens == 5
    for rid in ("cancelled", "completed"):
        s.confirm_release(rid, 1.1)
    assert s.snapshot().wasted_tokens == 5 and s.snapshot().completed == 1


# == the table of planted changes ================================================================


@attrs.frozen
class Planted:
    """One planted change: in ``owner.method``, the source text ``old`` becomes ``new``.

    ``old`` is matched ignoring whitespace (so a reformatted method still matches) and must
    occur exactly once in the method; ``caught_by`` is the behaviour test that must fail
    with the change planted.
    """

    name: str
    owner: Any  # a class, or a module for a module-level function
    method: str
    old: str
    new: str
    caught_by: Callable[[], None]


PLANTED: tuple[Planted, ...] = (
    Planted(
        "every class's initial quantile fixed at 0.5",
        CalibratedPolicy,
        "initial_allowance",
        "lengths.quantile(req.key, req.cls.initial_quantile)",
        "lengths.quantile(req.key, 0.5)",
        test_initial_grant_is_the_class_initial_quantile,
    ),
    Planted(
        "extensions sized from the unconditional quantile",
        CalibratedPolicy,
        "_target",
        "self._s.lengths.conditional_quantile(req.key, req.cls.extension_quantile, req.boundary)",
        "self._s.lengths.quantile(req.key, req.cls.extension_quantile)",
        test_extension_is_sized_from_the_length_already_outlived,
    ),
    Planted(
        "victims sorted by recompute cost only (no deadline-slack tiebreak)",
        CalibratedPolicy,
        "choose_victims",
        "key=lambda r: (r.prompt + r.generated,"
        " -(r.deadline_at - now if r.deadline_at is not None else math.inf),)",
        "key=lambda r: r.prompt + r.generated",
        test_equal_cost_victims_the_one_with_more_deadline_slack_gives_way,
    ),
    Planted(
        "cancellations recorded as uncensored stops",
        Scheduler,
        "cancel",
        "self.lengths.observe(req.key, req.generated, censored=True)",
        "self.lengths.observe(req.key, req.generated, censored=False)",
        test_a_cancelled_request_does_not_pull_the_length_quantiles_down,
    ),
    Planted(
        "the online decode-cost fit switched off",
        Scheduler,
        "observe_step",
        "self.cost.observe_decode(batch_size, context_tokens, seconds)",
        "pass",
        test_observed_steps_refit_the_cost_model_and_the_latency_floor_admission,
    ),
    Planted(
        "the stall counter never incremented",
        Scheduler,
        "charge",
        "req.stats.stalls += 1",
        "pass",
        test_an_inter_token_gap_over_the_floor_counts_a_stall,
    ),
    Planted(
        "wasted tokens not counted when a live request is cancelled",
        lifecycle,
        "settle",
        # the end-of-request bookkeeping lives in one place: plant the exception there
        "if effect.wastes_output:",
        "if effect.wastes_output and outcome is not Outcome.CANCELLED:",
        test_cancelling_a_running_request_counts_its_generated_tokens_as_wasted,
    ),
)
"""The planted changes to the core that the fast suite catches, each with the behaviour test
that catches it. Issue 11: before this module each of them passed ``pytest -m "not vllm"``.
Add a row (and a behaviour test) for every rule that the suite should not let change unseen."""


def _pattern(text: str) -> re.Pattern[str]:
    """``text`` as a regex that ignores whitespace (between any two of its characters)."""
    return re.compile(r"\s*".join(re.escape(ch) for ch in text if not ch.isspace()))


def _recompiled(func: Callable[..., Any], source: str, label: str) -> Callable[..., Any]:
    """``func`` compiled again from ``source``, in (a copy of) its module's namespace."""
    namespace = dict(vars(sys.modules[func.__module__]))
    code = compile(
        source,
        f"<planted: {label}>",
        "exec",
        # the core's annotations are postponed (``annotations`` is that __future__ feature)
        flags=annotations.compiler_flag,
        dont_inherit=True,
    )
    exec(code, namespace)
    new: Callable[..., Any] = namespace[func.__name__]
    return new


def _original(change: Planted) -> tuple[Callable[..., Any], str]:
    func = inspect.unwrap(getattr(change.owner, change.method))
    return func, textwrap.dedent(inspect.getsource(func))


def mutant(change: Planted) -> Callable[..., Any]:
    """``change.owner.method`` compiled from its current source with the change planted."""
    func, source = _original(change)
    pattern = _pattern(change.old)
    found = pattern.findall(source)
    assert len(found) == 1, (
        f"{change.owner.__name__}.{change.method} reads {change.old!r} {len(found)} times, "
        "not once: the code changed; update PLANTED (and the behaviour test) to follow it"
    )
    return _recompiled(func, pattern.sub(lambda _m: change.new, source), change.name)


@pytest.mark.parametrize("change", PLANTED, ids=[c.name for c in PLANTED])
def test_planted_change_is_caught(change: Planted, monkeypatch: pytest.MonkeyPatch) -> None:
    change.caught_by()  # the rule holds in the real core ...
    monkeypatch.setattr(change.owner, change.method, mutant(change))
    with pytest.raises(AssertionError):
        change.caught_by()  # ... and its behaviour test notices when it is broken


def test_an_unchanged_copy_of_each_method_passes() -> None:
    """Planting itself changes nothing else: the methods recompiled from their own source,
    unchanged, behave as the originals (so a caught change is the change's own doing)."""
    originals = {(c.owner, c.method): _original(c) for c in PLANTED}
    with pytest.MonkeyPatch.context() as mp:
        for (owner, method), (func, source) in originals.items():
            mp.setattr(owner, method, _recompiled(func, source, "unchanged"))
        for change in PLANTED:
            change.caught_by()
