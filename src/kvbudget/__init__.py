"""kvbudget: KV-cache budgets for LLM serving.

Calibrated admission, grants that grow through bounded extensions from a shared headroom pool,
protected interactive streams, preemptible batch work with its cost visible, release only on the
engine's confirmation, and early "overloaded" for callers the queue cannot serve in time.
"""

from kvbudget.budget import Budget, GenerationResult, GenerationStep, Lease, ShellCounters
from kvbudget.core.config import SchedulerConfig
from kvbudget.core.model import (
    BATCH,
    DEFAULT_CLASSES,
    INTERACTIVE,
    Capacity,
    RequestSpec,
    ServiceClass,
    block_hashes,
)
from kvbudget.core.policy import POLICY_NAMES, CalibratedPolicy, Policy, make_policy
from kvbudget.core.resume import Checkpoint, Continuation
from kvbudget.core.scheduler import Scheduler
from kvbudget.core.stats import Snapshot
from kvbudget.errors import (
    AlreadyReleased,
    BudgetClosed,
    ContinuationRequired,
    DuplicateRequest,
    EngineDead,
    EngineError,
    EngineStalled,
    Forbidden,
    GrantExceeded,
    HardLimitExceeded,
    InvalidInput,
    InvalidTransition,
    KvBudgetError,
    Overloaded,
    PolicyViolation,
    Preempted,
    Unauthorized,
    UnknownClass,
    UnknownPolicy,
    UnknownRequest,
)
from kvbudget.names import NameFolder, NameLimits

__version__ = "0.1.0"

__all__ = [
    "BATCH",
    "DEFAULT_CLASSES",
    "INTERACTIVE",
    "POLICY_NAMES",
    "AlreadyReleased",
    "Budget",
    "BudgetClosed",
    "CalibratedPolicy",
    "Capacity",
    "Checkpoint",
    "Continuation",
    "ContinuationRequired",
    "DuplicateRequest",
    "EngineDead",
    "EngineError",
    "EngineStalled",
    "Forbidden",
    "GenerationResult",
    "GenerationStep",
    "GrantExceeded",
    "HardLimitExceeded",
    "InvalidInput",
    "InvalidTransition",
    "KvBudgetError",
    "Lease",
    "NameFolder",
    "NameLimits",
    "Overloaded",
    "Policy",
    "PolicyViolation",
    "Preempted",
    "RequestSpec",
    "Scheduler",
    "SchedulerConfig",
    "ServiceClass",
    "ShellCounters",
    "Snapshot",
    "Unauthorized",
    "UnknownClass",
    "UnknownPolicy",
    "UnknownRequest",
    "block_hashes",
    "make_policy",
]
