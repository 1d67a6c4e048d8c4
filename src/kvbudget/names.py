"""Bounded names: the tenants and tasks a client may invent collapse into a bounded set.

Every server hands the budget names a client wrote (``X-KVBudget-Tenant``, ``X-KVBudget-Task``,
gRPC fields). The core keeps state per name: counters per (class, tenant), a tenant queue per
tenant, length-model histograms per calibration key, Prometheus series per label value. Left
alone, a client that invents a new name per request grows all of them, and every scrape, without
bound, and spreads its load over many tenants to game weighted fairness.

A :class:`NameFolder` (one per :class:`~kvbudget.Budget`, applied where the budget takes a
request's spec, so every server and embedder is covered) keeps:

* ``default`` and every name the operator configured (``NameLimits.known_tenants``/
  ``known_tasks``, the keys of ``SchedulerConfig.tenant_weights``, the tenants of an API-keys
  file) as it is, always;
* the first ``max_tenants`` (``max_tasks``) other names it sees, as they are, for the life of
  the budget (first come, not most active: a name that was counted keeps its series, so
  Prometheus counters never move between labels);
* everything else, and any name longer than ``max_name_length``, as ``other`` (``NameLimits.
  other``), counted in :attr:`NameFolder.folded` (exported as ``kvbudget_folded_names_total``).

Service classes need no folding: a class the budget was not configured with is refused
(``UnknownClass``, HTTP 400).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final, Literal

import attrs

from kvbudget.core.model import RequestSpec
from kvbudget.errors import InvalidInput
from kvbudget.validate import integer

NameKind = Literal["tenant", "task"]
KINDS: Final[tuple[NameKind, ...]] = ("tenant", "task")

#: default limits (documented in docs/operations.md)
DEFAULT_MAX_TENANTS: Final = 64
DEFAULT_MAX_TASKS: Final = 64
DEFAULT_MAX_NAME_LENGTH: Final = 128
DEFAULT_OTHER: Final = "other"


def _names(value: Iterable[str] | None) -> frozenset[str]:
    if value is None:
        return frozenset()
    if isinstance(value, str):
        return frozenset([value])
    return frozenset(value)


def _check_names(_inst: object, attr: Any, value: frozenset[str]) -> None:
    for name in value:
        if not isinstance(name, str) or not name:
            raise InvalidInput(attr.name, name, "non-empty strings")


def _check_other(_inst: object, _attr: object, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidInput("other", value, "a non-empty string")


@attrs.frozen(slots=True)
class NameLimits:
    """How many client-chosen names the budget keeps apart.

    ``max_tenants``/``max_tasks``: names kept as they are beyond the configured ones (first
    seen, first kept; 0: every unconfigured name is ``other``). ``max_name_length``: a longer
    name is folded whatever the count. ``other``: the name the rest are folded into.
    ``known_tenants``/``known_tasks``: configured names, always kept (the budget adds the keys
    of ``SchedulerConfig.tenant_weights``).
    """

    max_tenants: int = attrs.field(default=DEFAULT_MAX_TENANTS, validator=integer(0))
    max_tasks: int = attrs.field(default=DEFAULT_MAX_TASKS, validator=integer(0))
    max_name_length: int = attrs.field(
        default=DEFAULT_MAX_NAME_LENGTH, validator=integer(0)
    )
    other: str = attrs.field(default=DEFAULT_OTHER, validator=_check_other)
    known_tenants: frozenset[str] = attrs.field(
        default=frozenset(), converter=_names, validator=_check_names
    )
    known_tasks: frozenset[str] = attrs.field(
        default=frozenset(), converter=_names, validator=_check_names
    )

    def limit(self, kind: NameKind) -> int:
        return self.max_tenants if kind == "tenant" else self.max_tasks

    def known(self, kind: NameKind) -> frozenset[str]:
        return self.known_tenants if kind == "tenant" else self.known_tasks

    def with_known(
        self, tenants: Iterable[str] = (), tasks: Iterable[str] = ()
    ) -> NameLimits:
        """These limits with more configured names."""
        return attrs.evolve(
            self,
            known_tenants=self.known_tenants | frozenset(tenants),
            known_tasks=self.known_tasks | frozenset(tasks),
        )


class NameFolder:
    """Folds the tenants and tasks of request specs into the bounded set :class:`NameLimits`
    allows. Its memory is bounded: at most ``max_tenants + max_tasks`` names beyond the
    configured ones."""

    __slots__ = ("_seen", "folded", "limits")

    def __init__(self, limits: NameLimits | None = None) -> None:
        self.limits = limits if limits is not None else NameLimits()
        self._seen: dict[NameKind, set[str]] = {kind: set() for kind in KINDS}
        #: requests whose name of each kind was folded into ``other``
        self.folded: dict[NameKind, int] = dict.fromkeys(KINDS, 0)

    def fold_name(self, kind: NameKind, name: str) -> str:
        """``name`` if it is configured, already kept or a slot is free; else ``other``."""
        limits = self.limits
        if name == limits.other or name == "default" or name in limits.known(kind):
            return name
        seen = self._seen[kind]
        if name in seen:
            return name
        if len(name) <= limits.max_name_length and len(seen) < limits.limit(kind):
            seen.add(name)
            return name
        self.folded[kind] += 1
        return limits.other

    def fold(self, spec: RequestSpec) -> RequestSpec:
        """``spec`` with its tenant and task folded (the same object when nothing changes)."""
        tenant = self.fold_name("tenant", spec.tenant)
        task = self.fold_name("task", spec.task)
        if tenant == spec.tenant and task == spec.task:
            return spec
        return attrs.evolve(spec, tenant=tenant, task=task)

    def kept(self, kind: NameKind) -> int:
        """Unconfigured names of ``kind`` kept apart so far (at most the limit)."""
        return len(self._seen[kind])

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (servers add it to their snapshot document as ``names``)."""
        lim = self.limits
        return {
            kind: {
                "kept": self.kept(kind),
                "limit": lim.limit(kind),
                "configured": len(lim.known(kind)),
                "folded_requests": self.folded[kind],
            }
            for kind in KINDS
        } | {"other": lim.other, "max_name_length": lim.max_name_length}


__all__ = [
    "DEFAULT_MAX_NAME_LENGTH",
    "DEFAULT_MAX_TASKS",
    "DEFAULT_MAX_TENANTS",
    "DEFAULT_OTHER",
    "KINDS",
    "NameFolder",
    "NameKind",
    "NameLimits",
]
