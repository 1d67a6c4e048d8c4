"""The checks of DESIGN §4, one function per invariant, against the harness's shadow records.

This module owns the assertions that make the harness a test. Each function takes the scheduler
and what the harness recorded itself (its :class:`~kvbudget.testing.machine.Shadow` of every
request, the engine-side KV of stopped instances, the slack it configured) and checks one
invariant without trusting the ledger's bookkeeping; its message carries the marker ``(inv. N)``
where the harness has always printed one.

When they run (:class:`~kvbudget.testing.machine.BudgetStateMachine`):

* after every step, :meth:`~kvbudget.testing.machine.BudgetStateMachine.verify` runs
  :func:`core_matches_shadow` (not a §4 item: the core's records agree with the shadow, so that
  the checks are about the core) and the checks of 1, 2, 3, 4 and 7, in that order;
* at each Admit or Extend, while the actions of a call are replayed against the free blocks:
  :func:`grant_fits` (1) and :func:`protected_headroom_kept` (5);
* at teardown, once everything was driven to its end: :func:`ended_exactly_once` (6).

The checks that need the action in hand (an Admit's boundary under the hard max, a Released
only after a confirmation, a Preempt's checkpoint, a Continue's consent, a second end) stay in
the machine's replay of that action, with the same markers.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import TYPE_CHECKING

from kvbudget.core import events as ev
from kvbudget.core.lifecycle import LIVE_STATES, State
from kvbudget.core.model import blocks_for
from kvbudget.core.scheduler import Scheduler
from kvbudget.core.stats import Snapshot

if TYPE_CHECKING:
    from kvbudget.testing.shadow import Shadow

__all__ = [
    "charged_blocks",
    "core_matches_shadow",
    "ended_exactly_once",
    "grant_fits",
    "idle_requests_cost_nothing",
    "protected_headroom_kept",
    "reserved_within_capacity",
    "shared_blocks_charged_once",
    "stopped_blocks_wait_for_confirmation",
    "tokens_within_grant",
    "within_hard_max",
]

_OVER = ("ended", "rejected")  # phases of a request the core has forgotten


def _known(shadows: Collection[Shadow]) -> Iterator[Shadow]:
    """The requests the core still knows (every phase but ended and rejected)."""
    return (sh for sh in shadows if sh.phase not in _OVER)


# -- not a §4 item: the core's records agree with the shadow --------------------------------------


def core_matches_shadow(
    s: Scheduler,
    snap: Snapshot,
    shadows: Collection[Shadow],
    *,
    admitted: int,
    preempted: int,
    rejected: int,
    first_tokens: int,
) -> None:
    """Every request the harness sent is where the harness says (state, tokens, boundary,
    blocks), and the snapshot counts what the harness counted (``admitted``, ``preempted``,
    ``rejected``: the Admit, Preempt and Reject actions it received; ``first_tokens``: callers'
    own first tokens under a first-token objective that it sent and the caller receives)."""
    counts = {p: 0 for p in ("queued", "running", "stopped", "checkpointed")}
    for sh in shadows:
        req = s.requests.get(sh.rid)
        if sh.phase in counts:
            counts[sh.phase] += 1
        if sh.phase in _OVER:
            assert req is None, f"{sh.rid} is {sh.phase} but the core still has {req!r}"
            continue
        assert req is not None, f"{sh.rid} ({sh.phase}) is unknown to the core"
        assert req.blocks == sh.blocks, (req, sh.blocks)
        assert req.generated == sh.generated, (req, sh.generated)
        if sh.phase == "running":
            assert req.state in LIVE_STATES, (req, sh.phase)
        elif sh.phase == "stopped":
            want = State.PREEMPTING if sh.preempted_to_resume else State.RELEASING
            assert req.state is want, (req, want)
        elif sh.phase == "queued":
            assert req.state is State.QUEUED, req
        else:
            assert req.state is State.CHECKPOINTED, req
        if sh.phase in ("running", "stopped"):
            assert req.boundary == sh.boundary, (req, sh.boundary)
    assert snap.active == counts["running"] == s.active, (snap.active, counts)
    assert snap.queued == counts["queued"] + counts["checkpointed"], (snap.queued, counts)
    assert snap.releasing == counts["stopped"], (snap.releasing, counts)
    assert snap.totals.admitted == admitted, (snap.totals.admitted, admitted)
    assert snap.totals.preemptions == preempted
    assert snap.totals.rejected == rejected, (snap.totals.rejected, rejected)
    # (a caller's own first token is counted once, whatever pauses and resumes it went through)
    t = snap.totals
    assert t.first_tokens == first_tokens, (t.first_tokens, first_tokens)
    assert t.first_tokens_late <= t.first_tokens <= t.arrived, (t.first_tokens, t.arrived)


# -- 1 ----------------------------------------------------------------------------------------


def reserved_within_capacity(s: Scheduler, snap: Snapshot, shadows: Collection[Shadow]) -> None:
    """1. Reserved blocks (grants + headroom in use) never exceed capacity; all pools add up to
    capacity.

    The blocks the harness saw granted (Admit/Extend minus Released) add up to
    ``ledger.reserved`` (a prompt block that several holders name, once: 8), which is
    ``<= capacity``, and ``reserved + free == capacity`` (in the
    ledger and in its snapshot)."""
    led = s.ledger
    cap = s.capacity
    held = charged_blocks([sh for sh in shadows if sh.blocks])
    assert held == led.reserved, (
        f"harness sees {held} blocks granted, ledger {led.reserved} (inv. 1)"
    )
    assert 0 <= led.reserved <= cap.blocks, (led.reserved, cap.blocks)
    assert led.reserved + led.free == cap.blocks
    assert snap.reserved_blocks == held and snap.free_blocks == cap.blocks - held


def charged_blocks(holders: Collection[Shadow]) -> int:
    """What ``holders`` (requests holding a grant) are charged together: each one's own blocks,
    and each prompt block any of them names once."""
    prefix: set[int] = set()
    own = 0
    for sh in holders:
        own += sh.own_blocks
        prefix.update(sh.prefix)
    return own + len(prefix)


def grant_fits(a: ev.Admit | ev.Extend, free: int) -> None:
    """1, at the grant: ``free`` (the free blocks replayed up to and including ``a``) stays
    ``>= 0``."""
    assert free >= 0, f"{a!r} over-commits: free would be {free} (inv. 1)"


# -- 2 ----------------------------------------------------------------------------------------


def within_hard_max(s: Scheduler, shadows: Collection[Shadow], slack: int) -> None:
    """2. No request generates past its hard max; a spec whose prompt already leaves no room is
    refused at once.

    No request generated past its hard max, no boundary passes it, and no grant holds more than
    ``blocks_for(prompt + hard_max + slack)`` blocks. (The refusal of a spec with no room is the
    ``no-room`` case of the ``arrive_invalid`` rule; each Admit/Extend's boundary is checked
    against the hard max as it is replayed.)"""
    bs = s.capacity.block_size
    for sh in _known(shadows):
        prompt, hard = sh.spec.prompt_tokens, sh.spec.hard_max
        req = s.requests[sh.rid]
        assert sh.generated <= hard, (req, sh.generated)
        assert req.boundary <= hard, req
        assert sh.blocks <= blocks_for(prompt + hard + slack, bs), (
            f"{sh.rid} holds {sh.blocks} blocks, more than its hard max needs (inv. 2)"
        )


# -- 3 ----------------------------------------------------------------------------------------


def tokens_within_grant(s: Scheduler, shadows: Collection[Shadow], slack: int) -> None:
    """3. Tokens charged to a grant never exceed the blocks it holds, beyond a bounded, reserved
    slack.

    Every holding request (running or stopped) has ``generated <= boundary + slack`` and
    ``blocks >= blocks_for(prompt + generated)``."""
    bs = s.capacity.block_size
    for sh in _known(shadows):
        if sh.phase not in ("running", "stopped"):
            continue
        req = s.requests[sh.rid]
        assert sh.generated <= sh.boundary + slack, (req, sh.boundary, slack)
        assert sh.blocks >= blocks_for(sh.spec.prompt_tokens + sh.generated, bs), req


# -- 4 ----------------------------------------------------------------------------------------


def stopped_blocks_wait_for_confirmation(
    s: Scheduler,
    snap: Snapshot,
    shadows: Collection[Shadow],
    stale: Mapping[tuple[str, int], int],
) -> None:
    """4. Blocks of a stopped request return to the budget only after the engine confirms; an
    unconfirmed abort keeps its blocks charged and is counted.

    A holding request keeps its blocks; the KV the engine still holds for stopped requests
    (``stale``: blocks by (request id, stop instance)) never exceeds what the ledger still
    charges for them; the stops the harness left unconfirmed past the timeout are flagged and
    counted. (A Released only after the confirmation, or after reconciliation once the engine
    freed the KV, is checked as each Released is replayed.)"""
    stale_ledger = 0
    unconf = 0
    for sh in _known(shadows):
        req = s.requests[sh.rid]
        if sh.phase == "stopped":
            stale_ledger += sh.blocks
            unconf += sh.unconfirmed
            assert req.unconfirmed == sh.unconfirmed, (
                f"{req!r}: unconfirmed={req.unconfirmed}, harness says {sh.unconfirmed} (inv. 4)"
            )
        if sh.phase in ("running", "stopped"):
            assert sh.blocks > 0, (
                req,
                "a stopped request lost its blocks unconfirmed (inv. 4)",
            )
    stale_engine = sum(stale.values())
    stale_ledger -= sum(len(sh.prefix) for sh in _known(shadows) if sh.phase == "stopped")
    assert stale_engine <= stale_ledger, (
        f"the engine still holds {stale_engine} blocks of stopped requests, the ledger "
        f"charges only {stale_ledger} (inv. 4)"
    )
    assert snap.unconfirmed_releasing == unconf, (snap.unconfirmed_releasing, unconf)


# -- 5 ----------------------------------------------------------------------------------------


def protected_headroom_kept(sh: Shadow, a: ev.Admit | ev.Extend, free: int, protected: int) -> None:
    """5. Protected interactive headroom is never granted to batch work.

    No grant or extension ``a`` of an unprotected class leaves ``free`` (the free blocks replayed
    up to and including ``a``) below the ledger's protected blocks. ``protected``: the least
    the protected part was during the call that made ``a`` (a call may run several passes, and
    the policy may size the part anew in each: a batch grant made under a smaller part is not
    taken back when a later pass grows it)."""
    if not sh.cls.protected:
        assert free >= protected, (
            f"{a!r} of unprotected {sh.rid} leaves {free} < protected "
            f"{protected} free blocks (inv. 5)"
        )


# -- 6 ----------------------------------------------------------------------------------------


def ended_exactly_once(shadows: Collection[Shadow]) -> None:
    """6. Every admitted request ends in exactly one way: completed (stop or hard max),
    cancelled, preempted-then-resumed, continued, or failed — and never with a silent truncation
    below its hard max.

    At teardown: every admitted request ended exactly once, and one that stopped short of its
    true length says why (completed at its true length or its hard max, continued with a
    Continue, failed with an Abort, a Reject or the engine's failure). (A second end, a Continue
    the request did not allow, and a Preempt's checkpoint are checked as they happen.)"""
    for sh in shadows:
        if sh.admitted:
            assert len(sh.ends) == 1, f"{sh.rid} ended {sh.ends} (inv. 6)"
        # no silent truncation: a request that stopped short of its true length says why
        if sh.end == "completed":
            assert sh.generated == sh.true_len or sh.generated == sh.spec.hard_max, sh
        elif sh.end == "continued":
            assert "Continue" in sh.actions, sh
        elif sh.end == "failed":
            assert {"Abort", "Reject", "sent:fail"} & set(sh.actions), sh


# -- 7 ----------------------------------------------------------------------------------------


def idle_requests_cost_nothing(s: Scheduler, shadows: Collection[Shadow]) -> None:
    """7. A request that is refused or queued costs no blocks.

    Queued and checkpointed requests hold no blocks, in the shadow and in the core; ended and
    refused ones hold none in the shadow (the core has forgotten them)."""
    for sh in shadows:
        if sh.phase in _OVER:
            assert sh.blocks == 0
        elif sh.phase not in ("running", "stopped"):
            req = s.requests[sh.rid]
            assert sh.blocks == 0 and req.blocks == 0, req


def prefill_backlog_consistent(s: Scheduler) -> None:
    """Bookkeeping the first-token forecast reads (not a DESIGN §4 invariant): the prefill
    backlog is the prompt tokens of admitted requests still waiting for their first token, and
    what the forecast takes as still ahead of a newcomer is part of it."""
    pending = sum(r.prefill_pending for r in s.requests.values())
    assert s.prefill_backlog == pending >= 0, (s.prefill_backlog, pending)
    ahead = s.forecast.queued_prefill()
    assert 0 <= ahead <= s.prefill_backlog, (ahead, s.prefill_backlog)


# -- 8 ----------------------------------------------------------------------------------------


def shared_blocks_charged_once(
    s: Scheduler,
    shadows: Collection[Shadow],
    stale_prefix: Mapping[tuple[str, int], tuple[int, ...]],
) -> None:
    """8. A prompt block shared by several live requests (same chained block hash) is charged
    once; its charge ends only after the last holder's stop is confirmed.

    The ledger charges each prompt block exactly as many holders as the harness counts holding
    a grant that names it (running, or stopped and not yet released): none is charged once its
    holders are all released, none drops while one of them lives or awaits its confirmation,
    and every prompt block the engine still holds for a stopped instance is charged. (That each
    is charged once, however many share it, is the block count of 1.)"""
    want: dict[int, int] = {}
    for sh in _known(shadows):
        if sh.blocks:
            for h in sh.prefix:
                want[h] = want.get(h, 0) + 1
    shared = s.ledger.shared
    for h, n in want.items():
        assert shared.get(h) == n, (
            f"prompt block {h} is named by {n} holders, the ledger charges it for "
            f"{shared.get(h)} (inv. 8)"
        )
    assert set(shared) == set(want), (
        f"the ledger still charges prompt blocks no holder names: "
        f"{sorted(set(shared) - set(want))} (inv. 8)"
    )
    for key, prefix in stale_prefix.items():
        for h in prefix:
            assert h in shared, (
                f"the engine still holds prompt block {h} of stopped {key}, the ledger no "
                "longer charges it (inv. 8)"
            )
