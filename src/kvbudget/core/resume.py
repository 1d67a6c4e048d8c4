"""What a stopped request keeps to go on: its checkpoint (preempted) or continuation (ended).

Plain values with no dependencies, so that the errors that carry them
(:class:`~kvbudget.errors.Preempted`, :class:`~kvbudget.errors.ContinuationRequired`) can name
their types without importing the rest of the core.
"""

from __future__ import annotations

import attrs


@attrs.frozen(slots=True)
class Checkpoint:
    """What a preempted request keeps: it resumes by re-prefilling prompt + generated tokens."""

    request_id: str
    prompt_tokens: int
    generated_tokens: int

    @property
    def recompute_tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens


@attrs.frozen(slots=True)
class Continuation:
    """The explicit end of a request that may not wait for its grant to grow.

    The application resumes it with a new request whose prompt is the old prompt plus the
    ``generated_tokens`` already produced, asking for at most ``remaining_tokens`` more.
    """

    request_id: str
    continuation_id: str
    prompt_tokens: int
    generated_tokens: int
    remaining_tokens: int
