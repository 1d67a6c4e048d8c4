"""Engine profiles: the simulator's engine model fitted from a real engine's observed steps.

This module owns :class:`EngineProfile` (a named, cited engine model that ``kvbudget simulate
--engine-profile FILE`` reads), :func:`fit_step_time` (the batch least-squares fit of the step
time from observed engine steps) and :class:`StepRecorder` (a bounded record of those steps;
:class:`kvbudget.vllm.BudgetedEngine` keeps one and builds a profile from it with
``engine_profile()``).

The fit
-------
Each observed step is ``(batch, context_tokens, prefill_tokens, seconds)``. Steps without a
prefill fit ``seconds = fixed + per_seq * batch + per_context_token * context`` by least squares;
steps with one then fit ``prefill_per_token`` through the origin on what the decode part, as
fitted, leaves of their time. Coefficients are kept >= 0: one that comes out negative is fixed at
0 and the others refitted (an active set over three unknowns). With too few decode steps to
separate the three (fewer than 3, or all at one batch size and context), the batch and context
terms that cannot be told apart are 0 and the fixed cost is the mean.

:class:`StepRecorder` keeps two records of the same steps: timed by the engine (its model
execution) and timed whole (from the previous step's stats to this one's, as the caller receives
them; a gap over ``MAX_WALL_GAP_S`` is a stall and left out).

The front end (:func:`fit_front_end`). A server's front-end process is observed as a whole: over
each stretch of work (a benchmark's workload) the CPU time it used, the requests it took in, the
outputs it streamed (tokens delivered) and how long the stretch lasted. ``cpu = per_request *
requests + per_output * outputs + idle * seconds`` is fitted by least squares over the stretches,
coefficients kept >= 0 as above; the first two make the simulator's
:class:`~kvbudget.sim.engine_model.FrontEndModel`, the third (what the process spends per
second whatever it serves: timers, metrics) is reported and left out of it. It is the CPU of
every thread of the process, taken as the work of one: where a server runs some of it on other
threads (vLLM tokenizes raw prompts on a thread pool), the front end is modelled a little
slower than it is.

A profile also carries what the engine was configured with (KV blocks and block size, batch cap,
prefill chunk) and the abort latency: the time an idle engine takes to confirm a stop (the
adapter's round trip to the engine core; a busy engine confirms with its step records, which
the simulator counts itself); it is taken as the median observed step time unless given.

The intake (``intake_s``, engine time per arriving request) is not in the steps' fit: the steps
a burst of arrivals slows are timed whole with everything else in them, and a caller of the
engine sees arrivals the engine's own steps do not count (the server's parsing and tokenizing).
It is measured from the first tokens of a run's bursts against the simulated ones
(``docs/benchmarks-history.md``, the twenty-third session) and set on the profile by hand, 0
unless set.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from kvbudget.core.cost import StepTimeModel
from kvbudget.core.model import Capacity
from kvbudget.errors import InvalidInput
from kvbudget.sim.engine_model import DEFAULT_TICK_S, EngineModel, FrontEndModel
from kvbudget.validate import check_float, check_int, integer, nonnegative, text

#: one observed engine step: (batch size, context tokens, prefill tokens, seconds)
StepRecord = tuple[int, int, int, float]

#: the profiles shipped with kvbudget (``kvbudget simulate --engine-profile NAME``)
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
#: a gap between two steps' stats longer than this is a stall, not a step (StepRecorder)
MAX_WALL_GAP_S = 0.5


class StepRecorder:
    """The last ``limit`` observed engine steps (O(1) per step, bounded memory)."""

    __slots__ = ("steps", "wall", "wall_at")

    def __init__(self, limit: int = 20_000) -> None:
        check_int("limit", limit, minimum=1)
        #: steps timed by the engine itself (its model execution)
        self.steps: deque[StepRecord] = deque(maxlen=limit)
        #: the same steps timed whole, from the previous step's end as the caller saw it
        self.wall: deque[StepRecord] = deque(maxlen=limit)
        #: when each of ``wall`` ended (the caller's clock; NaN where not given)
        self.wall_at: deque[float] = deque(maxlen=limit)

    def record(self, batch: int, context_tokens: int, prefill_tokens: int, seconds: float) -> None:
        if seconds >= 0.0 and math.isfinite(seconds):
            self.steps.append((batch, context_tokens, prefill_tokens, seconds))

    def record_wall(
        self,
        batch: int,
        context_tokens: int,
        prefill_tokens: int,
        seconds: float,
        at: float | None = None,
    ) -> None:
        """A step timed whole, ending at ``at``. Gaps over ``MAX_WALL_GAP_S`` are not steps but
        stalls of the caller (or of the machine) and are left out."""
        if 0.0 <= seconds <= MAX_WALL_GAP_S:
            self.wall.append((batch, context_tokens, prefill_tokens, seconds))
            self.wall_at.append(math.nan if at is None else at)

    def wall_between(self, since: float, until: float) -> list[StepRecord]:
        """The steps timed whole that ended in ``[since, until]`` (the clock ``at`` was given
        on; steps recorded without one are in no window)."""
        return [r for r, at in zip(self.wall, self.wall_at, strict=True) if since <= at <= until]

    def __len__(self) -> int:
        return len(self.steps)


#: one observed stretch of a front end's work: (requests, outputs, seconds, CPU seconds)
FrontEndRecord = tuple[int, int, float, float]


def _solve(rows: list[list[float]], ys: list[float], active: list[int]) -> list[float]:
    """Least squares over the columns in ``active`` (normal equations, Gaussian elimination
    with partial pivoting); columns that are not active, or that the data cannot determine,
    get 0."""
    n = len(active)
    a = [[sum(r[i] * r[j] for r in rows) for j in active] for i in active]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in active]
    for col in range(n):
        pivot = max(range(col, n), key=lambda k: abs(a[k][col]))
        if abs(a[pivot][col]) < 1e-12 * max(1.0, max(abs(v) for row in a for v in row)):
            continue  # not determined by the data: left at 0
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for k in range(n):
            if k != col and a[k][col] != 0.0:
                f = a[k][col] / a[col][col]
                a[k] = [x - f * y for x, y in zip(a[k], a[col], strict=True)]
                b[k] -= f * b[col]
    out = [0.0, 0.0, 0.0]
    for idx, col in enumerate(active):
        out[col] = b[idx] / a[idx][idx] if abs(a[idx][idx]) > 0.0 else 0.0
    return out


def fit_step_time(steps: Iterable[StepRecord]) -> StepTimeModel:
    """The step-time model that fits ``steps`` best (module docstring). Raises InvalidInput
    without a single decode step."""
    decode: list[tuple[int, int, float]] = []
    prefill: list[tuple[int, int, int, float]] = []
    for batch, context, tokens, seconds in steps:
        if tokens > 0:
            prefill.append((batch, context, tokens, seconds))
        elif batch > 0:
            decode.append((batch, context, seconds))
    if not decode:
        raise InvalidInput("steps", len(prefill), "at least one decode step (no prefill)")
    # scaled features (seconds ~ ms, batch ~ tens, context ~ thousands) keep the system sane
    sb, sc = 64.0, 65536.0
    rows = [[1.0, b / sb, c / sc] for b, c, _ in decode]
    ys = [s for _, _, s in decode]
    coef = _nonnegative_fit(rows, ys)
    fixed, per_seq, per_ctx = coef[0], coef[1] / sb, coef[2] / sc
    num = den = 0.0
    for batch, context, tokens, seconds in prefill:
        rest = seconds - (
            (fixed + per_seq * batch + per_ctx * context) if batch else fixed
        )
        num += tokens * rest
        den += tokens * tokens
    per_token = max(0.0, num / den) if den else 0.0
    return StepTimeModel(
        fixed_s=fixed, per_seq_s=per_seq, per_context_token_s=per_ctx, prefill_per_token_s=per_token
    )


def _nonnegative_fit(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares over three columns with every coefficient >= 0 (an active set: the most
    negative one is fixed at 0 and the others refitted)."""
    active = [0, 1, 2]
    coef = _solve(rows, ys, active)
    while any(coef[i] < 0.0 for i in active) and len(active) > 1:
        active.remove(min(active, key=lambda i: coef[i]))
        coef = _solve(rows, ys, active)
    return [max(0.0, c) for c in coef]


def fit_front_end(stretches: Iterable[FrontEndRecord]) -> tuple[FrontEndModel, float]:
    """The front end that fits ``stretches`` best, and its idle CPU per second (module
    docstring). Raises InvalidInput without two stretches that did any work."""
    rows: list[list[float]] = []
    ys: list[float] = []
    names = ("requests", "outputs", "seconds", "cpu_seconds")
    for stretch in stretches:
        if not isinstance(stretch, tuple | list) or len(stretch) != len(names):
            raise InvalidInput("stretch", stretch, "(requests, outputs, seconds, cpu_seconds)")
        requests, outputs, seconds, cpu = (
            check_float(n, v) for n, v in zip(names, stretch, strict=True)
        )
        if requests or outputs:
            # scaled (requests ~ 100, outputs ~ 10,000, seconds ~ 10) to keep the system sane
            rows.append([requests / 100.0, outputs / 10_000.0, seconds / 10.0])
            ys.append(cpu)
    if len(rows) < 2:
        raise InvalidInput("stretches", len(rows), "at least two stretches with requests")
    per_request, per_output, idle = _nonnegative_fit(rows, ys)
    return (
        FrontEndModel(per_request_s=per_request / 100.0, per_output_s=per_output / 10_000.0),
        idle / 10.0,
    )


def _front_end(value: Any) -> FrontEndModel | None:
    if value is None or isinstance(value, FrontEndModel):
        return value
    if isinstance(value, Mapping):
        try:
            return FrontEndModel(**value)
        except TypeError as exc:
            raise InvalidInput("front_end", value, "per_request_s, per_output_s") from exc
    raise InvalidInput("front_end", value, "a FrontEndModel, a mapping of its fields or None")


def _step(value: Any) -> StepTimeModel:
    if isinstance(value, StepTimeModel):
        return value
    if isinstance(value, Mapping):
        try:
            return StepTimeModel(**value)
        except TypeError as exc:
            raise InvalidInput(
                "step", value, "fixed_s, per_seq_s, per_context_token_s, prefill_per_token_s"
            ) from exc
    raise InvalidInput("step", value, "a StepTimeModel or a mapping of its fields")


@attrs.frozen(slots=True, kw_only=True)
class EngineProfile:
    """A named engine model, with where its figures come from (module docstring)."""

    name: str = attrs.field(validator=text())
    #: where the figures come from: the engine, model, hardware and the measurement or citation
    source: str = attrs.field(validator=text())
    step: StepTimeModel = attrs.field(converter=_step)
    capacity_blocks: int = attrs.field(validator=integer(1))
    block_size: int = attrs.field(validator=integer(1))
    max_batch: int = attrs.field(validator=integer(1))
    prefill_chunk_tokens: int = attrs.field(validator=integer(1))
    abort_latency_s: float = attrs.field(validator=nonnegative())
    #: how many engine steps the fit saw (0: not fitted, figures taken from the source)
    observed_steps: int = attrs.field(default=0, validator=integer(0))
    #: the server process in front of the engine (:func:`fit_front_end`); None: not modelled
    front_end: FrontEndModel | None = attrs.field(default=None, converter=_front_end)
    #: engine seconds per arriving request (:class:`~kvbudget.sim.engine_model.EngineModel`'s
    #: ``intake_s``); measured from a run's bursts, not from the steps (module docstring)
    intake_s: float = attrs.field(default=0.0, validator=nonnegative(name="intake_s"))

    def engine_model(self, tick_s: float = DEFAULT_TICK_S) -> EngineModel:
        """The simulator's engine for this profile."""
        return EngineModel(
            capacity=Capacity(self.capacity_blocks, self.block_size),
            step=self.step,
            abort_latency_s=self.abort_latency_s,
            max_batch=self.max_batch,
            prefill_chunk_tokens=self.prefill_chunk_tokens,
            tick_s=tick_s,
            front_end=self.front_end,
            intake_s=self.intake_s,
        )

    def to_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=False)
        out["step"] = attrs.asdict(self.step)
        if self.front_end is None:
            del out["front_end"]  # (files written before front ends were modelled match)
        else:
            out["front_end"] = self.front_end.to_dict()
        if not self.intake_s:
            del out["intake_s"]  # (nor before the intake was)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineProfile:
        if not isinstance(data, Mapping):
            raise InvalidInput("profile", data, "a JSON object of EngineProfile fields")
        fields = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise InvalidInput("profile", unknown, f"only the fields {sorted(fields)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise InvalidInput("profile", sorted(data), f"the fields {sorted(fields)}") from exc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path_or_name: str | Path) -> EngineProfile:
        """Read a profile file, or a shipped profile by name (see :func:`shipped_profiles`)."""
        path = Path(path_or_name)
        if not path.exists() and (PROFILES_DIR / f"{path_or_name}.json").exists():
            path = PROFILES_DIR / f"{path_or_name}.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise InvalidInput(
                "engine_profile", str(path_or_name),
                f"a profile file or one of {', '.join(shipped_profiles())}",
            ) from None
        except json.JSONDecodeError as exc:
            raise InvalidInput("engine_profile", str(path), f"valid JSON ({exc})") from None
        return cls.from_dict(data)


def shipped_profiles() -> list[str]:
    """Names of the profiles that come with kvbudget."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def fit_profile(
    steps: Iterable[StepRecord],
    *,
    name: str,
    source: str,
    capacity_blocks: int,
    block_size: int,
    max_batch: int,
    prefill_chunk_tokens: int,
    abort_latency_s: float | None = None,
) -> EngineProfile:
    """An :class:`EngineProfile` fitted from observed ``steps`` (module docstring)."""
    records = list(steps)
    step = fit_step_time(records)
    if abort_latency_s is None:
        abort_latency_s = statistics.median(s for *_, s in records)
    return EngineProfile(
        name=name,
        source=source,
        step=step,
        capacity_blocks=capacity_blocks,
        block_size=block_size,
        max_batch=max_batch,
        prefill_chunk_tokens=prefill_chunk_tokens,
        abort_latency_s=abort_latency_s,
        observed_steps=len(records),
    )


__all__ = [
    "PROFILES_DIR",
    "EngineProfile",
    "FrontEndRecord",
    "StepRecord",
    "StepRecorder",
    "fit_front_end",
    "fit_profile",
    "fit_step_time",
    "shipped_profiles",
]
