"""Calibrated's pauses for first tokens (off by default, turned on here with the share
:data:`FIRST_TOKEN_PAUSE_SHARE`), where a pause is cheap: a burst larger than the cache
gets every first token in time (streams that have had theirs give way once, requeued behind
the callers then queued), and the rules around it (no pause before a victim's first token, none
for a stream about to finish, a stale release rate not taken for blocks coming back, the
arrival turn-away spared where pauses could serve the caller)."""

from __future__ import annotations

import random
from collections.abc import Iterable

import attrs
import pytest

from kvbudget.core import events as ev
from kvbudget.core.forecast import Forecast
from kvbudget.core.ledger import State
from kvbudget.core.model import Capacity, RequestSpec
from kvbudget.core.policy import CalibratedPolicy
from kvbudget.core.policy.base import Blocked
from kvbudget.core.policy.calibrated import FIRST_TOKEN_PAUSE_SHARE
from kvbudget.core.scheduler import Scheduler

BLOCK = 32


def measured(policy: CalibratedPolicy, blocks: int = 256) -> Scheduler:
    """A scheduler whose cost model has seen the engine's prefills (a fast engine: a pause is
    cheap), as BudgetedEngine's start-up probes leave it."""
    s = Scheduler(Capacity(blocks, BLOCK), policy=policy)
    for _ in range(policy.min_prefill_observations):
        s.cost.observe_prefill(512, 0.01)
    return s


def spec(prompt: int = 512, max_tokens: int = 300) -> RequestSpec:
    return RequestSpec(prompt_tokens=prompt, max_tokens=max_tokens, model_max_len=2048)


class Engine:
    """A deterministic engine over the core: one step prefills every newly admitted request
    (its first token) and decodes one token for every running one; step time 4 ms + 50 us per
    decoding sequence + 20 us per prompt token prefilled; stops are confirmed at the first step
    that ends ``confirm_delay`` seconds after they were asked (0: the next step); ticks every
    50 ms."""

    def __init__(self, s: Scheduler, confirm_delay: float = 0.0) -> None:
        self.s = s
        self.now = 0.0
        self.confirm_delay = confirm_delay
        self.running: dict[str, bool] = {}  # request id -> still to prefill
        self.to_confirm: list[tuple[str, float]] = []  # (request id, asked at)
        self.first_token: dict[str, float] = {}
        self.rejected: dict[str, str] = {}
        self.gave_way: list[tuple[str, str, int]] = []  # (victim, reason, its tokens then)
        self.admissions: list[tuple[float, str, int]] = []

    def apply(self, actions: Iterable[ev.Action]) -> None:
        for a in actions:
            if isinstance(a, ev.Admit):
                self.running[a.request_id] = True
                self.admissions.append(
                    (self.now, a.request_id, self.s.requests[a.request_id].generated)
                )
            elif isinstance(a, ev.Preempt):
                self.running.pop(a.request_id, None)
                self.to_confirm.append((a.request_id, self.now))
                self.gave_way.append(
                    (a.request_id, a.reason, self.s.requests[a.request_id].generated)
                )
            elif isinstance(a, ev.Abort):
                self.running.pop(a.request_id, None)
                self.to_confirm.append((a.request_id, self.now))
            elif isinstance(a, ev.Reject):
                self.running.pop(a.request_id, None)
                self.rejected[a.request_id] = a.reason

    def run(self, until: float = 30.0) -> None:
        s = self.s
        last_tick = 0.0
        while self.now < until and (self.running or s.queued() or self.to_confirm):
            prefill = [r for r, p in self.running.items() if p]
            decode = [r for r, p in self.running.items() if not p]
            req_prompt = {r: s.requests[r].prompt for r in prefill}
            dt = 0.004 + 50e-6 * len(decode) + 20e-6 * sum(req_prompt.values())
            self.now += dt
            due = self.now - self.confirm_delay
            confirm = [rid for rid, asked in self.to_confirm if asked <= due]
            self.to_confirm = [(rid, asked) for rid, asked in self.to_confirm if asked > due]
            for rid in confirm:
                self.apply(s.confirm_release(rid, self.now))
            for rid in prefill + decode:
                req = s.requests.get(rid)
                if rid not in self.running or req is None or req.generated >= req.boundary:
                    continue
                self.running[rid] = False
                self.first_token.setdefault(rid, self.now)
                self.apply(s.charge(rid, 1, self.now))
                req = s.requests.get(rid)
                if req is None or rid not in self.running:
                    continue
                if req.generated >= req.hard_max:
                    self.apply(s.finish(rid, "length", self.now))
                    self.running.pop(rid, None)
                    self.to_confirm.append((rid, self.now))
                elif req.generated >= req.boundary:
                    self.apply(s.boundary_reached(rid, self.now))
            if decode:
                self.apply(s.observe_step(len(decode), 0, dt, self.now))
            if self.now - last_tick >= 0.05:
                last_tick = self.now
                self.apply(s.tick(self.now))


def pausing() -> CalibratedPolicy:
    """The calibrated policy with its first-token pauses on (they are off by default)."""
    return CalibratedPolicy(first_token_pause_share=FIRST_TOKEN_PAUSE_SHARE)


def burst(policy: CalibratedPolicy, n: int = 30) -> Engine:
    s = measured(policy)
    engine = Engine(s)
    for i in range(n):
        engine.apply(s.arrive(f"r{i}", spec(), 0.0))
    engine.run()
    return engine


def test_a_burst_larger_than_the_cache_gets_every_first_token_in_time() -> None:
    # 30 callers of 512 + 300 tokens (26 blocks each at the end) on 256 blocks, at once: the
    # cache holds 14 prompts, and the first of them finish only after ~1.5 s
    e = burst(pausing())
    assert not e.rejected
    late = {r: t for r, t in e.first_token.items() if t > 2.0}
    assert len(e.first_token) == 30 and not late
    for_first_tokens = [v for v in e.gave_way if v[1].startswith("admit:")]
    assert for_first_tokens, "streams gave way for first tokens"
    victims = [v for v, _, _ in for_first_tokens]
    assert len(victims) == len(set(victims)), "each stream gives way at most once"
    assert all(g >= 1 for _, _, g in for_first_tokens), "only after its own first token"
    # every request completes with all its tokens (nothing cut short by the pauses)
    assert all(
        r.state is State.DONE and r.generated == 300 for r in e.s.all_requests()
    ) or not e.s.all_requests()
    assert e.s.snapshot().totals.completed == 30


def test_by_default_no_stream_is_paused_and_the_same_burst_turns_callers_away() -> None:
    e = burst(CalibratedPolicy())
    in_time = sum(1 for t in e.first_token.values() if t <= 2.0)
    assert e.rejected and in_time < 30
    assert not [v for v in e.gave_way if v[1].startswith("admit:")]


class TimedEngine(Engine):
    """:class:`Engine` that also records when each caller was turned away, and why."""

    def __init__(self, s: Scheduler) -> None:
        super().__init__(s)
        self.turned_away: dict[str, tuple[float, str]] = {}

    def apply(self, actions: Iterable[ev.Action]) -> None:
        actions = list(actions)
        for a in actions:
            if isinstance(a, ev.Reject):
                self.turned_away[a.request_id] = (self.now, a.reason)
        super().apply(actions)


def cold_burst(n: int) -> TimedEngine:
    s = measured(CalibratedPolicy())
    e = TimedEngine(s)
    for i in range(n):
        e.apply(s.arrive(f"r{i}", spec(), 0.0))
    e.run()
    return e


def test_a_cold_servers_burst_is_told_overloaded_once_its_releases_are_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """100 callers at once on a scheduler that has seen no release: each is queued on a
    placeholder forecast (no one is turned away at arrival), and once releases are measured
    the turn-away at arrival judges them again, telling the callers it would not have queued
    "overloaded" then, not at their 2 s bound; no caller it keeps loses its first token in
    time for it (the same callers are served in time as without the second judgement)."""
    e = cold_burst(100)
    early = {r: t for r, (t, why) in e.turned_away.items() if why == "deadline"}
    assert early, "callers judged again once releases were measured"
    assert all(0.0 < t < 1.0 for t in early.values())
    in_time = {r for r, t in e.first_token.items() if t <= 2.0}
    monkeypatch.setattr(Scheduler, "_judge_placeholder_waits", lambda *_: None)
    without = cold_burst(100)
    assert not [r for r, (_, why) in without.turned_away.items() if why == "deadline"]
    assert in_time == {r for r, t in without.first_token.items() if t <= 2.0}
    assert set(e.turned_away) == set(without.turned_away)


def test_a_stream_gives_way_only_for_a_fresh_due_caller_and_not_when_about_to_finish() -> None:
    policy = pausing()
    s = measured(policy, blocks=64)
    s.arrive("old", spec(prompt=512, max_tokens=300), 0.0)
    old = s.requests["old"]
    head_spec = spec(prompt=512, max_tokens=300)
    s.arrive("head", head_spec, 0.0)
    head = s.requests["head"]
    assert old.state is State.ADMITTED
    assert policy.first_token_pause_at(head) == pytest.approx(0.75 * 2.0)
    s.charge("old", 1, 0.01)
    assert policy.gives_way(old, head)
    # a checkpoint waiting to resume is not a fresh caller: nothing is paused for it
    head.generated = 5
    assert policy.first_token_pause_at(head) is None
    head.generated = 0
    # a stream two tokens from its end returns its blocks sooner than a pause would
    old.generated = old.hard_max - 2
    assert not policy.gives_way(old, head)
    # nor does a stream that was paused once already give way again
    old.generated = 10
    old.preemptions = 1
    assert not policy.gives_way(old, head)


def test_a_stale_release_rate_does_not_hold_the_pauses_back() -> None:
    # a previous wave left a high release rate behind; the streams running now finish only
    # after ~1.5 s: whether blocks come back in time for a due first token is judged from them
    s = measured(pausing())
    s.forecast.note_release(5000, 0.0)
    assert s.forecast.release_rate(0.0) > 1000.0
    e = Engine(s)
    for i in range(30):
        e.apply(s.arrive(f"r{i}", spec(), 0.0))
    e.run()
    assert not e.rejected and all(t <= 2.0 for t in e.first_token.values())
    assert [v for v in e.gave_way if v[1].startswith("admit:")]


def test_growth_asked_ahead_does_not_pause_a_stream_still_awaiting_its_first_token() -> None:
    policy = CalibratedPolicy()
    s = measured(policy, blocks=36)  # two 512-token prompts (16 blocks each) and 4 more
    s.arrive("a", spec(), 0.0)
    s.arrive("b", spec(), 0.0)
    a, b = s.requests["a"], s.requests["b"]
    assert a.state is State.ADMITTED and b.state is State.ADMITTED
    s.charge("a", 1, 0.01)
    actions: list[ev.Action] = []
    while a.generated < a.boundary - 1 and not any(isinstance(x, ev.Preempt) for x in actions):
        actions += s.charge("a", 1, 0.02)
    # "b" has not had its first token: "a", asking ahead, waits rather than pause it
    assert b.state is State.ADMITTED and not [x for x in actions if isinstance(x, ev.Preempt)]


@pytest.mark.parametrize("share", [0.5, None])
def test_arrival_is_not_turned_away_where_pauses_could_serve_it(
    share: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = measured(CalibratedPolicy(first_token_pause_share=share), blocks=64)
    for rid in ("x", "y", "z"):  # three long streams that hold the cache
        s.arrive(rid, spec(prompt=512, max_tokens=1000), 0.0)
    assert sum(r.state is State.ADMITTED for r in s.live.values()) == 3
    # the wait forecast says the newcomer would wait past its bound (a slow release rate)
    monkeypatch.setattr(
        Forecast, "turns_away", lambda self, req, wait, bound, pauses=False, ahead=None: True
    )
    monkeypatch.setattr(Forecast, "wait_estimate", lambda self, req: (5.0, True))
    actions = s.arrive("n", spec(prompt=512, max_tokens=300), 0.02)
    rejected = [a for a in actions if isinstance(a, ev.Reject)]
    if share is None:
        assert rejected and rejected[0].reason == "deadline"
    else:
        # the three streams would give way for it: it queues, its queue bound still applies
        assert not rejected and s.requests["n"].state is State.QUEUED
        # a fourth and fifth fit the same streams' blocks; beyond what they hold, turned away
        s.arrive("n2", spec(prompt=512, max_tokens=300), 0.02)
        s.arrive("n3", spec(prompt=512, max_tokens=300), 0.02)
        late = s.arrive("n4", spec(prompt=512, max_tokens=300), 0.02)
        assert [a for a in late if isinstance(a, ev.Reject) and a.reason == "deadline"]


@pytest.mark.parametrize("share", [0.75, None])
def test_a_cold_wait_forecast_keeps_its_margin_only_where_pauses_may_serve_the_caller(
    share: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no outcomes yet, the turn-away at arrival quarters a forecast for a caller whose
    first token may have streams paused for it (later rounds of pauses serve such callers:
    UNCALIBRATED_WAIT_RATIO_PAUSES), and trusts it as it is otherwise (a caller no pause can
    serve times out at its bound if it queues)."""
    s = measured(CalibratedPolicy(first_token_pause_share=share), blocks=64)
    for rid in ("x", "y", "z"):  # three long streams that hold the cache
        s.arrive(rid, spec(prompt=512, max_tokens=1000), 0.0)
    seen: list[bool] = []
    real = Forecast.turns_away

    def spy(self: Forecast, req: object, wait: float, bound: float | None,
            pauses: bool = False, ahead: tuple[int, int] | None = None) -> bool:
        seen.append(pauses)
        return bool(real(self, req, wait, bound, pauses, ahead))  # type: ignore[arg-type]

    monkeypatch.setattr(Forecast, "turns_away", spy)
    s.arrive("n", spec(prompt=512, max_tokens=300), 0.02)
    assert seen == [share is not None]


def test_callers_a_round_of_pauses_was_made_for_are_not_turned_away_while_it_confirms() -> None:
    """Streams paused for callers whose queue bound then passes while the engine has not yet
    confirmed the pauses: those callers wait for the blocks (their first tokens come, if late)
    instead of being turned away, which would lose the pauses and the callers both. Here every
    stop is confirmed 1 s after it was asked, on the 30-caller burst: one round pauses 6 streams
    for 7 due callers, whose bounds pass before the pauses are confirmed (turned away then, all
    7 were lost; now they get their first tokens, late). The grants are the ones a block ahead
    (``tight_floor_steps=None``): the round's figures are theirs."""
    s = measured(CalibratedPolicy(
        first_token_pause_share=FIRST_TOKEN_PAUSE_SHARE, tight_floor_steps=None
    ))
    e = Engine(s, confirm_delay=1.0)
    for i in range(30):
        e.apply(s.arrive(f"r{i}", spec(), 0.0))
    e.run()
    heads = {reason.split(":", 1)[1] for _, reason, _ in e.gave_way if reason.startswith("admit:")}
    assert heads, "streams gave way for first tokens"
    assert not e.rejected, "callers streams were paused for were turned away"
    assert all(h in e.first_token for h in heads)
    assert sum(1 for t in e.first_token.values() if t > 2.0) == 7
    assert s.snapshot().totals.completed + len(e.rejected) == 30


def test_a_due_caller_that_fits_the_headroom_is_not_held_back_by_a_stale_release_rate() -> None:
    """A due caller that needs a little more than the admission budget, within the headroom
    beyond its protected part, while a previous wave's release rate says blocks come back in
    time and the streams running now say they do not: the policy's gate (which keeps the
    headroom for the streams' growth on the recent release rate) gives way to the drain
    forecast once the caller's first token is due. Before, no stream was paused for it either
    (it fits the headroom) and it waited to the end of its bound, admitted 1.98 s after it
    arrived."""
    s = measured(pausing())
    # twelve long streams and a short one fill the cache but for the headroom (its floor: the
    # streams are granted the vLLM way and claim none beyond it)
    for i in range(12):
        s.arrive(f"x{i}", spec(prompt=512, max_tokens=1000), 0.0)
    s.arrive("y", spec(prompt=32, max_tokens=1000), 0.0)
    t = 0.0
    for _ in range(30):
        t += 0.02
        for rid in list(s.live):
            s.charge(rid, 1, t)
    s.forecast.note_release(5000, t)  # the stale rate
    arrived = t
    assert not s.arrive("n", spec(prompt=512, max_tokens=300), t)
    n = s.requests["n"]
    assert not s.ledger.fits_admission(n.want_blocks)
    assert s.ledger.fits_extension(n.want_blocks, protected=False)
    while n.state is State.QUEUED and t < arrived + 3.0:
        t += 0.02
        s.tick(t)
    assert n.state is State.ADMITTED
    # admitted once due (a quarter of its 2 s objective waited), not at the end of its bound
    assert t - arrived < 0.75


def test_the_stream_that_gives_way_is_the_one_a_pause_costs_least() -> None:
    # Where a pause is cheap, a stream that needs room pauses one admitted after it. Not the
    # newest, as vLLM does: the one that makes the most tokens per pause it will have had.
    # Two streams after "a": "short" (its task stops at ~40 tokens, newest) and "long" (~1,000):
    # one pause breaks the pace of a 40-token answer (1 gap in 39 over the floor), not a
    # 1,000-token one's; paused once already, "long" counts as 500 and still goes first; only
    # once it has been paused so often that its tokens per pause fall below 40 is it spared.
    policy = CalibratedPolicy()
    s = short_and_long(policy, {"a": "long", "long": "long", "short": "short"})
    a, long_, short = (s.requests[r] for r in ("a", "long", "short"))
    assert a.seq < long_.seq < short.seq and policy.cheap_to_pause(a)
    candidates = [long_, short]
    assert policy.choose_victims(a, 1, candidates) == [long_]
    long_.preemptions = 1
    assert policy.choose_victims(a, 1, candidates) == [long_]
    long_.preemptions = 30  # 1,000 / 31 tokens per pause: fewer than short's 40
    assert policy.choose_victims(a, 1, candidates) == [short]
    # equal expected lengths: the newest first, as vLLM preempts
    long_.preemptions = 0
    short.key = long_.key
    assert policy.choose_victims(a, 1, candidates) == [short]
    # a stream still awaiting its first token goes last, however long
    short.key = spec_for("short").calibration_key
    s.arrive("fresh", spec_for("long"), 0.02)
    fresh = s.requests["fresh"]
    assert fresh.first_token_at is None and fresh.seq > short.seq
    assert policy.choose_victims(a, 10**6, [fresh, long_, short]) == [long_, short, fresh]


def spec_for(task: str) -> RequestSpec:
    return RequestSpec(prompt_tokens=256, max_tokens=1500, model_max_len=2048, task=task)


def short_and_long(policy: CalibratedPolicy, streams: dict[str, str]) -> Scheduler:
    """A measured scheduler whose "short" task's answers stop at 40 tokens and "long" one's at
    1,000, with ``streams`` (request id -> task) admitted in order, each with its first token."""
    s = measured(policy, blocks=256)
    for _ in range(64):
        s.lengths.observe(spec_for("short").calibration_key, 40)
        s.lengths.observe(spec_for("long").calibration_key, 1000)
    for rid, task in streams.items():
        s.arrive(rid, spec_for(task), 0.0)
        s.charge(rid, 1, 0.01)
    return s


def test_growth_asked_ahead_waits_for_blocks_due_back_before_its_boundary() -> None:
    # "a" asks ahead of its boundary and "b", admitted after it, has had its first token: "b"
    # gives way now, unless blocks are due back first: a stop the engine is expected to have
    # confirmed, or a stream expected to end (and be confirmed, two steps), before "a" reaches
    # its boundary.
    # At its boundary, or too near it for a release to come, "a" has "b" give way after all.
    policy = CalibratedPolicy()
    s = short_and_long(policy, {"a": "long", "b": "long"})
    a = s.requests["a"]
    step = s.step_seconds()
    assert policy.cheap_to_pause(a) and a.boundary - a.generated > 3
    assert policy.on_blocked(a) is Blocked.PREEMPT_OTHERS  # nothing is due back
    s.arrive("c", spec_for("short"), 0.0)  # a short answer, one token from its expected end
    for _ in range(38):
        s.charge("c", 1, 0.02)
    c = s.requests["c"]
    assert s.seconds_left(c, step) + 2 * step <= (a.boundary - a.generated) * step
    assert policy.on_blocked(a) is Blocked.WAIT
    # too near its boundary for "c"'s blocks to be back in time
    a.generated = a.boundary - 2
    assert policy.on_blocked(a) is Blocked.PREEMPT_OTHERS
    # a stop still to be confirmed: not counted on before the engine has shown how long its
    # confirmations take; then counted on if it is due back in time
    a.generated = 1
    s.cancel("c", 0.03)
    assert "c" in s.stopping and "c" not in s.live
    assert s.confirm_seconds is None and policy.on_blocked(a) is Blocked.PREEMPT_OTHERS
    s.arrive("d", spec_for("short"), 0.03)
    s.cancel("d", 0.03)
    s.confirm_release("d", 0.031)
    assert s.confirm_seconds == pytest.approx(0.001)
    assert policy.on_blocked(a) is Blocked.WAIT
    # an engine that confirms slowly: the same stop is not due back before the boundary
    s.confirm_seconds = 10.0
    assert policy.on_blocked(a) is Blocked.PREEMPT_OTHERS


def test_growth_of_a_less_important_stream_never_pauses_a_more_important_one() -> None:
    # "a" (batch) asks ahead of its boundary with no room and nothing due back. Streams admitted
    # after it may give way, but only of its class or a less important one: with only an
    # interactive stream after it, "a" gives way itself (as vLLM's priority scheduling preempts
    # the least important request, which may be the one that needs room); with a batch stream
    # after it as well, that one does, however much longer the interactive one is expected to
    # run. Among equals nothing changes: an interactive asker still has an interactive stream
    # admitted after it give way.
    policy = CalibratedPolicy()
    s = short_and_long(policy, {})
    batch_long = RequestSpec(
        prompt_tokens=256, max_tokens=1500, model_max_len=2048, task="long",
        service_class="batch",
    )
    batch_mid = attrs.evolve(batch_long, task="mid")
    for _ in range(64):
        s.lengths.observe(batch_long.calibration_key, 1000)
        s.lengths.observe(batch_mid.calibration_key, 500)
    s.arrive("a", batch_long, 0.0)
    s.charge("a", 1, 0.01)
    s.arrive("i", spec_for("long"), 0.0)
    s.charge("i", 1, 0.01)
    a, i = s.requests["a"], s.requests["i"]
    assert a.cls.priority > i.cls.priority and a.seq < i.seq
    assert policy.cheap_to_pause(a) and a.boundary - a.generated > 3
    assert policy.on_blocked(a) is Blocked.PREEMPT_SELF
    assert policy.choose_victims(a, 1, [i]) == []
    # a batch stream after it that still awaits its first token: asked ahead, "a" waits for it
    # to have had it (the interactive stream's first token does not count: it will not give way)
    s.arrive("b", batch_mid, 0.0)
    b = s.requests["b"]
    assert b.first_token_at is None
    assert policy.on_blocked(a) is Blocked.WAIT
    s.charge("b", 1, 0.01)
    assert s.expected_length(i) > s.expected_length(b)
    assert policy.on_blocked(a) is Blocked.PREEMPT_OTHERS
    assert policy.choose_victims(a, 1, [i, b]) == [b]
    # an interactive asker: a stream of its own class admitted after it still gives way
    s.arrive("j", spec_for("long"), 0.0)
    s.charge("j", 1, 0.01)
    assert policy.on_blocked(i) is Blocked.PREEMPT_OTHERS
    assert policy.choose_victims(i, 1, [b, s.requests["j"]]) == [s.requests["j"]]


def test_a_wave_pauses_for_the_callers_behind_a_head_the_drain_would_serve() -> None:
    # 120 callers of 512 + 100..300 tokens at once on a fresh server: the first streams end
    # soon enough for the head of the queue, but the callers behind it wait a turnover of the
    # cache each 14 of them. Judged for the head alone (before the round was judged whole),
    # the pauses began only as the head's slack ran out: 44 first tokens late, p50 1.69 s
    s = measured(pausing())
    rnd = random.Random(0)
    e = Engine(s)
    for i in range(120):
        e.apply(s.arrive(f"r{i}", spec(max_tokens=rnd.randint(100, 300)), 0.0))
    e.run()
    assert not e.rejected
    first_tokens = sorted(e.first_token.values())
    assert len(first_tokens) == 120
    assert first_tokens[-1] <= 2.0
    assert first_tokens[60] < 1.5
    assert [v for v in e.gave_way if v[1].startswith("admit:")]
    assert e.s.snapshot().totals.completed == 120


def test_a_caller_behind_the_head_begins_the_pauses_only_while_they_can_still_serve_it() -> None:
    # Three streams hold the cache; the head is taken to fit what is free, the caller behind
    # it to need two turnovers of what the streams hold (the blocks each wants are given).
    # It begins the pauses now only where waiting for the head's own moment would leave it
    # too few pause cycles (more than half its slack) while its whole slack still holds
    # them; with more slack it waits, with less it is past help and nothing is paused for it.
    s = measured(pausing(), blocks=64)
    for rid in ("a", "b", "c"):
        s.arrive(rid, spec(), 0.0)
        s.charge(rid, 1, 0.01)
    s.arrive("head", spec(), 0.0)
    s.arrive("tail", spec(), 0.0)
    head, tail = s.requests["head"], s.requests["tail"]
    held = sum(s.ledger.footprint(r) for r in s.live.values())
    free = s.ledger.free - s.ledger.headroom_target
    wants = [max(1, free), 2 * held - 1]  # the head fits; the tail needs two turnovers
    cycle = s.cost.predict_prefill(held * BLOCK) + 2.0 * s.step_seconds()
    cycles = 2 * cycle

    def pauses_begin(slack: float) -> bool:
        s.now = tail.arrival + 2.0 - s.forecast.first_token_delay(tail) - slack
        assert s.queue_slack(tail) == pytest.approx(slack)
        return not s._back_in_time([head, tail], wants)

    assert pauses_begin(1.5 * cycles)  # waiting would leave it too few cycles
    assert not pauses_begin(2.5 * cycles)  # it can wait for a later round
    assert not pauses_begin(0.5 * cycles)  # no round can serve it in time any more
