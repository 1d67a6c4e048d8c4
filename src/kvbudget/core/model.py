"""The value types of the core: capacity, service classes, request specs, checkpoints.

Everything here is a frozen, slotted attrs class that validates itself on construction, so a
bad value is refused with :class:`~kvbudget.errors.InvalidInput` naming the field and the
accepted range before it can reach the ledger.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from kvbudget.core.resume import Checkpoint as Checkpoint
from kvbudget.core.resume import Continuation as Continuation
from kvbudget.errors import InvalidInput, UnknownClass

OnExhausted = Literal["extend", "continue"]
StopReason = Literal["stop", "length"]


def check_int(field: str, value: Any, *, minimum: int = 0, maximum: int | None = None) -> int:
    """Return ``value`` if it is an int in ``[minimum, maximum]``, else raise InvalidInput."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(field, value, f"an integer >= {minimum}")
    if value < minimum or (maximum is not None and value > maximum):
        rng = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise InvalidInput(field, value, f"an integer {rng}")
    return value


def check_float(
    field: str,
    value: Any,
    *,
    minimum: float = 0.0,
    maximum: float | None = None,
    open_min: bool = False,
    open_max: bool = False,
) -> float:
    """Return ``value`` as float if finite and in range, else raise InvalidInput."""
    lo = "(" if open_min else "["
    hi = ")" if open_max else "]"
    rng = f"in {lo}{minimum}, {'inf' if maximum is None else maximum}{hi}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(field, value, f"a finite number {rng}")
    v = float(value)
    if not math.isfinite(v):
        raise InvalidInput(field, value, f"a finite number {rng}")
    if v < minimum or (open_min and v == minimum):
        raise InvalidInput(field, value, f"a number {rng}")
    if maximum is not None and (v > maximum or (open_max and v == maximum)):
        raise InvalidInput(field, value, f"a number {rng}")
    return v


def _positive_int(field: str) -> Any:
    def validate(_inst: object, _attr: object, value: Any) -> None:
        check_int(field, value, minimum=1)

    return validate


def _nonneg_int(field: str) -> Any:
    def validate(_inst: object, _attr: object, value: Any) -> None:
        check_int(field, value, minimum=0)

    return validate


def _quantile(field: str) -> Any:
    def validate(_inst: object, _attr: object, value: Any) -> None:
        check_float(field, value, minimum=0.0, maximum=1.0, open_min=True, open_max=True)

    return validate


def _fraction(field: str) -> Any:
    def validate(_inst: object, _attr: object, value: Any) -> None:
        check_float(field, value, minimum=0.0, maximum=1.0)

    return validate


def _optional_seconds(field: str) -> Any:
    def validate(_inst: object, _attr: object, value: Any) -> None:
        if value is not None:
            check_float(field, value, minimum=0.0, open_min=True)

    return validate


def _name(field: str) -> Any:
    def validate(_inst: object, _attr: object, value: Any) -> None:
        if not isinstance(value, str) or not value:
            raise InvalidInput(field, value, "a non-empty string")

    return validate


def blocks_for(tokens: int, block_size: int) -> int:
    """Whole blocks needed to hold ``tokens`` tokens (the engine rounds up too)."""
    return -(-tokens // block_size)


@attrs.frozen(slots=True)
class Capacity:
    """The KV cache the budget divides: ``blocks`` blocks of ``block_size`` tokens each."""

    blocks: int = attrs.field(validator=_positive_int("blocks"))
    block_size: int = attrs.field(validator=_positive_int("block_size"))

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size


@attrs.frozen(slots=True)
class ServiceClass:
    """How a class of requests is treated.

    ``priority``: lower is served first. ``initial_quantile``: the quantile of the output-length
    distribution granted at admission. ``extension_quantile``: the conditional quantile an
    extension aims to cover. ``max_extension_tokens``: the largest single extension.
    ``protected``: may draw the protected headroom and preempt preemptible work.
    ``preemptible``: may be checkpointed to make room for protected classes.
    ``latency_floor_s``: the slowest inter-token interval an active stream of this class may be
    pushed to (None: no floor). ``ttft_slo_s``: time-to-first-token objective; a caller still
    queued when the objective less its predicted prefill has passed is turned away.
    ``max_queue_delay_s``: a caller waiting longer than this for admission is turned away (None:
    only its own deadline and first-token objective bound the wait). ``default_deadline_s``:
    completion deadline when the request gives none.
    """

    name: str = attrs.field(validator=_name("name"))
    priority: int = attrs.field(default=0, validator=_nonneg_int("priority"))
    initial_quantile: float = attrs.field(default=0.9, validator=_quantile("initial_quantile"))
    extension_quantile: float = attrs.field(default=0.9, validator=_quantile("extension_quantile"))
    max_extension_tokens: int = attrs.field(
        default=512, validator=_positive_int("max_extension_tokens")
    )
    protected: bool = False
    preemptible: bool = True
    latency_floor_s: float | None = attrs.field(
        default=None, validator=_optional_seconds("latency_floor_s")
    )
    ttft_slo_s: float | None = attrs.field(default=None, validator=_optional_seconds("ttft_slo_s"))
    max_queue_delay_s: float | None = attrs.field(
        default=None, validator=_optional_seconds("max_queue_delay_s")
    )
    default_deadline_s: float | None = attrs.field(
        default=None, validator=_optional_seconds("default_deadline_s")
    )


INTERACTIVE = ServiceClass(
    "interactive",
    priority=0,
    initial_quantile=0.5,
    extension_quantile=0.5,
    max_extension_tokens=512,
    protected=True,
    preemptible=False,
    latency_floor_s=0.2,
    ttft_slo_s=2.0,
    max_queue_delay_s=2.0,
)
BATCH = ServiceClass(
    "batch",
    priority=1,
    initial_quantile=0.5,
    extension_quantile=0.75,
    max_extension_tokens=1024,
    protected=False,
    preemptible=True,
    latency_floor_s=None,
    ttft_slo_s=None,
    max_queue_delay_s=None,
    default_deadline_s=600.0,
)
DEFAULT_CLASSES: tuple[ServiceClass, ...] = (INTERACTIVE, BATCH)


def class_table(
    classes: Mapping[str, ServiceClass] | tuple[ServiceClass, ...] | list[ServiceClass] | None,
) -> dict[str, ServiceClass]:
    """Normalise a class collection to a name → class dict (defaults when None)."""
    if classes is None:
        classes = DEFAULT_CLASSES
    if isinstance(classes, Mapping):
        table = dict(classes)
        for name, cls in table.items():
            if cls.name != name:
                raise InvalidInput("classes", name, f"the key to equal the class name {cls.name!r}")
    else:
        table = {}
        for cls in classes:
            if not isinstance(cls, ServiceClass):
                raise InvalidInput("classes", cls, "ServiceClass instances")
            if cls.name in table:
                raise InvalidInput("classes", cls.name, "unique class names")
            table[cls.name] = cls
    if not table:
        raise InvalidInput("classes", classes, "at least one service class")
    return table


def lookup_class(table: Mapping[str, ServiceClass], name: str) -> ServiceClass:
    try:
        return table[name]
    except KeyError:
        raise UnknownClass(name, sorted(table)) from None


@attrs.frozen(slots=True)
class CalibrationKey:
    """What a request's output length is predicted from (DESIGN §6)."""

    model: str = "default"
    task: str = "default"
    service_class: str = "interactive"
    tenant: str = "default"
    sampling: str = "default"
    stops: str = "default"


def _bool(field: str) -> Any:
    def validate(_inst: object, _attr: object, value: Any) -> None:
        if not isinstance(value, bool):
            raise InvalidInput(field, value, "True or False")

    return validate


def _check_on_exhausted(_inst: object, _attr: object, value: Any) -> None:
    if value not in ("extend", "continue"):
        raise InvalidInput("on_exhausted", value, "'extend' or 'continue'")


@attrs.frozen(slots=True)
class RequestSpec:
    """What the application knows about a request when it arrives.

    ``max_tokens`` is the product ceiling, not a forecast; the hard maximum is
    ``min(max_tokens, model_max_len - prompt_tokens)`` and is never exceeded. A prompt that
    leaves no room under ``model_max_len`` is refused here. ``deadline`` is in seconds from
    arrival (None: the class default). ``on_exhausted="continue"`` lets the request end with an
    explicit continuation when its grant cannot grow, instead of waiting. ``resumable=False``:
    the engine cannot resume this request from a checkpoint without changing what it produces
    (its sampling state would not carry across a re-prefill: a per-request seed, penalties over
    the output, structured output, logits processors, a stop string across the seam), so it is
    admitted only with a grant to its hard max, never paused and never preempted.
    """

    prompt_tokens: int = attrs.field(validator=_positive_int("prompt_tokens"))
    max_tokens: int = attrs.field(validator=_positive_int("max_tokens"))
    model_max_len: int = attrs.field(validator=_positive_int("model_max_len"))
    service_class: str = attrs.field(default="interactive", validator=_name("service_class"))
    tenant: str = attrs.field(default="default", validator=_name("tenant"))
    task: str = attrs.field(default="default", validator=_name("task"))
    model: str = attrs.field(default="default", validator=_name("model"))
    sampling: str = attrs.field(default="default", validator=_name("sampling"))
    stops: str = attrs.field(default="default", validator=_name("stops"))
    durable: bool = False
    on_exhausted: OnExhausted = attrs.field(default="extend", validator=_check_on_exhausted)
    deadline: float | None = attrs.field(default=None, validator=_optional_seconds("deadline"))
    resumable: bool = attrs.field(default=True, validator=_bool("resumable"))

    def __attrs_post_init__(self) -> None:
        if self.prompt_tokens >= self.model_max_len:
            raise InvalidInput(
                "prompt_tokens",
                self.prompt_tokens,
                f"fewer than model_max_len={self.model_max_len} tokens, so at least one output "
                "token fits",
            )

    @property
    def hard_max(self) -> int:
        """The most output tokens this request may ever generate."""
        return min(self.max_tokens, self.model_max_len - self.prompt_tokens)

    @property
    def calibration_key(self) -> CalibrationKey:
        return CalibrationKey(
            model=self.model,
            task=self.task,
            service_class=self.service_class,
            tenant=self.tenant,
            sampling=self.sampling,
            stops=self.stops,
        )
