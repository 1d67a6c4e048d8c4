"""Property-test harness for kvbudget policies: hypothesis strategies and a state machine.

Run it on your own policy (or a change to a shipped one) to check that the scheduler still keeps
every invariant of DESIGN §4 whatever the engine and the clients do::

    from kvbudget.testing import BudgetStateMachine
    from my_pkg import MyPolicy          # subclass of kvbudget.core.policy.CalibratedPolicy

    TestMyPolicy = BudgetStateMachine.for_policy(lambda true_length: MyPolicy()).TestCase

``pytest`` collects ``TestMyPolicy`` like any ``unittest.TestCase``; tune it with
``TestMyPolicy.settings = hypothesis.settings(max_examples=..., stateful_step_count=...)``.

Strategies
----------
:func:`request_specs` (valid :class:`~kvbudget.core.model.RequestSpec` values),
:func:`capacities`, :func:`workloads` (lists of :class:`WorkloadItem`: an arrival with its true
output length), :func:`policies` (a :class:`PolicyFactory` for every shipped policy; the oracle
is wired to the true lengths the harness draws).

The state machine
-----------------
:class:`BudgetStateMachine` plays the engine and the clients against a
:class:`~kvbudget.core.scheduler.Scheduler`. Its rules send arrivals (valid and invalid specs),
generate tokens (only inside the grant, its reserved slack and the hard max), attempt charges
past the hard max or the grant (the typed error must come back and nothing may change), report
boundaries, finishes (``stop`` at the true length, ``length`` at the hard max), cancellations,
engine failures, and the engine freeing stopped requests, whose confirmation is sent at once,
delayed, lost (then recovered by :meth:`~kvbudget.core.scheduler.Scheduler.reconcile` from the
harness's own engine model) or duplicated (the second must raise and change nothing). Time
advances with ``tick``; engine steps are observed; events for unknown requests must raise.

The harness keeps its own shadow of every request (what it sent, what the engine holds, which
actions it received) and after every step checks DESIGN §4 against the scheduler without
trusting the ledger's bookkeeping:

1. blocks the harness saw granted (Admit/Extend minus Released) add up to ``ledger.reserved``,
   which is ``<= capacity`` and ``reserved + free == capacity``;
2. no request generates past its hard max, no boundary passes it, no grant holds more than
   ``blocks_for(prompt + hard_max + slack)`` blocks (a grant is exactly
   ``blocks_for(prompt + boundary + slack)``), and a spec with no room is refused at construction;
3. every holding request has ``generated <= boundary + slack`` and
   ``blocks >= blocks_for(prompt + generated)``;
4. a stopped request keeps its blocks until the harness confirms it (or reconciliation releases
   it, and then the KV the engine really still holds for stopped requests never exceeds what the
   ledger still charges for them); stops unconfirmed after the timeout are counted;
5. no grant or extension of an unprotected class leaves ``free < protected_blocks`` (checked at
   the point of each Admit/Extend, replaying the action list);
6. every admitted request ends exactly once (completed, cancelled, continued, failed; maybe after
   preemption and resume), ``Continue`` only when ``on_exhausted="continue"``, never a silent
   cut, and a Preempt carries a checkpoint equal to what was generated;
7. queued, checkpointed and refused requests hold no blocks.

At teardown the harness drives everything to completion and asserts ``reserved == 0``.

Layout: :mod:`~kvbudget.testing.strategies` (the strategies and policy factories),
:mod:`~kvbudget.testing.machine` (the state machine and :func:`fingerprint`),
:mod:`~kvbudget.testing.shadow` (the harness's record of one request) and
:mod:`~kvbudget.testing.invariants` (one check per item above, and when each runs). Every public
name is importable from here.
"""

from __future__ import annotations

from kvbudget.testing.machine import BudgetStateMachine, fingerprint
from kvbudget.testing.strategies import DEFAULT_TENANTS as DEFAULT_TENANTS  # not in __all__
from kvbudget.testing.strategies import (
    NamedPolicyFactory,
    PolicyFactory,
    TrueLength,
    WorkloadItem,
    capacities,
    policies,
    policy_factory,
    request_specs,
    workloads,
)
from kvbudget.testing.strategies import true_lengths as true_lengths  # not in __all__

__all__ = [
    "BudgetStateMachine",
    "NamedPolicyFactory",
    "PolicyFactory",
    "TrueLength",
    "WorkloadItem",
    "capacities",
    "fingerprint",
    "policies",
    "policy_factory",
    "request_specs",
    "workloads",
]
