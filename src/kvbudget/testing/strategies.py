"""Hypothesis strategies for kvbudget, and the policy factories the state machine runs.

This module owns what a property test draws: valid :class:`~kvbudget.core.model.RequestSpec`
values (:func:`request_specs`), small KV caches (:func:`capacities`), true output lengths
(:func:`true_lengths`), whole workloads (:func:`workloads`, lists of :class:`WorkloadItem`) and
the shipped policies (:func:`policies`), as :class:`PolicyFactory` values: a factory receives the
harness's true lengths (:data:`TrueLength`), so that the oracle policy can be wired to them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
from hypothesis import strategies as st

from kvbudget.core.model import Capacity, RequestSpec
from kvbudget.core.policy import POLICY_NAMES, OraclePolicy, Policy, make_policy
from kvbudget.errors import InvalidInput

__all__ = [
    "DEFAULT_TENANTS",
    "NamedPolicyFactory",
    "PolicyFactory",
    "TrueLength",
    "WorkloadItem",
    "capacities",
    "policies",
    "policy_factory",
    "request_specs",
    "true_lengths",
    "workloads",
]

TrueLength = Callable[[str], int | None]
"""Maps a request id to its true output length (None: unknown)."""


class PolicyFactory(Protocol):
    """Builds a fresh policy for one run; receives the harness's true lengths (for oracles)."""

    def __call__(self, true_length: TrueLength, /) -> Policy: ...


@attrs.frozen
class NamedPolicyFactory:
    """A :class:`PolicyFactory` for a shipped policy, by name (``oracle`` gets the truth)."""

    name: str

    def __call__(self, true_length: TrueLength, /) -> Policy:
        if self.name == "oracle":
            return OraclePolicy(true_length)
        return make_policy(self.name)


def policy_factory(name: str) -> NamedPolicyFactory:
    """The factory of the shipped policy ``name`` (raises UnknownPolicy for other names)."""
    make_policy(name)  # validate now, with the typed error
    return NamedPolicyFactory(name)


# -- strategies ----------------------------------------------------------------------------------

DEFAULT_TENANTS: tuple[str, ...] = ("t0", "t1", "t2")


def request_specs(
    classes: Sequence[str] = ("interactive", "batch"),
    *,
    max_prompt: int = 64,
    model_max_len: int | None = None,
    max_tokens: int = 256,
    tenants: Sequence[str] = DEFAULT_TENANTS,
    on_exhausted: Sequence[str] = ("extend", "continue"),
) -> st.SearchStrategy[RequestSpec]:
    """Valid request specs: ``1 <= prompt <= max_prompt`` with room under ``model_max_len``
    (drawn in ``[2, max_prompt + max_tokens]`` when None), ``1 <= max_tokens``."""
    if max_prompt < 1 or max_tokens < 1:
        raise InvalidInput("max_prompt", max_prompt, "max_prompt >= 1 and max_tokens >= 1")
    if model_max_len is not None and model_max_len < 2:
        raise InvalidInput("model_max_len", model_max_len, "an integer >= 2")

    @st.composite
    def build(draw: st.DrawFn) -> RequestSpec:
        mml = (
            model_max_len
            if model_max_len is not None
            else draw(st.integers(2, max_prompt + max_tokens))
        )
        prompt = draw(st.integers(1, min(max_prompt, mml - 1)))
        deadline = draw(st.one_of(st.none(), st.sampled_from([0.5, 3.0, 60.0, 900.0])))
        return RequestSpec(
            prompt_tokens=prompt,
            max_tokens=draw(st.integers(1, max_tokens)),
            model_max_len=mml,
            service_class=draw(st.sampled_from(list(classes))),
            tenant=draw(st.sampled_from(list(tenants))),
            task=draw(st.sampled_from(["chat", "code"])),
            on_exhausted=draw(st.sampled_from(list(on_exhausted))),
            deadline=deadline,
        )

    return build()


def prefix_chain(chain: int, blocks: int) -> tuple[int, ...]:
    """The first ``blocks`` block hashes of "system prompt" ``chain``: requests of one chain
    share every leading block up to the shorter one's length, as chained hashes do."""
    return tuple(chain * 1_000_003 + i for i in range(blocks))


def capacities(
    *, min_blocks: int = 4, max_blocks: int = 96, block_sizes: Sequence[int] = (1, 2, 4, 8, 16)
) -> st.SearchStrategy[Capacity]:
    """Small KV caches, so that pressure, extensions and preemption happen often."""
    return st.builds(
        Capacity, st.integers(min_blocks, max_blocks), st.sampled_from(list(block_sizes))
    )


def true_lengths(hard_max: int) -> st.SearchStrategy[int]:
    """A true output length in ``[1, hard_max]``: often short, sometimes the hard max."""
    return st.one_of(
        st.integers(1, min(8, hard_max)),
        st.integers(1, hard_max),
        st.just(hard_max),
    )


@attrs.frozen
class WorkloadItem:
    """One arrival: ``at`` seconds after the previous one, with its true output length."""

    request_id: str
    spec: RequestSpec
    true_length: int
    at: float


def workloads(
    classes: Sequence[str] = ("interactive", "batch"),
    *,
    max_requests: int = 40,
    max_prompt: int = 64,
    model_max_len: int | None = None,
    tenants: Sequence[str] = DEFAULT_TENANTS,
) -> st.SearchStrategy[list[WorkloadItem]]:
    """Sequences of arrivals with true lengths, classes, tenants and ``on_exhausted``."""

    @st.composite
    def item(draw: st.DrawFn) -> tuple[RequestSpec, int, float]:
        spec = draw(
            request_specs(
                classes, max_prompt=max_prompt, model_max_len=model_max_len, tenants=tenants
            )
        )
        return spec, draw(true_lengths(spec.hard_max)), draw(st.sampled_from([0.0, 0.01, 0.2]))

    return st.lists(item(), max_size=max_requests).map(
        lambda xs: [WorkloadItem(f"w{i}", s, n, at) for i, (s, n, at) in enumerate(xs)]
    )


def policies() -> st.SearchStrategy[NamedPolicyFactory]:
    """Every shipped policy, as a factory (``factory(true_length) -> Policy``)."""
    return st.sampled_from(POLICY_NAMES).map(NamedPolicyFactory)
