"""The scenario overlay: what a bare workload does not say about its requests (DESIGN §10).

A trace gives arrivals, prompt lengths and true output lengths. This module owns everything
layered on top before the simulator can run it: the service-class mix, tenants, ``max_tokens``
per class and the model's context length, sampling and stop profiles (parts of the calibration
key), per-class objectives, client abandonment, durability, ``on_exhausted="continue"``, a
replay-rate multiplier, an optional synchronized *wave* of long interactive outputs, and shared
*system prompts* for traces that carry no prefix data of their own.

:class:`Scenario` holds those settings (validated, JSON round-trippable via
:func:`scenario_to_dict` / :func:`scenario_from_dict`); :func:`apply_scenario` turns a
:class:`~kvbudget.sim.workload.Workload` into :class:`SimRequest` values, the per-request input
of the discrete-event driver. The overlay is deterministic for a given workload and scenario.

Randomness. Every trace request consumes the same fixed number of draws from one
``random.Random`` stream, whatever the settings, so changing one share (say
``interactive_share``) does not reshuffle the tenants or abandonment of other requests. Wave
requests draw from a separate stream, so adding a wave leaves the trace requests unchanged.

Abandonment. An ``abandon_share`` of *interactive* callers (wave ones included) disconnect
before their request ends on its own; batch callers never do. How long a caller stays is
modelled as time spent *after its first token*, exponential with mean ``abandon_mean_s``.
The first-token time is only known inside the simulation, so :attr:`SimRequest.abandon_after_s`
(seconds after *arrival*, what the driver acts on) anchors that draw at the interactive TTFT
objective: ``abandon_after_s = ttft_slo_s + Exp(abandon_mean_s)``. A request served within its
TTFT objective thus streams for about the drawn time before its caller leaves; one whose first
token is late loses streaming time, as an impatient caller would. The raw draw is kept in
:attr:`SimRequest.abandon_after_first_token_s` for a driver that tracks first tokens itself.
A caller who would leave after the request finished simply never disconnects.

System prompts. With ``system_prompts`` = N > 0, a ``system_prompt_share`` of the trace requests
that have no ``hash_ids`` of their own start with one of N distinct system prompts of
``system_prompt_tokens`` tokens each, chosen uniformly; the system prompt is *prepended*, so such
a request's prompt is the trace's prompt plus ``system_prompt_tokens`` (then clamped as below).
:attr:`SimRequest.system_prompt` names it; the simulator turns it into shared prompt blocks at
the engine's block size (:func:`kvbudget.sim.prefix.system_prompt_blocks`). These draws come
from a stream of their own, so turning system prompts on changes nothing else of a request.
Wave requests carry none.

Clamping. A prompt longer than ``model_max_len - 1`` is cut to ``model_max_len - 1`` (one
output token must fit), and a true output length above the request's hard maximum
``min(max_tokens, model_max_len - prompt)`` is cut to it; both are kept unclamped on the
:class:`SimRequest` and counted by :func:`overlay_summary`.
"""

from __future__ import annotations

import bisect
import random
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from kvbudget.core.model import BATCH, INTERACTIVE, RequestSpec, ServiceClass
from kvbudget.errors import InvalidInput
from kvbudget.sim.workload import Workload
from kvbudget.validate import check_float, fraction, integer, nonnegative, positive, text

__all__ = [
    "DEFAULT_SAMPLING_PROFILES",
    "DEFAULT_STOP_PROFILES",
    "DEFAULT_TENANTS",
    "Profiles",
    "Scenario",
    "SimRequest",
    "Wave",
    "apply_scenario",
    "overlay_summary",
    "scenario_from_dict",
    "scenario_to_dict",
]

Profiles = tuple[tuple[str, float], ...]
"""Named shares, e.g. ``(("acme", 0.6), ("globex", 0.4))``; weights are normalised."""

DEFAULT_TENANTS: Profiles = (("acme", 0.6), ("globex", 0.3), ("initech", 0.1))
DEFAULT_SAMPLING_PROFILES: Profiles = (("greedy", 0.3), ("temp0.7", 0.7))
DEFAULT_STOP_PROFILES: Profiles = (("eos", 0.8), ("stop-strings", 0.2))


# --------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------


def _to_profiles(value: Any) -> Any:
    """Lists of pairs (as JSON gives them) → tuple of (name, weight) tuples; else unchanged."""
    if isinstance(value, Mapping):
        return tuple((k, v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return tuple(tuple(p) if isinstance(p, list | tuple) else p for p in value)
    return value


def _profiles(field: str) -> Any:
    def validate(_inst: object, _attr: object, value: Any) -> None:
        if not isinstance(value, tuple) or not value:
            raise InvalidInput(field, value, "a non-empty sequence of (name, share) pairs")
        seen: set[str] = set()
        for pair in value:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise InvalidInput(field, pair, "(name, share) pairs")
            name, share = pair
            if not isinstance(name, str) or not name:
                raise InvalidInput(f"{field}.name", name, "a non-empty string")
            if name in seen:
                raise InvalidInput(field, name, "unique names")
            seen.add(name)
            check_float(f"{field}[{name!r}]", share, minimum=0.0, open_min=True)

    return validate


def _to_wave(value: Any) -> Any:
    if isinstance(value, Mapping):
        return _from_mapping(Wave, value, "wave")
    return value


def _check_wave(_inst: object, _attr: object, value: Any) -> None:
    if value is not None and not isinstance(value, Wave):
        raise InvalidInput("wave", value, "a Wave, a mapping of its fields, or None")


# --------------------------------------------------------------------------------------------
# Value types
# --------------------------------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class Wave:
    """A synchronized burst of long interactive outputs.

    ``count`` interactive requests with ``prompt_tokens`` of prompt, each truly generating
    ``output_tokens`` (cut to its hard max), arrive uniformly at random in
    ``[at_s, at_s + spread_s]``. ``at_s`` is on the *replayed* timeline, i.e. after
    ``rate_scale`` has compressed the trace's arrivals.
    """

    at_s: float = attrs.field(default=60.0, validator=nonnegative(name="wave.at_s"))
    count: int = attrs.field(default=64, validator=integer(1, name="wave.count"))
    output_tokens: int = attrs.field(default=2000, validator=integer(1, name="wave.output_tokens"))
    prompt_tokens: int = attrs.field(default=512, validator=integer(1, name="wave.prompt_tokens"))
    spread_s: float = attrs.field(default=1.0, validator=nonnegative(name="wave.spread_s"))


@attrs.frozen(slots=True, kw_only=True)
class Scenario:
    """Everything a trace does not say about its requests (DESIGN §10).

    Class mix: ``interactive_share`` of requests are ``interactive``, the rest ``batch``.
    ``tenants``, ``sampling_profiles``, ``stop_profiles``: named shares, weights normalised;
    tenant, sampling and stop behaviour are parts of the calibration key and do not change a
    request's true length. ``interactive_max_tokens``/``batch_max_tokens``: the product's
    ``max_tokens`` per class, a ceiling independent of the true length. ``model_max_len``: the
    model's context. ``model``/``task``: the calibration-key labels given to every request.

    Objectives: ``ttft_slo_s`` and ``itl_floor_s`` (the latency floor) for interactive work,
    ``batch_deadline_s`` (completion deadline, seconds after arrival) for batch work; see
    :meth:`service_classes`.

    Callers: ``abandon_share`` of interactive callers disconnect (module docstring: when),
    ``abandon_mean_s`` the mean of the exponential time they stream before leaving.
    ``durable_share`` of batch requests survive their caller. ``continue_share`` of all
    requests ask for ``on_exhausted="continue"``.

    Replay: ``rate_scale`` divides the trace's arrival times (2.0 replays twice as fast).
    ``wave``: an optional synchronized burst (:class:`Wave`). ``seed``: the overlay's seed.

    Shared prefixes: ``system_prompts`` distinct system prompts (0: none) of
    ``system_prompt_tokens`` tokens each, prepended to a ``system_prompt_share`` of the trace
    requests without ``hash_ids`` (module docstring).
    """

    seed: int = attrs.field(default=0, validator=integer(-(2**63)))
    interactive_share: float = attrs.field(default=0.7, validator=fraction())
    tenants: Profiles = attrs.field(
        default=DEFAULT_TENANTS, converter=_to_profiles, validator=_profiles("tenants")
    )
    interactive_max_tokens: int = attrs.field(
        default=2048, validator=integer(1, name="interactive_max_tokens")
    )
    batch_max_tokens: int = attrs.field(
        default=4096, validator=integer(1, name="batch_max_tokens")
    )
    model_max_len: int = attrs.field(default=8192, validator=integer(2))
    model: str = attrs.field(default="default", validator=text())
    task: str = attrs.field(default="default", validator=text())
    sampling_profiles: Profiles = attrs.field(
        default=DEFAULT_SAMPLING_PROFILES,
        converter=_to_profiles,
        validator=_profiles("sampling_profiles"),
    )
    stop_profiles: Profiles = attrs.field(
        default=DEFAULT_STOP_PROFILES, converter=_to_profiles, validator=_profiles("stop_profiles")
    )
    ttft_slo_s: float = attrs.field(default=2.0, validator=positive())
    itl_floor_s: float = attrs.field(default=0.2, validator=positive())
    batch_deadline_s: float = attrs.field(
        default=600.0, validator=positive(name="batch_deadline_s")
    )
    abandon_share: float = attrs.field(default=0.1, validator=fraction())
    abandon_mean_s: float = attrs.field(default=5.0, validator=nonnegative())
    durable_share: float = attrs.field(default=0.5, validator=fraction())
    continue_share: float = attrs.field(default=0.0, validator=fraction())
    rate_scale: float = attrs.field(default=1.0, validator=positive())
    wave: Wave | None = attrs.field(default=None, converter=_to_wave, validator=_check_wave)
    system_prompts: int = attrs.field(default=0, validator=integer(0, name="system_prompts"))
    system_prompt_tokens: int = attrs.field(
        default=0, validator=integer(0, name="system_prompt_tokens")
    )
    system_prompt_share: float = attrs.field(
        default=1.0, validator=fraction(name="system_prompt_share")
    )

    def __attrs_post_init__(self) -> None:
        if self.system_prompts and not 1 <= self.system_prompt_tokens <= self.model_max_len - 2:
            # (a request must keep at least one token of its own and one of output)
            raise InvalidInput(
                "system_prompt_tokens",
                self.system_prompt_tokens,
                f"between 1 and model_max_len - 2 = {self.model_max_len - 2} tokens when "
                f"system_prompts = {self.system_prompts}",
            )

    def max_tokens_for(self, service_class: str) -> int:
        """The product ``max_tokens`` of ``service_class`` ("interactive" or "batch")."""
        if service_class == "interactive":
            return self.interactive_max_tokens
        if service_class == "batch":
            return self.batch_max_tokens
        raise InvalidInput("service_class", service_class, "'interactive' or 'batch'")

    def service_classes(self) -> tuple[ServiceClass, ServiceClass]:
        """The default interactive and batch classes with this scenario's objectives.

        Interactive: ``ttft_slo_s`` (also its ``max_queue_delay_s``: a caller not admitted
        within its TTFT objective is turned away) and ``latency_floor_s = itl_floor_s``.
        Batch: ``default_deadline_s = batch_deadline_s``. Other settings are the library's
        defaults (:data:`kvbudget.core.model.INTERACTIVE` / ``BATCH``).
        """
        interactive = attrs.evolve(
            INTERACTIVE,
            ttft_slo_s=self.ttft_slo_s,
            max_queue_delay_s=self.ttft_slo_s,
            latency_floor_s=self.itl_floor_s,
        )
        batch = attrs.evolve(BATCH, default_deadline_s=self.batch_deadline_s)
        return interactive, batch

    def to_dict(self) -> dict[str, Any]:
        return scenario_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Scenario:
        return scenario_from_dict(data)


@attrs.frozen(slots=True, kw_only=True)
class SimRequest:
    """One request as the discrete-event driver replays it.

    ``arrival_s``: seconds on the replayed timeline. ``prompt_tokens``: after clamping to
    ``model_max_len - 1`` (``unclamped_prompt_tokens``: as the workload gave it).
    ``true_output_tokens``: what the request generates if nothing stops it, already cut to the
    hard max (``unclamped_output_tokens``: the workload's true length). ``spec``: what the
    application tells the budget. ``abandon_after_s``: seconds after arrival at which the
    client disconnects (None: never); ``abandon_after_first_token_s``: the same decision as
    time after the first token (module docstring). ``is_wave``: part of the scenario's wave.
    ``hash_ids``: prefix-block ids from the trace, if any (512 tokens each, Mooncake).
    ``system_prompt``: which of the scenario's shared system prompts the prompt starts with
    (None: none), ``system_prompt_tokens`` its length (included in ``prompt_tokens``).
    ``abandon_after_tokens``: the client disconnects once it has received this many tokens
    (None: it does not; a client that reads a fixed share of a stream, as a benchmark client
    does; the overlay never sets it, a caller builds such requests with ``attrs.evolve``).
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    true_output_tokens: int
    unclamped_output_tokens: int
    unclamped_prompt_tokens: int
    spec: RequestSpec
    abandon_after_s: float | None = None
    abandon_after_first_token_s: float | None = None
    is_wave: bool = False
    hash_ids: tuple[int, ...] = ()
    system_prompt: int | None = None
    system_prompt_tokens: int = 0
    abandon_after_tokens: int | None = None

    @property
    def service_class(self) -> str:
        return self.spec.service_class

    @property
    def tenant(self) -> str:
        return self.spec.tenant

    @property
    def hard_max(self) -> int:
        return self.spec.hard_max

    @property
    def prompt_clamped(self) -> bool:
        return self.prompt_tokens != self.unclamped_prompt_tokens

    @property
    def output_clamped(self) -> bool:
        return self.true_output_tokens != self.unclamped_output_tokens


# --------------------------------------------------------------------------------------------
# The overlay
# --------------------------------------------------------------------------------------------


class _Picker:
    """Maps a uniform draw in [0, 1) to a name, by normalised shares."""

    __slots__ = ("_cum", "_names")

    def __init__(self, profiles: Profiles) -> None:
        total = sum(w for _, w in profiles)
        acc = 0.0
        cum: list[float] = []
        for _, w in profiles:
            acc += w / total
            cum.append(acc)
        cum[-1] = 1.0
        self._cum = cum
        self._names = [n for n, _ in profiles]

    def __call__(self, u: float) -> str:
        return self._names[bisect.bisect_right(self._cum, u)]


class _Builder:
    """Builds SimRequests from per-request uniform draws; shared by trace and wave requests."""

    def __init__(self, scenario: Scenario) -> None:
        self.s = scenario
        self.tenant = _Picker(scenario.tenants)
        self.sampling = _Picker(scenario.sampling_profiles)
        self.stops = _Picker(scenario.stop_profiles)
        self.max_prompt = scenario.model_max_len - 1

    def build(
        self,
        request_id: str,
        arrival_s: float,
        prompt: int,
        output: int,
        interactive: bool,
        u: list[float],
        stream_s: float,
        *,
        is_wave: bool,
        hash_ids: tuple[int, ...] = (),
        system_prompt: int | None = None,
    ) -> SimRequest:
        """``u``: six uniforms (tenant, sampling, stops, durable, continue, abandon)."""
        s = self.s
        system_tokens = 0
        if system_prompt is not None:
            system_tokens = s.system_prompt_tokens
            prompt += system_tokens
        prompt_c = prompt if prompt <= self.max_prompt else self.max_prompt
        service_class = "interactive" if interactive else "batch"
        max_tokens = s.interactive_max_tokens if interactive else s.batch_max_tokens
        deadline = None if interactive else s.batch_deadline_s
        durable = (not interactive) and u[3] < s.durable_share  # only batch work is durable
        abandons = interactive and u[5] < s.abandon_share  # only interactive callers leave
        hard_max = min(max_tokens, s.model_max_len - prompt_c)
        spec = RequestSpec(
            prompt_tokens=prompt_c,
            max_tokens=max_tokens,
            model_max_len=s.model_max_len,
            service_class=service_class,
            tenant=self.tenant(u[0]),
            task=s.task,
            model=s.model,
            sampling=self.sampling(u[1]),
            stops=self.stops(u[2]),
            durable=durable,
            on_exhausted="continue" if u[4] < s.continue_share else "extend",
            deadline=deadline,
        )
        return SimRequest(
            request_id=request_id,
            arrival_s=arrival_s,
            prompt_tokens=prompt_c,
            true_output_tokens=output if output <= hard_max else hard_max,
            unclamped_output_tokens=output,
            unclamped_prompt_tokens=prompt,
            spec=spec,
            abandon_after_s=(s.ttft_slo_s + stream_s) if abandons else None,
            abandon_after_first_token_s=stream_s if abandons else None,
            is_wave=is_wave,
            hash_ids=hash_ids,
            system_prompt=system_prompt,
            system_prompt_tokens=system_tokens,
        )


def apply_scenario(workload: Workload, scenario: Scenario) -> tuple[SimRequest, ...]:
    """Overlay ``scenario`` on ``workload``: one :class:`SimRequest` per request, plus the wave.

    Returns the requests sorted by replayed arrival (trace requests before wave requests that
    arrive at the same instant). Trace requests are named ``t<index>`` after their position
    in the workload, wave requests ``w<index>``. Deterministic for a given workload and
    scenario (see the module docstring for how draws are laid out and how abandonment and
    clamping work); :func:`overlay_summary` counts what was clamped.
    """
    if not isinstance(workload, Workload):
        raise InvalidInput("workload", workload, "a kvbudget.sim.workload.Workload")
    if not isinstance(scenario, Scenario):
        raise InvalidInput("scenario", scenario, "a kvbudget.sim.scenario.Scenario")
    s = scenario
    builder = _Builder(s)
    rng = random.Random(f"kvbudget.scenario:{s.seed}")
    rand = rng.random
    expo = rng.expovariate
    scale = s.rate_scale
    share = s.interactive_share
    mean = s.abandon_mean_s
    digits = max(6, len(str(len(workload.requests))))
    # system prompts draw from their own stream (two draws per trace request, always)
    srng = random.Random(f"kvbudget.scenario.system:{s.seed}")
    srand = srng.random
    n_system = s.system_prompts
    system_share = s.system_prompt_share

    out: list[SimRequest] = []
    for i, tr in enumerate(workload.requests):
        # Fixed layout: class, tenant, sampling, stops, durable, continue, abandon, stream time.
        interactive = rand() < share
        u = [rand(), rand(), rand(), rand(), rand(), rand()]
        stream_s = expo(1.0) * mean
        carries, which = srand() < system_share, srand()
        system = (
            min(n_system - 1, int(which * n_system))
            if n_system and carries and not tr.hash_ids
            else None
        )
        out.append(
            builder.build(
                f"t{i:0{digits}d}",
                tr.arrival_s / scale,
                tr.prompt_tokens,
                tr.output_tokens,
                interactive,
                u,
                stream_s,
                is_wave=False,
                hash_ids=tr.hash_ids,
                system_prompt=system,
            )
        )

    wave = s.wave
    if wave is not None:
        wrng = random.Random(f"kvbudget.scenario.wave:{s.seed}")
        wrand = wrng.random
        times = sorted(wave.at_s + wave.spread_s * wrand() for _ in range(wave.count))
        wdigits = max(4, len(str(wave.count)))
        waves = []
        for j, t in enumerate(times):
            u = [wrand(), wrand(), wrand(), wrand(), wrand(), wrand()]
            stream_s = wrng.expovariate(1.0) * mean
            waves.append(
                builder.build(
                    f"w{j:0{wdigits}d}",
                    t,
                    wave.prompt_tokens,
                    wave.output_tokens,
                    True,
                    u,
                    stream_s,
                    is_wave=True,
                )
            )
        out.extend(waves)
        out.sort(key=lambda r: r.arrival_s)  # stable: trace requests first on ties
    return tuple(out)


def overlay_summary(requests: Iterable[SimRequest]) -> dict[str, Any]:
    """Counts of an overlay's output: classes, tenants, wave, clamping, abandonment, durability."""
    reqs = list(requests)
    classes: Counter[str] = Counter()
    tenants: Counter[str] = Counter()
    summary: dict[str, Any] = {
        "count": len(reqs),
        "wave": 0,
        "prompts_clamped": 0,
        "outputs_clamped": 0,
        "abandoning": 0,
        "durable": 0,
        "continue": 0,
        "system_prompt": 0,
        "duration_s": (reqs[-1].arrival_s - reqs[0].arrival_s) if len(reqs) > 1 else 0.0,
        "total_true_output_tokens": 0,
    }
    for r in reqs:
        classes[r.spec.service_class] += 1
        tenants[r.spec.tenant] += 1
        summary["wave"] += r.is_wave
        summary["prompts_clamped"] += r.prompt_tokens != r.unclamped_prompt_tokens
        summary["outputs_clamped"] += r.true_output_tokens != r.unclamped_output_tokens
        summary["abandoning"] += r.abandon_after_s is not None
        summary["durable"] += r.spec.durable
        summary["continue"] += r.spec.on_exhausted == "continue"
        summary["system_prompt"] += r.system_prompt is not None
        summary["total_true_output_tokens"] += r.true_output_tokens
    summary["classes"] = dict(sorted(classes.items()))
    summary["tenants"] = dict(sorted(tenants.items()))
    return summary


# --------------------------------------------------------------------------------------------
# JSON round trip
# --------------------------------------------------------------------------------------------


def _from_mapping(cls: Any, data: Mapping[str, Any], where: str) -> Any:
    if not isinstance(data, Mapping):
        raise InvalidInput(where, data, "a mapping of field names to values")
    known = [a.name for a in attrs.fields(cls)]
    for key in data:
        if key not in known:
            raise InvalidInput(f"{where}.{key}", data[key], f"a known field: {', '.join(known)}")
    return cls(**dict(data))


def scenario_to_dict(scenario: Scenario) -> dict[str, Any]:
    """A JSON-ready dict of ``scenario`` (pairs become 2-element lists; ``wave`` a dict/None)."""
    d: dict[str, Any] = {}
    for a in attrs.fields(Scenario):
        v = getattr(scenario, a.name)
        if isinstance(v, Wave):
            v = attrs.asdict(v)
        elif isinstance(v, tuple):
            v = [list(p) for p in v]
        d[a.name] = v
    return d


def scenario_from_dict(data: Mapping[str, Any]) -> Scenario:
    """The inverse of :func:`scenario_to_dict`; missing keys take defaults, unknown keys fail."""
    scenario: Scenario = _from_mapping(Scenario, data, "scenario")
    return scenario
