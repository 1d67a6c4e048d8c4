"""Shared prompt blocks (issue 12, DESIGN §4 item 8): hashes, the ledger's single charge, its end
at the last holder's confirmation, the engine's cache reports, and reconciliation under sharing.

Hand-worked cases through the public API; the property harness (``test_properties.py``) checks
invariant 8 after every step of random sequences, and ``test_harness_catches_bugs.py`` plants
the bugs it must catch.
"""

from __future__ import annotations

from typing import Any

import pytest

import kvbudget
from kvbudget.core import events as ev
from kvbudget.core.config import SchedulerConfig
from kvbudget.core.model import Capacity, RequestSpec, block_hashes
from kvbudget.core.scheduler import Scheduler
from kvbudget.errors import InvalidInput

BS = 4


def sched(blocks: int = 64, **config: Any) -> Scheduler:
    return Scheduler(Capacity(blocks, BS), policy="reserve-max", config=SchedulerConfig(**config))


def twin(prompt: int = 42, max_tokens: int = 6, chain: int = 1, shared: int = 10) -> RequestSpec:
    """A request whose first ``shared`` prompt blocks are those of "system prompt" ``chain``."""
    prefix = tuple(chain * 1000 + i for i in range(shared))
    return RequestSpec(prompt, max_tokens, 4096, prefix_blocks=prefix)


def admitted(actions: list[ev.Action], rid: str) -> ev.Admit:
    found = [a for a in actions if isinstance(a, ev.Admit) and a.request_id == rid]
    assert found, actions
    return found[0]


# -- the hashes ------------------------------------------------------------------------------------


def test_block_hashes_are_chained() -> None:
    a = list(range(100))
    b = [*range(40), 999, *range(41, 100)]  # differs in block 10 (tokens 40..43)
    ha, hb = block_hashes(a, BS), block_hashes(b, BS)
    # only full blocks of the tokens an engine can reuse: all but the last token (99 -> 24)
    assert len(ha) == 24 and len(block_hashes(a[:97], BS)) == 24
    assert len(block_hashes(a[:96], BS)) == 23
    assert ha[:10] == hb[:10]
    # once the tokens differ, every later hash differs, although blocks 11.. are equal again
    assert all(x != y for x, y in zip(ha[10:], hb[10:], strict=True))
    assert len(set(ha)) == len(ha)
    assert block_hashes(a, BS, salt="lora:7")[0] != ha[0]  # what else the cache is keyed on
    assert block_hashes(a, BS, cacheable=100) == ha + block_hashes(a, BS, cacheable=100)[24:]
    assert block_hashes([1, 2, 3], BS) == ()
    assert kvbudget.block_hashes is block_hashes


def test_prefix_blocks_are_validated() -> None:
    assert RequestSpec(8, 4, 64, prefix_blocks=[3, 4]).prefix_blocks == (3, 4)  # any iterable
    for bad in ((1, 1), ("a",), (1.5,), (True,), "ab", 7):
        with pytest.raises(InvalidInput) as e:
            RequestSpec(8, 4, 64, prefix_blocks=bad)  # type: ignore[arg-type]
        assert e.value.field == "prefix_blocks"
    s = sched()
    with pytest.raises(InvalidInput, match="full block"):
        s.arrive("x", RequestSpec(8, 4, 64, prefix_blocks=(1, 2, 3)), 0.0)  # 8 tokens: 2 blocks
    assert not s.requests and s.ledger.reserved == 0


# -- one charge, held until the last holder's confirmation --------------------------------------


def test_twins_are_charged_their_shared_blocks_once() -> None:
    s = sched()
    first = admitted(s.arrive("a", twin(), 0.0), "a")
    assert first.blocks == 12 and s.ledger.reserved == 12  # ceil((42 + 6) / 4)
    second = admitted(s.arrive("b", twin(), 0.0), "b")
    assert second.blocks == 12  # the grant is the request's whole grant ...
    assert s.ledger.reserved == 14  # ... but only its 2 own blocks are taken
    other = admitted(s.arrive("c", twin(chain=2), 0.0), "c")
    assert other.blocks == 12 and s.ledger.reserved == 26  # another system prompt: all charged
    snap = s.snapshot()
    assert snap.shared_prefix_blocks == 20
    assert snap.totals.prefix_shared_blocks == 10
    assert s.ledger.footprint(s.requests["a"]) == 2  # b still names the shared 10
    assert s.ledger.footprint(s.requests["c"]) == 12
    s.ledger.check(list(s.requests.values()))


def test_shared_charge_ends_only_at_the_last_holders_confirmation() -> None:
    s = sched()
    s.arrive("a", twin(), 0.0)
    s.arrive("b", twin(), 0.0)
    s.charge("a", 6, 0.1)
    s.finish("a", "length", 0.1)
    assert s.ledger.reserved == 14  # stopped, unconfirmed: nothing returns
    out = s.confirm_release("a", 0.2)
    assert [a.blocks for a in out if isinstance(a, ev.Released)] == [2]  # its own blocks only
    assert s.ledger.reserved == 12 and len(s.ledger.shared) == 10
    s.cancel("b", 0.3)
    assert s.ledger.reserved == 12  # b's stop is not confirmed: the prefix stays charged
    out = s.confirm_release("b", 0.4)
    assert [a.blocks for a in out if isinstance(a, ev.Released)] == [12]
    assert s.ledger.reserved == 0 and not s.ledger.shared and s.ledger.used == 0


def test_a_twin_admits_where_a_stranger_would_not() -> None:
    """14 blocks: one request of 12 blocks runs; its twin needs 2 more, a stranger 12."""
    s = sched(blocks=14)
    s.arrive("a", twin(), 0.0)
    assert s.arrive("stranger", twin(chain=2), 0.0) == []  # queued
    s.cancel("stranger", 0.0)
    admitted(s.arrive("b", twin(), 0.0), "b")
    assert s.ledger.free == 0


def test_a_preempted_twin_resumes_sharing_again() -> None:
    s = Scheduler(Capacity(64, BS), policy="reserve-current")
    s.arrive("a", twin(max_tokens=40), 0.0)
    s.arrive("b", twin(max_tokens=40), 0.0)
    req = s.requests["b"]
    s.note_cached("b", 2 * BS)  # the engine found only 2 of the 10 blocks: 8 copies
    assert req.prefix == tuple(1000 + i for i in range(2))
    s._preempt(req, 0.1, [], reason="test")
    s.confirm_release("b", 0.2)
    assert req.prefix == twin().prefix_blocks  # a new grant may share the whole prefix again
    s.ledger.check(list(s.requests.values()))


# -- the engine's cache report -------------------------------------------------------------------


def test_engine_caching_fewer_blocks_charges_the_copies() -> None:
    s = sched()
    s.arrive("a", twin(), 0.0)
    s.arrive("b", twin(), 0.0)
    assert s.ledger.reserved == 14
    s.note_cached("b", 10 * BS)  # as expected: nothing changes
    s.note_cached("b", 10 * BS + 3)
    assert s.ledger.reserved == 14 and s.snapshot().totals.prefix_mismatches == 0
    s.note_cached("b", 6 * BS + 1)  # only 6 whole blocks were found: b computed 4 itself
    assert s.ledger.reserved == 18
    assert s.snapshot().totals.prefix_mismatches == 1
    assert s.ledger.shared[1000 + 9] == 1 and s.ledger.shared[1000 + 5] == 2
    s.ledger.check(list(s.requests.values()))
    s.note_cached("a", 0)  # the first holder never expected a hit: nothing to correct
    s.note_cached("nobody", 0)  # forgotten or unknown: ignored, like other late news
    with pytest.raises(InvalidInput):
        s.note_cached("b", -1)
    for rid in ("a", "b"):
        s.cancel(rid, 1.0)
        s.confirm_release(rid, 1.0)
    assert s.ledger.reserved == 0 and not s.ledger.shared


def test_copies_are_charged_only_as_far_as_free_blocks_allow() -> None:
    s = sched(blocks=15)
    s.arrive("a", twin(), 0.0)
    s.arrive("b", twin(), 0.0)
    assert s.ledger.free == 1
    s.note_cached("b", 0)  # 10 copies, 1 free block
    assert s.ledger.free == 0 and len(s.requests["b"].prefix) == 9
    s.ledger.check(list(s.requests.values()))


# -- reconciliation under sharing ------------------------------------------------------------------


def test_reconcile_keeps_a_stopped_request_the_engine_still_holds() -> None:
    """Issue 12's case: two running twins share 10 blocks, a third request is stopped and
    unconfirmed. The engine holds 10 + 2 + 2 for the twins and the third's 5: per holder, the
    twins would look like 24 blocks, leaving the third's 5 unexplained, so it was released
    while the engine still held it."""
    s = sched(confirm_timeout_s=1.0)
    s.arrive("a", twin(), 0.0)
    s.arrive("b", twin(), 0.0)
    s.arrive("c", RequestSpec(20, 4, 4096), 0.0)
    s.charge("c", 1, 0.0)
    s.cancel("c", 0.0)
    s.tick(5.0)
    assert s.requests["c"].unconfirmed
    twins = 10 + 2 * (11 - 10)  # each twin uses ceil(42 / 4) = 11 blocks, 10 of them shared
    assert s.reconcile(twins + 6, 5.0) == []  # c (21 tokens: 6 blocks) is still held
    assert "c" in s.requests
    assert s.drift == 0
    out = s.reconcile(twins, 6.0)  # now the engine freed it
    assert [a.request_id for a in out if isinstance(a, ev.Released)] == ["c"]


def test_reconcile_keeps_a_stopped_twin_whose_prefix_runs_on() -> None:
    s = sched(confirm_timeout_s=1.0)
    s.arrive("a", twin(), 0.0)
    s.arrive("b", twin(), 0.0)
    s.cancel("b", 0.0)
    s.tick(5.0)
    # the engine holds a (11 blocks) and still b's own block: b's shared 10 are a's too
    assert s.reconcile(12, 5.0) == []
    out = s.reconcile(11, 6.0)
    assert [a.request_id for a in out if isinstance(a, ev.Released)] == ["b"]
    assert s.ledger.reserved == 12 and len(s.ledger.shared) == 10


def test_a_lease_reports_the_engines_cache_hit() -> None:
    """Through the shell: two twins hold leases; the second's engine found only 4 of the 10
    blocks, so 6 copies are charged to it."""
    import anyio

    from kvbudget import Budget

    async def main() -> tuple[int, int, int]:
        budget = Budget(Capacity(64, BS), policy="reserve-max")
        async with budget, budget.lease(twin()) as a, budget.lease(twin()) as b:  # (admitted)
            before = budget.snapshot().reserved_blocks
            b.note_cached(4 * BS)
            after = budget.snapshot()
            a.cancel()
            b.cancel()
            return before, after.reserved_blocks, after.totals.prefix_mismatches

    before, after, mismatches = anyio.run(main)
    assert (before, after, mismatches) == (14, 20, 1)


def test_sglangs_admission_counts_only_the_tokens_to_extend() -> None:
    """SGLang's PrefillAdder takes a newcomer's ``extend_input_len`` (its prompt less the
    radix-cache match) off the budget: in 20 blocks beside one running request, its twin is
    admitted and a stranger of the same size is not."""
    for other, admits in ((twin(), True), (twin(chain=2), False)):
        s = Scheduler(Capacity(20, BS), policy="new-token-ratio")
        admitted(s.arrive("a", twin(), 0.0), "a")
        out = s.arrive("b", other, 0.0)
        assert any(isinstance(x, ev.Admit) for x in out) is admits, other
