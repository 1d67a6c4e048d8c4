"""The sans-I/O core: pure, synchronous, deterministic. No asyncio, no clock reads, no logging.

``model`` and ``resume`` (value types), ``events`` (events in, actions out), ``lifecycle``
(states, the transition table, each outcome's bookkeeping), ``ledger`` (blocks and pools),
``queue`` (class queues, tenant fairness), ``forecast`` (waits, expiries, retry-after),
``lengths`` (calibrated output-length model), ``cost`` (step-cost model), ``view`` (what policies
read), ``policy`` (decisions), ``config`` and ``scheduler`` (the passes), ``stats`` (counters and
the snapshot). docs/architecture.md draws the imports.
"""

from kvbudget.core.config import SchedulerConfig
from kvbudget.core.cost import CostModel, StepTimeModel
from kvbudget.core.events import (
    Abort,
    Action,
    Admit,
    Arrived,
    BoundaryReached,
    CancelRequested,
    Continue,
    Deny,
    Event,
    Extend,
    Failed,
    Finished,
    KvUsageReported,
    Preempt,
    Reject,
    ReleaseConfirmed,
    Released,
    StepObserved,
    Tick,
    TokensGenerated,
)
from kvbudget.core.ledger import Ledger
from kvbudget.core.lengths import LengthModel
from kvbudget.core.lifecycle import TRANSITIONS, Outcome, Request, State, Trigger
from kvbudget.core.model import (
    BATCH,
    DEFAULT_CLASSES,
    INTERACTIVE,
    CalibrationKey,
    Capacity,
    RequestSpec,
    ServiceClass,
    block_hashes,
    blocks_for,
)
from kvbudget.core.policy import (
    POLICY_NAMES,
    BasePolicy,
    Blocked,
    CalibratedPolicy,
    NewTokenRatioPolicy,
    OraclePolicy,
    PastFuturePolicy,
    Policy,
    ReserveCurrentPolicy,
    ReserveMaxPolicy,
    SegmentedPolicy,
    make_policy,
)
from kvbudget.core.resume import Checkpoint, Continuation
from kvbudget.core.scheduler import Scheduler
from kvbudget.core.stats import Snapshot

__all__ = [
    "BATCH",
    "DEFAULT_CLASSES",
    "INTERACTIVE",
    "POLICY_NAMES",
    "TRANSITIONS",
    "Abort",
    "Action",
    "Admit",
    "Arrived",
    "BasePolicy",
    "Blocked",
    "BoundaryReached",
    "CalibratedPolicy",
    "CalibrationKey",
    "CancelRequested",
    "Capacity",
    "Checkpoint",
    "Continuation",
    "Continue",
    "CostModel",
    "Deny",
    "Event",
    "Extend",
    "Failed",
    "Finished",
    "KvUsageReported",
    "Ledger",
    "LengthModel",
    "NewTokenRatioPolicy",
    "OraclePolicy",
    "Outcome",
    "PastFuturePolicy",
    "Policy",
    "Preempt",
    "Reject",
    "ReleaseConfirmed",
    "Released",
    "Request",
    "RequestSpec",
    "ReserveCurrentPolicy",
    "ReserveMaxPolicy",
    "Scheduler",
    "SchedulerConfig",
    "SegmentedPolicy",
    "ServiceClass",
    "Snapshot",
    "State",
    "StepObserved",
    "StepTimeModel",
    "Tick",
    "TokensGenerated",
    "Trigger",
    "block_hashes",
    "blocks_for",
    "make_policy",
]
