"""The policy options every server shares on its command line (the examples' servers and
``kvbudget serve``): the first-token pause share of the calibrated policy, parsed, and the
policy a server then runs. Kept apart from :mod:`kvbudget.cli`, which imports the servers."""

from __future__ import annotations

import argparse
from typing import Any, Final

from kvbudget.core.policy import make_policy
from kvbudget.core.policy.base import Policy
from kvbudget.core.policy.calibrated import FIRST_TOKEN_PAUSE_SHARE
from kvbudget.errors import InvalidInput

__all__ = ["POLICY_DEFAULT", "add_first_token_pause_option", "server_policy", "share_or_off"]

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


def add_first_token_pause_option(parser: Any, flag: str = "--first-token-pause-share") -> None:
    """The servers' option for :class:`~kvbudget.core.policy.calibrated.CalibratedPolicy`'s
    ``first_token_pause_share`` (read back with :func:`server_policy`)."""
    parser.add_argument(
        flag, type=share_or_off, default=POLICY_DEFAULT, metavar="S|off|default",
        help="calibrated policy: pause running streams for a fresh interactive caller once its "
             "queue slack falls to this share of its first-token objective (where a late first "
             "token costs more than a stall of seconds in a stream already answering); off: "
             f"never. Default: the policy's (off; {FIRST_TOKEN_PAUSE_SHARE} to turn them on)",
    )


def server_policy(name: str, first_token_pause_share: float | str | None) -> Policy | str:
    """The policy a server runs: ``name``, with ``first_token_pause_share`` unless it is
    :data:`POLICY_DEFAULT`; only the calibrated policy has that setting."""
    if first_token_pause_share == POLICY_DEFAULT:
        return name
    if name != "calibrated":
        raise InvalidInput(
            "first_token_pause_share", first_token_pause_share,
            f"a setting of the calibrated policy only (the policy is {name!r})",
        )
    return make_policy(name, first_token_pause_share=first_token_pause_share)
