"""The value types of the core: capacity, service classes, request specs, checkpoints.

Everything here is a frozen, slotted attrs class that validates itself on construction, so a
bad value is refused with :class:`~kvbudget.errors.InvalidInput` naming the field and the
accepted range before it can reach the ledger.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import attrs

from kvbudget.core.resume import Checkpoint as Checkpoint
from kvbudget.core.resume import Continuation as Continuation
from kvbudget.errors import InvalidInput, UnknownClass
from kvbudget.validate import boolean, integer, one_of, optional, quantile, seconds, text
from kvbudget.validate import check_float as check_float
from kvbudget.validate import check_int as check_int

OnExhausted = Literal["extend", "continue"]
StopReason = Literal["stop", "length"]


def blocks_for(tokens: int, block_size: int) -> int:
    """Whole blocks needed to hold ``tokens`` tokens (the engine rounds up too)."""
    return -(-tokens // block_size)


def _to_hashes(value: Iterable[int]) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidInput("prefix_blocks", value, "a tuple of int block hashes")
    return tuple(value)


def _check_prefix_blocks(value: tuple[object, ...]) -> None:
    types = set(map(type, value))  # (one pass in C: this runs for every request)
    if types - {int} and not all(issubclass(t, int) and t is not bool for t in types):
        raise InvalidInput("prefix_blocks", value, "a tuple of int block hashes")
    if len(set(value)) != len(value):
        # a chained hash never repeats within one prompt; a repeat means the hashes were not
        # chained, and two blocks would be charged as one
        raise InvalidInput("prefix_blocks", value, "distinct (chained) block hashes")


#: the chain's seed: the hash "before" a prompt's first block
_CHAIN_SEED = 0x6B7662  # "kvb"


def block_hashes(
    token_ids: Sequence[int], block_size: int, *, salt: object = None, cacheable: int | None = None
) -> tuple[int, ...]:
    """The chained hashes of the full blocks of ``token_ids`` for :attr:`RequestSpec.prefix_blocks`.

    Block ``i``'s hash covers the hash of block ``i - 1`` and the block's own tokens, so two
    prompts share the hash at position ``i`` exactly when they agree on every token up to the
    end of block ``i`` (and on ``salt``: whatever else the engine keys its cache on, such as a
    LoRA adapter or a cache salt). Only blocks the engine can reuse count: the first
    ``cacheable`` tokens (default: all but the last one, which an engine always recomputes to
    produce the first output token). The hashes are Python's tuple hash, stable within a
    process; pass the same ``salt`` for requests that may share.
    """
    size = check_int("block_size", block_size, minimum=1)
    tokens = tuple(token_ids)
    usable = len(tokens) - 1 if cacheable is None else check_int("cacheable", cacheable)
    usable = max(0, min(usable, len(tokens)))
    out: list[int] = []
    parent = hash((_CHAIN_SEED, salt))
    for start in range(0, usable - size + 1, size):
        parent = hash((parent, tokens[start : start + size]))
        out.append(parent)
    return tuple(out)


@attrs.frozen(slots=True)
class Capacity:
    """The KV cache the budget divides: ``blocks`` blocks of ``block_size`` tokens each."""

    blocks: int = attrs.field(validator=integer(1))
    block_size: int = attrs.field(validator=integer(1))

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size


@attrs.frozen(slots=True)
class ServiceClass:
    """How a class of requests is treated.

    ``priority``: lower is served first. ``initial_quantile``: the quantile of the output-length
    distribution granted at admission. ``extension_quantile``: the conditional quantile an
    extension aims to cover. ``max_extension_tokens``: the largest single extension.
    ``protected``: may draw the protected headroom and preempt preemptible work.
    ``preemptible``: may be checkpointed to make room for protected classes.
    ``latency_floor_s``: the slowest inter-token interval an active stream of this class may be
    pushed to (None: no floor). ``ttft_slo_s``: time-to-first-token objective; a caller still
    queued when the objective less its predicted prefill has passed is turned away.
    ``max_queue_delay_s``: a caller waiting longer than this for admission is turned away (None:
    only its own deadline and first-token objective bound the wait). ``default_deadline_s``:
    completion deadline when the request gives none.
    """

    name: str = attrs.field(validator=text())
    priority: int = attrs.field(default=0, validator=integer(0))
    initial_quantile: float = attrs.field(default=0.9, validator=quantile())
    extension_quantile: float = attrs.field(default=0.9, validator=quantile())
    max_extension_tokens: int = attrs.field(default=512, validator=integer(1))
    protected: bool = False
    preemptible: bool = True
    latency_floor_s: float | None = attrs.field(default=None, validator=optional(seconds()))
    ttft_slo_s: float | None = attrs.field(default=None, validator=optional(seconds()))
    max_queue_delay_s: float | None = attrs.field(default=None, validator=optional(seconds()))
    default_deadline_s: float | None = attrs.field(default=None, validator=optional(seconds()))


INTERACTIVE = ServiceClass(
    "interactive",
    priority=0,
    initial_quantile=0.5,
    extension_quantile=0.5,
    max_extension_tokens=512,
    protected=True,
    preemptible=False,
    latency_floor_s=0.2,
    ttft_slo_s=2.0,
    max_queue_delay_s=2.0,
)
BATCH = ServiceClass(
    "batch",
    priority=1,
    initial_quantile=0.5,
    extension_quantile=0.75,
    max_extension_tokens=1024,
    protected=False,
    preemptible=True,
    latency_floor_s=None,
    ttft_slo_s=None,
    max_queue_delay_s=None,
    default_deadline_s=600.0,
)
DEFAULT_CLASSES: tuple[ServiceClass, ...] = (INTERACTIVE, BATCH)


def class_table(
    classes: Mapping[str, ServiceClass] | tuple[ServiceClass, ...] | list[ServiceClass] | None,
) -> dict[str, ServiceClass]:
    """Normalise a class collection to a name → class dict (defaults when None)."""
    if classes is None:
        classes = DEFAULT_CLASSES
    if isinstance(classes, Mapping):
        table = dict(classes)
        for name, cls in table.items():
            if cls.name != name:
                raise InvalidInput("classes", name, f"the key to equal the class name {cls.name!r}")
    else:
        table = {}
        for cls in classes:
            if not isinstance(cls, ServiceClass):
                raise InvalidInput("classes", cls, "ServiceClass instances")
            if cls.name in table:
                raise InvalidInput("classes", cls.name, "unique class names")
            table[cls.name] = cls
    if not table:
        raise InvalidInput("classes", classes, "at least one service class")
    return table


def lookup_class(table: Mapping[str, ServiceClass], name: str) -> ServiceClass:
    try:
        return table[name]
    except KeyError:
        raise UnknownClass(name, sorted(table)) from None


@attrs.frozen(slots=True, cache_hash=True)  # (a dict key on every arrival and allowance)
class CalibrationKey:
    """What a request's output length is predicted from (DESIGN §6)."""

    model: str = "default"
    task: str = "default"
    service_class: str = "interactive"
    tenant: str = "default"
    sampling: str = "default"
    stops: str = "default"


@attrs.frozen(slots=True)
class RequestSpec:
    """What the application knows about a request when it arrives.

    ``max_tokens`` is the product ceiling, not a forecast; the hard maximum is
    ``min(max_tokens, model_max_len - prompt_tokens)`` and is never exceeded. A prompt that
    leaves no room under ``model_max_len`` is refused here. ``deadline`` is in seconds from
    arrival (None: the class default). ``on_exhausted="continue"`` lets the request end with an
    explicit continuation when its grant cannot grow, instead of waiting. ``resumable=False``:
    the engine cannot resume this request from a checkpoint without changing what it produces
    (its sampling state would not carry across a re-prefill: a per-request seed, penalties over
    the output, structured output, logits processors, a stop string across the seam), so it is
    admitted only with a grant to its hard max, never paused and never preempted.

    ``prefix_blocks``: the chained hashes of the prompt's full blocks, in order, as the engine's
    prefix cache keys them (:func:`block_hashes`; equal hash at position ``i`` means equal
    tokens, and equal cache keys, up to the end of block ``i``). A block that live requests share
    is charged once. Empty: nothing is shared, every prompt block is charged to this request.
    """

    prompt_tokens: int = attrs.field(validator=integer(1))
    max_tokens: int = attrs.field(validator=integer(1))
    model_max_len: int = attrs.field(validator=integer(1))
    service_class: str = attrs.field(default="interactive", validator=text())
    tenant: str = attrs.field(default="default", validator=text())
    task: str = attrs.field(default="default", validator=text())
    model: str = attrs.field(default="default", validator=text())
    sampling: str = attrs.field(default="default", validator=text())
    stops: str = attrs.field(default="default", validator=text())
    durable: bool = False
    on_exhausted: OnExhausted = attrs.field(
        default="extend", validator=one_of("extend", "continue")
    )
    deadline: float | None = attrs.field(default=None, validator=optional(seconds()))
    resumable: bool = attrs.field(default=True, validator=boolean())
    prefix_blocks: tuple[int, ...] = attrs.field(
        default=(), converter=_to_hashes, validator=lambda _i, _a, v: _check_prefix_blocks(v)
    )

    def __attrs_post_init__(self) -> None:
        if self.prompt_tokens >= self.model_max_len:
            raise InvalidInput(
                "prompt_tokens",
                self.prompt_tokens,
                f"fewer than model_max_len={self.model_max_len} tokens, so at least one output "
                "token fits",
            )

    @property
    def hard_max(self) -> int:
        """The most output tokens this request may ever generate."""
        return min(self.max_tokens, self.model_max_len - self.prompt_tokens)

    @property
    def calibration_key(self) -> CalibrationKey:
        # (one instance per distinct key: the length model's look-ups, several per admission
        # and extension, then find their key by identity rather than comparing six fields)
        return _calibration_key(
            self.model, self.task, self.service_class, self.tenant, self.sampling, self.stops
        )


@functools.lru_cache(maxsize=4096)
def _calibration_key(
    model: str, task: str, service_class: str, tenant: str, sampling: str, stops: str
) -> CalibrationKey:
    return CalibrationKey(model, task, service_class, tenant, sampling, stops)
