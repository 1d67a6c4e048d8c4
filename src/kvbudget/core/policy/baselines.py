"""The baselines, each as the engine it is named after decides (DESIGN §5): ``reserve-max``
(TensorRT-LLM GUARANTEED_NO_EVICT / TGI before segments), ``segmented`` (TGI v3 router),
``reserve-current`` (vLLM v1 FCFS), ``new-token-ratio`` (SGLang), ``past-future`` (LightLLM,
ASPLOS 2025) and ``oracle`` (knows each true length; simulation only). They run over the same
ledger as kvbudget's own policy, which is what makes the comparison in ``kvbudget simulate``
fair.
"""

from __future__ import annotations

import bisect
import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

from kvbudget.core.lifecycle import STOPPING_STATES
from kvbudget.core.policy.base import BasePolicy, Blocked, _most_recent
from kvbudget.validate import check_float, check_int

if TYPE_CHECKING:
    from kvbudget.core.lifecycle import Request


class ReserveMaxPolicy(BasePolicy):
    """Reserve prompt + hard max at admission; never extend, never preempt.

    TensorRT-LLM's ``GUARANTEED_NO_EVICT`` capacity scheduler; TGI's router before grant segments.
    """

    name: ClassVar[str] = "reserve-max"
    preempt_for_admission = False


class SegmentedPolicy(BasePolicy):
    """Reserve prompt + min(hard max, ``segment``); at the boundary, re-queue with the output
    appended and re-prefill (TGI v3 router's segmented reservations)."""

    name: ClassVar[str] = "segmented"
    requeue_front = False

    def __init__(self, *, segment: int = 1024) -> None:
        self.segment = check_int("segment", segment, minimum=1)

    def initial_allowance(self, req: Request) -> int:
        return min(req.remaining, self.segment)

    def on_blocked(self, req: Request) -> Blocked:
        return Blocked.PREEMPT_SELF


class ReserveCurrentPolicy(BasePolicy):
    """vLLM v1 FCFS: admit while the prompt fits; grow block by block; when a step cannot
    allocate, preempt the most recently admitted request by recompute and put it at the head of
    the queue."""

    name: ClassVar[str] = "reserve-current"
    requeue_front = True

    def initial_allowance(self, req: Request) -> int:
        return 1

    def extension_tokens(self, req: Request) -> int | None:
        room = req.hard_max - req.boundary
        return min(room, self.block_size) if room > 0 else None

    def on_blocked(self, req: Request) -> Blocked:
        return Blocked.PREEMPT_OTHERS

    def choose_victims(
        self, req: Request, need_blocks: int, candidates: Sequence[Request]
    ) -> list[Request]:
        return _most_recent(req, candidates)


class NewTokenRatioPolicy(ReserveCurrentPolicy):
    """SGLang: admit while free tokens cover running requests' remaining x ratio plus the new
    request's prompt + min(max_new, 4096); the ratio starts at 0.7 and decays linearly to 0.098
    over 600 steps; when a step cannot allocate, retract the request with the fewest output
    tokens and reset the ratio.

    The running term uses the ledger's O(1) aggregate ``sum(hard_max) - sum(generated)`` rather
    than SGLang's per-request clip at 4096 (identical whenever max_new <= 4096).
    """

    name: ClassVar[str] = "new-token-ratio"
    clip = 4096

    def __init__(
        self, *, init_ratio: float = 0.7, min_ratio: float = 0.098, decay_steps: int = 600
    ) -> None:
        self.init_ratio = check_float("init_ratio", init_ratio, maximum=1.0, open_min=True)
        self.min_ratio = check_float("min_ratio", min_ratio, maximum=self.init_ratio)
        self.decay = (self.init_ratio - self.min_ratio) / check_int(
            "decay_steps", decay_steps, minimum=1
        )
        self.ratio = self.init_ratio

    def admit(self, req: Request, blocks: int) -> bool:
        led = self._s.ledger
        running_rest = (led.active_hard_max - led.active_generated) * self.ratio
        needed = req.prompt + req.generated + min(req.remaining, self.clip)
        return led.free * self.block_size - running_rest - needed >= 0

    def on_blocked(self, req: Request) -> Blocked:
        self.ratio = self.init_ratio
        return Blocked.PREEMPT_OTHERS

    def choose_victims(
        self, req: Request, need_blocks: int, candidates: Sequence[Request]
    ) -> list[Request]:
        pool = list(candidates)
        if req not in pool:
            pool.append(req)
        return [min(pool, key=lambda r: (r.generated, -r.seq))]

    def on_step(self) -> None:
        self.ratio = max(self.min_ratio, self.ratio - self.decay)


class PastFuturePolicy(ReserveCurrentPolicy):
    """LightLLM's Past-Future scheduler (ASPLOS 2025).

    A window of the last ``window`` finished lengths; each running request's final length is
    sampled from the window's lengths above what it already generated (its hard max when none);
    the peak KV over the finish points must stay under ``threshold`` of capacity in the worst of
    K = min(5, window/n + 1) samples; on overflow the most recently admitted request is paused.
    As in LightLLM, the test is drawn once per scheduling step: a refused head is drawn for again
    only when the clock or the set of running requests has moved.
    """

    name: ClassVar[str] = "past-future"

    def __init__(self, *, window: int = 200, threshold: float = 0.95, seed: int = 0) -> None:
        self.window: deque[int] = deque(maxlen=check_int("window", window, minimum=1))
        self.threshold = check_float("threshold", threshold, maximum=1.0, open_min=True)
        self._rng = random.Random(seed)
        self._sorted: list[int] = []
        self._dirty = False
        self._refused: tuple[str, float, int] | None = None

    def on_finished(self, req: Request, length: int) -> None:
        self.window.append(length)
        self._dirty = True

    def _sample(self, generated: int, hard_max: int) -> int:
        if self._dirty:
            self._sorted = sorted(self.window)
            self._dirty = False
        lengths = self._sorted
        i = bisect.bisect_right(lengths, generated)
        if i >= len(lengths):
            return hard_max
        return min(hard_max, lengths[self._rng.randrange(i, len(lengths))])

    def admit(self, req: Request, blocks: int) -> bool:
        # LightLLM draws once per scheduling step: a head refused at this instant, with the same
        # requests running, is not drawn for again until the clock or the running set moves
        attempt = (req.request_id, self._s.now, len(self._s.live))
        if attempt == self._refused:
            return False
        ok = self._fits_future(req)
        self._refused = None if ok else attempt
        return ok

    def _fits_future(self, req: Request) -> bool:
        live = list(self._s.live.values())
        live.append(req)
        n = len(live)
        k = min(5, self.window.maxlen // n + 1 if self.window.maxlen else 1)
        limit = self.threshold * self._s.capacity.tokens
        held_elsewhere = (
            sum(r.blocks for r in self._s.requests.values() if r.state in STOPPING_STATES)
            * self.block_size
        )
        for _ in range(k):
            futures = sorted(
                (self._sample(r.generated, r.hard_max) - r.generated, r.prompt + r.generated)
                for r in live
            )
            # at the moment the i-th shortest finishes, every request still running holds its
            # context plus that many more tokens
            total_ctx = sum(c for _, c in futures)
            peak = 0.0
            remaining_ctx = total_ctx
            for i, (rest, ctx) in enumerate(futures):
                usage = remaining_ctx + rest * (n - i)
                peak = max(peak, usage)
                remaining_ctx -= ctx
            if peak + held_elsewhere > limit:
                return False
        return True

    def choose_victims(
        self, req: Request, need_blocks: int, candidates: Sequence[Request]
    ) -> list[Request]:
        return _most_recent(req, candidates)


class OraclePolicy(BasePolicy):
    """Knows every request's true output length and reserves exactly that (simulation only).

    ``true_length(request_id)`` returns the length, or None when unknown (then the hard max is
    reserved, as ``reserve-max`` would).
    """

    name: ClassVar[str] = "oracle"

    def __init__(self, true_length: Callable[[str], int | None] | None = None) -> None:
        self.true_length = true_length

    def initial_allowance(self, req: Request) -> int:
        known = self.true_length(req.request_id) if self.true_length is not None else None
        if known is None or known <= req.generated:
            return req.remaining
        return max(1, min(req.remaining, known - req.generated))

    def extension_tokens(self, req: Request) -> int | None:
        room = req.hard_max - req.boundary
        return room if room > 0 else None


__all__ = [
    "NewTokenRatioPolicy",
    "OraclePolicy",
    "PastFuturePolicy",
    "ReserveCurrentPolicy",
    "ReserveMaxPolicy",
    "SegmentedPolicy",
]
