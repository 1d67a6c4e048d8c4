"""What policies and the forecast may read of the scheduler: a read-only view.

:class:`SchedulerView` is a protocol, so that the modules that read the scheduler's state do not
import the scheduler (imports in the core run one way: the scheduler uses them). The scheduler
satisfies it; a test may pass anything else that does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvbudget.core.cost import CostModel
    from kvbudget.core.ledger import Ledger
    from kvbudget.core.lengths import LengthModel
    from kvbudget.core.lifecycle import Request
    from kvbudget.core.model import Capacity, ServiceClass


class SchedulerView(Protocol):
    """The scheduler's state that its policies and forecast read (and never write)."""

    @property
    def capacity(self) -> Capacity: ...
    @property
    def classes(self) -> Mapping[str, ServiceClass]: ...
    @property
    def ledger(self) -> Ledger: ...
    @property
    def lengths(self) -> LengthModel: ...
    @property
    def cost(self) -> CostModel: ...
    @property
    def now(self) -> float: ...

    #: every request the scheduler knows (not yet forgotten), by id
    @property
    def requests(self) -> Mapping[str, Request]: ...

    #: requests holding a live grant, in admission order
    @property
    def live(self) -> Mapping[str, Request]: ...

    #: stopped requests whose release the engine has not confirmed yet, by id
    @property
    def stopping(self) -> Mapping[str, Request]: ...

    #: seconds from a stop to the engine's confirmation of it, averaged (None before any)
    @property
    def confirm_seconds(self) -> float | None: ...

    #: how many requests hold a live grant; how many are stopped awaiting confirmation
    @property
    def active(self) -> int: ...
    @property
    def releasing(self) -> int: ...

    #: prompt + generated tokens over the live requests
    @property
    def active_context(self) -> int: ...

    #: prompt tokens admitted whose first token has not come yet (the engine's prefill queue)
    @property
    def prefill_backlog(self) -> int: ...

    #: (when, tokens queued for prefill then, its own included) of the newest admission that
    #: added to ``prefill_backlog`` (read only while the backlog is not 0)
    @property
    def newest_prefill(self) -> tuple[float, int]: ...

    def first_token_delay(self, req: Request, extra_tokens: int = 0) -> float: ...
    def first_token_prefill_rate(self) -> float: ...
    def released_in_time(self, req: Request, blocks: int) -> bool: ...
    def queue_slack(self, req: Request) -> float | None: ...
    def step_seconds(self) -> float: ...
    def seconds_left(self, req: Request, step: float | None = None) -> float: ...
    def expected_length(self, req: Request) -> int: ...


__all__ = ["SchedulerView"]
