"""The baselines, each as the engine it is named after decides (DESIGN §5): ``reserve-max``
(TensorRT-LLM GUARANTEED_NO_EVICT / TGI v3's router), ``segmented`` (segmented reservations),
``reserve-current`` (vLLM v1), ``new-token-ratio`` (SGLang), ``past-future`` (LightLLM) and
``oracle`` (knows each true length; simulation only). They run over the same ledger as
kvbudget's own policy, which is what makes the comparison in ``kvbudget simulate`` fair, but
not behind kvbudget's front (``front = False``): each waits in its engine's own queue, first
come first served, and is never turned away for overload (only by its engine's own limits,
such as vLLM's queue caps). A baseline whose engine preempts inside its own step
(``preempts_in_engine``) gets its victim's blocks back at once in the simulator.

Each class names the source file and function it follows.
"""

from __future__ import annotations

import bisect
import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

from kvbudget.core.lifecycle import STOPPING_STATES, State
from kvbudget.core.policy.base import BasePolicy, Blocked, _most_recent
from kvbudget.errors import InvalidInput
from kvbudget.validate import check_float, check_int

if TYPE_CHECKING:
    from kvbudget.core.lifecycle import Request


class ReserveMaxPolicy(BasePolicy):
    """Reserve prompt + hard max at admission; never extend, never preempt; first come first
    served, the queue stopping at the first request that does not fit.

    TensorRT-LLM ``GUARANTEED_NO_EVICT`` (NVIDIA/TensorRT-LLM,
    ``cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp``,
    ``GuaranteedNoEvictScheduler::impl``: pending requests in order, each needing the blocks to
    its completion, "if one request fails to be scheduled, break"); TGI v3's router is the same
    rule (huggingface/text-generation-inference, ``backends/v3/src/queue.rs``,
    ``State::next_batch``: allocate ``input_length + max_new_tokens + speculate - 1``, else put
    the entry back at the front and stop).
    """

    name: ClassVar[str] = "reserve-max"
    front: ClassVar[bool] = False
    preempt_for_admission = False


class SegmentedPolicy(BasePolicy):
    """Reserve prompt + min(hard max, ``segment``); at the boundary, re-queue at the back with
    the output appended and re-prefill; first come first served.

    Not an engine's rule as it stands: TGI v3's router, to which DESIGN §5 attributed it, reserves
    the whole ``max_new_tokens`` up front (huggingface/text-generation-inference,
    ``backends/v3/src/queue.rs``, ``State::next_batch``; that is ``reserve-max``) and has no
    segments in any version of ``backends/v3`` or ``router/src/infer/v3``. It is kept as the
    segmented-reservation design point an engine router could run by itself: the re-queue is the
    router's own, so no abort travels (``preempts_in_engine``).
    """

    name: ClassVar[str] = "segmented"
    front: ClassVar[bool] = False
    preempts_in_engine: ClassVar[bool] = True
    requeue_front = False

    def __init__(self, *, segment: int = 1024) -> None:
        self.segment = check_int("segment", segment, minimum=1)

    def initial_allowance(self, req: Request) -> int:
        return min(req.remaining, self.segment)

    def on_blocked(self, req: Request) -> Blocked:
        return Blocked.PREEMPT_SELF


def _optional_cap(name: str, value: int | None) -> int | None:
    return None if value is None else check_int(name, value, minimum=0)


class ReserveCurrentPolicy(BasePolicy):
    """vLLM v1: admit while the prompt fits; grow block by block; when a step cannot allocate,
    preempt the most recently admitted running request (``priority``: the least important, latest
    arrival) by recompute, free its blocks at once and put it at the head of the waiting queue.
    The queue is first come first served (``priority``: by class priority, then arrival), and no
    caller is turned away unless a queue cap is set.

    vllm-project/vllm 0.32: ``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule`` (the
    running loop: ``allocate_slots`` fails -> ``preempted_req = self.running.pop()``, or
    ``max(self.running, key=(priority, arrival_time))`` under the priority policy, until the
    request fits or is itself the victim) and ``Scheduler._preempt_request`` (frees the blocks,
    ``self.waiting.prepend_request``); the caps are ``vllm/v1/engine/async_llm.py``,
    ``AsyncLLM.check_admission``: with ``max_num_queued_reqs`` a newcomer is refused (503) when
    the unfinished requests (waiting + running) would exceed it, with ``max_num_queued_tokens``
    when the prompt tokens of requests still in prefill already reach it. kvbudget reports both
    as ``queue-full``.
    """

    name: ClassVar[str] = "reserve-current"
    front: ClassVar[bool] = False
    preempts_in_engine: ClassVar[bool] = True
    requeue_front = True
    # (class defaults, so the subclasses that do not pass them run uncapped)
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None

    def __init__(
        self,
        *,
        priority: bool = False,
        max_num_queued_reqs: int | None = None,
        max_num_queued_tokens: int | None = None,
    ) -> None:
        if not isinstance(priority, bool):
            raise InvalidInput("priority", priority, "True or False")
        self.class_priority = priority
        self.max_num_queued_reqs = _optional_cap("max_num_queued_reqs", max_num_queued_reqs)
        self.max_num_queued_tokens = _optional_cap("max_num_queued_tokens", max_num_queued_tokens)

    def arrival_refusal(self, req: Request) -> str | None:
        cap = self.max_num_queued_reqs
        if cap is not None:
            # vLLM counts the requests its output processor has not finished: waiting, running
            # and preempted ones; a request stopping for good is gone from it
            unfinished = sum(1 for r in self._s.requests.values() if r.state is not State.RELEASING)
            if unfinished + 1 > cap:
                return "queue-full"
        tokens_cap = self.max_num_queued_tokens
        if tokens_cap is not None:
            # the prompts of requests whose first token has not come (queued or prefilling); the
            # newcomer's own prompt is not counted, as in vLLM
            in_prefill = sum(
                r.prompt
                for r in self._s.requests.values()
                if r.first_token_at is None and r.state not in STOPPING_STATES
            )
            if in_prefill >= tokens_cap:
                return "queue-full"
        return None

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
        if not self.class_priority:
            return _most_recent(req, candidates)
        pool = list(candidates)
        if req not in pool:
            pool.append(req)
        return [max(pool, key=lambda r: (r.cls.priority, r.arrival, r.seq))]


class NewTokenRatioPolicy(ReserveCurrentPolicy):
    """SGLang: admit while free tokens cover every running request's remaining x ratio plus the
    new request's prompt + min(max_new, 4096). The ratio starts at 0.7 and, on every decode step
    that could allocate, falls by (0.7 - 0.098) / 600 down to 0.098 (0.7 x 0.14). When a step
    cannot allocate, retract -- fewest output tokens first, then the longest prompt -- at least
    one request and until the free tokens cover ``retract_decode_steps`` (20) more tokens of every
    request left running (never the last one); then set the ratio to
    min(1, (tokens decoded + 20 x running) / sum of their max_new). Retracted requests join the
    back of the waiting queue and their blocks are freed at once.

    sgl-project/sglang: ``python/sglang/srt/managers/schedule_batch.py``,
    ``ScheduleBatch.retract_decode`` (the order, the stop rule and the new ratio);
    ``python/sglang/srt/managers/scheduler.py``, ``Scheduler.update_running_batch`` (retract
    when ``check_decode_mem`` fails, else decay; ``waiting_queue.extend(retracted)``) and
    ``Scheduler.__init__`` (init, min and decay from ``global_config``:
    ``default_init_new_token_ratio`` 0.7, ``default_min_new_token_ratio_factor`` 0.14,
    ``default_new_token_ratio_decay_steps`` 600, ``retract_decode_steps`` 20);
    ``python/sglang/srt/managers/schedule_policy.py``, ``PrefillAdder`` (the admission budget,
    ``CLIP_MAX_NEW_TOKENS_ESTIMATION`` 4096).

    The running term uses the ledger's O(1) aggregate ``sum(hard_max) - sum(generated)`` rather
    than SGLang's per-request clip at 4096 (identical whenever max_new <= 4096).
    """

    name: ClassVar[str] = "new-token-ratio"
    requeue_front = False  # waiting_queue.extend: the back
    clip = 4096

    def __init__(
        self,
        *,
        init_ratio: float = 0.7,
        min_ratio: float = 0.098,
        decay_steps: int = 600,
        retract_decode_steps: int = 20,
    ) -> None:
        self.init_ratio = check_float("init_ratio", init_ratio, maximum=1.0, open_min=True)
        self.min_ratio = check_float("min_ratio", min_ratio, maximum=self.init_ratio)
        self.decay = (self.init_ratio - self.min_ratio) / check_int(
            "decay_steps", decay_steps, minimum=1
        )
        self.retract_decode_steps = check_int(
            "retract_decode_steps", retract_decode_steps, minimum=1
        )
        self.ratio = self.init_ratio
        self._retracted = False  # this step retracted: it does not decay the ratio
        #: the admission round (one instant) and what its admissions charge beyond remaining x
        #: ratio: PrefillAdder takes a newcomer's whole min(max_new, 4096) off the budget of the
        #: round it joins; only from the next round on does it count as running
        self._round_now = -1.0
        self._round_extra = 0.0

    def admit(self, req: Request, blocks: int) -> bool:
        s = self._s
        if s.now != self._round_now:
            self._round_now = s.now
            self._round_extra = 0.0
        led = s.ledger
        running_rest = (led.active_hard_max - led.active_generated) * self.ratio
        future = min(req.remaining, self.clip)
        # SGLang takes only the tokens to extend (its radix cache's match is already held):
        # the prompt less the blocks a live twin holds
        needed = led.prefill_tokens(req) + future
        ok = led.free * self.block_size - running_rest - self._round_extra - needed >= 0
        if ok:
            self._round_extra += future - req.remaining * self.ratio
        return ok

    def choose_victims(
        self, req: Request, need_blocks: int, candidates: Sequence[Request]
    ) -> list[Request]:
        running = list(self._s.live.values())
        # pop order of retract_decode: fewest output tokens first, then the longest prompt
        order = sorted(candidates, key=lambda r: (r.generated, -r.prompt, -r.seq))
        steps = self.retract_decode_steps
        free_tokens = self._s.ledger.free * self.block_size
        left = len(running)
        victims: list[Request] = []
        for victim in order:
            if left <= 1:
                break  # the last request is never retracted
            if victims and free_tokens >= steps * left:
                break
            victims.append(victim)
            free_tokens += victim.blocks * self.block_size
            left -= 1
        gone = {v.request_id for v in victims}
        rest = [r for r in running if r.request_id not in gone]
        max_new = sum(r.hard_max for r in rest)
        if max_new > 0:
            decoded = sum(r.generated for r in rest)
            self.ratio = min(1.0, (decoded + steps * len(rest)) / max_new)
        self._retracted = True
        # the scheduler stops at the blocked request itself: it goes last
        victims.sort(key=lambda r: r is req)
        return victims

    def on_step(self) -> None:
        if self._retracted:
            self._retracted = False
            return
        self.ratio = max(self.min_ratio, self.ratio - self.decay)


class PastFuturePolicy(ReserveCurrentPolicy):
    """LightLLM's Past-Future scheduler (ASPLOS 2025).

    A window of the last ``window`` (200) finished output lengths, seeded with ``window // 2``
    copies of ``seed_length`` (LightLLM's ``--router_max_new_token_len``, 1024). At each
    scheduling round, K = min(5, 200 // n + 1) sample lists are drawn for the n running
    requests: a running request's final length is interpolated linearly at a uniform point over
    ``[its current length] + the window's lengths above it + [its max_new]``; a newcomer's is a
    uniform draw from the window (clipped to its max_new). Each admission appends its sample to
    every list; the peak KV of a list, over the moments its requests finish, plus the blocks held
    by stopped requests, must stay under ``threshold`` (0.95 = 1 - ``REVERSED``) of capacity in
    all K lists. The round stops at the first refusal (a refused head is not drawn for again
    until the round changes). On overflow the most recently admitted request is paused.

    ModelTC/lightllm: ``lightllm/server/router/req_queue/chunked_prefill/impl_past_future.py``,
    ``PastFutureQueue`` (``__init__``: the seeded window; ``_sample_cache_list``: the
    interpolation; ``_init_cache_list``: K; ``_update_cache_len_list``: the newcomer's draw;
    ``_calc_max_token_num_needed``: the peak) and ``ChunkedPrefillQueue.generate_new_batch``
    (``impl.py``: the round, which breaks at the first refusal).
    """

    name: ClassVar[str] = "past-future"
    MINIMUM_SAMPLES: ClassVar[int] = 200
    MAXIMUM_LISTS: ClassVar[int] = 5

    def __init__(
        self,
        *,
        window: int = 200,
        threshold: float = 0.95,
        seed: int = 0,
        seed_length: int = 1024,
    ) -> None:
        size = check_int("window", window, minimum=1)
        seed_length = check_int("seed_length", seed_length, minimum=1)
        self.window: deque[int] = deque([seed_length] * (size // 2), maxlen=size)
        self.threshold = check_float("threshold", threshold, maximum=1.0, open_min=True)
        self._rng = random.Random(seed)
        self._sorted: list[int] = sorted(self.window)
        self._dirty = False
        self._leaves = 0
        #: the current round: its key, its sample lists of (context, tokens still to come), the
        #: live count it expects, and whether it refused a head already
        self._round: tuple[float, int] | None = None
        self._lists: list[list[tuple[int, int]]] = []
        self._round_live = 0
        self._round_refused = False

    def on_finished(self, req: Request, length: int) -> None:
        self.window.append(length)
        self._dirty = True

    def on_leave(self, req: Request) -> None:
        self._leaves += 1

    def _history(self) -> list[int]:
        if self._dirty:
            self._sorted = sorted(self.window)
            self._dirty = False
        return self._sorted

    def _sample_running(self, r: Request) -> tuple[int, int]:
        his = self._history()
        g = r.generated
        pos = bisect.bisect_right(his, g)
        # the points [g] + his[pos:] + [hard_max]: at least two
        n_points = len(his) - pos + 2

        def point(k: int) -> int:
            if k == 0:
                return g
            if k == n_points - 1:
                return r.hard_max
            return his[pos + k - 1]

        x = self._rng.random() * (n_points - 1)
        k = int(x)
        lo, hi = point(k), point(k + 1)
        total = round(lo + (hi - lo) * (x - k))
        total = min(r.hard_max, max(g, total))
        return r.prompt + g, total - g

    def _sample_new(self, req: Request) -> tuple[int, int]:
        total = self._rng.choice(self.window) if self.window else req.hard_max
        total = min(req.hard_max, max(req.generated, total))
        return req.prompt + req.generated, total - req.generated

    @staticmethod
    def _peak(lst: list[tuple[int, int]]) -> int:
        # longest still to come first: when the i-th of them finishes, the first i+1 still hold
        # their context plus that many more tokens each
        peak = 0
        held = 0
        for i, (ctx, rest) in enumerate(sorted(lst, key=lambda e: -e[1])):
            held += ctx
            peak = max(peak, rest * (i + 1) + held)
        return peak

    def _start_round(self) -> None:
        live = list(self._s.live.values())
        n = len(live)
        if n:
            k = min(self.MAXIMUM_LISTS, self.MINIMUM_SAMPLES // n + 1)
            self._lists = [[self._sample_running(r) for r in live] for _ in range(k)]
        else:
            self._lists = [[]]
        self._round_live = n
        self._round_refused = False

    def admit(self, req: Request, blocks: int) -> bool:
        s = self._s
        # a round is one scheduling pass of LightLLM's router: the same instant, nothing left,
        # and nothing admitted but through this gate
        key = (s.now, self._leaves)
        if key != self._round or len(s.live) != self._round_live:
            self._round = key
            self._start_round()
        if self._round_refused:
            return False
        limit = self.threshold * s.capacity.tokens
        held_elsewhere = (
            sum(r.blocks for r in s.requests.values() if r.state in STOPPING_STATES)
            * self.block_size
        )
        lists = [[*lst, self._sample_new(req)] for lst in self._lists]
        if all(self._peak(lst) + held_elsewhere < limit for lst in lists):
            self._lists = lists
            self._round_live += 1
            return True
        self._round_refused = True
        return False

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
    front: ClassVar[bool] = False

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
