"""The policy options every server shares on its command line (the examples' servers and
``kvbudget serve``): the first-token pause share and pause limit of the calibrated policy,
parsed, and the policy a server then runs. Kept apart from :mod:`kvbudget.cli`, which imports
the servers."""

from __future__ import annotations

import argparse
from typing import Any, Final

from kvbudget.core.policy import make_policy
from kvbudget.core.policy.base import Policy
from kvbudget.core.policy.calibrated import FIRST_TOKEN_PAUSE_LIMIT_S, FIRST_TOKEN_PAUSE_SHARE
from kvbudget.errors import InvalidInput

__all__ = [
    "POLICY_DEFAULT",
    "add_policy_options",
    "seconds_or_off",
    "server_policy",
    "share_or_off",
]

#: ``--first-token-pause-share default`` (and not given): the policy's own setting
POLICY_DEFAULT: Final = "default"


def share_or_off(text: str) -> float | str | None:
    """An ``argparse`` type: ``off`` (None), ``default`` (:data:`POLICY_DEFAULT`) or a share in
    (0, 1]."""
    if text == "off":
        return None
    if text == POLICY_DEFAULT:
        return POLICY_DEFAULT
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < v <= 1.0:  # (NaN and inf fail it too)
        raise argparse.ArgumentTypeError(f"expected a share in (0, 1] or 'off', got {text!r}")
    return v


def seconds_or_off(text: str) -> float | str | None:
    """An ``argparse`` type: ``off`` (None), ``default`` (:data:`POLICY_DEFAULT`) or a finite
    number of seconds >= 0."""
    if text in ("off", POLICY_DEFAULT):
        return None if text == "off" else POLICY_DEFAULT
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0.0 <= v <= 3600.0:  # (NaN and inf fail it too)
        raise argparse.ArgumentTypeError(f"expected seconds in [0, 3600] or 'off', got {text!r}")
    return v


def add_policy_options(parser: Any, prefix: str = "--") -> None:
    """The servers' options for :class:`~kvbudget.core.policy.calibrated.CalibratedPolicy`'s
    ``first_token_pause_share`` and ``first_token_pause_limit_s``: ``{prefix}first-token-pause-
    share`` and ``{prefix}first-token-pause-limit`` (read back with :func:`server_policy`)."""
    parser.add_argument(
        f"{prefix}first-token-pause-share", type=share_or_off, default=POLICY_DEFAULT,
        metavar="S|off|default",
        help="calibrated policy: pause running streams for a fresh interactive caller once its "
             "queue slack falls to this share of its first-token objective; off: never (for a "
             "per-token latency SLO, where a stall costs more than a late first token). "
             f"Default: the policy's ({FIRST_TOKEN_PAUSE_SHARE})",
    )
    parser.add_argument(
        f"{prefix}first-token-pause-limit", type=seconds_or_off, default=POLICY_DEFAULT,
        metavar="SECONDS|off|default",
        help="calibrated policy: a stream paused longer than this resumes before any fresh "
             "caller, taking the turn of a stream that has run as long, and no stream is paused "
             "for a first token meanwhile: shorter freezes, more callers told 'overloaded' "
             "(a target: a freeze also waits for the pause's confirmation and a re-prefill). "
             f"off: no limit. Default: the policy's ({FIRST_TOKEN_PAUSE_LIMIT_S or 'off'})",
    )


def server_policy(
    name: str,
    first_token_pause_share: float | str | None = POLICY_DEFAULT,
    first_token_pause_limit: float | str | None = POLICY_DEFAULT,
) -> Policy | str:
    """The policy a server runs: ``name``, with the settings not :data:`POLICY_DEFAULT`; only
    the calibrated policy has them."""
    settings = {
        field: value
        for field, value in (
            ("first_token_pause_share", first_token_pause_share),
            ("first_token_pause_limit_s", first_token_pause_limit),
        )
        if value != POLICY_DEFAULT
    }
    if not settings:
        return name
    if name != "calibrated":
        field, value = next(iter(settings.items()))
        raise InvalidInput(
            field, value, f"a setting of the calibrated policy only (the policy is {name!r})"
        )
    return make_policy(name, **settings)
