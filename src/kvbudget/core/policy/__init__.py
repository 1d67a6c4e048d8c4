"""Policies: the decisions a scheduler delegates, kvbudget's own and the baselines.

``base`` (the :class:`Policy` protocol, :class:`BasePolicy`, :class:`Blocked`), ``calibrated``
(:class:`CalibratedPolicy`, the default), ``baselines`` (the engines' own rules); here, the
registry of shipped policies by name.
"""

from __future__ import annotations

from kvbudget.core.policy.base import BasePolicy, Blocked, Policy
from kvbudget.core.policy.baselines import (
    NewTokenRatioPolicy,
    OraclePolicy,
    PastFuturePolicy,
    ReserveCurrentPolicy,
    ReserveMaxPolicy,
    SegmentedPolicy,
)
from kvbudget.core.policy.calibrated import CalibratedPolicy
from kvbudget.errors import InvalidInput, UnknownPolicy

POLICIES: dict[str, type[BasePolicy]] = {
    cls.name: cls
    for cls in (
        CalibratedPolicy,
        ReserveMaxPolicy,
        SegmentedPolicy,
        ReserveCurrentPolicy,
        NewTokenRatioPolicy,
        PastFuturePolicy,
        OraclePolicy,
    )
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def make_policy(name: str, **kwargs: object) -> Policy:
    """Build a shipped policy by name (``calibrated``, ``reserve-max``, ...)."""
    if not isinstance(name, str):
        raise InvalidInput("policy", name, f"a policy name, one of {', '.join(POLICY_NAMES)}")
    try:
        cls = POLICIES[name]
    except KeyError:
        raise UnknownPolicy(name, POLICY_NAMES) from None
    policy: Policy = cls(**kwargs)
    return policy


def resolve_policy(policy: Policy | str | None) -> Policy:
    if policy is None:
        return CalibratedPolicy()
    if isinstance(policy, str):
        return make_policy(policy)
    for attr in ("name", "initial_allowance", "on_blocked", "bind"):
        if not hasattr(policy, attr):
            raise InvalidInput("policy", policy, f"a Policy (missing {attr!r}) or a policy name")
    return policy


__all__ = [
    "POLICIES",
    "POLICY_NAMES",
    "BasePolicy",
    "Blocked",
    "CalibratedPolicy",
    "NewTokenRatioPolicy",
    "OraclePolicy",
    "PastFuturePolicy",
    "Policy",
    "ReserveCurrentPolicy",
    "ReserveMaxPolicy",
    "SegmentedPolicy",
    "make_policy",
    "resolve_policy",
]
