"""Input validation, once: range checks and the attrs validators built on them.

Every value class of kvbudget (the core's model, ``SchedulerConfig``, the simulator's scenario)
validates itself on construction with these, so a bad value is refused with
:class:`~kvbudget.errors.InvalidInput` naming the field, the value and what is accepted. The
validators name the field after the attribute unless given another name (``"wave.at_s"``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

from kvbudget.errors import InvalidInput

Validator = Callable[[Any, Any, Any], None]


def check_int(field: str, value: Any, *, minimum: int = 0, maximum: int | None = None) -> int:
    """Return ``value`` if it is an int in ``[minimum, maximum]``, else raise InvalidInput."""
    if value.__class__ is int and value >= minimum and maximum is None:
        return value  # (the common case, on the core's hot paths: a plain int, no upper bound)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(field, value, f"an integer >= {minimum}")
    if value < minimum or (maximum is not None and value > maximum):
        rng = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise InvalidInput(field, value, f"an integer {rng}")
    return value


def whole(value: Any) -> int | None:
    """``value`` as an int if it is a whole number (an int, a NumPy integer), else None (a
    float, a NaN, a bool, anything else): for a policy's answers, which are refused, not
    raised on, when they are not (a NaN would compare false with every bound)."""
    if value.__class__ is int:
        return value  # (the common answer, asked several times per admission and extension)
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


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


def _field(attribute: Any, name: str | None) -> str:
    return name if name is not None else str(attribute.name)


def integer(minimum: int = 0, maximum: int | None = None, *, name: str | None = None) -> Validator:
    """An int in ``[minimum, maximum]``."""

    def validate(_inst: Any, attribute: Any, value: Any) -> None:
        check_int(_field(attribute, name), value, minimum=minimum, maximum=maximum)

    return validate


def number(
    minimum: float = 0.0,
    maximum: float | None = None,
    *,
    open_min: bool = False,
    open_max: bool = False,
    name: str | None = None,
) -> Validator:
    """A finite number in the range (open or closed at either end)."""

    def validate(_inst: Any, attribute: Any, value: Any) -> None:
        check_float(
            _field(attribute, name),
            value,
            minimum=minimum,
            maximum=maximum,
            open_min=open_min,
            open_max=open_max,
        )

    return validate


def quantile(*, name: str | None = None) -> Validator:
    """A number strictly between 0 and 1."""
    return number(0.0, 1.0, open_min=True, open_max=True, name=name)


def fraction(*, name: str | None = None) -> Validator:
    """A number in [0, 1]."""
    return number(0.0, 1.0, name=name)


def seconds(*, name: str | None = None) -> Validator:
    """A finite duration > 0 (seconds)."""
    return positive(name=name)


def positive(*, name: str | None = None) -> Validator:
    """A finite number > 0."""
    return number(0.0, open_min=True, name=name)


def nonnegative(*, name: str | None = None) -> Validator:
    """A finite number >= 0."""
    return number(0.0, name=name)


def optional(validator: Validator) -> Validator:
    """None, or what ``validator`` accepts."""

    def validate(inst: Any, attribute: Any, value: Any) -> None:
        if value is not None:
            validator(inst, attribute, value)

    return validate


def text(*, name: str | None = None) -> Validator:
    """A non-empty string."""

    def validate(_inst: Any, attribute: Any, value: Any) -> None:
        if not isinstance(value, str) or not value:
            raise InvalidInput(_field(attribute, name), value, "a non-empty string")

    return validate


def boolean(*, name: str | None = None) -> Validator:
    """True or False (not a truthy value)."""

    def validate(_inst: Any, attribute: Any, value: Any) -> None:
        if not isinstance(value, bool):
            raise InvalidInput(_field(attribute, name), value, "True or False")

    return validate


def one_of(*choices: Any, expected: str | None = None, name: str | None = None) -> Validator:
    """One of ``choices`` (compared by equality; ``expected`` describes them)."""
    described = expected or " or ".join(repr(c) for c in choices)

    def validate(_inst: Any, attribute: Any, value: Any) -> None:
        if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
            raise InvalidInput(_field(attribute, name), value, described)

    return validate


__all__ = [
    "Validator",
    "boolean",
    "check_float",
    "check_int",
    "fraction",
    "integer",
    "nonnegative",
    "number",
    "one_of",
    "optional",
    "positive",
    "quantile",
    "seconds",
    "text",
]
